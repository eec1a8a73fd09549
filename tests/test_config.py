import argparse
import dataclasses
import json
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from junk import JUNK

from offload import (
    ConfigError,
    OffloadConfig,
    OffloadError,
    PrefetchOffloadConfig,
    UVAOffloadConfig,
)
from offload.config import OFFLOAD_KEYS, DiskOffloadConfig, add_cli_args

# vLLM's vllm/config/offload.py: field names and defaults a config must keep to move unchanged.
VLLM_FIELDS = {
    OffloadConfig: {"offload_backend": "auto"},
    UVAOffloadConfig: {"cpu_offload_gb": 0, "cpu_offload_params": set()},
    PrefetchOffloadConfig: {
        "offload_group_size": 0,
        "offload_num_in_group": 1,
        "offload_prefetch_step": 1,
        "offload_params": set(),
    },
}


@pytest.mark.parametrize("kind", list(VLLM_FIELDS))
def test_vllm_field_names_and_defaults(kind):
    default = kind()
    for name, value in VLLM_FIELDS[kind].items():
        assert getattr(default, name) == value


def test_nested_defaults_cannot_be_changed():
    a, b = OffloadConfig(), OffloadConfig()
    with pytest.raises(AttributeError):  # (a frozenset: no default is shared and changed)
        a.uva.cpu_offload_params.add("experts")
    assert b.uva.cpu_offload_params == set() and a == b


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (
            lambda: UVAOffloadConfig(cpu_offload_gb=-1),
            "uva.cpu_offload_gb must be a finite number >= 0",
        ),
        (lambda: UVAOffloadConfig(cpu_offload_gb=float("nan")), "uva.cpu_offload_gb"),
        (lambda: UVAOffloadConfig(cpu_offload_gb=True), "uva.cpu_offload_gb must be a number"),
        (lambda: UVAOffloadConfig(cpu_offload_gb="lots"), "uva.cpu_offload_gb must be a number"),
        (
            lambda: UVAOffloadConfig(cpu_offload_params=[3]),
            "uva.cpu_offload_params must hold strings",
        ),
        (lambda: UVAOffloadConfig(cpu_offload_params={".mlp"}), "dot-separated name segments"),
        (lambda: PrefetchOffloadConfig(offload_group_size=-2), "prefetch.offload_group_size"),
        (lambda: PrefetchOffloadConfig(offload_group_size=1.5), "must be an integer >= 0"),
        (
            lambda: PrefetchOffloadConfig(offload_num_in_group=0),
            "offload_num_in_group must be a finite number >= 1",
        ),
        (lambda: PrefetchOffloadConfig(offload_prefetch_step=-1), "offload_prefetch_step"),
        (
            lambda: OffloadConfig(offload_backend="disk"),
            "offload_backend must be one of auto, uva, prefetch",
        ),
        (
            lambda: OffloadConfig(prefetch={"offload_group_size": 2, "offload_num_in_group": 3}),
            "offload_num_in_group (3) must be <= offload_group_size (2)",
        ),
        (
            lambda: OffloadConfig(prefetch={"offload_group_size": 4, "offload_prefetch_step": 0}),
            "offload_prefetch_step (0) must be >= 1",
        ),
        # vLLM: an explicit prefetch backend with group size 0 fails the num_in_group check.
        (
            lambda: OffloadConfig(offload_backend="prefetch"),
            "offload_num_in_group (1) must be <= offload_group_size (0); "
            "offload_backend='prefetch' needs offload_group_size >= 1",
        ),
        (lambda: OffloadConfig(uva={"cpu_offload_gbs": 1}), "unknown key 'cpu_offload_gbs' in uva"),
        (lambda: OffloadConfig(uva=3), "uva must be a UVAOffloadConfig or a mapping"),
        (lambda: OffloadConfig(disable_uva="yes"), "disable_uva must be true or false"),
        (
            lambda: OffloadConfig.from_dict({"cpu_ofload_gb": 1}),
            "unknown offload config key 'cpu_ofload_gb'",
        ),
        (lambda: OffloadConfig.from_dict([1]), "must be a mapping"),
    ],
)
def test_bad_values_raise_one_line_naming_the_field(make, needle):
    with pytest.raises(ConfigError) as info:
        make()
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


def test_prefetch_step_zero_is_fine_when_prefetch_is_off():
    assert OffloadConfig(prefetch={"offload_prefetch_step": 0}).selected_backend == "none"


