"""Start the lighthouse that replica groups meet at (``[fault_tolerance]``,
docs/fault-tolerance.md): ``python scripts/lighthouse.py [--port 29510]``.

Prints ``lighthouse: http://HOST:PORT`` (the address every group's
``fault_tolerance.lighthouse`` names) and serves until Ctrl-C or SIGTERM (exit 130). A quorum
forms as soon as every group it knows alive has asked, or ``--join-timeout-ms`` after
``--min-groups`` have; a group silent for ``--heartbeat-timeout-ms`` is left out of the next.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from forge.cli import help_first, summary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--port", type=int, default=29510, help="0: any free port")
    parser.add_argument("--bind", default="[::]", help="the address to listen on")
    parser.add_argument(
        "--min-groups", type=int, default=1, help="the fewest replica groups a quorum takes"
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=1000,
        help="how long a quorum waits for a group it does not know yet",
    )
    parser.add_argument(
        "--quorum-tick-ms",
        type=int,
        default=10,
        help="how often the lighthouse checks whether a quorum can form (each step waits for one)",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="a group silent this long is left out of the next quorum",
    )
    return parser.parse_args(argv)


help_first(__name__, parse_args)  # before torchft's and torch's imports: seconds

import sys
import threading

from forge.console import console_may_close
from forge.errors import print_errors
from forge.interrupts import exits_on_interrupt
from forge.resilience.replica_groups import quiet_torchft, torchft_problem
from forge.types import ExitCode


def option_problems(args: argparse.Namespace) -> list[str]:
    problems = []
    if not 0 <= args.port < 65536:
        problems.append(f"--port must be in [0, 65535], got {args.port}")
    for name in ("min_groups", "join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            problems.append(f"{flag} must be >= 1, got {getattr(args, name)}")
    return problems


@console_may_close()
@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problems = option_problems(args)
    if (missing := torchft_problem()) is not None:
        problems.append(missing.replace("fault_tolerance.enabled needs", "the lighthouse needs"))
    if problems:
        print_errors(problems)
        return ExitCode.CONFIG_ERROR
    quiet_torchft()  # RUST_LOG=info shows its quorums
    from torchft.coordination import LighthouseServer

    try:
        server = LighthouseServer(
            bind=f"{args.bind}:{args.port}",
            min_replicas=args.min_groups,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
    except Exception as exc:  # torchft's server raises what binding raised
        where = f"{args.bind}:{args.port}"
        print_errors([f"--bind/--port {where}: the lighthouse cannot listen there ({exc})"])
        return ExitCode.CONFIG_ERROR
    print(f"lighthouse: {server.address()}", flush=True)
    try:
        threading.Event().wait()  # until a signal ends the process
    finally:
        server.shutdown()
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
