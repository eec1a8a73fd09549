"""What speculative decoding buys on a placement, and the number of guesses `k` that buys
most (`offload plan --speculative-config`). A verify forward scores each row's next token
and its k guesses at once: it moves the weights once, as a decode step does, and
computes for k + 1 positions a row. Where bytes set the step (the disk tier, a GPU over
PCIe) it costs little more than one position and k pays up to what the guesses keep;
where compute does (a CPU's resident weights) each position costs its share, and a
drafter's own steps add theirs. Pure functions, no tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offload.planner.plan import Plan

# The share of guesses kept where the one before was, taken where nothing was measured:
# prompt lookup's depends on how much the answer repeats the prompt (a rewrite keeps
# most, open chat few); a draft of the model's own family keeps most. The engine measures
# its own as it runs (`engine.speculative.Pace`).
ASSUMED_ACCEPTANCE = {"ngram": 0.5, "draft_model": 0.7}
MOST_GUESSES = 16  # the largest k weighed
# Speculation is chosen only where it is predicted this much faster than plain steps.
MARGIN = 1.05


def tokens_per_forward(acceptance: float, guesses: int) -> float:
    """The expected tokens a row gains from a verify forward of `guesses` guesses, each
    kept with `acceptance` where the one before it was: 1 + a + a^2 + ... + a^k (the
    model's own token after the last kept guess counts too)."""
    if not 0 <= acceptance <= 1 or guesses < 0:
        raise ValueError(
            f"acceptance must be in [0, 1] and guesses >= 0, got {acceptance}, {guesses}"
        )
    return float(sum(acceptance**i for i in range(guesses + 1)))


@dataclass(frozen=True)
class Speculation:
    """A number of guesses `k` (0: none, plain steps) and what it is predicted to give: a
    row's tokens per forward, the seconds of a turn (drafting and the verify forward),
    against a plain step's."""

    k: int
    acceptance: float
    tokens_per_forward: float
    turn_s: float
    plain_s: float

    @property
    def speedup(self) -> float:
        """Tokens per second over a plain step's."""
        if self.turn_s <= 0:
            return 1.0
        return self.tokens_per_forward * self.plain_s / self.turn_s


def pick(
    plain_s: float,
    turn_s: Callable[[int], float],
    acceptance: float,
    most: int = MOST_GUESSES,
) -> tuple[Speculation, list[Speculation]]:
    """The best number of guesses from 1 to `most` given a plain step's seconds and
    `turn_s(k)`, a turn's with k guesses (or k = 0, speculation off, where none beats
    plain steps by `MARGIN`), and every k weighed."""
    off = Speculation(0, acceptance, 1.0, plain_s, plain_s)
    weighed = [
        Speculation(k, acceptance, tokens_per_forward(acceptance, k), turn_s(k), plain_s)
        for k in range(1, most + 1)
    ]
    best = max(weighed, key=lambda s: (s.speedup, -s.k))
    return (best if best.speedup >= MARGIN else off), weighed


def for_plan(
    plan: Plan, method: str, draft_bytes: int = 0, acceptance: float | None = None
) -> tuple[Speculation, list[Speculation]]:
    """`pick` for the plan's chosen placement and batch: a verify forward of k guesses is
    its step at (k + 1) x the batch's positions (the same bytes moved, the compute of
    more positions); a draft model of `draft_bytes` adds k resident steps, each taken as
    the model's own compute scaled by the share of its weight bytes (n-gram lookup adds
    nothing); `acceptance` as measured, else `ASSUMED_ACCEPTANCE[method]`."""
    from offload.planner.choose import predict_layout

    chosen, shape = plan.chosen, plan.shape
    measured = plan.measured.measurements
    batch = chosen.batch_size
    kv = shape.kv_bytes(batch, measured.context_len) if chosen.kv_offload else 0
    layer_s, head_s = measured.compute_at(batch)
    draft_s = (layer_s * shape.num_layers + head_s) * draft_bytes / max(1, shape.weight_bytes)

    def turn_s(k: int) -> float:
        verify = predict_layout(shape, measured, chosen.layout, batch * (k + 1), kv)
        return verify.step_s + k * draft_s

    share = ASSUMED_ACCEPTANCE[method] if acceptance is None else acceptance
    return pick(chosen.time.step_s, turn_s, share)


def weight_bytes_at(path: Path) -> int:
    """The bytes of a checkpoint's weights: a file's size, or a folder's weight files'."""
    if path.is_file():
        return path.stat().st_size
    suffixes = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.suffix in suffixes)
