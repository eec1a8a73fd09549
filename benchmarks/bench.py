"""`offload bench` as a benchmark script: the same code, its JSON and PNG saved under
benchmarks/results/ unless `--out` says otherwise.

    python benchmarks/bench.py [the flags of `offload bench`, e.g. --batch-sizes 1 8 32]
"""

from __future__ import annotations

import sys
from pathlib import Path

from offload.cli import main

RESULTS = Path(__file__).parent / "results"

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(arg == "--out" or arg.startswith("--out=") for arg in argv):
        argv += ["--out", str(RESULTS)]
    sys.exit(main(["bench", *argv]))
