"""Prefetch backend with the CPU as compute device (a worker thread plays the copy stream)."""

import warnings

import pytest
import torch
import zoo
from engines import ImmediateEngine, LateEngine, SlowEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import offload
from offload import ModelError
from offload.offloader.prefetch import PrefetchOffloader
from offload.offloader.selection import offloaded_layer_indices


def prefetch(
    model, group=1, num_in_group=1, step=1, params=(), engine=None, layers=None, unit="layer"
):
    config = {
        "offload_group_size": group,
        "offload_num_in_group": num_in_group,
        "offload_prefetch_step": step,
        "offload_params": list(params),
        "prefetch_unit": unit,
    }
    factory = (lambda device: engine) if engine is not None else None
    offloader = offload.create_offloader(config, copy_engine_factory=factory)
    offloader.ledger.name_modules(model)
    offloader.wrap_modules(layers if layers is not None else model.model.layers)
    offloader.post_init()
    return offloader


def _expected_bytes_per_forward(offloader):
    """Every offloaded layer whose slot it shares is copied once per forward."""
    layers = offloader._layers
    slots = len(offloader._slots)
    occupants = [sum(1 for p in range(len(layers)) if p % slots == s) for s in range(slots)]
    return sum(lay.slab.num_bytes for p, lay in enumerate(layers) if occupants[p % slots] > 1)


ARCH_PARAMS = {
    "llama": ["mlp", "q_proj"],
    "qwen3_moe": ["mlp", "self_attn"],
    "gpt2": ["mlp", "attn"],
}
STACK = {"llama": "model.layers", "qwen3_moe": "model.layers", "gpt2": "transformer.h"}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(sorted(ARCH_PARAMS)),
    num_layers=st.integers(1, 7),
    group=st.integers(1, 4),
    data=st.data(),
)
def test_exact_for_every_layout(arch, num_layers, group, data):
    num_in_group = data.draw(st.integers(1, group), label="num_in_group")
    step = data.draw(st.integers(1, 5), label="step")
    params = data.draw(st.sampled_from([(), *[(p,) for p in ARCH_PARAMS[arch]]]), label="params")
    unit = data.draw(st.sampled_from(["layer", "module"]), label="unit")
    if not offloaded_layer_indices(num_layers, group, num_in_group):
        return  # nothing to offload: an error, tested below
    model = zoo.build(arch, num_layers=num_layers)
    ids = zoo.inputs()
    expected = zoo.logits(model, ids)
    config = {
        "offload_group_size": group,
        "offload_num_in_group": num_in_group,
        "offload_prefetch_step": step,
        "offload_params": list(params),
        "prefetch_unit": unit,
    }
    offloader = offload.apply(model, config, layers=STACK[arch])  # a 1-layer "stack" too
    offloader.sync_prev_onload()  # the initial loads have landed
    first = offloader.stats().bytes_copied
    for forward in range(3):  # the prefetch wraps around from the last layers to the first
        assert torch.equal(zoo.logits(model, ids), expected), f"forward {forward}"
    offloader.sync_prev_onload()
    stats = offloader.stats()
    assert stats.bytes_copied - first == 3 * _expected_bytes_per_forward(offloader)
    # (with module units, the "layers" of this bound are the units: smaller)
    assert stats.device_staging_bytes <= min(step, stats.num_units) * stats.largest_layer_bytes
    if unit == "module":
        assert stats.num_units >= stats.num_offloaded_layers
    manifest = offloader.manifest()
    assert manifest and all(e.access == "prefetch" for e in manifest)
    if params:
        assert all(f".{params[0]}." in f".{e.name}." for e in manifest)


