"""A pipeline rank started by rank 0 on this machine (`distributed.join`): the `LLM`
made with rank 0's arguments (read from the file rank 0 wrote, which only its user can
read), which serves this rank's stage until rank 0 closes. A failure is one line on
stderr and exit status 1 (rank 0 names the rank)."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

from offload.distributed.join import ARGS_ENV
from offload.errors import OffloadError
from offload.llm.process_exit import leave_now


def main() -> None:
    kwargs = pickle.loads(Path(os.environ[ARGS_ENV]).read_bytes())
    rank = os.environ.get("RANK", "?")
    try:
        from offload.llm.llm import LLM

        LLM(**kwargs)
    except Exception as error:  # (a one-line reason; rank 0 says which rank ended)
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if not isinstance(error, OffloadError):  # (not a user's error: its kind helps)
            first = f"{type(error).__name__}: {first}"
        print(f"offload: pipeline rank {rank}: {first}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    leave_now(0)  # (the served stage closed: no 0.6 s of finalizing, `process_exit`)


if __name__ == "__main__":
    main()
