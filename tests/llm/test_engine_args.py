"""`EngineArgs`: `LLM`'s arguments as one record that checks itself."""

import inspect
import json

import pytest

from offload.config import Backend, OffloadConfig, UVAOffloadConfig
from offload.errors import ConfigError, OffloadError
from offload.llm.engine_args import EngineArgs, argument_names
from offload.llm.llm import LLM
from offload.memory.placement import AUTO, Auto


def test_the_record_has_llms_arguments_names_defaults_and_order():
    parameters = inspect.signature(LLM.__init__).parameters
    own = [name for name in parameters if name not in ("self", "offload_flags")]
    assert own == argument_names()
    defaults = {name: p.default for name, p in parameters.items() if name in own}
    made = EngineArgs()
    assert {name: getattr(made, name) for name in own} == defaults
    assert parameters["model"].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(parameters[name].kind == inspect.Parameter.KEYWORD_ONLY for name in own[1:])


def test_the_record_checks_itself_and_says_what_it_gives():
    args = EngineArgs(swap_space=0.5, max_num_seqs=4, offload_flags={"cpu_offload_gb": 1})
    assert args.limits.kv_offload and args.limits.max_num_seqs == 4
    assert args.config.uva.cpu_offload_gb == 1 and args.config.selected_backend == Backend.UVA
    with pytest.raises(OffloadError, match="max_num_seqs must be an integer >= 1"):
        EngineArgs(max_num_seqs=0)
    with pytest.raises(ConfigError, match="'cpu_ofload_gb' \\(did you mean 'cpu_offload_gb'"):
        EngineArgs(offload_flags={"cpu_ofload_gb": 1})
    with pytest.raises(TypeError):
        EngineArgs(None)  # keyword-only


def test_an_llm_made_from_a_spec_does_not_resolve_again(tmp_path, monkeypatch):
    import zoo

    import offload.model.spec as spec_module
    from offload.llm.spec import model_spec

    spec = model_spec(zoo.save_attentive_llm(tmp_path), device="cpu")
    monkeypatch.setattr(spec_module, "resolve_model", lambda *a, **k: pytest.fail("resolved"))
    with LLM(spec, max_model_len=16, enforce_eager=True) as llm:
        assert llm.model is spec.empty and llm.device == spec.device


def test_auto_is_the_string_auto_and_either_form_is_accepted():
    assert AUTO == "auto" == f"{AUTO}" == str(AUTO) and repr(AUTO) == "'auto'"
    assert Auto("auto") is AUTO
    plain, typed = UVAOffloadConfig(cpu_offload_gb="auto"), UVAOffloadConfig(cpu_offload_gb=AUTO)
    assert plain == typed and plain.cpu_offload_gb is AUTO  # the string is made the member
    config = OffloadConfig(uva=typed)
    assert json.loads(json.dumps(config.to_dict()))["uva"]["cpu_offload_gb"] == "auto"
    assert json.dumps({"dtype": AUTO}) == '{"dtype": "auto"}'
    assert OffloadConfig.from_dict({"cpu_offload_gb": "auto"}) == config
    assert OffloadConfig.from_cli(["--cpu-offload-gb", "auto"]) == config
    args = [
        EngineArgs(
            dtype=auto, device=auto, load_format=auto, offload_flags={"cpu_offload_gb": auto}
        )
        for auto in ("auto", AUTO)
    ]
    assert args[0].config == args[1].config and args[0].config.selected_backend == Backend.UVA
    assert EngineArgs().dtype == EngineArgs().device == EngineArgs().load_format == "auto"