@pytest.mark.parametrize("unit", ["layer", "module"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "t5", "bert", "opt", "phi3", "qwen3_moe"])
def test_greedy_and_logits_exact_across_architectures(arch, unit):
    model = zoo.build(arch)
    ids = zoo.inputs()
    expected = zoo.logits(model, ids)
    expected_tokens = zoo.greedy(model, ids) if arch in zoo.CAUSAL_ARCHS else None
    config = {"offload_group_size": 1, "offload_prefetch_step": 2, "prefetch_unit": unit}
    offloader = offload.apply(model, config)
    assert torch.equal(zoo.logits(model, ids), expected)
    if expected_tokens is not None:
        assert torch.equal(zoo.greedy(model, ids), expected_tokens)
    assert offloader.stats().bytes_copied > 0


@pytest.mark.parametrize("unit", ["layer", "module"])
@pytest.mark.parametrize(("num_layers", "step"), [(5, 1), (5, 2), (6, 4), (4, 3)])
@pytest.mark.parametrize("engine", [SlowEngine, LateEngine])
def test_delayed_copies_still_give_exact_outputs(num_layers, step, unit, engine):
    model = zoo.build("llama", num_layers=num_layers)
    ids = zoo.inputs()
    expected = zoo.logits(model, ids)
    offloader = prefetch(model, step=step, engine=engine(), unit=unit)
    for _ in range(3):
        assert torch.equal(zoo.logits(model, ids), expected)
    if engine is LateEngine:  # (a SlowEngine's copy may be done before its wait on a busy machine)
        assert offloader.stats().copies.num_stalls > 0  # compute really waited for late copies


def test_the_delayed_check_catches_a_missing_wait():
    """The same check with compute that does not wait for its copy: it must fail, which
    shows the test above can fail."""
    model = zoo.build("llama", num_layers=5)
    ids = zoo.inputs()
    expected = zoo.logits(model, ids)
    prefetch(model, step=2, engine=SlowEngine(delay_s=0.02, waits=False))
    assert not torch.equal(zoo.logits(model, ids), expected)


def test_the_late_engine_catches_a_missing_wait_every_time():
    class NoWait(LateEngine):
        def wait(self, ticket):
            return None

    model = zoo.build("llama", num_layers=5)
    ids = zoo.inputs()
    expected = zoo.logits(model, ids)
    prefetch(model, step=2, engine=NoWait())
    assert not torch.equal(zoo.logits(model, ids), expected)


class Skippable(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))
        self.skip: set[int] = set()

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("skips", [[{1}], [{0, 4}, set(), {2}], [{1, 3}, {0, 1, 2, 3, 4}, set()]])
def test_skipped_layers_never_read_another_layers_slot(step, skips):
    model = Skippable()
    x = torch.randn(3, 16)
    expected = []
    for skip in skips:
        model.skip = skip
        expected.append(model(x))
    prefetch(model, step=step, layers=model.layers, engine=SlowEngine(delay_s=0.001))
    for skip, want in zip(skips, expected, strict=True):
        model.skip = skip
        assert torch.equal(model(x), want)


def test_memory_bounds_and_host_slabs():
    model = zoo.build("llama", num_layers=6)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    offloader = prefetch(model, group=3, num_in_group=2, step=2)
    stats = offloader.stats()
    assert stats.num_offloaded_layers == 4 and stats.num_slots == 2
    assert stats.device_staging_bytes <= 2 * stats.largest_layer_bytes
    params = len(offloader.manifest())
    assert (
        stats.offloaded_bytes <= stats.host_bytes <= stats.offloaded_bytes + params * 256 + 4 * 4096
    )
    assert stats.pinned_bytes == 0
    assert {e.module for e in offloader.manifest()} == {f"model.layers.{i}" for i in (1, 2, 4, 5)}
    # Every offloaded parameter is a view into one of the slots.
    for entry in offloader.manifest():
        param = model.get_parameter(entry.name)
        assert any(
            slot.data_ptr() <= param.data_ptr() < slot.data_ptr() + slot.numel()
            for slot in offloader._slots
        )
        assert torch.equal(
            offloader.ledger.host_tensor(entry.name, offloader.restore), original[entry.name]
        )


