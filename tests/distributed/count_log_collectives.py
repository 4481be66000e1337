"""``scripts/train.py`` with every ``torch.distributed`` collective counted while a step's
record is built (``StepLogger.log``): each rank (``tests/ranks.py``) writes its counts, one
list per logged step, to ``<run.dir>/log_collectives_rank<R>.json``."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import runpy
import sys

import torch.distributed as torch_dist

from forge.training.loop.step_logger import StepLogger

REPO = pathlib.Path(__file__).resolve().parents[2]
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
)


def main() -> int:
    per_log: list[list[str]] = []
    logging = []

    def counted(name, collective):
        @functools.wraps(collective)
        def call(*args, **kwargs):
            if logging:
                per_log[-1].append(name)
            return collective(*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(torch_dist, name, counted(name, getattr(torch_dist, name)))
    log = StepLogger.log

    def counting_log(self, state, result):
        per_log.append([])
        logging.append(True)
        try:
            log(self, state, result)
        finally:
            logging.pop()

    StepLogger.log = counting_log  # type: ignore[method-assign]
    train = runpy.run_path(str(REPO / "scripts" / "train.py"))["main"]
    code = train(sys.argv[1:])
    run_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--run.dir="))
    rank = int(os.environ.get("RANK", "0"))
    out = pathlib.Path(run_dir) / f"log_collectives_rank{rank}.json"
    out.write_text(json.dumps(per_log))
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as scripts/train.py: gloo threads can abort the interpreter's exit
