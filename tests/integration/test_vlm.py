"""Vision-language models in one process: what each architecture sees, how it is built and
initialised, its step, its loader's resume, captioning, and a local Hugging Face tower."""

from __future__ import annotations

import contextlib
import sys
from typing import Any
from unittest import mock

import attrs
import pytest
import torch

from forge.config.sections import (
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    Precision,
    SchedulerConfig,
    VisionConfig,
    VisionEncoderKind,
    VlmArch,
)
from forge.data.batch import Batch
from forge.data.image_text import open_image_captions
from forge.data.loader import TextLoader, single_source
from forge.data.shards import read_manifest
from forge.errors import UserInputError
from forge.model.chunked_loss import LossSpec
from forge.model.generate import caption
from forge.model.transformer import Transformer, num_parameters
from forge.model.vlm import VisionLanguageModel, build_model
from forge.optim.param_groups import build_optimizer
from forge.optim.schedules import Schedule, resolve_schedule
from forge.parallel.memory_plan import TEXT_ONLY, VisionFootprint, memory_plan, stage_parameters
from forge.parallel.world import MeshDims
from forge.training.setup.vlm import vision_footprint
from forge.training.steps.common import micro_batch_loss
from forge.training.steps.spec import StepSpec
from forge.training.steps.text import make_vlm_step
from forge.types import LoopState

VISION = VisionConfig(image_size=16, patch_size=4, dim=16, n_layers=1, n_heads=2)


def vlm_config(arch: VlmArch, **vision: Any) -> ModelConfig:
    return ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        max_seq_len=48,
        vlm=arch,
        vision=attrs.evolve(VISION, **vision),
    )


def images(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 16, 16, 3), dtype=torch.uint8, generator=gen)