def test_addresses_never_change():
    model = zoo.build("llama", num_layers=4)
    prefetch(model, step=2)
    before = [p.data_ptr() for p in model.parameters()]
    zoo.logits(model, zoo.inputs())
    zoo.greedy(model, zoo.inputs())
    assert [p.data_ptr() for p in model.parameters()] == before


def test_weights_tied_between_layers_stay_resident():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            shared = nn.Linear(8, 8)
            self.layers = nn.ModuleList(
                [nn.Sequential(shared), nn.Sequential(nn.Linear(8, 8)), nn.Sequential(shared)]
            )

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    model = Tied()
    x = torch.randn(2, 8)
    expected = model(x)
    offloader = offload.apply(model, {"offload_group_size": 1})
    assert [e.name for e in offloader.manifest()] == ["layers.1.0.weight", "layers.1.0.bias"]
    assert torch.equal(model(x), expected)


def test_offload_params_matching_nothing_is_an_error_and_changes_nothing():
    model = zoo.build("llama")
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(ModelError, match=r"offload_params \['experts'\] match no parameter"):
        offload.apply(model, {"offload_group_size": 1, "offload_params": ["experts"]})
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before


def test_a_layout_that_selects_no_layer_offloads_nothing_with_a_warning():
    # As vLLM: 8/2 on 3 layers is a valid config that offloads nothing (configs move
    # between the two unchanged); we say so.
    model = zoo.build("llama")
    x = torch.randint(0, 100, (1, 5))
    expected = model(x).logits
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.warns(UserWarning, match="offloads layers 6, 7, ... but there are only 3 layers"):
        offloader = offload.apply(model, {"offload_group_size": 8, "offload_num_in_group": 2})
    assert offloader.offloaded_bytes == 0 and offloader.stats().device_staging_bytes == 0
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert torch.equal(model(x).logits, expected)


def test_offload_params_segments_that_match_nothing_are_named_in_a_warning():
    model = zoo.build("llama")
    with pytest.warns(UserWarning, match=r"offload_params \['nope'\] match no parameter"):
        offloader = offload.apply(
            model, {"offload_group_size": 1, "offload_params": ["mlp", "nope"]}
        )
    assert offloader.offloaded_bytes > 0


def test_wrap_modules_twice_is_refused():
    model = zoo.build("llama")
    offloader = prefetch(model)
    with pytest.raises(ModelError, match="only once"):
        offloader.wrap_modules(model.model.layers)


def test_auto_selects_prefetch_and_graph_capture_context_runs_on_cpu():
    model = zoo.build("llama")
    ids = zoo.inputs()
    expected = zoo.logits(model, ids)
    offloader = offload.apply(model, {"offload_group_size": 1, "offload_prefetch_step": 2})
    assert isinstance(offloader, PrefetchOffloader)
    with offloader.graph_capture():
        out = zoo.logits(model, ids)
    assert torch.equal(out, expected)
    stats = offloader.stats()
    copies = stats.copies  # every counter is kept (a typed record: none can be missing)
    assert copies.bytes_copied > 0 and copies.num_copies > 0 and copies.copy_s > 0
    assert copies.stall_s >= 0 and copies.num_stalls >= 0
    assert stats.copies.achieved_gb_per_s > 0