@pytest.mark.parametrize(
    ("kwargs", "backend"),
    [
        ({}, "none"),
        ({"uva": {"cpu_offload_gb": 1}}, "uva"),
        ({"prefetch": {"offload_group_size": 4}}, "prefetch"),
        ({"offload_backend": "uva"}, "uva"),
        ({"offload_backend": "prefetch", "prefetch": {"offload_group_size": 2}}, "prefetch"),
    ],
)
def test_auto_selection_follows_vllm(kwargs, backend):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert OffloadConfig(**kwargs).selected_backend == backend


@pytest.mark.parametrize(
    ("kwargs", "needle", "backend"),
    [
        (
            {"uva": {"cpu_offload_gb": 1}, "prefetch": {"offload_group_size": 4}},
            "Prefetch backend will be selected",
            "prefetch",
        ),
        (
            {"offload_backend": "uva", "prefetch": {"offload_group_size": 4}},
            "Prefetch settings will be ignored",
            "uva",
        ),
        (
            {
                "offload_backend": "prefetch",
                "uva": {"cpu_offload_gb": 1},
                "prefetch": {"offload_group_size": 4},
            },
            "UVA settings will be ignored",
            "prefetch",
        ),
    ],
)
def test_both_backends_set_only_warns(kwargs, needle, backend):
    with pytest.warns(UserWarning, match=needle):
        config = OffloadConfig(**kwargs)
    assert config.selected_backend == backend


def test_coercions_match_what_flags_and_json_give():
    config = OffloadConfig(
        uva={"cpu_offload_gb": "2.5", "cpu_offload_params": ["experts,w2_weight", "lm"]}
    )
    assert config.uva.cpu_offload_gb == 2.5
    assert config.uva.cpu_offload_params == {"experts", "w2_weight", "lm"}
    assert PrefetchOffloadConfig(offload_group_size=4.0).offload_group_size == 4


def _variants():
    base = OffloadConfig().to_dict()
    yield "offload_backend", {**base, "offload_backend": "uva"}
    yield "cpu_offload_gb", {**base, "uva": {**base["uva"], "cpu_offload_gb": 1.0}}
    yield "cpu_offload_params", {**base, "uva": {**base["uva"], "cpu_offload_params": ["mlp"]}}
    for name, value in [
        ("offload_group_size", 4),
        ("offload_num_in_group", 2),
        ("offload_prefetch_step", 3),
        ("offload_params", ["w"]),
    ]:
        prefetch = {
            **base["prefetch"],
            name: value,
            "offload_group_size": 4 if name != "offload_group_size" else 8,
        }
        yield name, {**base, "prefetch": prefetch}
    yield "disable_uva", {**base, "disable_uva": True}
    yield "disable_pin_memory", {**base, "disable_pin_memory": True}
    for name, value in [
        ("cpu_memory_gb", 0.5),
        ("offload_folder", "/tmp/x"),
        ("read_ahead", 4),
        ("disk_io", "page-cache"),
        ("io_threads", 3),
    ]:
        yield name, {**base, "disk": {**base["disk"], name: value}}


def test_compute_hash_covers_every_field():
    seen = {OffloadConfig().compute_hash()}
    names = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, data in _variants():
            names.append(name)
            digest = OffloadConfig.from_dict(data).compute_hash()
            assert digest not in seen, name
            seen.add(digest)
    every_field = {"offload_backend", "disable_uva", "disable_pin_memory"}
    every_field |= {
        f.name
        for kind in (UVAOffloadConfig, PrefetchOffloadConfig, DiskOffloadConfig)
        for f in dataclasses.fields(kind)
    }
    assert set(names) == every_field
    assert OffloadConfig().compute_hash() == OffloadConfig().compute_hash()


def test_json_round_trip():
    config = OffloadConfig(
        offload_backend="uva",
        uva=UVAOffloadConfig(cpu_offload_gb=3.5, cpu_offload_params={"experts", "w2_weight"}),
        disable_pin_memory=True,
    )
    text = json.dumps(config.to_dict())
    again = OffloadConfig.from_dict(json.loads(text))
    assert again == config
    assert again.compute_hash() == config.compute_hash()


def test_vllm_only_dict_has_vllm_keys_only():
    data = OffloadConfig().to_dict(vllm_only=True)
    assert set(data) == {"offload_backend", "uva", "prefetch"}
    assert set(data["uva"]) == set(VLLM_FIELDS[UVAOffloadConfig])
    assert set(data["prefetch"]) == set(VLLM_FIELDS[PrefetchOffloadConfig])


def test_from_dict_accepts_flat_engine_argument_keys():
    with pytest.warns(UserWarning, match="Prefetch backend will be selected"):
        config = OffloadConfig.from_dict(
            {"cpu_offload_gb": 2, "offload_params": ["mlp"], "offload_group_size": 4}
        )
    assert config.uva.cpu_offload_gb == 2
    assert config.prefetch.offload_params == {"mlp"}
    assert config.selected_backend == "prefetch"


