"""Tiny models of several architectures, built by transformers from small configs."""

from __future__ import annotations

import torch
import transformers as tf

from offload.model.gguf_fast import FastReader

VOCAB = 128
_DECODER = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)


def _configs() -> dict[str, tuple[object, type]]:
    causal = tf.AutoModelForCausalLM
    common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {
        "llama": (tf.LlamaConfig(**_DECODER, num_key_value_heads=2, **common), causal),
        "qwen2": (tf.Qwen2Config(**_DECODER, num_key_value_heads=2, **common), causal),
        "mistral": (tf.MistralConfig(**_DECODER, num_key_value_heads=2, **common), causal),
        "gemma": (tf.GemmaConfig(**_DECODER, num_key_value_heads=2, head_dim=16, **common), causal),
        "phi3": (tf.Phi3Config(**_DECODER, num_key_value_heads=2, **common), causal),
        "qwen3_moe": (
            tf.Qwen3MoeConfig(
                **_DECODER,
                num_key_value_heads=2,
                head_dim=16,
                moe_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                **common,
            ),
            causal,
        ),
        "gpt2": (tf.GPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=64, **common), causal),
        "gpt_neox": (tf.GPTNeoXConfig(**_DECODER, **common), causal),
        "opt": (
            tf.OPTConfig(
                hidden_size=64,
                ffn_dim=96,
                num_hidden_layers=3,
                num_attention_heads=4,
                word_embed_proj_dim=64,
                max_position_embeddings=64,
                **common,
            ),
            causal,
        ),
        "bert": (
            tf.BertConfig(**_DECODER, max_position_embeddings=64, vocab_size=VOCAB),
            tf.AutoModelForMaskedLM,
        ),
        "t5": (
            tf.T5Config(
                d_model=64,
                d_ff=96,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                d_kv=16,
                vocab_size=VOCAB,
                decoder_start_token_id=0,
            ),
            tf.AutoModelForSeq2SeqLM,
        ),
    }


def _more_configs() -> dict[str, tuple[object, type]]:
    """Architectures built by name for the tests that need them, outside `ARCHS` (which
    tests run over every architecture): each shows one thing the others do not."""
    causal = tf.AutoModelForCausalLM
    return {
        # a state-space model: layers with a recurrent state, no KV cache
        "mamba": (
            tf.MambaConfig(hidden_size=64, num_hidden_layers=3, vocab_size=VOCAB, state_size=8),
            causal,
        ),
        # mixture of experts with transformers' fused expert weights
        "mixtral": (
            tf.MixtralConfig(
                hidden_size=64,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=3,
                num_experts_per_tok=2,
                vocab_size=VOCAB,
            ),
            causal,
        ),
        # latent attention: caches compressed latents, not heads x head_dim
        "deepseek_v3": (
            tf.DeepseekV3Config(
                hidden_size=64,
                intermediate_size=96,
                moe_intermediate_size=32,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=4,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_shared_experts=1,
                first_k_dense_replace=1,
                kv_lora_rank=16,
                q_lora_rank=32,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=16,
                n_group=1,
                topk_group=1,
                vocab_size=VOCAB,
            ),
            causal,
        ),
        # sliding-window layers (window 4) alternating with full ones
        "gemma2": (
            tf.Gemma2Config(
                vocab_size=VOCAB,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                sliding_window=4,
                pad_token_id=0,
            ),
            causal,
        ),
        # ALiBi attention: its bias is built from the 2D attention mask
        "bloom": (tf.BloomConfig(hidden_size=64, n_layer=4, n_head=4, vocab_size=VOCAB), causal),
    }


ARCHS = tuple(_configs())
CAUSAL_ARCHS = tuple(
    name for name, (_, auto) in _configs().items() if auto is tf.AutoModelForCausalLM
)


def build(arch: str, seed: int = 0, num_layers: int | None = None) -> torch.nn.Module:
    """A randomly initialised (seeded) tiny model in eval mode, float32 on the CPU: one of
    `ARCHS` or of the architectures built by name (`_more_configs`)."""
    config, auto = {**_configs(), **_more_configs()}[arch]
    if num_layers is not None:
        setattr(config, "n_layer" if arch == "gpt2" else "num_hidden_layers", num_layers)
        derived = isinstance(getattr(type(config), "layer_types", None), property)
        if getattr(config, "layer_types", None) and not derived:  # lists follow the count
            config.layer_types = [config.layer_types[0]] * num_layers
    torch.manual_seed(seed)
    return auto.from_config(config).eval()


