"""Replica groups through torchft (``[fault_tolerance]``, docs/fault-tolerance.md): each group
is an ordinary forge launch; a step's quorum says which groups take part, their gradients and
step totals are summed over them, and the step commits only when torchft's manager says every
group of the quorum finished it. A group that starts behind the others receives their state
from a live peer inside its first quorum (``heal``).

This module holds the torchft side only: what a step sends and applies on a heal is given by
the training floor (``ReplicaGroups.register``); which rows a group reads is
``forge.data.row_order.share_of``."""

from __future__ import annotations

import logging
import os
import socket
import time
import urllib.parse
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch
from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]
from torch.distributed.tensor import DTensor

from forge.config.fault_tolerance import FaultToleranceConfig
from forge.errors import UserInputError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# a fingerprint of the group's layout in 20 bits: its square sums exactly in float64
FINGERPRINT_BITS = 20


@attrs.frozen
class Quorum:
    """Who takes part in a step: ``participants`` groups, this one ``rank``-th among them;
    ``healed``: this group received a peer's state in it (``heal_s`` seconds for the quorum,
    the transfer included)."""

    participants: int
    rank: int
    healed: bool = False
    heal_s: float = 0.0


class GroupsLostError(RuntimeError):
    """No quorum formed in time: the lighthouse is gone, or too few groups are alive."""


def lighthouse_address(cfg: FaultToleranceConfig, env: dict[str, str]) -> str:
    """``fault_tolerance.lighthouse``, else ``$TORCHFT_LIGHTHOUSE``; ``UserInputError`` when
    neither names one."""
    address = cfg.lighthouse or env.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise UserInputError(
            "fault_tolerance.lighthouse: no lighthouse address (nor $TORCHFT_LIGHTHOUSE); start "
            "one with `python scripts/lighthouse.py` and pass the address it prints"
        )
    return address


def lighthouse_problem(address: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers at ``address`` (None when a connection opens)."""
    parsed = urllib.parse.urlparse(address)
    if parsed.hostname is None or parsed.port is None:
        return f"{address!r} is not an address with a host and a port, like http://host:29510"
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"nothing answers at {address} ({exc.strerror or exc})"


def torchft_problem() -> str | None:
    """Why torchft cannot be imported (None when it can)."""
    quiet_torchft()  # before its first import: its servers read RUST_LOG then
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        return (
            f"fault_tolerance.enabled needs torchft, which is not installed ({exc}); "
            "install the extra: pip install 'forge[ft]'"
        )
    return None


def quiet_torchft() -> None:
    """forge says what happens to the groups in its own lines (a heal, a step that did not
    commit, a lost quorum): torchft's own logs (its servers' info lines, a lost peer's
    traceback) stay out of the output unless asked for (``RUST_LOG``, the ``torchft``
    logger's level set by the caller)."""
    os.environ.setdefault("RUST_LOG", "warn")
    logger = logging.getLogger("torchft")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.CRITICAL)
    # a heal's tensors are read from the transfer's bytes, which torch warns are read-only
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def short_cause(exc: BaseException) -> str:
    """The first clause of a torchft error (its RPCs' messages carry gRPC's metadata)."""
    text = str(exc).split(", details:")[0].removeprefix("status: ")
    return text if len(text) <= 120 else text[:117] + "..."