def _from_cli(*argv):
    return OffloadConfig.from_cli(argv)


def test_from_cli_uses_vllm_flag_names():
    with pytest.warns(UserWarning, match="Prefetch settings will be ignored"):
        config = _from_cli(
            "--offload-backend", "uva",
            "--cpu-offload-gb", "1.5",
            "--cpu-offload-params", "experts", "w2_weight",
            "--offload-group-size", "8",
            "--offload-num-in-group", "2",
            "--offload-prefetch-step", "2",
            "--offload-params", "mlp",
            "--offload-disable-uva",
        )  # fmt: skip
    assert config.offload_backend == "uva"
    assert config.uva == UVAOffloadConfig(1.5, {"experts", "w2_weight"})
    assert config.prefetch == PrefetchOffloadConfig(8, 2, 2, {"mlp"})
    assert config.disable_uva and not config.disable_pin_memory


def test_from_cli_without_flags_is_the_default():
    assert OffloadConfig.from_cli([]) == OffloadConfig()


@pytest.mark.parametrize(
    "argv",
    [
        ["--cpu-offload-gb", "many"],
        ["--offload-backend", "disk"],
        ["--cpu-offload-gb", "-3"],
        ["--bogus"],
    ],
)
def test_from_cli_bad_flags_raise_config_error(argv):
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_cli(argv)
    assert "\n" not in str(info.value)


def test_add_cli_args_extends_a_users_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    add_cli_args(parser)
    args = parser.parse_args(["--model", "m", "--cpu-offload-gb", "4"])
    assert args.model == "m"
    assert OffloadConfig.from_cli_args(args).uva.cpu_offload_gb == 4


def test_a_config_is_frozen_and_a_changed_copy_is_checked():
    config = OffloadConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.uva.cpu_offload_gb = -1
    with pytest.raises(ConfigError, match="cpu_offload_gb"):
        dataclasses.replace(config, uva=dataclasses.replace(config.uva, cpu_offload_gb=-1))
    config.validate()  # (public, as vLLM's: it may run again, and still passes)


def test_cpu_offload_gb_auto_is_kept_for_the_engine_to_resolve():
    config = OffloadConfig.from_cli(["--cpu-offload-gb", "auto"])
    assert config.uva.cpu_offload_gb == "auto" and config.selected_backend == "uva"
    assert OffloadConfig.from_dict(config.to_dict()) == config


def test_prefetch_unit_is_ours_auto_by_default_and_checked():
    assert OffloadConfig().prefetch_unit == "auto"
    config = OffloadConfig.from_cli(
        ["--offload-group-size", "1", "--offload-prefetch-unit", "module"]
    )
    assert config.prefetch_unit == "module"
    assert OffloadConfig.from_dict(config.to_dict()) == config
    assert "prefetch_unit" not in config.to_dict(vllm_only=True)
    assert (
        config.compute_hash() != OffloadConfig.from_dict({"offload_group_size": 1}).compute_hash()
    )
    with pytest.raises(
        ConfigError, match="prefetch_unit must be one of auto, layer, module, got 'block'"
    ):
        OffloadConfig(prefetch_unit="block")


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"uva": 5}, "uva must be a UVAOffloadConfig or a mapping"),
        ({"uva": []}, "uva must be a UVAOffloadConfig or a mapping"),
        ({"prefetch": [1]}, "prefetch must be a PrefetchOffloadConfig or a mapping"),
        ({"uva": {"cpu_offload_gb": [1]}}, "uva.cpu_offload_gb must be a number"),
        ({"uva": {"zzz": 1}}, "unknown key 'zzz' in uva"),
        ({"prefetch": {5: 1, "a": 2}}, "unknown key 5 in prefetch"),
        ({"cpu_offload_gb": 1e400}, "uva.cpu_offload_gb must be a finite number"),
        ({"cpu_offload_gb": float("inf")}, "uva.cpu_offload_gb must be a finite number"),
        ({"cpu_offload_gb": 10**400}, "uva.cpu_offload_gb must be a finite number"),
        ({"cpu_offload_gb": "nan"}, "uva.cpu_offload_gb must be a finite number"),
        ({"offload_group_size": 10**400}, "prefetch.offload_group_size must be a finite"),
        ({"offload_group_size": "1e400"}, "prefetch.offload_group_size must be a finite"),
        ({"cpu_offload_params": b"mlp"}, "uva.cpu_offload_params must be a set of name"),
        ({"offload_params": {"mlp": 1}}, "prefetch.offload_params must be a set of name"),
        ({"offload_backend": [1]}, "offload_backend must be one of"),
    ],
)
def test_from_dict_junk_is_one_line_naming_the_field(data, needle):
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_dict(data)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_parts_may_be_instances_or_null_and_are_checked_again_by_validate():
    part = UVAOffloadConfig(cpu_offload_gb=1)
    assert OffloadConfig.from_dict({"uva": part, "prefetch": None}).uva == part
    with pytest.raises(dataclasses.FrozenInstanceError):
        OffloadConfig().uva = 5
    with pytest.raises(ConfigError, match="uva must be a UVAOffloadConfig"):
        dataclasses.replace(OffloadConfig(), uva=5)


