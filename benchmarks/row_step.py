"""The server's decode step alone (`rows.RowStep`), compiled against eager, by rows and
columns read (issue 28): where the compiled step pays, which `rows.MAX_WIDTH` follows.

The default model in float32 (`--dtype auto`: as stored), a server's row cache (`Serving`, with the layer boundaries
it attaches), rows made up at the given width (every row has written all but the last
column it reads). A lone row ("1xW") has a compiled graph of its own (its width dynamic). The compiled step is the server's (two graphs, a lone row's and the batches', the
rows and width dynamic: compiled or loaded from disk first, timed apart); the eager one is what the server runs
otherwise (its products, and attention in the prefill's kernel, `StepAttention`). Per shape: a warm-up of each,
then `--repeats` steps of each in turn; medians in ms. Saves JSON to benchmarks/results/.

    python benchmarks/row_step.py [--shapes 2x64 8x128 32x512 ...] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common

from offload import LLM
from offload.engine import prompt_attention

SHAPES = ("1x64", "1x512", "1x2048", "2x64", "8x64", "32x64", "8x128", "32x128", "2x256", "8x256", "32x256", "8x512",
          "32x512", "16x1024", "16x2048")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--dtype", default="float32", help="float32, or auto: the weights as stored"
    )
    args = parser.parse_args()
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    llm = LLM(dtype=args.dtype, device="cpu", max_model_len=max(w for _, w in shapes) + 1)
    serving = llm.serving(max_num_seqs=max(r for r, _ in shapes), engine_thread=False)
    engine, runner = serving.core.runner, serving.core.runner.model
    started = time.perf_counter()
    serving.warm_up()
    ready_s = time.perf_counter() - started
    print(f"compiled step ready in {ready_s:.1f} s")
    results = {}
    with torch.inference_mode():
        for num_rows, width in shapes:
            rows = [_row(width) for _ in range(num_rows)]
            step = engine.row_step(rows)

            def compiled(step=step):
                with prompt_attention.one_forward():  # (as the engine's steps run)
                    return runner.compiled(step)

            def eager(step=step, num_rows=num_rows):
                with engine._decoding(num_rows), prompt_attention.one_forward():
                    return step()

            # (as stored, the int4 products round their inputs to bfloat16: the compiled
            # step's last-bit differences become bfloat16 steps, logits up to ~0.5 apart;
            # the check is each row's greedy token)
            ours, theirs = compiled().float(), eager().float()
            same = torch.equal(ours.argmax(-1), theirs.argmax(-1))
            differ = (ours - theirs).abs().max().item()
            times = {"compiled": [], "eager": []}
            for _ in range(args.repeats):
                for name, run in (("compiled", compiled), ("eager", eager)):
                    began = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - began)
            ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
            results[f"{num_rows}x{width}"] = {**ms, "agree": same, "max_abs_diff": differ,
                                              "rounds_ms": times}  # fmt: skip
            print(f"{num_rows:>3} rows x {width:>5} columns: compiled {ms['compiled']:7.1f} ms, "
                  f"eager {ms['eager']:7.1f} ms, eager/compiled {ms['eager'] / ms['compiled']:.2f}"
                  f"{'' if same else ' (greedy tokens differ!)'}", flush=True)  # fmt: skip
    serving.close()
    llm.close()
    payload = {"dtype": args.dtype, "repeats": args.repeats, "threads": torch.get_num_threads(),
               "compiled_ready_s": ready_s, "results": results}  # fmt: skip
    print(f"saved {common.save('row-step', torch.device('cpu'), payload)}")


def _row(width: int) -> SimpleNamespace:
    """A row that has written `width - 1` columns and writes its next token at the last."""
    sequence = SimpleNamespace(tokens=[42])
    return SimpleNamespace(
        sequence=sequence, start=0, column=width - 1, is_live=True, input_token=42
    )


if __name__ == "__main__":
    main()
