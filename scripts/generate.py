"""Sample text from a trained run: ``python scripts/generate.py runs/debug --prompt 'def '``.

Loads the run's resolved ``config.toml`` and its newest complete checkpoint (the same resolver
training uses), then samples with temperature and top-k.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

import torch

from forge.checkpoint.resume import ResumeSource, resolve_resume
from forge.checkpoint.store import load_checkpoint
from forge.config import JobConfig
from forge.config.loader import load_config
from forge.data.shards import MANIFEST, read_manifest
from forge.data.tokenizer import ByteTokenizer, Tokenizer, tokenizer_from_manifest
from forge.errors import UserInputError
from forge.model.generate import sample
from forge.model.transformer import Transformer


def run_tokenizer(config: JobConfig) -> Tokenizer:
    """The tokenizer the run's (first) data source was prepared with; bytes if it is gone."""
    folder = pathlib.Path(config.data.source_list[0].path)
    if not (folder / MANIFEST).is_file():
        return ByteTokenizer()
    return tokenizer_from_manifest(read_manifest(folder).tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=pathlib.Path, help="a run folder holding config.toml")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=int, default=400)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        config = load_config([str(args.run_dir / "config.toml")]).config
        ckpt_dir = (
            pathlib.Path(config.checkpoint.dir)
            if config.checkpoint.dir
            else args.run_dir / "checkpoints"
        )
        load_path = (
            pathlib.Path(config.checkpoint.load_path) if config.checkpoint.load_path else None
        )
        plan = resolve_resume(ckpt_dir, load_path)
        if plan.source is ResumeSource.FRESH or plan.path is None:
            raise UserInputError(f"{ckpt_dir}: no checkpoint to sample from; train the run first")
        model = Transformer(config.model)
        load_checkpoint(plan.path, model, None, restore_rng_state=False)
        tok = run_tokenizer(config)
    except UserInputError as exc:
        for line in exc.lines:
            print(f"error: {line}", file=sys.stderr)
        return 2
    ids = sample(
        model,
        tok.encode(args.prompt, bos=True),
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        stop_id=tok.eos_id,
        generator=torch.Generator().manual_seed(args.seed),
    )
    print(f"# sampled from {plan.path}", file=sys.stderr)
    print(tok.decode(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