def inputs(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (2, 9), generator=generator)  # [batch, seq]


@torch.no_grad()
def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if model.config.is_encoder_decoder:
        return model(input_ids=ids, decoder_input_ids=ids[:, :4]).logits
    return model(input_ids=ids).logits


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: torch.Tensor, num_tokens: int = 6) -> torch.Tensor:
    mask = torch.ones_like(ids)
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=num_tokens, do_sample=False
    )


@torch.no_grad()
def greedy_new_tokens(
    model: torch.nn.Module, prompts: list[list[int]], num: int
) -> list[list[int]]:
    """transformers' own greedy answer of exactly `num` new tokens to each prompt, alone."""
    answers = []
    for ids in prompts:
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=num, min_new_tokens=num, do_sample=False
        )
        answers.append(out[0, len(ids) :].tolist())
    return answers


def layer_param_bytes(model: torch.nn.Module) -> int:
    from offload.offloader.layers import find_layers

    return sum(p.numel() * p.element_size() for m in find_layers(model) for p in m.parameters())


def load_on_cpu(path) -> torch.nn.Module:
    """A saved checkpoint through transformers' own loader, float32, on the CPU."""
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def save_smollm2_shape(path):
    """A seeded, randomly initialised checkpoint of SmolLM2-135M's shape, with a
    tokenizer made here, saved to `path` (where the real model cannot be had)."""
    shape = tf.LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(shape).save_pretrained(path)
    _word_tokenizer(shape.vocab_size).save_pretrained(path)
    return path


def save_q4_0_shape(path, layers=8, kernels="gguf"):
    """A random checkpoint of SmolLM2-135M's width (`layers` layers) with every matrix in
    GGUF Q4_0 blocks laid out for `kernels`, as offload keeps a .gguf read as stored, and
    a word tokenizer; `path`'s name ends in the kernels'."""
    path = path.with_name(f"{path.name}-{kernels}")
    shape = tf.LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    return _save_quantized(path, shape, "Q4_0", kernels, max_shard_bytes=10**7)


def _save_quantized(path, shape, kind: str, kernels: str, max_shard_bytes: int):
    """Random GGUF `kind` blocks for every matrix of the Llama `shape` (a config), laid out
    for `kernels`, and a word tokenizer of its vocabulary, written to `path`."""
    from offload.bench.checkpoint import write_random_checkpoint

    config = shape.to_dict()
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    write_random_checkpoint(path, config, max_shard_bytes, quantized=kind, kernels=kernels)
    _word_tokenizer(shape.vocab_size).save_pretrained(path)
    return path


def save_large_llama(path):
    """A randomly initialised Llama checkpoint of about 400 MB in float32 (8 layers of
    width 1024, an untied vocabulary of 16000), saved to `path`: large enough that a
    second copy of its weights would stand out in a process's peak memory."""
    shape = tf.LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=16000,
        tie_word_embeddings=False,
    )
    tf.AutoModelForCausalLM.from_config(shape).save_pretrained(path)
    return path


def save_with_tokenizer(model: torch.nn.Module, path):
    """`model` saved to `path` with a word tokenizer of the zoo's vocabulary, for tests
    that load a checkpoint folder (the CLI, `LLM`)."""
    model.save_pretrained(path)
    _word_tokenizer(VOCAB).save_pretrained(path)
    return path


