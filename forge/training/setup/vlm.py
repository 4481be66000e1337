"""A vision-language run's set-up checks: what its config cannot do (checked before anything
is built), its vision footprint; and ``mismatched_images`` for evaluation. Its loaders are
built in ``forge.training.setup.loaders``."""

from __future__ import annotations

import pathlib

import attrs
import torch

from forge.config.sections import JobConfig, ModelConfig, VisionEncoderKind, VlmArch
from forge.data.batch import Batch
from forge.data.image_text import image_size_of
from forge.data.shards import DataError
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


def mismatched_images(batch: Batch) -> Batch:
    """``batch`` with each row's image swapped for the next row's (rolled by one): every
    caption now describes another image. What a model that ignores images would not notice."""
    if batch.images is None:
        raise ValueError("the batch carries no images")
    return attrs.evolve(batch, images=batch.images.roll(1, dims=0))
