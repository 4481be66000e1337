"""Sample text from a trained run: ``python scripts/generate.py runs/debug --prompt 'def '``.

Loads the run's resolved ``config.toml`` and its newest complete checkpoint (the same resolver
training uses), then samples — greedy at temperature 0, else with temperature, top-k and top-p
— with a KV cache, until the tokenizer's EOS or the model's context is full.

A vision-language run (``model.vlm``) captions an image instead (greedy unless
``--temperature`` is given; the prompt, if any, starts the caption)::

    python scripts/generate.py runs/vlm_debug --image shape.png

The model runs on ``cuda:<local rank>`` where torch sees GPUs, else on the CPU, with the
checkpoint's dtype (``--device``, ``--dtype`` to choose). Under ``torchrun
--nproc_per_node=N`` each rank samples its own text (seed ``--seed + rank``) and rank 0 prints
all N, in rank order (greedy decoding, at temperature 0, gives one text: printed once).
"""

from __future__ import annotations

import argparse
import pathlib

from forge.cli import add_device_options, help_first, run_path, summary


def parser() -> argparse.ArgumentParser:
    """The options ``main`` reads, built before torch is imported (``help_first``)."""
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "run_dir", type=run_path, help="a run directory or one checkpoint (step_N folder)"
    )
    parser.add_argument(
        "--prompt",
        default=None,
        help="text to continue; the byte tokenizer takes bytes that are not UTF-8 as they are "
        "(default: 'def ', or '' with --image)",
    )
    parser.add_argument(
        "--image",
        type=pathlib.Path,
        default=None,
        help="a vision-language run: the image to caption (PNG, JPEG...; needs Pillow)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens to sample (default: up to the model's max_seq_len)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="softmax temperature, 0: greedy (default: 0.8, or 0 with --image)",
    )
    parser.add_argument(
        "--top-k", type=int, default=40, help="sample among the k likeliest tokens (0: all)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="sample within this much probability (1: all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="the model's multi-token depths draft, the main model verifies (the same output: "
        "greedy the same tokens, sampled the same distribution); prints the acceptance rate and "
        "the tokens/s against plain generation of the same length, timed here too",
    )
    add_device_options(parser)
    return parser


help_first(__name__, lambda args: parser().parse_args(args))

import importlib.util
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from forge.config import JobConfig
from forge.console import console_may_close
from forge.data.image_text import load_image
from forge.data.tokenizer import ByteTokenizer, Tokenizer
from forge.errors import UserInputError, print_errors
from forge.interrupts import exits_on_interrupt
from forge.model.generate import caption, sample
from forge.model.speculative import speculation_problem, speculative_sample
from forge.model.transformer import Transformer
from forge.model.vlm import VisionLanguageModel
from forge.optim.optimizers import evaluation_weights
from forge.parallel.devices import choose_device, end_script_world, start_script_world
from forge.parallel.world import world_info
from forge.training.evaluation.inference import load_for_inference, run_dir_of, run_tokenizer
from forge.training.records.run_dir import load_run_config
from forge.types import ExitCode


def sampling_problems(args: argparse.Namespace) -> list[str]:
    """Out-of-range sampling options, one line each."""
    problems = []
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        problems.append(f"--max-new-tokens: must be >= 0, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        problems.append(f"--temperature: must be a finite number >= 0, got {args.temperature}")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        problems.append(f"--top-p: must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        problems.append(f"--top-k: must be >= 0, got {args.top_k}")
    if not 0 <= args.seed < 2**63:
        problems.append(f"--seed: must be in [0, 2**63), got {args.seed}")
    return problems


def prompt_ids(tok: Tokenizer, prompt: str) -> list[int]:
    """The prompt's ids, BOS first. Command-line bytes that are not UTF-8 reach Python as
    lone surrogates (``surrogateescape``): the byte tokenizer takes them as the bytes they
    stand for; a Hugging Face tokenizer encodes text only, so there they are refused
    (``UserInputError``), as is a lone surrogate that stands for no byte."""
    if isinstance(tok, ByteTokenizer):
        try:
            return tok.encode(prompt.encode("utf-8", "surrogateescape"), bos=True)
        except UnicodeEncodeError as exc:
            raise UserInputError(
                f"--prompt: character {exc.start} (U+{ord(prompt[exc.start]):04X}) is a lone "
                "surrogate, neither text nor a byte; pass text or bytes"
            ) from None
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(prompt[exc.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise UserInputError(
            f"--prompt: {what} at character {exc.start} is not UTF-8 text, and the run's "
            f"tokenizer ({tok.path}) encodes text only; pass the prompt as UTF-8"
        ) from None
    return tok.encode(prompt, bos=True)


def length_problem(prompt: int, limit: int, asked: int | None) -> str | None:
    """Why ``prompt`` tokens and ``asked`` new ones (None: as many as fit, at least one) do not
    fit ``model.max_seq_len=limit``; None when they do."""
    room = limit - prompt
    need = 1 if asked is None else asked
    if need <= room:
        return None
    if room > 0:  # the prompt fits: fewer new tokens do too (asked is set: need > 1)
        return (
            f"--max-new-tokens: the prompt ({prompt} tokens) + {asked} new tokens exceed "
            f"model.max_seq_len={limit}; ask for at most {room}"
        )
    cut = prompt + need - limit
    size = f"{prompt} tokens (BOS included)"
    size += f", {prompt - limit} over" if prompt > limit else " leave no room"
    goal = "to sample any" if asked is None else "to fit" if asked == 0 else f"to sample {asked}"
    return (
        f"--prompt: too long for model.max_seq_len={limit}: {size}; shorten it by at least "
        f"{cut} token{'s' if cut != 1 else ''} {goal}"
    )


def image_problem_or_pixels(path: pathlib.Path | None, config: JobConfig) -> torch.Tensor | None:
    """The ``--image`` as the model's ``uint8`` ``(H, W, 3)`` input (None without one);
    ``UserInputError`` when it does not fit the run: a text run, a missing image, no Pillow."""
    if config.model.vlm is None:
        if path is not None:
            raise UserInputError(
                ["--image: the run is a text model (model.vlm is unset); drop --image"]
            )
        return None
    if path is None:
        raise UserInputError(
            ["--image: the run is a vision-language model; pass --image PATH to caption"]
        )
    if importlib.util.find_spec("PIL") is None:
        raise UserInputError(["--image: reading an image needs Pillow; pip install -e '.[vision]'"])
    size = config.model.vision_config.image_size
    return torch.from_numpy(load_image(path, size).copy())


def speculative_run(
    model: Transformer, prompt: list[int], new_tokens: int, sampling: dict[str, Any], seed: int
) -> tuple[list[int], str]:
    """(the speculative generation's ids, its line): the acceptance rate and tokens/s, and
    the ratio against plain generation of as many tokens, timed after it (same seed)."""
    started = time.perf_counter()
    ids, spec = speculative_sample(model, prompt, new_tokens, **sampling)
    fast = time.perf_counter() - started
    produced = len(ids) - len(prompt)
    sampling = {**sampling, "generator": torch.Generator().manual_seed(seed), "stop_id": None}
    started = time.perf_counter()
    sample(model, prompt, produced, **sampling)
    plain = time.perf_counter() - started
    line = (
        f"# speculative: {spec.accepted}/{spec.drafted} drafts kept ({spec.acceptance:.0%}), "
        f"{produced} tokens in {spec.forwards} forwards; {produced / fast:.1f} tokens/s, "
        f"{plain / fast:.2f}x plain generation ({produced / plain:.1f} tokens/s)"
    )
    return ids, line


def report(line: str) -> None:
    print(line, file=sys.stderr)


@console_may_close()
@exits_on_interrupt
def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return generate(args)
    finally:
        end_script_world()


def generate(args: argparse.Namespace) -> int:
    """The sampling ``main`` describes; the exit code."""
    world = world_info(os.environ)
    if args.temperature is None:
        args.temperature = 0.0 if args.image is not None else 0.8
    if args.prompt is None:
        args.prompt = "" if args.image is not None else "def "
    gpus = torch.cuda.device_count()
    choice = choose_device(args.device, torch.cuda.is_available(), gpus, world.local_rank)
    try:
        problems = sampling_problems(args)
        if choice.problem is not None:
            problems.append(choice.problem)
        if problems:
            raise UserInputError(problems)
        run_dir, checkpoint = run_dir_of(args.run_dir)
        config = load_run_config(run_dir)
        image = image_problem_or_pixels(args.image, config)
        device = start_script_world(world, choice, config.distributed.timeout_s)
        loaded = load_for_inference(config, run_dir, checkpoint, device, args.dtype, report)
        model, path = loaded.model, loaded.checkpoint
        if args.speculative and (problem := speculation_problem(model)) is not None:
            raise UserInputError(problem)
        tok = run_tokenizer(config)
        prompt = prompt_ids(tok, args.prompt)
        limit = config.model.max_seq_len
        problem = length_problem(len(prompt), limit, args.max_new_tokens)
        if problem is not None:
            raise UserInputError(problem)
        new_tokens = limit - len(prompt) if args.max_new_tokens is None else args.max_new_tokens
    except UserInputError as exc:
        if world.rank == 0 or choice.problem is not None:  # a rank of its own: it says so
            print_errors(exc.lines)
        return ExitCode.CONFIG_ERROR
    sampling = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "stop_id": tok.eos_id,
        "generator": torch.Generator().manual_seed(args.seed + world.rank),
    }
    with evaluation_weights(loaded.optimizer):
        if isinstance(model, VisionLanguageModel):
            assert image is not None
            ids = caption(model, image, prompt, new_tokens, **sampling)
            note = f"# captioned {args.image} with {path}"
        elif args.speculative and isinstance(model, Transformer):
            ids, note = speculative_run(model, prompt, new_tokens, sampling, args.seed + world.rank)
            note += f"\n# sampled from {path}"
        else:
            ids = sample(model, prompt, new_tokens, **sampling)  # type: ignore[arg-type]
            note = f"# sampled from {path}"
    texts = [tok.decode(ids)]
    if world.world_size > 1 and args.temperature > 0:  # every rank's text, printed by rank 0
        gathered: list[object] = [None] * world.world_size
        dist.all_gather_object(gathered, texts[0])
        texts = [str(t) for t in gathered]
    if world.rank == 0:
        print(note, file=sys.stderr)
        for rank, text in enumerate(texts):
            if len(texts) > 1:
                print(f"# rank {rank} (seed {args.seed + rank})")
            print(text)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
