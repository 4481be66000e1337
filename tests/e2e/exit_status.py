"""A torchrun worker that runs ``python ARGV...`` and writes its exit code to
``$FORGE_TEST_EXIT_DIR/rank<RANK>``: torchrun reports none of a worker it shut down (its
agent re-raises the signal it got). The signal torchrun sends the worker's process group
reaches the script too; this process only waits for it."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

if __name__ == "__main__":
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda *_: None)  # a handler, not SIG_IGN: the script keeps its own
    code = subprocess.call([sys.executable, *sys.argv[1:]])
    folder = pathlib.Path(os.environ["FORGE_TEST_EXIT_DIR"])
    (folder / f"rank{os.environ['RANK']}").write_text(str(code))
    sys.exit(code if code >= 0 else 128 - code)
