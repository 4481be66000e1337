"""A stand-in for ``srun`` inside an allocation, on this one machine.

Starts ``SLURM_JOB_NUM_NODES × SLURM_NTASKS_PER_NODE`` tasks of the command it is given, each
with the variables SLURM sets for a task (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NODEID``, ``SLURMD_NODENAME``, ``SLURM_NTASKS``, ``SLURM_STEP_NUM_NODES``, and
``CUDA_VISIBLE_DEVICES`` listing the node's GPUs when ``STANDIN_GPUS_PER_NODE`` says it has
some), as SLURM's default binding does. The nodes are the hosts of ``SLURM_JOB_NODELIST``
written as ``prefix[a-b]`` (here loopback addresses: ``127.0.0.[1-2]``). SIGUSR1 and SIGTERM
are forwarded to every task; with ``--kill-on-bad-exit=1`` a task that fails ends the others.
Exits with the first non-zero task's code, else 0. srun's other options are ignored.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time


def hosts(nodelist: str) -> list[str]:
    """``127.0.0.[1-2]`` -> ``['127.0.0.1', '127.0.0.2']``; a plain name is itself."""
    m = re.fullmatch(r"([^\[]+)\[(\d+)-(\d+)\]", nodelist)
    if m is None:
        return [nodelist]
    return [f"{m.group(1)}{i}" for i in range(int(m.group(2)), int(m.group(3)) + 1)]


def main(argv: list[str]) -> int:
    options = []
    while argv and argv[0].startswith("-"):  # srun's own options come before the command
        options.append(argv.pop(0))
    kill_on_bad_exit, command = "--kill-on-bad-exit=1" in options, argv
    nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
    per_node = int(os.environ["SLURM_NTASKS_PER_NODE"])
    names = hosts(os.environ["SLURM_JOB_NODELIST"])
    assert len(names) == nodes, (names, nodes)
    gpus = int(os.environ.get("STANDIN_GPUS_PER_NODE", "0"))
    tasks = []
    for node in range(nodes):
        for local in range(per_node):
            env = os.environ | {
                "SLURM_PROCID": str(node * per_node + local),
                "SLURM_LOCALID": str(local),
                "SLURM_NODEID": str(node),
                "SLURMD_NODENAME": names[node],
                "SLURM_NTASKS": str(nodes * per_node),
                "SLURM_STEP_NUM_NODES": str(nodes),
            }
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus)))
            tasks.append(subprocess.Popen(command, env=env))

    def forward(signum: int, _frame: object) -> None:
        for task in tasks:
            if task.poll() is None:
                task.send_signal(signum)

    signal.signal(signal.SIGUSR1, forward)
    signal.signal(signal.SIGTERM, forward)
    code = 0
    while any(task.poll() is None for task in tasks):
        failed = [t.returncode for t in tasks if t.returncode not in (None, 0)]
        if failed and kill_on_bad_exit:
            for task in tasks:
                if task.poll() is None:
                    task.kill()
        time.sleep(0.05)
    for task in tasks:
        if task.returncode != 0 and code == 0:
            code = task.returncode if task.returncode > 0 else 128 - task.returncode
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