@pytest.mark.parametrize(
    ("arch", "num_layers", "step", "unit"),
    [
        ("llama", 3, 2, "layer"),
        ("llama", 4, 1, "layer"),
        ("llama", 2, 3, "module"),
        # Its last bits changed when the waits also declared the rotary tables mutated.
        ("qwen3_moe", 3, 2, "layer"),
    ],
)
def test_torch_compile_fullgraph_matches_compiled_resident(arch, num_layers, step, unit):
    """Inductor on the CPU: the offloaded model compiles with fullgraph=True, moves bytes,
    and gives bitwise what the same compiled model gives without offloading."""
    torch._dynamo.reset()
    model = zoo.build(arch, num_layers=num_layers)
    ids = zoo.inputs()
    with torch.no_grad():
        expected = torch.compile(model, fullgraph=True)(input_ids=ids).logits
    torch._dynamo.reset()
    config = {"offload_group_size": 1, "offload_prefetch_step": step, "prefetch_unit": unit}
    offloader = offload.apply(model, config)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if unit == "module":  # module units run their read check eagerly first
            for _ in range(2):
                zoo.logits(model, ids)
        offloader.sync_prev_onload()
        before = offloader.stats().bytes_copied
        for _ in range(2):
            assert torch.equal(compiled(input_ids=ids).logits, expected)
    offloader.sync_prev_onload()
    assert offloader.stats().bytes_copied - before == 2 * _expected_bytes_per_forward(offloader)
    torch._dynamo.reset()


def _step_nodes(graph, op):
    nodes = {}
    for node in graph.nodes:
        target = node.args[0] if node.args and node.target is not op else node.target
        if target is op:
            nodes[node.kwargs.get("position", node.args[-1] if node.args else None)] = node
    return nodes


