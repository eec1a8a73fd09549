"""A CPU decode step three ways (issue 28): eager, `torch.compile`d as it is, and compiled with
each one-row linear written as a fused multiply-and-sum that inductor streams over the
weight on every core (MKL's float32 matrix-vector product runs on one thread here).

The default model in float32, resident, transformers' static cache, greedy tokens from the
same prompt; each way in its own process (a fresh compile cache unless --warm-cache), the
first steps (compile) timed apart, then a median over repeats of `--steps` steps. Printed
beside the read bound: the weights' bytes over the machine's read rate (a two-thread sum
over the head's 113 MB). Saves JSON to benchmarks/results/.

    python benchmarks/cpu_step.py [--steps 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
import common

WAYS = ("eager", "compiled", "compiled-fused-matvec")


def one_way(way: str, steps: int, repeats: int) -> dict[str, object]:
    from transformers import AutoModelForCausalLM, StaticCache

    from offload.model.default import default_model_path

    model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32)
    model.eval()
    if way == "compiled-fused-matvec":
        plain = torch.nn.Linear.forward

        def forward(self, x):
            if x.numel() != x.shape[-1]:
                return plain(self, x)
            out = (x.reshape(1, -1) * self.weight).sum(-1).reshape(*x.shape[:-1], -1)
            return out if self.bias is None else out + self.bias

        torch.nn.Linear.forward = forward
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 4649, 30, 2]])
    length = ids.shape[1] + 8 + steps * (repeats + 1)
    cache = StaticCache(config=model.config, max_cache_len=length)

    def step(token, position):
        out = model(input_ids=token, past_key_values=cache, cache_position=position)
        return out.logits[:, -1]

    run = step if way == "eager" else torch.compile(step, dynamic=False)
    with torch.inference_mode():
        positions = torch.arange(ids.shape[1])
        logits = model(input_ids=ids, past_key_values=cache, cache_position=positions).logits
        token, position, tokens = logits[:, -1].argmax(-1, keepdim=True), ids.shape[1], []
        started = time.perf_counter()
        for _ in range(8):  # compile (once) and warm up
            token = run(token, torch.tensor([position])).argmax(-1, keepdim=True)
            position += 1
            tokens.append(int(token))
        first_s = time.perf_counter() - started
        rates = []
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(steps):
                token = run(token, torch.tensor([position])).argmax(-1, keepdim=True)
                position += 1
                tokens.append(int(token))
            rates.append(steps / (time.perf_counter() - started))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rates.sort()
    return {
        "way": way,
        "first_8_steps_s": first_s,
        "tokens_per_s": rates[len(rates) // 2],
        "tokens_per_s_all": rates,
        "weight_bytes": weight_bytes,
        "tokens": tokens[:24],
    }


def read_gb_per_s() -> float:
    head = torch.randn(49152, 576)
    seconds = common.median_seconds(head.sum, torch.device("cpu"), warmup=3, repeats=15)
    return head.numel() * 4 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # (one child process)
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's cache")
    args = parser.parse_args()
    if args.way:
        print(json.dumps(one_way(args.way, args.steps, args.repeats)))
        return
    rate = read_gb_per_s()
    rows = []
    for way in WAYS:
        command = [sys.executable, __file__, "--way", way, "--steps", str(args.steps)]
        command += ["--repeats", str(args.repeats)]
        env = None
        if not args.warm_cache:
            import os
            import tempfile

            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp()}
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    bound = rate * 1e9 / rows[0]["weight_bytes"]
    print(
        f"read rate {rate:.1f} GB/s: bound {bound:.1f} tok/s for {rows[0]['weight_bytes'] / 1e6:.0f} MB a token"
    )
    for row in rows:
        same = row["tokens"] == rows[0]["tokens"]
        print(
            f"{row['way']:>22}: {row['tokens_per_s']:6.1f} tok/s ({row['tokens_per_s'] / bound:.2f} "
            f"of the bound), first 8 steps {row['first_8_steps_s']:5.1f} s, tokens as eager: {same}"
        )
    path = common.save("cpu-step", torch.device("cpu"), {"read_gb_per_s": rate, "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