def _word_tokenizer(vocab_size: int):
    """One word per token, "t3" to "t<vocab-1>"; ids 0-2 are pad, bos and eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def save_tiny_llm(path, num_layers: int = 24):
    """A seeded tiny Llama checkpoint with `num_layers` layers and a word tokenizer, for
    `LLM` tests that need many layers but little compute."""
    return save_with_tokenizer(build("llama", num_layers=num_layers), path)


def save_attentive_llm(path, num_layers: int = 6, dtype: torch.dtype = torch.float32):
    """A tiny Llama whose attention really depends on the keys (its query and key
    projections scaled up: at the zoo's small init every score is ~0 and attention is
    uniform, so a lost or misplaced key would go unseen), with a word tokenizer; its
    weights stored in `dtype` (its config's `dtype`, which `dtype="auto"` runs in)."""
    model = build("llama", num_layers=num_layers)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return save_with_tokenizer(model.to(dtype), path)


def save_cut_gguf(source, path, layers: int = 6):
    """The .gguf `source` (the default model's, as shipped) cut to its first `layers`
    decoder layers and written to `path`: the same tensor types, bytes, tokenizer and chat
    template in a file small enough to travel where the package cannot (a GPU machine).
    Its answers are not the model's, but every stored format of the file is there."""
    import gguf

    reader = FastReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # (the writer writes these itself)
        value = layers if key == f"{arch}.block_count" else field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(
            tensor.name,
            tensor.data,
            raw_shape=tensor.data.shape,
            raw_dtype=tensor.tensor_type,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# A small Llama whose rows are 256 values (the K types' block), its head untied.
GGUF_TYPE_SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    tie_word_embeddings=False,
)


def save_gguf_type_llm(path, kind: str, kernels: str = "cpu", layers: int = 2):
    """`GGUF_TYPE_SHAPE` with `layers` layers and every matrix in random GGUF `kind` blocks
    laid out for `kernels`, as offload keeps a .gguf read as stored, and a word tokenizer
    of its 512 ids."""
    shape = tf.LlamaConfig(**GGUF_TYPE_SHAPE, num_hidden_layers=layers)
    return _save_quantized(path, shape, kind, kernels, max_shard_bytes=2**18)


def predictions(llm, text: str) -> list[tuple[float, int]]:
    """For each token of `text` after the first, from an `LLM`'s prompt logprobs: (its
    logprob, the most likely token there)."""
    from offload import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    output = llm.generate(text, params, use_tqdm=False)[0]
    ids, entries = output.prompt_token_ids, output.prompt_logprobs
    return [
        (entry[token].logprob, max(entry, key=lambda t: entry[t].logprob))
        for entry, token in zip(entries[1:], ids[1:], strict=True)
    ]


# GGUF's names for a layer's tensors, by transformers' (Llama and Qwen2 alike).
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    **{f"self_attn.{p}_proj.{w}": f"attn_{p}.{w}" for p in "qkv" for w in ("weight", "bias")},
}


def save_random_gguf(path, arch: str, kind: str = "Q8_0", hidden: int = 256, layers: int = 2):
    """A random `arch` ("llama" or "qwen2", whose attention has biases) model written as
    llama.cpp writes one: GGUF names, its query/key rows in llama.cpp's order for Llama,
    every matrix in `kind` blocks (quantized by the `gguf` package), the rest float32, and
    the default model's tokenizer (its metadata copied from the shipped file). Returns
    (the .gguf's path, the float32 model it was made from)."""
    import gguf
    import numpy as np

    from offload.model.default import gguf_path

    shape = dict(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
        max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0,
    )  # fmt: skip
    config = tf.Qwen2Config(**shape) if arch == "qwen2" else tf.LlamaConfig(**shape)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 or name.endswith("bias"):
                parameter.normal_(0, 0.05)
    source = FastReader(gguf_path())
    writer = gguf.GGUFWriter(path, arch)
    for key, field in source.fields.items():
        if key.startswith(("GGUF.", "general.architecture", "llama.")):
            continue  # (the writer writes the first two; the shape is this model's)
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    for i in range(layers):
        names.update(
            {f"model.layers.{i}.{hf}": f"blk.{i}.{ours}" for hf, ours in _GGUF_LAYER_NAMES.items()}
        )
    block = gguf.GGMLQuantizationType[kind]
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # (tied to the embedding)
        values = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = 4 if "q_proj" in name else 2  # (llama.cpp's interleaved rotary rows)
            halves = values.reshape(heads, 2, values.shape[0] // heads // 2, -1)
            values = halves.swapaxes(1, 2).reshape(values.shape)
        if values.ndim == 2:
            quantized = gguf.quants.quantize(np.ascontiguousarray(values), block)
            writer.add_tensor(names[name], quantized, raw_shape=quantized.shape, raw_dtype=block)
        else:
            writer.add_tensor(names[name], np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model


def realign(path):
    """Rewrite each safetensors file under `path` with the package's writer: the same
    names, tensors and shards, but data starting at a multiple of 64 bytes (the
    safetensors library pads its header to 8), so every tensor whose size is a multiple
    of 64 bytes starts aligned, as the disk tier's mapping needs."""
    from pathlib import Path

    from safetensors.torch import load_file

    from offload.memory.safetensors import checkpoint_tensors
    from offload.memory.safetensors_writer import SafetensorsWriter, TensorEntry

    offsets = {name: stored.offset for name, stored in checkpoint_tensors(Path(path)).items()}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors = load_file(file)
        order = sorted(tensors, key=offsets.__getitem__)  # (layers stay runs of one file)
        entries = [TensorEntry(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in order]
        file.unlink()
        with SafetensorsWriter(file, entries) as writer:
            for name in order:
                writer.write(name, tensors[name].contiguous())
    return path
