"""A trained run's model, loaded for inference on this rank's device: what ``eval.py``,
``generate.py`` and ``eval_harness.py`` share (the same resolver as a resume)."""

from __future__ import annotations

import pathlib
import re
from collections.abc import Callable

import attrs
import torch
from torch import nn

from forge.checkpoint.paths import CheckpointPath
from forge.checkpoint.resume import load_newest_weights
from forge.checkpoint.store import (
    CheckpointError,
    ShapeMismatchError,
    is_complete,
    load_checkpoint,
)
from forge.cli import DtypeRequest
from forge.config import JobConfig, Precision
from forge.data.shards import MANIFEST, read_manifest
from forge.data.tokenizer import ByteTokenizer, Tokenizer, tokenizer_from_manifest
from forge.errors import UserInputError
from forge.model.attention import runnable_here
from forge.model.vlm import empty_model
from forge.optim.param_groups import inference_optimizer
from forge.parallel.devices import choose_dtype, stored_dtype
from forge.training.records.run_dir import checkpoint_dir_of, load_path_of


@attrs.frozen
class LoadedModel:
    """The model in eval-ready weights, the optimizer whose ``evaluation_weights`` apply
    (Schedule-Free's average), the checkpoint read, and the device and dtype it is in."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    checkpoint: CheckpointPath
    device: torch.device
    dtype: torch.dtype


def run_dir_of(path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path | None]:
    """(the run directory, the checkpoint asked for or None): ``path`` is either."""
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/", str(path)):  # argparse's Path ate a "//"
        raise UserInputError(
            [
                f"{path}: a URL; give the run directory (its config.toml names the "
                "checkpoint.dir, which may be a URL: its checkpoints are read from there)"
            ]
        )
    if (path / "config.toml").is_file():
        return path, None
    if (path / "train_state.json").is_file():
        for parent in path.parents[:3]:
            if (parent / "config.toml").is_file():
                return parent, path
        raise UserInputError([f"{path}: no run config.toml above this checkpoint"])
    raise UserInputError(
        [f"{path}: neither a run directory (config.toml) nor a checkpoint (train_state.json)"]
    )


def load_for_inference(
    config: JobConfig,
    run_dir: pathlib.Path,
    checkpoint: CheckpointPath | None,
    device: torch.device,
    dtype_request: DtypeRequest,
    report: Callable[[str], None],
) -> LoadedModel:
    """The run's model built directly on ``device`` in the asked (or stored) dtype, with the
    weights of ``checkpoint``, or of the newest loadable checkpoint of the run (then its
    ``checkpoint.load_path``), as training would resume. Raises ``UserInputError``."""
    dtype = choose_dtype(dtype_request, stored_dtype(config.train.param_dtype))
    bf16 = dtype is torch.bfloat16 or config.train.mixed_precision is Precision.BF16
    model = empty_model(runnable_here(config.model, device.type, bf16), device, dtype)
    optimizer = inference_optimizer(model, config.optimizer)
    used = load_run_weights(config, run_dir, checkpoint, model, optimizer, report)
    return LoadedModel(model, optimizer, used, device, dtype)


def load_run_weights(
    config: JobConfig,
    run_dir: pathlib.Path,
    checkpoint: CheckpointPath | None,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    report: Callable[[str], None],
) -> CheckpointPath:
    """Load into ``model`` (and ``optimizer``) the weights of ``checkpoint``, or of the newest
    loadable checkpoint of the run (then its ``checkpoint.load_path``), as training would
    resume; returns the checkpoint used. Every script that reads a checkpoint loads here, so
    each takes the same forms of path (``run_dir_of``)."""
    if checkpoint is not None:  # the one named: no other of the run's is looked at
        try:
            load_checkpoint(checkpoint, model, optimizer, restore_rng_state=False)
        except ShapeMismatchError:  # another model's: said as it is
            raise
        except CheckpointError as exc:
            gone = not is_complete(checkpoint)
            raise NamedCheckpointError(
                checkpoint, "removed while it was read, by retention" if gone else str(exc)
            ) from None
        return checkpoint
    return load_newest_weights(
        checkpoint_dir_of(config, run_dir), load_path_of(config), model, report, optimizer
    )


class NamedCheckpointError(CheckpointError):
    """The checkpoint a reader was given does not load (``why``); its message says what to
    give the reader instead."""

    def __init__(self, path: CheckpointPath, why: str) -> None:
        super().__init__(
            f"{path}: does not load ({why}); name another checkpoint of the run, or the run "
            "directory to read its newest that loads"
        )
        self.why = why


def tokenizer_problem(config: JobConfig, run_dir: pathlib.Path) -> str | None:
    """Why the run's tokenizer cannot be trusted for scoring text: its data (and with it the
    tokenizer's description) is gone and the model is not a byte-level one, or its vocabulary
    is larger than the model's."""
    folder = pathlib.Path(config.data.source_list[0].path)
    vocab = config.model.vocab_size
    if not (folder / MANIFEST).is_file():
        if vocab == ByteTokenizer().vocab_size:
            return None
        return (
            f"{run_dir}: the run's data {folder} is gone, and with it which tokenizer the "
            f"model (vocab {vocab}) reads; restore the folder or point data.path in "
            f"{run_dir}/config.toml at a copy"
        )
    tokens = read_manifest(folder).vocab_size
    if tokens > vocab:
        return f"{folder}: vocab size {tokens} is larger than the model's {vocab}"
    return None


def run_tokenizer(config: JobConfig) -> Tokenizer:
    """The tokenizer the run's (first) data source was prepared with; bytes if it is gone."""
    folder = pathlib.Path(config.data.source_list[0].path)
    if not (folder / MANIFEST).is_file():
        return ByteTokenizer()
    return tokenizer_from_manifest(read_manifest(folder).tokenizer)