def tokens(n: int, t: int = 12) -> torch.Tensor:
    return torch.randint(0, 259, (n, t), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", list(VlmArch))
def test_logits_cover_the_text_and_depend_on_the_image(arch):
    torch.manual_seed(0)
    model = VisionLanguageModel(vlm_config(arch))
    if model.cross_attention is not None:  # open the gates: at zero the image is ignored
        for block in model.cross_attention.values():
            torch.nn.init.constant_(block.attn_gate, 0.5)
    x, pics = tokens(2), images(2)
    logits = model(x, pics)
    assert logits.shape == (2, 12, 259)
    other = model(x, images(2, seed=1))
    assert not torch.allclose(logits, other)  # every position reads the image
    assert (logits - other).abs().amax(dim=-1).min() > 0


@pytest.mark.parametrize("arch", list(VlmArch))
def test_text_stays_causal(arch):
    torch.manual_seed(0)
    model = VisionLanguageModel(vlm_config(arch))
    x, pics = tokens(1), images(1)
    changed = x.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 259
    a, b = model(x, pics), model(changed, pics)
    torch.testing.assert_close(a[:, :7], b[:, :7])  # positions before the change agree
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_cross_attention_starts_as_exactly_the_text_decoder():
    """Its gates start at zero: tanh(0) = 0, so the image adds nothing until they move."""
    cfg = vlm_config(VlmArch.CROSS_ATTENTION)
    model = VisionLanguageModel(cfg)
    model.init_weights(seed=4)
    text = Transformer(cfg)
    text.init_weights(seed=4)
    x = tokens(2)
    assert torch.equal(model(x, images(2)), text(x))


@pytest.mark.parametrize("arch", list(VlmArch))
def test_built_on_meta_then_materialised_starts_where_a_direct_build_does(arch):
    cfg = vlm_config(arch)
    with torch.device("meta"):
        late = build_model(cfg)
    late.materialize("cpu")
    late.init_weights(seed=9)
    early = build_model(cfg)
    early.init_weights(seed=9)
    assert late.state_dict().keys() == early.state_dict().keys()
    for name, value in early.state_dict().items():
        assert torch.equal(late.state_dict()[name], value), name


def test_the_chunked_loss_equals_the_plain_one():
    torch.manual_seed(0)
    model = VisionLanguageModel(vlm_config(VlmArch.JOINT_DECODER))
    batch = image_caption_batch()
    plain = micro_batch_loss(model, batch, contextlib.nullcontext)
    chunked = micro_batch_loss(model, batch, contextlib.nullcontext, loss_spec=LossSpec(5))
    torch.testing.assert_close(chunked.loss, plain.loss)
    torch.testing.assert_close(chunked.objective, plain.objective)


def image_caption_batch() -> Batch:
    labels = tokens(4)
    labels[:, 9:] = -100  # padding past the caption
    return Batch(tokens(4), labels, images=images(4))


def test_the_vlm_step_trains_and_reports_its_images():
    torch.manual_seed(0)
    model = VisionLanguageModel(vlm_config(VlmArch.JOINT_DECODER))
    optimizer = build_optimizer(model, OptimizerConfig(lr=3e-3))
    step = make_vlm_step(
        StepSpec(
            model,
            optimizer,
            resolve_schedule_for(20),
            3e-3,
            Precision.FP32,
            1.0,
            token_slices=2,
            world_size=2,
            vlm=VlmArch.JOINT_DECODER,
        )
    )
    assert step.__name__ == "joint_decoder_step"
    batch = image_caption_batch()
    losses = []

    def peer_with_the_same_batches(total: torch.Tensor) -> None:
        total.mul_(2)  # the step's label count summed with one identical data-parallel peer

    with mock.patch(
        "forge.training.steps.common.torch_dist.all_reduce", peer_with_the_same_batches
    ):
        for i in range(8):
            result = step((batch, batch), LoopState(step=i))
            losses.append(result.loss)
            assert result.images == 2 * 4 * 2  # micro-batches × rows × data-parallel ranks
    assert losses[-1] < 0.9 * losses[0]
    # an identical peer leaves each token's weight as one rank alone would
    torch.manual_seed(0)
    alone = VisionLanguageModel(vlm_config(VlmArch.JOINT_DECODER))
    one_rank = make_vlm_step(
        StepSpec(
            alone,
            build_optimizer(alone, OptimizerConfig(lr=3e-3)),
            resolve_schedule_for(20),
            3e-3,
            Precision.FP32,
            1.0,
            vlm=VlmArch.JOINT_DECODER,
        )
    )
    assert one_rank((batch, batch), LoopState()).loss == pytest.approx(losses[0], rel=1e-6)
    with pytest.raises(ValueError, match="needs batches with images"):
        step((Batch(batch.inputs, batch.labels),), LoopState())


def resolve_schedule_for(steps: int) -> Schedule:
    return resolve_schedule(SchedulerConfig(warmup_steps=1), steps)


def test_the_image_caption_loader_resumes_exactly_with_its_images(small_shapes):
    manifest = read_manifest(small_shapes)
    captions = open_image_captions(small_shapes, manifest, "train", 96, verify=True)

    def loader() -> TextLoader:
        return TextLoader(captions, single_source(len(captions), 4, seed=7))

    whole = loader()
    expected = [next(whole) for _ in range(6)]
    first = loader()
    for _ in range(3):
        next(first)
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    for want in expected[3:]:
        got = next(resumed)
        assert got.images is not None and want.images is not None
        assert torch.equal(got.images, want.images)
        assert torch.equal(got.inputs, want.inputs)
        assert torch.equal(got.labels, want.labels)
    assert expected[0].images is not None and expected[0].images.shape == (4, 16, 16, 3)


def test_a_caption_is_greedy_and_stops_at_eos():
    torch.manual_seed(0)
    model = VisionLanguageModel(vlm_config(VlmArch.JOINT_DECODER))
    picture = images(1)[0]
    ids = caption(model, picture, [256], 20)
    assert ids[0] == 256 and len(ids) == 21
    assert caption(model, picture, [256], 20) == ids  # greedy: the same every time
    # the reference: each next token is the argmax of the full forward pass
    full = model(torch.tensor([ids[:-1]]), picture.unsqueeze(0))[0]
    assert full.argmax(-1).tolist() == ids[1:]
    stopped = caption(model, picture, [256], 20, stop_id=ids[3])
    assert stopped == ids[: ids.index(ids[3], 1) + 1]


# --- a local Hugging Face tower -----------------------------------------------------------


def save_tower(folder, kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    common = dict(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
    )
    if kind == "siglip":
        tower = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**common))
    else:
        tower = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**common))
    tower.save_pretrained(folder)