def quiet_transport(timeout: timedelta) -> Any:
    """torchft's HTTP transport for heals (its default), without a line on stderr for every
    request a peer makes (the server's per-instance handler class: no other server changes)."""
    from torchft.checkpointing.http_transport import HTTPTransport

    transport = HTTPTransport(timeout=timeout, num_chunks=0)
    handler = transport._server.RequestHandlerClass
    handler.log_message = lambda *_args, **_kwargs: None  # type: ignore[method-assign]
    # a peer that dies while it receives is the quorum's business, not a traceback's
    server = transport._server
    setattr(server, "handle_error", lambda *_args: None)  # noqa: B010 — one instance's
    return transport


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard; a plain tensor itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ReplicaGroups:
    """This group's torchft manager: the quorum of each step, sums over the groups taking
    part, the commit, and a heal's state going out (to a peer behind) and coming in.

    ``step`` (the run's step when the group starts: the manager counts committed steps
    alike). The group's own ranks find the manager through the launch's store
    (``MASTER_ADDR``/``MASTER_PORT`` under torchrun; a store of its own in one process)."""

    def __init__(
        self,
        cfg: FaultToleranceConfig,
        group_rank: int,
        group_size: int,
        step: int,
        fingerprint: int,
        env: dict[str, str] | None = None,
    ) -> None:
        quiet_torchft()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        env = dict(os.environ) if env is None else env
        self.cfg = cfg
        self.fingerprint = fingerprint % (1 << FINGERPRINT_BITS)  # what a heal compares
        self.layout = self.fingerprint  # what every step's sums compare (``settle``)
        self._store = None
        if "MASTER_PORT" in env:
            addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"])
        else:  # one process: the manager's store is this process's
            self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            addr, port = "127.0.0.1", self._store.port
        self._send: Callable[[], dict[str, Any]] | None = None
        self._receive: Callable[[dict[str, Any]], None] | None = None
        timeout = timedelta(seconds=cfg.timeout_s)
        self.manager = Manager(
            checkpoint_transport=quiet_transport(timeout),
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._apply,
            state_dict=self._payload,
            min_replica_size=cfg.min_groups,
            use_async_quorum=False,  # a healed group takes part in the step of its quorum
            timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
            connect_timeout=timeout,
            rank=group_rank,
            world_size=group_size,
            store_addr=addr,
            store_port=port,
            lighthouse_addr=lighthouse_address(cfg, env),
            replica_id=f"group_{cfg.group}",  # torchft reads the group from its last digits
            hostname=socket.gethostname(),
            heartbeat_interval=timedelta(milliseconds=cfg.heartbeat_ms),
            init_sync=False,  # every group initialises alike from the seed
        )
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.heals = 0

    def register(
        self, send: Callable[[], dict[str, Any]], receive: Callable[[dict[str, Any]], None]
    ) -> None:
        """What a peer behind receives from this group (``send``, called while this group
        waits in its quorum) and how this group applies what it receives (``receive``)."""
        self._send, self._receive = send, receive

    def _payload(self) -> dict[str, Any]:
        assert self._send is not None, "ReplicaGroups.register first"
        return self._send()

    def _apply(self, payload: dict[str, Any]) -> None:
        assert self._receive is not None, "ReplicaGroups.register first"
        try:
            self._receive(payload)
        except UserInputError:  # refused by name (another layout)
            raise
        except Exception as exc:  # said as a heal's failure, not as a missing quorum
            raise GroupsLostError(f"the heal from a live peer failed ({short_cause(exc)})") from exc
        self.heals += 1

    def quorum(self) -> Quorum:
        """The quorum of the next step (waits for it; a group behind heals inside it);
        ``GroupsLostError`` when none forms within ``fault_tolerance.quorum_timeout_s``."""
        heals, start = self.heals, time.perf_counter()
        try:
            self.manager.start_quorum()
            participants = self.manager.num_participants()
            rank = self.manager.participating_rank()
        except (UserInputError, GroupsLostError):  # a peer's state refused, a heal failed
            raise
        except Exception as exc:  # torchft raises what its RPCs raise (gRPC's own text)
            raise GroupsLostError(f"no quorum formed ({short_cause(exc)})") from exc
        if rank is None or participants < 1:
            raise GroupsLostError("this group is not among the quorum's participants")
        if (error := self.manager.errored()) is not None:  # torchft keeps a heal's failure
            raise GroupsLostError(f"the quorum or its heal failed ({short_cause(error)})")
        healed = self.heals > heals
        return Quorum(participants, rank, healed, time.perf_counter() - start if healed else 0.0)

    def sum_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum ``tensors`` in place over the groups of the step's quorum, one all-reduce per
        dtype (a DTensor: its local shard, summed with the same shard of every group). A
        group lost inside it leaves them as they were; the step then does not commit."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            part = local(t)
            by_dtype.setdefault(part.dtype, []).append(part)
        for parts in by_dtype.values():
            flat = torch.cat([p.reshape(-1) for p in parts])
            self.manager.allreduce(flat, reduce_op=_sum_op()).wait()
            offset = 0
            for p in parts:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def settle(self, fingerprint: int) -> None:
        """From here, every step's sums compare ``fingerprint`` (the layout's, with what the
        set-up settled: the LR schedule in force), not the one a heal compares."""
        self.layout = fingerprint % (1 << FINGERPRINT_BITS)

    def agreed_layout(self, sums: torch.Tensor) -> bool:
        """Whether every group of the quorum has this one's fingerprint, from the summed
        ``[1, f, f²]`` of ``layout_terms``: the sums are ``p·f`` and ``p·f²`` only when every
        ``f`` is the same (Cauchy–Schwarz)."""
        count, first, second = (float(v) for v in sums.tolist())
        f = float(self.layout)
        return first == count * f and second == count * f * f

    def layout_terms(self, device: torch.device) -> torch.Tensor:
        """``[1, f, f²]`` of this group's fingerprint, in float64 (exact sums)."""
        f = float(self.layout)
        return torch.tensor([1.0, f, f * f], dtype=torch.float64, device=device)

    def failed(self) -> bool:
        """Whether a collective of this step failed (its sums are then not to be read)."""
        return self.manager.errored() is not None

    def veto(self, reason: str) -> None:
        """This step may not commit, in this group or any other."""
        self.manager.report_error(RuntimeError(reason))

    def commit(self) -> bool:
        """Whether the step commits: every group of the quorum finished it without a
        collective failing and at least ``min_groups`` took part. Called once per step, by
        every rank of every group, before the optimizer step."""
        try:
            return self.manager.should_commit()
        except Exception as exc:  # its RPC timed out: no group may count on this step
            raise GroupsLostError(f"the commit did not answer ({short_cause(exc)})") from exc

    def close(self) -> None:
        """Leave the quorum and stop the manager's servers."""
        self.manager.shutdown(wait=False)
        self._store = None


def _sum_op() -> Any:
    from torch.distributed import ReduceOp

    return ReduceOp.SUM
