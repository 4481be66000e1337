"""A run's train and held-out loaders, text or image–caption, built by one set of helpers:
the same sampling, the same "at least one batch" check."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import attrs
import torch

from forge.config.sections import JobConfig
from forge.data.dataset import open_windows
from forge.data.image_text import ImageCaptions, open_image_captions
from forge.data.loader import Sampling, TextLoader, single_source, step_batches
from forge.data.mixture import resolve_phases
from forge.data.shards import DataError, Manifest
from forge.training.context import DataContext, StepBatches


@attrs.frozen
class Loaders:
    """A run's loaders, and a start-up warning for the main rank to print, if any."""

    train: TextLoader
    held_out: TextLoader | None
    warning: str | None = None


def train_sampling(config: JobConfig, sizes: Sequence[int], dp_rank: int, dp_size: int) -> Sampling:
    """The training order over sources of ``sizes`` examples: the mixture's phases, the data
    seed, this rank's slice of each batch, epochs."""
    train, data = config.train, config.data
    return Sampling(
        sizes=tuple(sizes),
        phases=resolve_phases(data.source_list, data.phases, data.temperature),
        seed=train.effective_data_seed,
        batch_size=train.batch_size,
        rank=dp_rank,
        world_size=dp_size,
        # replica groups read shares of one step's micro-batches (forge.data.row_order.share_of)
        grad_accum_steps=train.grad_accum_steps * config.fault_tolerance.active_groups,
        max_epochs=train.max_epochs,
    )


def held_out_sampling(config: JobConfig, size: int, dp_rank: int, dp_size: int) -> Sampling:
    """The held-out order: one source, seed 0, the same batch size (every eval alike)."""
    batch = config.train.batch_size
    return single_source(size, batch, seed=0, rank=dp_rank, world_size=dp_size)


def require_batch(count: int, needed: int, where: str, what: str, advice: str) -> None:
    """``DataError`` unless ``count`` examples (``what``) fill the ``needed`` rows of one
    batch over every data-parallel rank."""
    if count < needed:
        raise DataError(f"{where} has {count} {what}, fewer than one {advice}")


def text_loaders(
    config: JobConfig,
    folders: Sequence[pathlib.Path],
    manifests: Sequence[Manifest],
    *,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
    context: tuple[int, int] = (0, 1),
) -> Loaders:
    """Windows of ``train.seq_len + 1`` tokens of every source (packed into documents'
    rows under ``data.pack_documents``); held out from the first source when evaluating.
    ``context`` ``(rank, cp)``: each batch cut to this context-parallel rank's tokens."""
    data, seq_len = config.data, config.train.seq_len
    train = [
        open_windows(folder, manifest, data.train_split, seq_len, data.verify_checksum)
        for folder, manifest in zip(folders, manifests, strict=True)
    ]
    needed = config.train.batch_size * dp_size
    what = f"windows of {seq_len + 1} tokens"
    for folder, windows in zip(folders, train, strict=True):
        require_batch(
            len(windows),
            needed,
            f"{folder}: split '{data.train_split}'",
            what,
            f"batch ({needed}); use more data or a smaller train.seq_len / train.batch_size",
        )
    bos_id = int(manifests[0].tokenizer["bos_id"]) if data.pack_documents else None
    loader = TextLoader(
        train,
        train_sampling(config, [len(w) for w in train], dp_rank, dp_size),
        bos_id=bos_id,
        num_workers=data.num_workers,
        device=device,
        context=context,
    )
    if config.eval.in_loop_interval <= 0:
        return Loaders(loader, None)
    held_out = open_windows(
        folders[0], manifests[0], data.eval_split, seq_len, data.verify_checksum
    )
    require_batch(
        len(held_out),
        needed,
        f"{folders[0]}: split '{data.eval_split}'",
        what,
        f"eval batch ({needed}); set --eval.interval=0, or re-prepare the data with a larger "
        "--validation-percent",
    )
    sampling = held_out_sampling(config, len(held_out), dp_rank, dp_size)
    held = TextLoader([held_out], sampling, bos_id=bos_id, device=device, context=context)
    return Loaders(loader, held)


def image_caption_loaders(
    config: JobConfig,
    folder: pathlib.Path,
    manifest: Manifest,
    *,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
) -> Loaders:
    """The train loader over ``data.train_split``'s examples and, when evaluating, the
    held-out one over ``data.eval_split``'s: each batch carries its images. Warns when
    captions are cut (``caption_cut_warning``)."""
    train_cfg, data = config.train, config.data

    def open_split(split: str) -> ImageCaptions:
        return open_image_captions(folder, manifest, split, train_cfg.seq_len, data.verify_checksum)

    train = open_split(data.train_split)
    warning = caption_cut_warning(train.longest_caption, train_cfg.seq_len, folder)
    needed = train_cfg.batch_size * dp_size
    what = "image–caption examples"
    require_batch(
        len(train),
        needed,
        f"{folder}: split '{data.train_split}'",
        what,
        f"batch ({needed}); use more data or a smaller train.batch_size",
    )
    sampling = train_sampling(config, [len(train)], dp_rank, dp_size)
    loader = TextLoader(train, sampling, num_workers=data.num_workers, device=device)
    if config.eval.in_loop_interval <= 0:
        return Loaders(loader, None, warning)
    held_out = open_split(data.eval_split)
    require_batch(
        len(held_out),
        needed,
        f"{folder}: split '{data.eval_split}'",
        what,
        f"eval batch ({needed}); set --eval.interval=0 or prepare more",
    )
    held_sampling = held_out_sampling(config, len(held_out), dp_rank, dp_size)
    return Loaders(loader, TextLoader(held_out, held_sampling, device=device), warning)


def caption_cut_warning(longest: int, seq_len: int, folder: pathlib.Path) -> str | None:
    """A warning when the longest caption (in tokens, BOS and EOS included) does not fit in
    ``seq_len + 1`` and so loses its end; None when every caption fits."""
    if longest <= seq_len + 1:
        return None
    return (
        f"{folder}'s longest caption has {longest} tokens; captions are cut at "
        f"train.seq_len + 1 = {seq_len + 1} (their end is not learned); set "
        f"train.seq_len >= {longest - 1} to keep them whole"
    )


def train_batches(data: DataContext, grad_accum_steps: int) -> StepBatches:
    """The train loader grouped into optimizer steps of ``grad_accum_steps`` micro-batches."""
    return step_batches(data.train_loader, grad_accum_steps)