@pytest.mark.parametrize(
    "argv",
    [["--cpu-offload-gb", "inf"], ["--cpu-offload-gb", "1e400"], ["--offload-group-size", "1e400"]],
)
def test_from_cli_numbers_beyond_range_are_config_errors(argv):
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_cli(argv)
    assert "\n" not in str(info.value)


_PARTS = {
    "uva": [f.name for f in dataclasses.fields(UVAOffloadConfig)],
    "prefetch": [f.name for f in dataclasses.fields(PrefetchOffloadConfig)],
    "disk": [f.name for f in dataclasses.fields(DiskOffloadConfig)],
}


@settings(max_examples=200, deadline=None)
@given(
    key=st.sampled_from([*OFFLOAD_KEYS, "zzz"]),
    value=JUNK,
    nested=st.booleans(),
)
def test_from_dict_junk_builds_or_raises_an_offload_error(key, value, nested):
    """Any value under any key (flat, or inside its part): a config or OffloadError."""
    part = next((p for p, fields in _PARTS.items() if key in fields), None)
    data = {part: {key: value}} if nested and part else {key: value}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            OffloadConfig.from_dict(data)
    except OffloadError as error:
        assert "\n" not in str(error)


def test_the_disk_tier_is_ours_off_by_default_and_through_prefetch():
    assert not OffloadConfig().disk.is_active
    config = OffloadConfig.from_cli(
        ["--cpu-memory-gb", "0.75", "--read-ahead", "3", "--disk-io", "page-cache"]
    )
    assert config.disk == DiskOffloadConfig(cpu_memory_gb=0.75, read_ahead=3, disk_io="page-cache")
    assert config.selected_backend == "prefetch"  # every layer, when no layout is given
    assert "disk" not in config.to_dict(vllm_only=True)
    again = OffloadConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and again.compute_hash() == config.compute_hash()


def test_an_offload_folder_may_be_a_path_object(tmp_path):
    """A `pathlib.Path` is kept as its string (the config's JSON and hash take strings)."""
    config = OffloadConfig.from_dict({"offload_folder": tmp_path / "spill"})
    assert config.disk.offload_folder == str(tmp_path / "spill")
    assert OffloadConfig.from_dict({"offload_folder": str(tmp_path / "spill")}) == config


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"cpu_memory_gb": -1}, "disk.cpu_memory_gb must be a finite number >= 0"),
        ({"read_ahead": 0}, "disk.read_ahead must be a finite number >= 1"),
        ({"io_threads": 1.5}, "disk.io_threads must be an integer >= 1"),
        ({"disk_io": "fast"}, "disk.disk_io must be one of auto, direct, page-cache, mmap"),
        ({"offload_folder": 3}, "disk.offload_folder must be a folder path"),
        ({"cpu_memory_gb": 1, "offload_backend": "uva"}, "offload_backend='uva' cannot use it"),
        ({"disk": {"budget": 1}}, "unknown key 'budget' in disk"),
    ],
)
def test_bad_disk_settings_are_one_line_naming_the_field(data, needle):
    with pytest.raises(ConfigError) as info:
        OffloadConfig.from_dict(data)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_backends_and_units_are_typed_and_still_equal_to_vllms_strings():
    from offload.config import Backend, PrefetchUnit

    config = OffloadConfig(
        offload_backend="prefetch", prefetch={"offload_group_size": 2}, prefetch_unit="module"
    )
    assert config.offload_backend is Backend.PREFETCH and config.offload_backend == "prefetch"
    assert config.prefetch_unit is PrefetchUnit.MODULE
    assert OffloadConfig().selected_backend is Backend.NONE
    data = json.loads(json.dumps(config.to_dict()))
    assert data["offload_backend"] == "prefetch" and data["prefetch_unit"] == "module"
    assert OffloadConfig.from_dict(data).to_dict() == config.to_dict()
    with pytest.raises(ConfigError, match="offload_backend must be one of auto, uva, prefetch"):
        OffloadConfig(offload_backend="none")