def _ancestors(node):
    seen, todo = set(), [node]
    while todo:
        for parent in todo.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def test_compiled_graph_chains_waits_and_starts_through_the_activations():
    """In the traced graph each layer's wait comes before its start, and its start before
    the next layer's wait, by data dependency (not by luck of program order)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    model = zoo.build("llama", num_layers=3)
    config = {"offload_group_size": 1, "offload_prefetch_step": 2, "prefetch_unit": "layer"}
    offload.apply(model, config)
    with torch.no_grad():
        torch.compile(model, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(
            input_ids=zoo.inputs()
        )
    torch._dynamo.reset()
    graph = graphs[0].graph
    waits = _step_nodes(graph, torch.ops.offload.wait_layer.default)
    starts = _step_nodes(graph, torch.ops.offload.start_layer.default)
    assert sorted(waits) == sorted(starts) == [0, 1, 2]
    for position in range(3):
        assert waits[position] in _ancestors(starts[position])
        if position + 1 in waits:
            assert starts[position] in _ancestors(waits[position + 1])


class _TwoStreamBlock(nn.Module):
    """Like diffusers' Flux double blocks: two streams in, returned in the other order.
    (The weight-only `tanh` is ordered after the wait by program order only: see ops.py.)"""

    def __init__(self, dim):
        super().__init__()
        self.image = nn.Linear(dim, dim)
        self.text = nn.Linear(dim, dim)

    def forward(self, scale, hidden, context):
        mixed = torch.tanh(self.text.weight * 0.5)  # reads the slot before any activation
        return context @ mixed + scale, self.image(hidden) * scale


class _TwoStreamModel(nn.Module):
    def __init__(self, num_layers=3, dim=32):
        super().__init__()
        self.layers = nn.ModuleList(_TwoStreamBlock(dim) for _ in range(num_layers))

    def forward(self, hidden, context):
        scale = torch.full((1,), 1.01)  # the first float argument, but not a stream
        for layer in self.layers:
            context, hidden = layer(scale, hidden, context)
        return hidden + context


def test_compiled_two_stream_blocks_chain_through_every_activation():
    """A block whose first float argument is not its stream and whose streams come back in
    the other order: each wait follows the previous start and each start follows its wait,
    by data dependency through both streams; outputs exact with delayed copies."""
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    model, inputs = _TwoStreamModel(), (torch.randn(2, 32), torch.randn(2, 32))
    with torch.no_grad():
        expected = model(*inputs)
        expected_inductor = torch.compile(model, fullgraph=True)(*inputs)
    graphs = []

    def keep(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    offloader = prefetch(model, engine=SlowEngine(), layers=model.layers)
    with torch.no_grad():
        out = torch.compile(model, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(*inputs)
        assert torch.equal(out, expected)
        torch._dynamo.reset()
        for _ in range(2):
            assert torch.equal(torch.compile(model, fullgraph=True)(*inputs), expected_inductor)
    torch._dynamo.reset()
    assert offloader.stats().bytes_copied > 0
    graph = graphs[0].graph
    waits = _step_nodes(graph, torch.ops.offload.wait_layer.default)
    starts = _step_nodes(graph, torch.ops.offload.start_layer.default)
    assert sorted(waits) == sorted(starts) == [0, 1, 2]
    steps = set(waits.values()) | set(starts.values())
    for position in range(3):
        assert waits[position] in _ancestors(starts[position])
        if position + 1 in waits:
            assert starts[position] in _ancestors(waits[position + 1])
        # Every computation that reads this layer's weights comes before its start (which
        # lets the copy engine refill the slot).
        node = waits[position]
        weights = set(node.kwargs["weights"] if "weights" in node.kwargs else node.args[1])
        readers = [n for w in weights for n in w.users if n not in steps]
        assert readers
        before_start = _ancestors(starts[position])
        assert all(reader in before_start for reader in readers)


def test_replacing_offloaded_data_is_caught_at_the_next_forward():
    model = zoo.build("llama")
    prefetch(model)
    model.to(torch.float64)
    with pytest.raises(ModelError, match=r"model\.layers\.0 no longer live in their device slot"):
        model(torch.randint(0, 100, (1, 4)))


def test_state_dict_reads_and_load_state_dict_writes_the_host_copy():
    model, other = zoo.build("llama", seed=0), zoo.build("llama", seed=1)
    truth = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    x = torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        expected = other(x).logits
    prefetch(model, step=1)  # one slot shared by every layer
    with torch.no_grad():
        model(x)  # the slot now holds the last layer
    state = model.state_dict()
    assert state.keys() == truth.keys()
    assert all(torch.equal(state[name], truth[name]) for name in truth)
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(model(x).logits, expected)
        assert torch.equal(model(x).logits, expected)


def test_backward_through_shared_slots_fails_loudly_not_wrongly():
    model = zoo.build("llama")
    x = torch.randint(0, 100, (1, 6))
    prefetch(model, step=1)
    with pytest.warns(UserWarning, match="for inference"):
        loss = model(x).logits.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_backward_with_a_slot_per_layer_gives_the_resident_gradients():
    model, reference = zoo.build("llama"), zoo.build("llama")
    x = torch.randint(0, 100, (1, 6))
    reference(x).logits.sum().backward()
    prefetch(model, step=len(model.model.layers))  # nothing is ever overwritten
    model(x).logits.sum().backward()
    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, grads[name].grad), name


def test_module_units_are_the_weight_modules_and_norms_stay_resident():
    model = zoo.build("llama", num_layers=2)
    x = torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        expected = model(x).logits
    offloader = prefetch(model, step=2, unit="module")
    manifest = offloader.manifest()
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    parents = ["self_attn"] * 4 + ["mlp"] * 3
    assert [e.name for e in manifest[:7]] == [
        f"model.layers.0.{p}.{n}.weight" for p, n in zip(parents, names, strict=True)
    ]
    up = model.model.layers[0].mlp.up_proj.weight
    assert (
        offloader.ledger.host_tensor("model.layers.0.mlp.up_proj.weight", offloader.restore).shape
        == up.shape
    )
    assert not any("norm" in e.name for e in manifest)  # a few hundred bytes: resident
    assert not offloader.ledger.is_offloaded(model.model.layers[0].input_layernorm.weight)
    # One unit per linear layer, named by it.
    assert [e.module for e in manifest[:7]] == [e.name[: -len(".weight")] for e in manifest[:7]]
    stats = offloader.stats()
    assert (stats.num_units, stats.num_offloaded_layers) == (14, 2)
    assert stats.unit == "module"
    per_unit: dict[str, int] = {}
    for e in manifest:
        per_unit[e.module] = per_unit.get(e.module, 0) + e.num_bytes
    assert stats.device_staging_bytes <= 2 * max(per_unit.values()) + 2 * 4 * 256
    with torch.no_grad():
        assert torch.equal(model(x).logits, expected)
        assert torch.equal(model(x).logits, expected)


class _Reversed(nn.Module):
    """A block that calls its five linear layers last to first: against the order their
    units are scheduled in (registration order)."""

    def __init__(self):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))

    def forward(self, x):
        for linear in reversed(self.linears):
            x = torch.tanh(linear(x))
        return x


def _module_units_of_three(block_class, step, engine):
    """Three seeded blocks, their resident output, then offloaded with module units."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[block_class() for _ in range(3)])
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = blocks(x)
    offloader = prefetch(blocks, step=step, layers=list(blocks), unit="module", engine=engine)
    return blocks, x, expected, offloader


