"""Structured outputs at each token: a request's spec compiled once for the model's
tokenizer (xgrammar's compiler, made on the first request that asks, its cache bounded),
one matcher per sequence, and the masks that leave a row only the tokens its grammar
allows next (batched over the rows that have one; the others' logits are not touched)."""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import Any

import torch

from offload.engine.structured import StructuredOutputsParams, why, xgrammar
from offload.errors import ConfigError

# What the compiled grammars may hold at once (vLLM's default VLLM_XGRAMMAR_CACHE_MB);
# beyond it, xgrammar drops the least recently used.
CACHE_BYTES = 512 * 2**20


class Grammars:
    """Compiles specs for one tokenizer whose model's logits are `vocab_size` wide, where
    `eos_ids` end a sequence (the grammar allows them once its language is complete)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Collection[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._compiler = None
        self._lock = threading.Lock()  # (requests are made on any thread: one compiler)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The spec's compiled grammar (xgrammar's cache: once per spec)."""
        xgr = xgrammar()  # (each time: a one-line error where it is missing)
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._eos_ids
                )
                self._compiler = xgr.GrammarCompiler(
                    info, cache_enabled=True, cache_limit_bytes=CACHE_BYTES
                )
        compiler = self._compiler
        try:
            if spec.kind == "json":
                return compiler.compile_json_schema(spec.spec, **spec.json_options)
            if spec.kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if spec.kind == "regex":
                return compiler.compile_regex(spec.spec)
            return compiler.compile_grammar(spec.spec)  # (choice, grammar)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ConfigError(f"structured_outputs.{spec.kind} {why(error)}") from None


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, compiled: Any):
        self._matcher = xgrammar().GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size  # (its bitmask's width)

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of `bitmask` [rows, words]: the tokens allowed next."""
        self._matcher.fill_next_token_bitmask(bitmask, index)

    def accept(self, token: int) -> bool:
        """Advance past `token`; False where the grammar cannot take it."""
        return self._matcher.accept_token(token)

    @property
    def is_terminated(self) -> bool:
        """Its language is complete and a stop token was taken: nothing more may follow."""
        return self._matcher.is_terminated()


def mask_logits(logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> None:
    """Each row of logits [batch, vocab] whose grammar is not None: -inf where its grammar
    allows no token (columns past the grammar's vocabulary too); in place, in one pass
    over those rows. The other rows are not written."""
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return
    vocab = grammars[rows[0]].vocab_size  # (one compiler's, for every row)
    bitmask = torch.full((logits.shape[0], (vocab + 31) // 32), -1, dtype=torch.int32)
    for row in rows:  # [batch, words]: on the CPU, where the matchers are
        grammars[row].fill(bitmask, row)
    vocab = min(vocab, logits.shape[-1])
    if logits.device.type == "cpu":  # (xgrammar's kernel: float32, bfloat16, float16)
        xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
    else:
        apply_bitmask(logits, bitmask.to(logits.device), rows, vocab)
    if logits.shape[-1] > vocab:  # (a padded lm_head: its extra tokens are no language's)
        logits[rows, vocab:] = -float("inf")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab: int):
    """logits[rows, :vocab] = -inf where bitmask [batch, words] (on the logits' device)
    has a 0 bit: in torch, for any device (xgrammar's own kernel for one needs triton)."""
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    index = torch.tensor(rows, device=logits.device)
    words = bitmask.index_select(0, index)  # [rows, words]
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]  # [rows, vocab]
    logits[index, :vocab] = logits[index, :vocab].masked_fill(~allowed, -float("inf"))
