"""`process_exit.leave_now` ends a program as a normal exit would (the other threads
waited for, thread pools ended, exit handlers run, buffered output written, the status
given) without finalizing it, and `offload` ends so."""

import subprocess
import sys

PROGRAM = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from offload.llm.process_exit import leave_now

folder = Path(sys.argv[1])
pool = ThreadPoolExecutor(max_workers=1)  # (never shut down: a normal exit ends it)
pool.submit(lambda: None).result()
atexit.register(lambda: (folder / "handler").write_text("ran"))

def late():
    time.sleep(0.3)
    (folder / "thread").write_text("done")

threading.Thread(target=late).start()
sys.stdout.write("buffered, no newline")
leave_now(3)
(folder / "after").write_text("must not run")
"""


CLI = """
import sys, weakref
from pathlib import Path
from offload.cli.main import main

class Held:
    pass

held = Held()  # (alive to the end: finalized only by CPython's finalization)
weakref.finalize(held, Path(sys.argv[1]).write_text, "finalized").atexit = False
sys.argv = ["offload", "generate", "--temperature", "-1"]
main()
"""


def test_a_program_left_now_ends_as_a_normal_exit_would(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newline" and done.stderr == ""
    assert (tmp_path / "handler").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done"  # (waited for, as at a normal exit)
    assert not (tmp_path / "after").exists()


def test_the_program_leaves_without_finalizing(tmp_path):
    """An object finalized at a normal exit is not, where `offload` ends: the program ends
    through `leave_now` (with its status: 2 for a bad flag given after parsing)."""
    done = subprocess.run(
        [sys.executable, "-c", CLI, str(tmp_path / "mark")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "temperature" in done.stderr
    assert done.stderr.count("\n") == 1  # (one line, no traceback)
    assert not (tmp_path / "mark").exists()