@pytest.mark.parametrize(("kind", "n_tokens"), [("siglip", 4), ("clip", 5)])
def test_a_local_hugging_face_tower_loads_its_weights(tmp_path, kind, n_tokens):
    transformers = pytest.importorskip("transformers")
    save_tower(tmp_path, kind)
    cfg = vlm_config(VlmArch.JOINT_DECODER, encoder=VisionEncoderKind.HF, path=str(tmp_path))
    with torch.device("meta"):
        model = VisionLanguageModel(cfg)
    model.materialize("cpu")
    model.init_weights(seed=0)
    assert model.num_image_tokens == n_tokens
    cls = transformers.SiglipVisionModel if kind == "siglip" else transformers.CLIPVisionModel
    reference = cls.from_pretrained(tmp_path)
    ours = model.vision_encoder.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(ours[f"model.{name}"], value), name
    pics = images(2)
    logits = model(tokens(2), pics)
    assert logits.shape == (2, 12, 259)
    # the tower sees the pixels scaled to [0, 1] then normalised with mean = std = 0.5
    x = (pics.permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
    torch.testing.assert_close(
        model.vision_encoder(pics), reference(pixel_values=x).last_hidden_state
    )


@pytest.mark.parametrize("kind", ["siglip", "clip"])
def test_a_loaded_hugging_face_tower_computes_as_the_trained_one(tmp_path, kind):
    """eval and generate allocate the model empty and load a checkpoint into it: the
    tower's position ids (in no checkpoint) must come back too."""
    from forge.model.vlm import empty_model

    save_tower(tmp_path, kind)
    cfg = vlm_config(VlmArch.JOINT_DECODER, encoder=VisionEncoderKind.HF, path=str(tmp_path))
    trained = VisionLanguageModel(cfg)
    loaded = empty_model(cfg, "cpu")
    loaded.load_state_dict(trained.state_dict())
    pics = images(2)
    torch.testing.assert_close(loaded(tokens(2), pics), trained(tokens(2), pics), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("empty", "holds no config.json"),
        ("text model", "holds a 'gpt2' model"),
        ("no transformers", "needs transformers; pip install"),
    ],
)
def test_a_tower_that_cannot_be_used_is_named(tmp_path, setup, message):
    transformers = pytest.importorskip("transformers")
    if setup == "text model":
        transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    cfg = vlm_config(VlmArch.JOINT_DECODER, encoder=VisionEncoderKind.HF, path=str(tmp_path))
    modules = {"transformers": None} if setup == "no transformers" else {}
    with (
        mock.patch.dict(sys.modules, modules),
        pytest.raises(UserInputError) as exc,
        torch.device("meta"),
    ):
        VisionLanguageModel(cfg)
    assert len(exc.value.lines) == 1
    assert message in exc.value.lines[0]
    assert exc.value.lines[0].startswith("model.vision.")


@pytest.mark.parametrize(
    ("arch", "decoder_tokens"), [(VlmArch.JOINT_DECODER, 16), (VlmArch.CROSS_ATTENTION, 0)]
)
def test_the_memory_plan_counts_every_parameter_and_image_token_of_the_vlm(arch, decoder_tokens):
    cfg = vlm_config(arch)
    built = num_parameters(VisionLanguageModel(cfg))
    vision = vision_footprint(cfg)
    assert vision == VisionFootprint(built - num_parameters(Transformer(cfg)), decoder_tokens)
    job = JobConfig(model=cfg)
    assert stage_parameters(job, 1, vision)[0] == built
    text = memory_plan(job, MeshDims())
    with_images = memory_plan(job, MeshDims(), vision)
    assert with_images.parameters > text.parameters
    assert (with_images.activations > text.activations) == (decoder_tokens > 0)
    assert vision_footprint(attrs.evolve(cfg, vlm=None, vision=None)) == TEXT_ONLY
