"""Convert between forge checkpoints and a Hugging Face Llama export (safetensors + config.json).

    python scripts/convert_checkpoint.py export runs/debug --out exports/debug --dtype bfloat16
    python scripts/convert_checkpoint.py import exports/debug --out ckpt/imported

``export`` reads the run's newest complete checkpoint (the training resolver); ``import``
writes a model-only forge checkpoint (``<out>/step_0``) to use as ``checkpoint.load_path``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from forge.checkpoint.export import DTYPES, export_model, import_model
from forge.checkpoint.resume import ResumeSource, resolve_resume
from forge.checkpoint.store import load_checkpoint, save_model_only
from forge.config.loader import load_config
from forge.errors import UserInputError
from forge.model.transformer import Transformer


def export(run_dir: pathlib.Path, out: pathlib.Path, dtype: str) -> None:
    config = load_config([str(run_dir / "config.toml")]).config
    ckpt_dir = (
        pathlib.Path(config.checkpoint.dir) if config.checkpoint.dir else run_dir / "checkpoints"
    )
    plan = resolve_resume(ckpt_dir, None)
    if plan.source is ResumeSource.FRESH or plan.path is None:
        raise UserInputError(f"{ckpt_dir}: no checkpoint to export; train the run first")
    model = Transformer(config.model)
    load_checkpoint(plan.path, model, None, restore_rng_state=False)
    export_model(model.state_dict(), config.model, out, dtype)
    print(f"exported {plan.path} to {out} ({dtype})")


def import_(folder: pathlib.Path, out: pathlib.Path) -> None:
    cfg, state = import_model(folder)
    model = Transformer(cfg)
    model.load_state_dict(state)
    path = save_model_only(out, 0, model, {"step": 0, "imported_from": str(folder)})
    print(f"wrote {path}; use it with --checkpoint.load_path={path} and this [model] section:")
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden_dim"):
        print(f"  {key} = {getattr(cfg, key)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="forge run -> safetensors + config.json")
    ex.add_argument("run_dir", type=pathlib.Path)
    ex.add_argument("--out", type=pathlib.Path, required=True)
    ex.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    im = sub.add_parser("import", help="safetensors + config.json -> forge checkpoint")
    im.add_argument("folder", type=pathlib.Path)
    im.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            export(args.run_dir, args.out, args.dtype)
        else:
            import_(args.folder, args.out)
    except UserInputError as exc:
        for line in exc.lines:
            print(f"error: {line}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
