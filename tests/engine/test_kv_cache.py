"""The KV cache in host memory: bitwise the same as the device cache, with the bytes the
schedule says, ordered against delayed copies, and refused when the host has no room."""

import pytest
import torch
import zoo
from engines import LateEngine, SlowEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload import ConfigError
from offload.engine.kv_cache import KVOffloader
from offload.engine.transformers_cache import probe_kv_dims, static_cache
from offload.memory.kv_shape import KVShape, check_host_kv

CPU = torch.device("cpu")
KV_ARCHS = ("llama", "qwen2", "gemma", "phi3", "qwen3_moe", "gpt_neox", "opt", "gpt2")


@torch.inference_mode()
def decode(model, ids, steps, *, offload, num_slots=2, engine=None, kv_dims=None):
    """A prefill of `ids` then `steps` greedy tokens in a static cache; every step's
    logits, and the cache's KV offloader (or None)."""
    batch, width = ids.shape
    factory = (lambda device: engine) if engine is not None else None
    extra = {"copy_engine_factory": factory} if factory else {}
    cache = static_cache(
        model.config, batch, width + steps, torch.float32, CPU, offload=offload,
        num_slots=num_slots, kv_dims=kv_dims, **extra,
    )  # fmt: skip
    outputs, tokens, position = [], ids, torch.arange(width)
    for _ in range(steps + 1):
        logits = model(
            input_ids=tokens, past_key_values=cache, cache_position=position, use_cache=True
        ).logits
        outputs.append(logits)
        tokens = logits[:, -1:].argmax(-1)
        position = position[-1:] + 1
    if cache.kv_offloader is not None:
        cache.kv_offloader.close()
    return outputs, cache.kv_offloader


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("arch", KV_ARCHS)
def test_exact_on_every_architecture(arch):
    model = zoo.build(arch, num_layers=4)
    ids = zoo.inputs()
    expected, _ = decode(model, ids, 5, offload=False)
    got, kv = decode(model, ids, 5, offload=True)
    assert equal(got, expected)
    assert kv.stats().bytes_copied > 0  # the cache really went through the host


def test_latent_attention_is_sized_by_what_it_caches():
    """DeepSeek-V3's attention caches compressed latents, not heads x head_dim as its
    config suggests: the probe measures the real shape, and the host cache holds it."""
    model = zoo.build("deepseek_v3")
    config = model.config
    dims = probe_kv_dims(model)
    assert dims is not None and dims[1:] != (config.head_dim, config.head_dim)
    ids = zoo.inputs()
    expected, _ = decode(model, ids, 4, offload=False)
    got, kv = decode(model, ids, 4, offload=True, kv_dims=dims)
    assert equal(got, expected) and kv.stats().bytes_copied > 0
    llama = zoo.build("llama", num_layers=2)
    heads, head_dim = llama.config.num_key_value_heads, llama.config.head_dim
    assert probe_kv_dims(llama) == (heads, head_dim, head_dim)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_layers=st.integers(1, 6),
    num_slots=st.integers(1, 7),
    batch=st.integers(1, 3),
    width=st.integers(1, 6),
    steps=st.integers(0, 5),
)
def test_exact_for_every_ring(num_layers, num_slots, batch, width, steps):
    model = zoo.build("llama", num_layers=num_layers)
    ids = torch.randint(3, zoo.VOCAB, (batch, width), generator=torch.Generator().manual_seed(2))
    expected, _ = decode(model, ids, steps, offload=False)
    got, kv = decode(model, ids, steps, offload=True, num_slots=num_slots)
    assert equal(got, expected)
    assert kv.device_bytes == min(num_slots, num_layers) * kv.shape.layer_bytes


def test_bytes_moved_are_the_written_prefix_and_the_new_rows():
    """With 2 slots and 4 layers every layer is brought in each step, but only the
    positions written so far; only new positions are written back."""
    model = zoo.build("llama", num_layers=4)
    ids = zoo.inputs()  # [2, 9]
    steps = 5
    _, kv = decode(model, ids, steps, offload=True)
    row = kv.shape.row_elements * 4  # float32
    width = ids.shape[1]
    # Forward s (0 = prefill) needs, for each layer, the positions written before it:
    # nothing at the prefill, then width + s - 1 rows, once per layer. The last layer
    # of each forward already brings in the first layer for the next one, so the last
    # forward also loads layer 0 (width + steps rows) for a forward that never comes.
    expected = sum(4 * (width + s - 1) * row for s in range(1, steps + 1))
    expected += (width + steps) * row
    stats = kv.stats()
    assert stats.bytes_copied == expected
    assert stats.bytes_written_back == 4 * (width + steps) * row
    # transformers' offloaded static cache moves every layer's whole cache both ways
    # each forward; this is far less.
    whole_cache_both_ways = 2 * 4 * kv.shape.layer_bytes * (steps + 1)
    assert stats.bytes_copied + stats.bytes_written_back < whole_cache_both_ways / 2


@pytest.mark.parametrize(("num_layers", "num_slots"), [(4, 2), (5, 2), (5, 3), (3, 1)])
def test_delayed_copies_still_give_exact_outputs(num_layers, num_slots):
    model = zoo.build("llama", num_layers=num_layers)
    ids = zoo.inputs()
    expected, _ = decode(model, ids, 4, offload=False)
    got, _ = decode(model, ids, 4, offload=True, num_slots=num_slots, engine=SlowEngine())
    assert equal(got, expected)
    # Copies run only when compute waits for them: the same on any machine, however busy.
    got, kv = decode(model, ids, 4, offload=True, num_slots=num_slots, engine=LateEngine())
    assert equal(got, expected)
    assert kv.stats().copies.num_stalls > 0  # compute really waited for late copies