@pytest.mark.parametrize("engine", [SlowEngine, ImmediateEngine])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_module_units_stay_exact_when_modules_run_out_of_registration_order(step, engine):
    blocks, x, expected, offloader = _module_units_of_three(_Reversed, step, engine())
    assert offloader.stats().num_units == 15
    for _ in range(3):
        assert torch.equal(blocks(x), expected)


def test_copies_are_counted_when_issued_as_on_cuda():
    model = zoo.build("llama", num_layers=4)
    offloader = prefetch(model, step=2, engine=SlowEngine(delay_s=0.05))
    issued = sum(layer.slab.num_bytes for layer in offloader._layers[:2])  # the initial loads
    assert offloader.stats().bytes_copied == issued  # before they have run
    offloader.sync_prev_onload()
    assert offloader.stats().bytes_copied == issued and offloader.stats().copies.num_copies == 2


class _ReadsChildWeights(nn.Module):
    """A block that reads one child's weights directly (never calling that child), as
    Mamba's mixer reads `dt_proj.weight`: module units must still see the right bytes."""

    def __init__(self):
        super().__init__()
        self.direct = nn.Linear(8, 8)
        self.called = nn.Linear(8, 8)

    def forward(self, x):
        x = torch.tanh(nn.functional.linear(x, self.direct.weight.T, self.direct.bias))
        return torch.tanh(self.called(x))


@pytest.mark.parametrize("engine", [SlowEngine, ImmediateEngine])
@pytest.mark.parametrize("step", [1, 2, 3])
@torch.no_grad()
def test_module_units_read_outside_their_forward_stay_exact_with_a_warning(step, engine):
    blocks, x, expected, offloader = _module_units_of_three(_ReadsChildWeights, step, engine())
    with pytest.warns(UserWarning, match=r"reads the weights of .*direct outside"):
        assert torch.equal(blocks(x), expected)
    for _ in range(4):  # past the checked calls: the layers that read so stay checked
        assert torch.equal(blocks(x), expected)
    assert offloader.stats().bytes_copied > 0


def test_the_copy_engine_comes_from_the_factory_given_and_other_backends_ignore_it():
    from offload.api import finish, prepare
    from offload.memory.copy_engine import SyncCopyEngine

    made = []

    def factory(device):
        made.append(SyncCopyEngine())
        return made[-1]

    model, ids = zoo.build("llama", num_layers=3), zoo.inputs()
    expected = zoo.logits(model, ids)
    config = {"offload_group_size": 1, "offload_prefetch_step": 2}
    offloader = prepare(model, config, torch.device("cpu"), copy_engine_factory=factory)
    assert offloader.copy_engine is None and not made  # made by post_init
    finish(offloader)
    assert offloader.copy_engine is made[0] and len(made) == 1
    assert torch.equal(zoo.logits(model, ids), expected)
    assert made[0].stats.bytes_copied > 0
    uva = {"cpu_offload_gb": 0.0001}
    offload.apply(zoo.build("llama", num_layers=3), uva, copy_engine_factory=factory)
    assert len(made) == 1


