"""The data pipeline through scripts/train.py: mixtures, phases, packing, workers, resume."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from forge.config import load_config
from forge.data.shards import sha256_of
from forge.optim import lr_at, resolve_schedule
from tests.e2e.test_train_script import (
    TRAIN,
    SignalAt,
    final_weights,
    latest,
    reference_config,
    run_dir,
)

MIXTURE = """
[[data.sources]]
name = "json_email"
path = "{a}"
weight = 3.0

[[data.sources]]
name = "unittest"
path = "{b}"
weight = 1.0

[[data.phases]]
start_step = 7
weights = {{ json_email = 0.0 }}
lr_scale = 0.25
"""


@pytest.fixture
def mixture_config(tiny_config, small_corpus, second_corpus):
    tiny_config.write_text(
        tiny_config.read_text() + MIXTURE.format(a=small_corpus, b=second_corpus)
    )
    return tiny_config


def records(config):
    lines = (run_dir(config) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_a_phase_switches_data_and_lr_at_the_same_step(mixture_config):
    assert TRAIN.main([str(mixture_config)]) == 0
    recs = records(mixture_config)
    cfg = load_config([str(mixture_config)]).config
    schedule = resolve_schedule(cfg.scheduler, cfg.train.max_steps)
    for r in recs:
        scheduled = lr_at(schedule, cfg.optimizer.lr, r["step"] - 1)
        scale = 0.25 if r["step"] >= 7 else 1.0
        assert r["lr"] == pytest.approx(scheduled * scale, rel=1e-12), r["step"]
        # per-source tokens since the last log (log_interval = 1): the phase drops json_email
        if r["step"] >= 7:
            assert r["data/json_email/tokens"] == 0 and r["data/unittest/tokens"] > 0
    assert sum(r["data/json_email/tokens"] for r in recs[:6]) > 0
    total = cfg.train.batch_size * cfg.train.seq_len
    assert all(r["data/json_email/tokens"] + r["data/unittest/tokens"] == total for r in recs)


def test_per_source_metrics_cover_every_step_since_the_last_log(mixture_config, tmp_path):
    """Logged every 4 steps, each record's per-source tokens and loss are those of the steps
    since the previous log, as a run that logs every step sees them."""
    every = reference_config(mixture_config, tmp_path)
    assert TRAIN.main([str(every)]) == 0
    assert TRAIN.main([str(mixture_config), "--metrics.log_interval=4"]) == 0
    per_step = {r["step"]: r for r in records(every)}
    logged = records(mixture_config)
    assert [r["step"] for r in logged] == [1, 4, 8, 12]
    previous = 0
    for r in logged:
        window = [per_step[k] for k in range(previous + 1, r["step"] + 1)]
        for name in ("json_email", "unittest"):
            tokens = sum(w[f"data/{name}/tokens"] for w in window)
            assert r[f"data/{name}/tokens"] == tokens, (r["step"], name)
            if tokens:
                loss = sum(
                    w[f"data/{name}/loss"] * w[f"data/{name}/tokens"]
                    for w in window
                    if w[f"data/{name}/tokens"]
                )
                assert r[f"data/{name}/loss"] == pytest.approx(loss / tokens, rel=1e-9)
        previous = r["step"]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--data.pack_documents=true", "--data.num_workers=2"],
    ],
    ids=["mixture", "packed, 2 workers"],
)
def test_mixture_resumes_exactly_across_the_phase_switch(mixture_config, tmp_path, extra):
    reference = reference_config(mixture_config, tmp_path)
    assert TRAIN.main([str(reference), *extra]) == 0
    assert TRAIN.main([str(mixture_config), *extra], hooks=[SignalAt(5)]) == 75
    assert latest(mixture_config) == "step_6"  # the signal is seen after the next step
    assert TRAIN.main([str(mixture_config), *extra]) == 0
    got = [(r["step"], r["loss"]) for r in records(mixture_config)]
    assert got == [(r["step"], r["loss"]) for r in records(reference)]
    for name, tensor in final_weights(reference, 12).items():
        assert torch.equal(tensor, final_weights(mixture_config, 12)[name]), name


def test_a_changed_global_batch_continues_at_the_next_unconsumed_row(
    tiny_config, small_corpus, second_corpus, tmp_path, capsys
):
    """A mixture (no phase) in steps of 4 rows to the step-5 checkpoint, then steps of 2 under
    allow_config_change: after two steps of 2 the run has read rows 0-23, exactly what the
    uninterrupted run of 4 had read at step 6 (the same row count and digest)."""
    sources = MIXTURE.split("[[data.phases]]")[0].format(a=small_corpus, b=second_corpus)
    tiny_config.write_text(tiny_config.read_text() + sources)
    mixture_config = tiny_config
    reference = reference_config(mixture_config, tmp_path)
    assert TRAIN.main([str(reference)]) == 0
    assert TRAIN.main([str(mixture_config)], hooks=[SignalAt(4)]) == 75
    assert latest(mixture_config) == "step_5"
    changed = ["--train.batch_size=2", "--checkpoint.allow_config_change=true"]
    assert TRAIN.main([str(mixture_config), *changed]) == 0
    assert "global batch" in capsys.readouterr().err  # the warning names the change
    ref = {r["step"]: r for r in records(reference)}
    got = {r["step"]: r for r in records(mixture_config)}
    assert [got[s]["data/rows"] for s in (5, 6, 7, 8)] == [20, 22, 24, 26]
    assert got[7]["data/rows_digest"] == ref[6]["data/rows_digest"]
    assert got[6]["data/rows_digest"] not in (
        ref[5]["data/rows_digest"],
        ref[6]["data/rows_digest"],
    )


class EvalSpy:
    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []

    def on_eval_end(self, state, loss) -> None:
        self.calls.append((state.step, loss))

    def __getattr__(self, name):  # every other hook: no-op
        return lambda *args: None


def test_eval_logs_loss_and_perplexity_and_calls_on_eval_end(tiny_config):
    spy = EvalSpy()
    args = [str(tiny_config), "--eval.interval=4", "--eval.steps=3"]
    assert TRAIN.main(args, hooks=[spy]) == 0
    lines = (run_dir(tiny_config) / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, lines) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [4, 8, 12]
    assert [(r["step"], r["eval/loss"]) for r in evals] == spy.calls
    for r in evals:
        assert r["eval/perplexity"] == pytest.approx(torch.tensor(r["eval/loss"]).exp().item())


def corrupt_copy(corpus, tmp_path, damage):
    """A copy of ``corpus`` with ``damage(folder, manifest_json)`` applied."""
    folder = tmp_path / "damaged"
    shutil.copytree(corpus, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    damage(folder, manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def first_shard(folder, manifest):
    return folder / manifest["splits"]["train"]["shards"][0]["file"]


def truncate(folder, manifest):
    path = first_shard(folder, manifest)
    path.write_bytes(path.read_bytes()[:-10])


def flip_a_byte(folder, manifest):
    path = first_shard(folder, manifest)
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))


def id_beyond_vocab(folder, manifest):
    """Token 300 in a byte-tokenized shard, with the checksum updated to match."""
    path = first_shard(folder, manifest)
    tokens = np.fromfile(path, dtype=np.uint16)
    tokens[50] = 300
    tokens.tofile(path)
    manifest["splits"]["train"]["shards"][0]["sha256"] = sha256_of(path)


def tiny_shard(folder, manifest):
    """One more train shard of 12 tokens (shorter than a 33-token window)."""
    np.array([256, *range(65, 75), 257], dtype=np.uint16).tofile(folder / "train_tiny.bin")
    manifest["splits"]["train"]["shards"].append(
        {"file": "train_tiny.bin", "num_tokens": 12, "sha256": sha256_of(folder / "train_tiny.bin")}
    )


def no_manifest_dtype(folder, manifest):
    del manifest["dtype"]


# (case, damage, text in the one error line)
BAD_DATA = [
    ("shard shorter than its manifest says", truncate, "manifest says"),
    ("checksum mismatch", flip_a_byte, "checksum mismatch with the manifest"),
    ("token id beyond the vocab", id_beyond_vocab, "token 50 is id 300, outside the manifest's vocab_size 259"),
    ("shard shorter than one sequence", tiny_shard, "train_tiny.bin: holds 12 tokens, fewer than one sequence"),
    ("malformed manifest", no_manifest_dtype, "malformed manifest"),
]  # fmt: skip


@pytest.mark.parametrize("damage,text", [b[1:] for b in BAD_DATA], ids=[b[0] for b in BAD_DATA])
def test_bad_data_is_one_line_exit_2_and_nothing_on_disk(
    tiny_config, small_corpus, tmp_path, capsys, damage, text
):
    folder = corrupt_copy(small_corpus, tmp_path, damage)
    assert TRAIN.main([str(tiny_config), f"--data.path={folder}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0], err
    assert not run_dir(tiny_config).exists()


def test_sources_with_different_tokenizers_are_refused(
    mixture_config, second_corpus, tmp_path, capsys
):
    def other_tokenizer(folder, manifest):
        manifest["tokenizer"]["bos_id"] = 1

    folder = corrupt_copy(second_corpus, tmp_path, other_tokenizer)
    text = mixture_config.read_text().replace(str(second_corpus), str(folder))
    mixture_config.write_text(text)
    assert TRAIN.main([str(mixture_config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "every source must use one tokenizer" in err[0], err
    assert "data.sources.unittest.path" in err[0]
