"""Hooks named in the config: imported and checked at start-up, called in the step."""

from __future__ import annotations

import json
import math

import pytest

from tests.e2e.test_train_script import TRAIN, nothing_written, run_dir

HOOK = "tests.e2e.grad_norm_hook:LayerGradNorms"


def with_hooks(config, text: str):
    config.write_text(config.read_text() + "\n" + text)
    return config


def test_a_config_hook_records_grad_norms_per_layer_before_clipping(tiny_config, tmp_path):
    out = tmp_path / "norms.jsonl"
    with_hooks(
        tiny_config, f'[hooks]\nclasses = ["{HOOK}"]\n[hooks.args."{HOOK}"]\npath = "{out}"\n'
    )
    # clip at 0.1: far below the tiny model's norms, so clipped gradients would show
    args = [str(tiny_config), "--train.max_steps=4", "--train.grad_clip_norm=0.1"]
    assert TRAIN.main(args) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    logged = {
        r["step"]: r["grad_norm"]
        for r in map(json.loads, (run_dir(tiny_config) / "metrics.jsonl").read_text().splitlines())
        if "grad_norm" in r
    }
    for r in rows:
        assert set(r["layers"]) == {"tok_embeddings", "layers.0", "layers.1", "norm", "output"}
        total = math.sqrt(sum(v**2 for v in r["layers"].values()))
        assert total == pytest.approx(r["grad_norm"], rel=1e-5)  # the global norm, unclipped
        assert r["grad_norm"] > 0.1
        if r["step"] in logged:
            assert logged[r["step"]] == pytest.approx(r["grad_norm"], rel=1e-6)
    # the run's saved config keeps the hook and its arguments (a resume runs it again)
    saved = (run_dir(tiny_config) / "config.toml").read_text()
    assert f'[hooks.args."{HOOK}"]' in saved and str(out) in saved


BAD_HOOKS = [
    (
        "no module",
        'classes = ["no_such_pkg.mod:Hook"]',
        "hooks.classes[0]: cannot import 'no_such_pkg.mod' (ModuleNotFoundError",
    ),
    (
        "no class",
        'classes = ["tests.e2e.grad_norm_hook:Missing"]',
        "hooks.classes[0]: module 'tests.e2e.grad_norm_hook' has no class 'Missing'",
    ),
    (
        "not a hook",
        'classes = ["tests.e2e.grad_norm_hook:NotAHook"]',
        "is not a subclass of forge.training.loop.hooks.Hooks",
    ),
    ("not a path", 'classes = ["grad_norm_hook.LayerGradNorms"]', "hooks.classes[0]: must be"),
    (
        "unknown argument",
        f'classes = ["{HOOK}"]\n[hooks.args."{HOOK}"]\npath = "x"\ncolour = "red"',
        f"hooks.args.\"{HOOK}\": got an unexpected keyword argument 'colour'",
    ),
    (
        "missing argument",
        f'classes = ["{HOOK}"]',
        f"hooks.args.\"{HOOK}\": missing a required argument: 'path'",
    ),
    (
        "arguments for an unlisted class",
        '[hooks.args."tests.e2e.grad_norm_hook:Exploding"]\nx = 1',
        "names a class that hooks.classes does not list",
    ),
    (
        "constructor raises",
        'classes = ["tests.e2e.grad_norm_hook:Exploding"]',
        "hooks.classes[0]: tests.e2e.grad_norm_hook:Exploding failed to construct "
        "(RuntimeError: no GPU here)",
    ),
]


@pytest.mark.parametrize("body,text", [b[1:] for b in BAD_HOOKS], ids=[b[0] for b in BAD_HOOKS])
def test_a_bad_hook_is_one_line_exit_2_and_nothing_on_disk(tiny_config, capsys, body, text):
    with_hooks(tiny_config, f"[hooks]\n{body}\n")
    assert TRAIN.main([str(tiny_config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0], err
    assert nothing_written(tiny_config)
