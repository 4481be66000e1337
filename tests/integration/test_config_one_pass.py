"""Config errors of every stage in one pass: types, ranges and combinations, then the checks
against the world (layout, data, hooks, freeze, vision, sinks, directories). A check waits
only while a section it reads has a problem of its own."""

from __future__ import annotations

import pytest

from forge.config.loader import ConfigError
from forge.training.setup.phases import load_and_validate_config
from tests.conftest import TINY

# (case, overrides, TOML added to the config, fragments each expected among the error lines,
# fragments no line starts with)
CASES = [
    (
        "a range error in [train] beside the data, a hook and a sink; the layout reads [train]",
        ["--train.max_steps=0", "--data.path=/nope", '--hooks.classes=["nowhere:Hook"]',
         "--metrics.wandb=true", "--distributed.tp=3"],
        "",
        ["train.max_steps: must be > 0", "data.path: /nope/manifest.json",
         "hooks.classes[0]: cannot import 'nowhere'", "metrics.wandb: no W&B credentials"],
        ["distributed"],
    ),
    (
        "a type error in [model] holds back the checks that read the model",
        ["--model.dim=abc", "--data.path=/nope", '--hooks.classes=["nowhere:Hook"]'],
        "",
        ["model.dim: expected an integer, got 'abc'", "hooks.classes[0]: cannot import"],
        ["data.path"],
    ),
    (
        "a layout that does not fit the world beside bad data",
        ["--distributed.dp_shard=2", "--data.path=/nope"],
        "",
        ["distributed: pp*dp_replicate*dp_shard*tp", "data.path: /nope/manifest.json"],
        [],
    ),
    (
        "a freeze rule naming no module beside a bad path",
        ["--run.dir=runs/a\u0000b"],
        '[[freeze]]\nmodule = "nothing_here"\nend_step = 3\n',
        ["freeze[0]", "run.dir: contains a NUL byte"],
        [],
    ),
    (
        "a stray argument and an unknown key with a bad sink",
        ["oops", "--train.max_step=5", "--metrics.wandb=true"],
        "",
        ["'oops': unexpected argument", "train.max_step: unknown key",
         "metrics.wandb: no W&B credentials"],
        [],
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    "overrides,extra,expected,absent", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_every_stage_reports_in_one_pass(
    tmp_path, small_corpus, monkeypatch, overrides, extra, expected, absent
):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    config = tmp_path / "tiny.toml"
    run = f'\n[run]\ndir = "{tmp_path / "run"}"\n'
    config.write_text(TINY.format(data=small_corpus) + run + extra)
    with pytest.raises(ConfigError) as raised:
        load_and_validate_config([str(config), *overrides])
    lines = raised.value.lines
    for fragment in expected:
        assert any(fragment in line for line in lines), (fragment, lines)
    for fragment in absent:
        assert not any(line.startswith(fragment) for line in lines), (fragment, lines)
    assert not (tmp_path / "run").exists()  # validation writes nothing


@pytest.mark.parametrize("rank,refused", [(0, True), (1, False)])
def test_only_rank_0_which_alone_logs_needs_the_sinks_credentials(
    tmp_path, small_corpus, monkeypatch, rank, refused
):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # this node has no ~/.netrc
    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2}.items():
        monkeypatch.setenv(name, str(value))
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(data=small_corpus) + f'\n[run]\ndir = "{tmp_path / "run"}"\n')
    argv = [str(config), "--metrics.wandb=true"]
    if refused:
        with pytest.raises(ConfigError, match=r"metrics\.wandb: no W&B credentials"):
            load_and_validate_config(argv)
    else:
        assert load_and_validate_config(argv).config.metrics.wandb