def test_mamba_with_module_units_gives_the_resident_tokens():
    model = zoo.build("mamba", num_layers=4)
    ids = zoo.inputs()
    expected = zoo.greedy(model, ids)
    offloader = prefetch(model, step=2, layers=model.backbone.layers, unit="module")
    with pytest.warns(UserWarning, match="outside that module's forward"):
        assert torch.equal(zoo.greedy(model, ids), expected)
    assert offloader.stats().bytes_copied > 0


@torch.no_grad()
def test_compiled_module_units_run_only_layers_that_passed_the_eager_read_check():
    """The read check cannot run inside a compiled graph: a layer not yet checked, or one
    found reading a unit's weights outside its forward, refuses to run compiled."""
    torch._dynamo.reset()
    blocks, x, expected, offloader = _module_units_of_three(_ReadsChildWeights, 2, SlowEngine())
    compiled = torch.compile(blocks, fullgraph=True)
    with pytest.raises(ModelError, match=r"has run 0 of the 2 eager calls"):
        compiled(x)
    with pytest.warns(UserWarning, match="outside that module's forward"):
        assert torch.equal(blocks(x), expected)  # eager: checked, exact
    assert torch.equal(blocks(x), expected)
    assert offloader.stats().bytes_copied > 0
    torch._dynamo.reset()
    with pytest.raises(ModelError, match=r"reads module weights outside .* prefetch_unit='layer'"):
        torch.compile(blocks, fullgraph=True)(x)
    torch._dynamo.reset()


def test_module_units_of_ordinary_layers_are_checked_only_on_their_first_calls():
    from offload.offloader.unit_check import NUM_CHECKED_CALLS, UnitReadCheck

    model = zoo.build("llama", num_layers=3)
    x = zoo.inputs()
    offloader = prefetch(model, step=2, unit="module")
    checks = [hook for hook in offloader.ledger.hooks if isinstance(hook, UnitReadCheck)]
    assert len(checks) == 3  # one per offloaded layer
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no read outside a module's own forward
        for _ in range(NUM_CHECKED_CALLS + 1):
            zoo.logits(model, x)
    assert not any(check.is_permanent for check in checks)
    assert all(check._num_calls == NUM_CHECKED_CALLS for check in checks)


@pytest.mark.parametrize("unit", ["layer", "module"])
def test_a_copy_that_never_queued_is_loaded_again_not_read_stale(unit):
    """The red team's case: a Ctrl-C in the refill of layer 0 (the load that brings it
    back for the next forward) on its third call, before the copy is queued. The slot
    must not be recorded as holding layer 0: the next forward would run it on the
    weights of the layer that used the slot last."""
    model, reference = zoo.build("llama", num_layers=5), zoo.build("llama", num_layers=5)
    engine = SlowEngine(delay_s=0.001)
    offloader = prefetch(model, step=2, engine=engine, unit=unit)
    first = offloader._layers[0].slab.buffer.data_ptr()
    real_copy, loads_of_first = engine.copy, []

    def copy(dst, src, after=None):
        if src.data_ptr() == first:
            loads_of_first.append(True)
            if len(loads_of_first) == 3:
                raise KeyboardInterrupt
        return real_copy(dst, src, after)

    engine.copy = copy
    ids = zoo.inputs()
    expected = zoo.logits(reference, ids)
    with pytest.raises(KeyboardInterrupt):  # loaded at start, then at the end of each forward
        for _ in range(3):
            assert torch.equal(zoo.logits(model, ids), expected)
    assert len(loads_of_first) == 3
    assert torch.equal(zoo.logits(model, ids), expected)
    assert torch.equal(zoo.logits(model, ids), expected)
