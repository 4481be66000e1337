"""A vision-language run's set-up: what its config cannot do (checked before anything is
built), and its image–caption loaders."""

from __future__ import annotations

import pathlib

import attrs
import torch

from forge.config.sections import JobConfig, ModelConfig, VisionEncoderKind, VlmArch
from forge.data.image_text import ImageCaptions, image_size_of, open_image_captions
from forge.data.loader import Batch, Sampling, TextLoader, single_source
from forge.data.mixture import resolve_phases
from forge.data.shards import DataError, Manifest
from forge.errors import UserInputError
from forge.model.transformer import Transformer, num_parameters
from forge.model.vlm import VisionLanguageModel
from forge.parallel.memory_plan import TEXT_ONLY, VisionFootprint


def vlm_problems(config: JobConfig) -> list[str]:
    """What a ``model.vlm`` run cannot do with this config and data: one line per problem,
    each naming its key. The model is built on the meta device (no memory) to count its
    image tokens (``vision_footprint``); a Hugging Face tower's folder is read here."""
    m = config.model
    if m.vlm is None:
        return []
    try:
        n_image = vision_footprint(m).decoder_tokens
    except UserInputError as exc:
        return exc.lines
    problems: list[str] = []
    seq_len = config.train.seq_len
    if n_image + seq_len > m.max_seq_len:  # 0 image tokens in a cross-attention decoder
        problems.append(
            f"model.max_seq_len: the joint decoder runs {n_image} image tokens + "
            f"train.seq_len={seq_len} caption tokens; set it >= {n_image + seq_len}"
        )
    refusals = {
        "data.sources": bool(config.data.sources),
        "data.pack_documents": config.data.pack_documents,
        "checkpoint.export_final": config.checkpoint.export_final,
    }
    for key, refused in refusals.items():
        if refused:
            problems.append(
                f"{key}: is not supported with a vision-language model (model.vlm), which "
                "trains on one image–caption dataset at data.path; set it off"
            )
    if config.data.sources:
        return problems
    folder = pathlib.Path(config.data.path)
    try:
        size = image_size_of(folder)
    except DataError as exc:
        return problems + [f"data.path: {line}" for line in exc.lines]
    vision = m.vision_config
    if vision.encoder is VisionEncoderKind.VIT and size != vision.image_size:
        problems.append(
            f"model.vision.image_size: {vision.image_size}, but {folder}'s images are "
            f"{size}x{size}; set model.vision.image_size={size}"
        )
    return problems


def vision_footprint(m: ModelConfig) -> VisionFootprint:
    """What ``m``'s vision-language parts add to its decoder, counted on the meta device
    (``TEXT_ONLY`` for a text model), for ``memory_plan``."""
    if m.vlm is None:
        return TEXT_ONLY
    with torch.device("meta"):
        model = VisionLanguageModel(m)
        parameters = num_parameters(model) - num_parameters(Transformer(m))
    joint = m.vlm is VlmArch.JOINT_DECODER
    return VisionFootprint(parameters, model.num_image_tokens if joint else 0)


@attrs.frozen
class CaptionLoaders:
    """A vision-language run's loaders, and a start-up warning for the main rank to print
    (``caption_cut_warning``), if any."""

    train: TextLoader
    held_out: TextLoader | None
    warning: str | None


def image_caption_loaders(
    config: JobConfig,
    folder: pathlib.Path,
    manifest: Manifest,
    *,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
) -> CaptionLoaders:
    """The train loader over ``data.train_split``'s examples and, when evaluating, the
    held-out one over ``data.eval_split``'s: each batch carries its images."""
    train_cfg, data = config.train, config.data

    def open_split(split: str) -> ImageCaptions:
        return open_image_captions(folder, manifest, split, train_cfg.seq_len, data.verify_checksum)

    train = open_split(data.train_split)
    warning = caption_cut_warning(train.longest_caption, train_cfg.seq_len, folder)
    needed = train_cfg.batch_size * dp_size
    if len(train) < needed:
        raise DataError(
            f"{folder}: split '{data.train_split}' has {len(train)} image–caption examples, "
            f"fewer than one batch ({needed}); use more data or a smaller train.batch_size"
        )
    loader = TextLoader(
        train,
        Sampling(
            sizes=(len(train),),
            phases=resolve_phases(data.source_list, data.phases, data.temperature),
            seed=train_cfg.effective_data_seed,
            batch_size=train_cfg.batch_size,
            rank=dp_rank,
            world_size=dp_size,
            grad_accum_steps=train_cfg.grad_accum_steps,
            max_epochs=train_cfg.max_epochs,
        ),
        num_workers=data.num_workers,
        device=device,
    )
    if config.eval.interval <= 0:
        return CaptionLoaders(loader, None, warning)
    held_out = open_split(data.eval_split)
    if len(held_out) < needed:
        raise DataError(
            f"{folder}: split '{data.eval_split}' has {len(held_out)} image–caption examples, "
            f"fewer than one eval batch ({needed}); set --eval.interval=0 or prepare more"
        )
    sampling = single_source(
        len(held_out), train_cfg.batch_size, seed=0, rank=dp_rank, world_size=dp_size
    )
    return CaptionLoaders(loader, TextLoader(held_out, sampling, device=device), warning)


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


def mismatched_images(batch: Batch) -> Batch:
    """``batch`` with each row's image swapped for the next row's (rolled by one): every
    caption now describes another image. What a model that ignores images would not notice."""
    if batch.images is None:
        raise ValueError("the batch carries no images")
    return attrs.evolve(batch, images=batch.images.roll(1, dims=0))