def test_the_delayed_check_catches_a_missing_wait():
    """Compute that does not wait for its copy reads a slot still holding another
    layer's keys: the check above must then fail (it can fail)."""
    model = zoo.build("llama", num_layers=4)
    ids = zoo.inputs()
    expected, _ = decode(model, ids, 4, offload=False)
    got, _ = decode(model, ids, 4, offload=True, engine=SlowEngine(delay_s=0.02, waits=False))
    assert not equal(got, expected)


def test_a_lost_write_back_is_caught(monkeypatch):
    """Without the write-back the host copy misses the new rows; a layer brought back in
    then attends to zeros, and the outputs differ."""
    model = zoo.build("llama", num_layers=4)
    ids = zoo.inputs()
    expected, _ = decode(model, ids, 3, offload=False)
    monkeypatch.setattr(KVOffloader, "_write_back", lambda self, *args: None)
    got, _ = decode(model, ids, 3, offload=True)
    assert not equal(got, expected)


def test_sliding_window_layers_stay_on_the_device(caplog):
    """Mistral's layers all have sliding windows (bounded caches): nothing to offload,
    said once, and the output is unchanged."""
    model = zoo.build("mistral", num_layers=3)
    ids = zoo.inputs()
    expected, _ = decode(model, ids, 3, offload=False)
    got, kv = decode(model, ids, 3, offload=True)
    assert kv is None and equal(got, expected)
    assert "sliding windows" in caplog.text


def test_device_cache_is_unchanged_without_offload():
    model = zoo.build("llama", num_layers=2)
    cache = static_cache(model.config, 1, 8, torch.float32, CPU)
    assert cache.kv_offloader is None
    from transformers.cache_utils import StaticLayer

    # transformers' own layer (a compiled step writes it through one op: static_layers)
    assert isinstance(cache.layers[0], StaticLayer)


def test_host_cache_larger_than_swap_space_is_refused():
    shape = KVShape(batch=4, num_heads=8, max_cache_len=4096, k_head_dim=128, v_head_dim=128,
                    dtype=torch.bfloat16)  # fmt: skip
    need = 32 * shape.layer_bytes  # 2 GiB for 32 layers
    check_host_kv(shape, 32, swap_space_bytes=need)
    with pytest.raises(
        ConfigError, match=r"needs 2\.00 GiB of host memory, more than swap_space \(1\.00 GiB\)"
    ):
        check_host_kv(shape, 32, swap_space_bytes=2**30)
    with pytest.raises(ConfigError, match="RAM available"):
        check_host_kv(KVShape(1024, 64, 2**17, 128, 128, torch.float32), 80, 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_layers=st.integers(1, 5),
    num_slots=st.integers(1, 4),
    order=st.lists(st.integers(0, 4), min_size=1, max_size=25),
)
def test_any_update_order_sees_its_own_rows(num_layers, num_slots, order):
    """Layers updated in any order (skipped, repeated, out of order): when a layer's
    update begins, its slot holds exactly the rows written to that layer so far."""
    shape = KVShape(batch=1, num_heads=1, max_cache_len=len(order), k_head_dim=2,
                    v_head_dim=2, dtype=torch.float32)  # fmt: skip
    kv = KVOffloader(num_layers, shape, CPU, num_slots=num_slots,
                     copy_engine_factory=lambda device: SlowEngine(delay_s=0.0005))  # fmt: skip
    written = [[] for _ in range(num_layers)]
    for step, layer in enumerate(layer % num_layers for layer in order):
        kv.before_update(layer)
        slot = kv.slot_rows[layer % kv.num_slots]
        count = len(written[layer])
        assert torch.equal(slot[:count], torch.stack(written[layer]) if count else slot[:0])
        row = torch.full((shape.row_elements,), float(step + 1))
        slot[count] = row
        written[layer].append(row)
        kv.after_update(layer, torch.tensor([count]), 1)
    kv.close()


def test_the_seen_length_is_a_device_counter_as_in_the_resident_cache():
    """The mask reads the query's offset from the cache's length. In a CUDA graph a
    Python int would be frozen at capture (every replay masked as the captured step;
    only the GPU run showed it): the length must be the counter the layer advances."""
    model = zoo.build("llama", num_layers=3)
    ids = zoo.inputs()[:, :5]
    for offload in (False, True):
        cache = static_cache(model.config, len(ids), 10, torch.float32, CPU, offload=offload)
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(5))
        length = cache.get_seq_length()
        assert isinstance(length, torch.Tensor) and int(length) == 5
        counter = cache.layers[0].cumulative_length
        counter.add_(1)  # what a replayed step does on the device
        assert int(cache.get_seq_length()) == 6
        if offload:
            cache.kv_offloader.count_replayed_step()  # and what the engine counts for it
            assert cache.kv_offloader.lengths == [6, 6, 6]
            cache.kv_offloader.close()


def test_mixed_sliding_and_full_layers():
    """Gemma 2 alternates sliding-window and full layers: the full ones go to the host,
    the sliding ones (window 4, shorter than the text) keep their ring on the device."""
    model = zoo.build("gemma2")
    ids = zoo.inputs()
    expected, _ = decode(model, ids, 5, offload=False)
    got, kv = decode(model, ids, 5, offload=True, num_slots=1)  # one slot: refills
    assert equal(got, expected)
    assert kv.num_layers == 2 and kv.stats().bytes_copied > 0
