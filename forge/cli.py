"""The command-line options the scripts beside training share (``--device``, ``--dtype``),
and how argparse reads an enum: one line naming the choices. The choice they lead to is
``forge.parallel.devices``'s."""

from __future__ import annotations

import argparse
import enum
import pathlib
import re
import sys
from collections.abc import Callable, Sequence


class DeviceRequest(enum.Enum):
    """``--device``: the GPU when there is one (``auto``), or a device forced."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"

    def __str__(self) -> str:  # as --help shows the default
        return self.value


class DtypeRequest(enum.Enum):
    """``--dtype``: the checkpoint's own (``auto``), or the weights cast to one."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"

    @classmethod
    def _missing_(cls, value: object) -> DtypeRequest | None:
        # the config's spelling of the same dtypes (train.param_dtype = "bf16")
        return {"fp32": cls.FLOAT32, "bf16": cls.BFLOAT16}.get(str(value).lower())

    def __str__(self) -> str:  # as --help shows the default
        return self.value


def run_path(text: str) -> pathlib.Path:
    """argparse's type for a script's run directory (or one of its checkpoints): a local
    path. A URL is refused as it was typed — as a ``pathlib.Path`` it would be ``s3:/…``, a
    local folder that does not exist (a follower waited for it for minutes)."""
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a URL; give the run directory (its config.toml names the "
            "checkpoint.dir, which may be a URL: its checkpoints are read from there)"
        )
    return pathlib.Path(text)


def help_first(name: str, show: Callable[[Sequence[str]], object]) -> None:
    """A script's ``-h``/``--help`` answered by ``show`` (given the arguments; argparse's
    ``parse_args`` prints the usage and exits 0) before the script imports torch, when it runs
    as a program (``name``: its ``__name__``): the first command a new user runs answers in a
    fraction of a second instead of the seconds torch's import takes."""
    args = sys.argv[1:]
    if name != "__main__" or not {"-h", "--help"} & set(args):
        return
    show(args)
    sys.exit(0)


def task_names(value: str) -> list[str]:
    """``--tasks a,b``: lm-eval task names, each once, blanks dropped."""
    return list(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))


def summary(doc: str | None) -> str:
    """A script's one-line description: its docstring's first line, or nothing where Python
    ran with ``-OO`` (docstrings stripped) — ``--help`` still answers."""
    return doc.strip().splitlines()[0] if doc and doc.strip() else ""


def request_parser(cls: type[enum.Enum]) -> Callable[[str], enum.Enum]:
    """An argparse ``type`` for ``cls``: its value (any case), else one line naming them."""

    def parse(text: str) -> enum.Enum:
        try:
            return cls(text.lower())
        except ValueError:
            names = ", ".join(str(member.value) for member in cls)
            raise argparse.ArgumentTypeError(f"{text!r}: choose one of {names}") from None

    return parse


def add_device_options(
    parser: argparse.ArgumentParser,
    dtype: bool = True,
    default: DeviceRequest = DeviceRequest.AUTO,
) -> None:
    """``--device`` and (with ``dtype``) ``--dtype``, as the scripts beside training take
    them (an export has a ``--dtype`` of its own: the written weights')."""
    parser.add_argument(
        "--device",
        type=request_parser(DeviceRequest),
        choices=list(DeviceRequest),
        default=default,
        metavar="{" + ",".join(r.value for r in DeviceRequest) + "}",
        help="auto: cuda:<local rank> where torch sees GPUs (NCCL between ranks), else the CPU",
    )
    if not dtype:
        return
    parser.add_argument(
        "--dtype",
        type=request_parser(DtypeRequest),
        choices=list(DtypeRequest),
        default=DtypeRequest.AUTO,
        metavar="{" + ",".join(r.value for r in DtypeRequest) + "}",
        help="the weights' dtype; auto: the checkpoint's (train.param_dtype)",
    )
