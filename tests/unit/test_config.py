"""Config loading: TOML + CLI overrides, strict types, every problem reported at once."""

import importlib
import pathlib

import attrs
import pytest
import tomli

from forge.config import (
    ConfigError,
    JobConfig,
    Precision,
    ScheduleName,
    dumps_toml,
    load_config,
    structure_config,
    unstructure_config,
)
from forge.config.overrides import apply_overrides, parse_cli, parse_override_value
from forge.config.sections import RopeScaling, TrainConfig
from tests.conftest import REPO


@pytest.fixture
def toml_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "tiny.toml"
    path.write_text(
        "[train]\nmax_steps = 50\n[optimizer]\nlr = 1e-3\n[scheduler]\nwarmup_steps = 5\n"
    )
    return path


def test_defaults_then_toml_then_cli(toml_file):
    loaded = load_config([str(toml_file), "--optimizer.betas=[0.8,0.9]", "--train.seed=7"])
    cfg = loaded.config
    assert cfg.train.max_steps == 50  # TOML
    assert cfg.optimizer.lr == 1e-3  # TOML
    assert cfg.optimizer.betas == (0.8, 0.9)  # CLI, TOML syntax
    assert cfg.train.seed == 7
    assert cfg.train.batch_size == JobConfig().train.batch_size  # default


def test_run_dir_defaults_to_the_config_stem(toml_file):
    assert load_config([str(toml_file)]).config.run.dir == "runs/tiny"


@pytest.mark.parametrize(
    "text,value",
    [
        ("3", 3),
        ("3e-4", 3e-4),
        ("true", True),
        ("[0.9,0.95]", [0.9, 0.95]),
        ('"quoted"', "quoted"),
        ("runs/x", "runs/x"),
        ("bf16", "bf16"),
    ],
)
def test_override_values_use_toml_syntax(text, value):
    assert parse_override_value(text) == value


def test_bare_flag_means_true():
    overrides, problems = parse_cli(["--model.tie_embeddings"])
    assert overrides == [("model.tie_embeddings", True)] and problems == []


def test_overrides_create_nested_tables():
    raw = apply_overrides({}, [("checkpoint.dyn_ckpt_window.stop", 8)])
    assert raw == {"checkpoint": {"dyn_ckpt_window": {"stop": 8}}}
    cfg = structure_config(raw)
    assert cfg.checkpoint.dyn_ckpt_window is not None
    assert cfg.checkpoint.dyn_ckpt_window.stop == 8


def test_enum_values_structure_to_members():
    cfg = structure_config({"train": {"mixed_precision": "fp32"}, "scheduler": {"name": "wsd"}})
    assert cfg.train.mixed_precision is Precision.FP32
    assert cfg.scheduler.name is ScheduleName.WSD


# (case, raw config, expected line)
BAD = [
    (
        "[eval.tasks] in single brackets",
        {"eval": {"tasks": {"name": "hellaswag"}}},
        "eval.tasks: a single table [eval.tasks] where an array of tables belongs; write each "
        "entry under [[eval.tasks]] (double brackets)",
    ),
    (
        "[data.sources] in single brackets",
        {"data": {"sources": {"name": "a", "path": "x"}}},
        "data.sources: a single table [data.sources] where an array of tables belongs; write "
        "each entry under [[data.sources]] (double brackets)",
    ),
    (
        "unknown key",
        {"train": {"max_step": 5}},
        "train.max_step: unknown key; did you mean 'train.max_steps'?",
    ),
    ("unknown section", {"optimiser": {}}, "optimiser: unknown key; did you mean 'optimizer'?"),
    (
        "string for int",
        {"train": {"batch_size": "8"}},
        "train.batch_size: expected an integer, got '8'",
    ),
    (
        "fraction for int",
        {"train": {"max_steps": 1.5}},
        "train.max_steps: expected an integer, got 1.5",
    ),
    ("bool for int", {"model": {"dim": True}}, "model.dim: expected an integer, got a boolean"),
    (
        "string for bool",
        {"model": {"tie_embeddings": "yes"}},
        "model.tie_embeddings: expected true or false, got 'yes'",
    ),
    ("number for string", {"data": {"path": 3}}, "data.path: expected a string, got 3"),
    (
        "bad enum",
        {"train": {"mixed_precision": "fp16"}},
        "train.mixed_precision: expected one of 'bf16', 'fp32', got 'fp16'",
    ),
    (
        "bad list item",
        {"optimizer": {"betas": [0.9, "x"]}},
        "optimizer.betas[1]: expected a number, got 'x'",
    ),
    ("out of range", {"train": {"batch_size": 0}}, "train.batch_size: must be > 0, got 0"),
    (
        "beta out of range",
        {"optimizer": {"betas": [0.9, 1.0]}},
        "optimizer.betas: each beta must be in [0, 1), got [0.9, 1.0]",
    ),
    (
        "heads do not divide dim",
        {"model": {"dim": 100, "n_heads": 3}},
        "model.dim: must be divisible by model.n_heads=3",
    ),
    (
        "kv heads do not divide heads",
        {"model": {"n_heads": 4, "n_kv_heads": 3}},
        "model.n_kv_heads: must divide model.n_heads=4",
    ),
    (
        "seq longer than the model's",
        {"train": {"seq_len": 512}, "model": {"max_seq_len": 256}},
        "train.seq_len: must be <= model.max_seq_len=256, got 512",
    ),
    (
        "window stop before start",
        {"checkpoint": {"dyn_ckpt_window": {"start": 5, "stop": 2}}},
        "checkpoint.dyn_ckpt_window.stop: must be >= start=5, got 2",
    ),
    (
        "warmup covers the run",
        {"train": {"max_steps": 10}, "scheduler": {"warmup_steps": 10}},
        "scheduler.warmup_steps: must be < train.max_steps=10 (the run would end inside warmup)",
    ),
    (
        "scalar for a table",
        {"checkpoint": 5},
        "checkpoint: is a table; set its keys as checkpoint.<key>=...",
    ),
    (
        "nan for a float",
        {"optimizer": {"lr": float("nan")}},
        "optimizer.lr: expected a finite number, got nan",
    ),
    (
        "inf for a float",
        {"optimizer": {"lr": float("inf")}},
        "optimizer.lr: expected a finite number, got inf",
    ),
    (
        "nan init std",
        {"model": {"init_std": float("nan")}},
        "model.init_std: expected a finite number, got nan",
    ),
    (
        "nan rope theta",
        {"model": {"rope_theta": float("nan")}},
        "model.rope_theta: expected a finite number, got nan",
    ),
    (
        "a health timeout too short for a healthy step (every run ended at step 1, unnamed)",
        {"resilience": {"health_timeout_s": 0.001}},
        "resilience.health_timeout_s: must be >= 1 s, got 0.001: the per-step control word "
        "waits that long for the slowest rank's step, so a shorter one fails healthy runs; it "
        "bounds how long a dead peer goes unnoticed",
    ),
    (
        "-inf timeout",
        {"resilience": {"health_timeout_s": float("-inf")}},
        "resilience.health_timeout_s: expected a finite number, got -inf",
    ),
    (
        "a checkpoint dir in a store fsspec does not know",
        {"checkpoint": {"dir": "nosuch://bucket/prefix"}},
        "checkpoint.dir: 'nosuch://bucket/prefix': 'nosuch://' is not a storage protocol "
        "fsspec knows (s3://, gs://, and those of fsspec's registry); fix the URL",
    ),
    (
        "a checkpoint dir in this process's memory (every checkpoint lost at its exit)",
        {"checkpoint": {"dir": "memory://bucket/run"}},
        "checkpoint.dir: 'memory://bucket/run': memory:// keeps its files in this process "
        "alone: a checkpoint saved there is gone when the process ends, and none saved by "
        "another could be read; give a local folder or a durable store (s3://, gs://)",
    ),
    (
        "a checkpoint to load from this process's memory (none saved by another run)",
        {"checkpoint": {"load_path": "memory://bucket/run/step_4"}},
        "checkpoint.load_path: 'memory://bucket/run/step_4': memory:// keeps its files in this "
        "process alone: a checkpoint saved there is gone when the process ends, and none saved "
        "by another could be read; give a local folder or a durable store (s3://, gs://)",
    ),
    (
        "a collective timeout no process group starts in",
        {"distributed": {"timeout_s": 0.001}},
        "distributed.timeout_s: must be >= 1 s, got 0.001: process-group start-up and every "
        "collective must fit in it",
    ),
    (
        "a shutdown timeout no emergency save fits in",
        {"resilience": {"shutdown_timeout_s": 1e-300}},
        "resilience.shutdown_timeout_s: must be >= 1 s, got 1e-300: the rest of the step and "
        "the emergency save must fit in it",
    ),
    *(
        (
            f"{key} past a week (threading and gloo overflow on such waits)",
            raw,
            f"{key}: must be at most 604800 s (a week), got {value:g}: it bounds nothing",
        )
        for key, value, raw in [
            ("distributed.timeout_s", 1e300, {"distributed": {"timeout_s": 1e300}}),
            ("resilience.health_timeout_s", 1e300, {"resilience": {"health_timeout_s": 1e300}}),
            ("resilience.shutdown_timeout_s", 1e10, {"resilience": {"shutdown_timeout_s": 1e10}}),
            ("checkpoint.storage_timeout_s", 1e9, {"checkpoint": {"storage_timeout_s": 1e9}}),
            (
                "fault_tolerance.quorum_timeout_s",
                604801.0,
                {"fault_tolerance": {"enabled": True, "quorum_timeout_s": 604801.0}},
            ),
        ]
    ),
    (
        "a misspelt storage option (dropped silently by fsspec: this one would talk to AWS)",
        {"checkpoint": {"dir": "s3://bucket/prefix", "storage_options": {"endpoint": "x"}}},
        "checkpoint.storage_options: 'endpoint' is not an option of s3:// (S3FileSystem); "
        "did you mean 'endpoint_url'?",
    ),
    (
        "a URL with one slash (it would be a local folder named 's3:')",
        {"checkpoint": {"dir": "s3:/bucket/x"}},
        "checkpoint.dir: 's3:/bucket/x' is a URL with one slash (s3:/): write s3://... for "
        "the store, or ./s3:/bucket/x for a local folder of that name",
    ),
    (
        "storage options with no URL to use them",
        {"checkpoint": {"dir": "runs/ckpt", "storage_options": {"anon": True}}},
        "checkpoint.storage_options: is set, but neither checkpoint.dir nor "
        "checkpoint.load_path is a URL (s3://...); remove it or give the URL",
    ),
    (
        "an export asked of a run that saves nothing (it would end with none)",
        {"checkpoint": {"enabled": False, "export_final": True}},
        "checkpoint.export_final: writes the export with the final save, and "
        "checkpoint.enabled is false; set checkpoint.enabled = true, or remove it",
    ),
    (
        "a URL as the run dir",
        {"run": {"dir": "gs://bucket/run"}},
        "run.dir: 'gs://bucket/run' is a URL (gs://), and this key takes a local (or mounted) "
        "path only (checkpoint.dir and checkpoint.load_path may name an object store); give a "
        "local path",
    ),
    (
        "negative spike threshold",
        {"resilience": {"spike_threshold": -1}},
        "resilience.spike_threshold: must be >= 0, got -1.0",
    ),
    (
        "nan spike threshold",
        {"resilience": {"spike_threshold": float("nan")}},
        "resilience.spike_threshold: expected a finite number, got nan",
    ),
    (
        "unknown spike policy",
        {"resilience": {"on_spike": "ignore"}},
        "resilience.on_spike: expected one of 'warn', 'skip', 'rollback', got 'ignore'",
    ),
    (
        "negative replay interval",
        {"resilience": {"replay_interval": -2}},
        "resilience.replay_interval: must be >= 0, got -2",
    ),
    (
        "replay first step as a string",
        {"resilience": {"replay_first_step": "yes"}},
        "resilience.replay_first_step: expected true or false, got 'yes'",
    ),
    (
        "straggler ratio of one",
        {"resilience": {"straggler_ratio": 1.0}},
        "resilience.straggler_ratio: must be > 1 (the slowest rank's time over the median's), "
        "got 1.0",
    ),
    (
        "no straggler logs",
        {"resilience": {"straggler_logs": 0}},
        "resilience.straggler_logs: must be > 0, got 0",
    ),
    (
        "integer beyond 64 bits",
        {"train": {"seed": 99999999999999999999999}},
        "train.seed: 99999999999999999999999 is out of range: must fit in 64 bits (|value| < 2**63)",
    ),
    (
        "float for an int",
        {"checkpoint": {"interval": 1e3}},
        "checkpoint.interval: expected an integer, got 1000.0",
    ),
    (
        "empty run dir",
        {"run": {"dir": ""}},
        "run.dir: must not be empty; leave it out for the default",
    ),
    (
        "empty checkpoint dir",
        {"checkpoint": {"dir": " "}},
        "checkpoint.dir: must not be empty; leave it out for the default",
    ),
    (
        "too many betas",
        {"optimizer": {"betas": [0.9, 0.9, 0.9]}},
        "optimizer.betas: expected 2 values, got 3",
    ),
    ("too few betas", {"optimizer": {"betas": [0.9]}}, "optimizer.betas: expected 2 values, got 1"),
    (
        "hook not a path",
        {"hooks": {"classes": ["pkg.Hook"]}},
        "hooks.classes[0]: must be 'package.module:ClassName', got 'pkg.Hook'",
    ),
    (
        "hook listed twice",
        {"hooks": {"classes": ["pkg:Hook", "pkg:Hook"]}},
        "hooks.classes: lists a class twice",
    ),
    (
        "hook arguments for an unlisted class",
        {"hooks": {"classes": ["pkg:A"], "args": {"pkg:B": {"x": 1}}}},
        'hooks.args."pkg:B": names a class that hooks.classes does not list',
    ),
    (
        "hook arguments not a table",
        {"hooks": {"classes": ["pkg:A"], "args": {"pkg:A": 3}}},
        'hooks.args: "pkg:A" must be a table of keyword arguments, got 3',
    ),
    (
        "a scalar for betas",
        {"optimizer": {"betas": 0.9}},
        "optimizer.betas: expected a list of 2 values, got 0.9",
    ),
    (
        "an odd head_dim",
        {"model": {"head_dim": 33}},
        "model.head_dim: must be even for RoPE, got 33",
    ),
    ("a zero head_dim", {"model": {"head_dim": 0}}, "model.head_dim: must be > 0, got 0"),
    (
        "a store timeout of 0",
        {"checkpoint": {"storage_timeout_s": 0}},
        "checkpoint.storage_timeout_s: must be > 0, got 0.0",
    ),
    (
        "rope scaling of another type",
        {"model": {"rope_scaling": {"type": "yarn"}}},
        "model.rope_scaling.type: expected one of 'llama3', got 'yarn'",
    ),
    (
        "a rope scaling factor below 1",
        {"model": {"rope_scaling": {"factor": 0.5}}},
        "model.rope_scaling.factor: must be >= 1 (it divides the low frequencies), got 0.5",
    ),
    (
        "a rope scaling band of no width",
        {"model": {"rope_scaling": {"low_freq_factor": 4.0, "high_freq_factor": 4.0}}},
        "model.rope_scaling.high_freq_factor: must be > model.rope_scaling.low_freq_factor=4.0 "
        "(the band between them is interpolated), got 4.0",
    ),
    (
        "a rope scaling context of 0",
        {"model": {"rope_scaling": {"original_max_seq_len": 0}}},
        "model.rope_scaling.original_max_seq_len: must be > 0, got 0",
    ),
    (
        "an unknown rope scaling key",
        {"model": {"rope_scaling": {"factr": 8.0}}},
        "model.rope_scaling.factr: unknown key; did you mean 'model.rope_scaling.factor'?",
    ),
    (
        "rope scaling a scalar",
        {"model": {"rope_scaling": 8.0}},
        "model.rope_scaling: is a table; set its keys as model.rope_scaling.<key>=...",
    ),
]


# (case, the config, the one line): checkpoint.export_final is checked against the export's
# own rules (forge.interop) when the run starts, not by the config package below them
EXPORT_FINAL = [
    (
        "an export of a model with a window",
        {"checkpoint": {"export_final": True}, "model": {"sliding_window": 8}},
        "checkpoint.export_final: model.sliding_window=8: the Llama, Mixtral and Qwen3 exports "
        "attend to the whole context, so this model has no export; train without a window to "
        "export it, or set it off",
    ),
    (
        "an export of a sigmoid-routed Qwen3-MoE",
        {
            "checkpoint": {"export_final": True},
            "model": {"qk_norm": True, "moe_num_experts": 4, "moe_router": "sigmoid"},
        },
        "checkpoint.export_final: model.moe_router='sigmoid': Qwen3MoeForCausalLM routes by a "
        "softmax over experts, so this model has no Qwen3-MoE export, or set it off",
    ),
]


@pytest.mark.parametrize(
    "raw,line", [e[1:] for e in EXPORT_FINAL], ids=[e[0] for e in EXPORT_FINAL]
)
def test_an_export_final_no_family_holds_gives_one_line_naming_the_key(raw, line):
    from forge.training.setup.problems import export_final_problems

    assert export_final_problems(structure_config(raw)) == [line]


def test_load_and_validate_config_refuses_an_export_final_no_family_holds(tiny_config):
    """The run's own validation makes the check (``WORLD_CHECKS``), before anything is built."""
    from forge.training.setup.phases import load_and_validate_config

    args = [str(tiny_config), "--checkpoint.export_final=true", "--model.sliding_window=8"]
    with pytest.raises(ConfigError) as refused:
        load_and_validate_config(args)
    assert refused.value.lines == [EXPORT_FINAL[0][2]]


def test_an_export_final_of_a_qwen3_model_passes_the_run_check():
    from forge.training.setup.problems import export_final_problems

    raw = {"checkpoint": {"export_final": True}, "model": {"qk_norm": True, "head_dim": 128}}
    assert export_final_problems(structure_config(raw)) == []


def test_a_qk_norm_model_may_export_at_the_end():
    """Its export is Qwen3's (docs/interop.md): checkpoint.export_final takes it."""
    raw = {"checkpoint": {"export_final": True}, "model": {"qk_norm": True, "head_dim": 128}}
    assert structure_config(raw).model.qk_norm


def test_rope_scaling_and_head_dim_load_from_a_toml_table_and_the_cli(tmp_path):
    """``[model.rope_scaling]`` is a table of its own (unset keys: Llama 3.1's values), set
    or changed key by key on the command line; a head size of its own needs no divisibility."""
    path = tmp_path / "c.toml"
    path.write_text(
        "[model]\ndim = 30\nn_heads = 4\nhead_dim = 16\n"
        '[model.rope_scaling]\ntype = "llama3"\nfactor = 32.0\n'
    )
    model = load_config([str(path), "--model.rope_scaling.original_max_seq_len=4096"]).config.model
    assert model.head_size == 16 and model.dim % model.n_heads != 0
    assert model.rope_scaling == RopeScaling(factor=32.0, original_max_seq_len=4096)
    assert load_config([str(path), "--model.head_dim=32"]).config.model.head_size == 32
    assert structure_config({}).model.rope_scaling is None


@pytest.mark.parametrize("raw,line", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_gives_one_line_naming_the_key(raw, line):
    with pytest.raises(ConfigError) as info:
        structure_config(raw)
    assert info.value.lines == [line]


def test_a_store_url_without_its_package_names_the_extra_to_install(monkeypatch):
    registry = importlib.import_module("fsspec.registry")  # fsspec.registry is also a dict

    def missing(protocol):
        raise ImportError(f"Install s3fs to access {protocol}")

    monkeypatch.setattr(registry, "get_filesystem_class", missing)
    with pytest.raises(ConfigError) as info:
        structure_config({"checkpoint": {"dir": "s3://bucket/prefix"}})
    assert info.value.lines == [
        "checkpoint.dir: 's3://bucket/prefix': s3:// needs a package that is not installed; "
        "install forge's 's3' extra: pip install -e '.[s3]'"
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("file:///tmp/ckpt", pathlib.Path("/tmp/ckpt")), ("runs/x/ckpt", pathlib.Path("runs/x/ckpt"))],
)
def test_a_local_url_or_path_is_a_local_checkpoint_directory(text, expected):
    from forge.checkpoint.paths import location

    assert location(text) == expected


def test_an_object_store_checkpoint_dir_and_its_options_are_taken():
    raw = {"checkpoint": {"dir": "s3://bucket/prefix", "storage_options": {"anon": True}}}
    cfg = structure_config(raw).checkpoint
    assert (cfg.dir, cfg.storage_options) == ("s3://bucket/prefix", {"anon": True})


@pytest.mark.parametrize("path", ["runs/a:b", "C:/runs", "file:name", "runs/x//y"])
def test_a_path_with_a_colon_or_double_slash_is_not_taken_for_a_url(path):
    assert structure_config({"checkpoint": {"dir": path}}).checkpoint.dir == path


def test_all_type_problems_are_reported_at_once():
    raw = {"train": {"batch_size": "x", "seq_len": 1.5}, "model": {"dim": "big"}}
    with pytest.raises(ConfigError) as info:
        structure_config(raw)
    assert sorted(line.split(":")[0] for line in info.value.lines) == [
        "model.dim",
        "train.batch_size",
        "train.seq_len",
    ]


def test_unknown_type_and_range_problems_of_all_sections_come_together():
    raw = {
        "trian": {},
        "train": {"max_stepz": 1, "seed": "x"},
        "model": {"dim": 0},
        "optimizer": {"lr": float("nan")},
    }
    with pytest.raises(ConfigError) as info:
        structure_config(raw)
    assert sorted(line.split(":")[0] for line in info.value.lines) == [
        "model.dim",
        "optimizer.lr",
        "train.max_stepz",
        "train.seed",
        "trian",
    ]


def test_all_range_problems_are_reported_at_once():
    raw = {"train": {"batch_size": 0, "max_steps": -1}, "optimizer": {"lr": 0.0}}
    with pytest.raises(ConfigError) as info:
        structure_config(raw)
    assert len(info.value.lines) == 3


def test_stray_positional_argument(toml_file):
    with pytest.raises(ConfigError) as info:
        load_config([str(toml_file), "extra"])
    assert info.value.lines == [
        "'extra': unexpected argument; overrides look like --section.key=value"
    ]


def test_cli_and_config_problems_together(toml_file):
    with pytest.raises(ConfigError) as info:
        load_config([str(toml_file), "stray", "--train.batch_size=0"])
    assert len(info.value.lines) == 2


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config([str(tmp_path / "nope.toml")])
    assert "config file not found" in info.value.lines[0]
    assert len(info.value.lines) == 1


def test_invalid_toml(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[train\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config([str(path)])


def test_no_arguments_is_a_usage_error():
    with pytest.raises(ConfigError, match="usage"):
        load_config([])


def test_resolved_config_round_trips_through_toml():
    cfg = structure_config(
        {
            "run": {"dir": "runs/x"},
            "optimizer": {"betas": [0.8, 0.9]},
            "checkpoint": {"dyn_ckpt_window": {"start": 0, "stop": 8}, "load_path": 'a b"c'},
            "train": {"mixed_precision": "fp32", "grad_clip_norm": 0.5},
            "hooks": {"classes": ["a.b:C"], "args": {"a.b:C": {"path": "x.jsonl", "n": [1, 2]}}},
            "model": {"head_dim": 16, "rope_scaling": {"factor": 32.0}},  # a nested table
        }
    )
    text = dumps_toml(unstructure_config(cfg))
    assert "[model.rope_scaling]" in text
    assert structure_config(tomli.loads(text)) == cfg


SHIPPED_CONFIGS = sorted((REPO / "configs").rglob("*.toml"))


def test_configs_are_shipped():
    assert SHIPPED_CONFIGS, f"no TOML file under {REPO / 'configs'}"


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    loaded = load_config([str(path)])  # raises ConfigError on any problem
    expected = structure_config(tomli.loads(path.read_text()))
    if expected.run.dir is None:
        expected = attrs.evolve(expected, run=attrs.evolve(expected.run, dir=f"runs/{path.stem}"))
    assert loaded.config == expected


def test_a_directory_as_config_file_says_so(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config([str(tmp_path)])
    assert info.value.lines == [f"{tmp_path}: is a directory; pass a TOML file inside it"]


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes("[run]\ndir = 'caf\xe9'\n".encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_config([str(path)])
    assert len(info.value.lines) == 1
    assert "not UTF-8" in info.value.lines[0]


# (precision, device, flags, warns)
PRECISION_WARNINGS = [
    (Precision.BF16, "cpu", frozenset({"avx2"}), True),
    (Precision.BF16, "cpu", frozenset({"avx2", "avx512_bf16"}), False),
    (Precision.BF16, "cpu", frozenset({"amx_bf16"}), False),
    (Precision.BF16, "cpu", frozenset(), False),  # unknown CPU: no guess
    (Precision.BF16, "cuda", frozenset({"avx2"}), False),
    (Precision.FP32, "cpu", frozenset({"avx2"}), False),
]


@pytest.mark.parametrize("precision,device,flags,warns", PRECISION_WARNINGS)
def test_bf16_on_a_cpu_without_bf16_support_warns(precision, device, flags, warns):
    from forge.training.setup.problems import precision_warning

    assert (precision_warning(precision, device, flags) is not None) is warns


def src(name, weight=1.0, path="d"):
    return {"name": name, "path": path, "weight": weight}


# (case, [data] table, the key of the one problem reported)
DATA_PROBLEMS = [
    ("duplicate source name", {"sources": [src("a"), src("a")]}, "data.sources[1].name"),
    ("negative weight", {"sources": [src("a", -1.0), src("b", 5.0)]}, "data.sources[0].weight"),
    ("all weights zero", {"sources": [src("a", 0.0), src("b", 0.0)]}, "data.sources"),
    ("empty source path", {"sources": [src("a", path="")]}, "data.sources[0].path"),
    ("zero temperature", {"temperature": 0.0}, "data.temperature"),
    ("negative workers", {"num_workers": -1}, "data.num_workers"),
    (
        "phase weight for an unknown source",
        {"sources": [src("a"), src("b")], "phases": [{"start_step": 5, "weights": {"c": 1.0}}]},
        "data.phases[0].weights.c",
    ),
    (
        "phases out of order",
        {"phases": [{"start_step": 9}, {"start_step": 4}]},
        "data.phases[1].start_step",
    ),
    ("phase at step 0", {"phases": [{"start_step": 0}]}, "data.phases[0].start_step"),
    ("zero lr_scale", {"phases": [{"start_step": 3, "lr_scale": 0.0}]}, "data.phases[0].lr_scale"),
    (
        "a phase that zeroes every source",
        {"sources": [src("a"), src("b")],
         "phases": [{"start_step": 2, "weights": {"a": 0.0, "b": 0.0}}]},
        "data.phases[0].weights",
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    "data,key", [c[1:] for c in DATA_PROBLEMS], ids=[c[0] for c in DATA_PROBLEMS]
)
def test_data_config_problems_name_their_key(data, key):
    data = dict(data)
    raw = {"data": data}
    if "_distributed" in data:
        raw["distributed"] = data.pop("_distributed")
    with pytest.raises(ConfigError) as info:
        structure_config(raw)
    assert [line.split(":")[0] for line in info.value.lines] == [key]


def test_a_mixture_with_phases_round_trips_through_toml():
    raw = {
        "data": {
            "sources": [src("code", 2.0), src("web", 1.0)],
            "temperature": 2.0,
            "phases": [{"start_step": 100, "weights": {"web": 3.0}, "lr_scale": 0.5}],
        }
    }
    cfg = structure_config(raw)
    assert cfg.data.phases[0].weights == {"web": 3.0}
    again = structure_config(tomli.loads(dumps_toml(unstructure_config(cfg))))
    assert again == cfg


# (train.compile, compute dtype, device, a C++ compiler found, compiled)
COMPILE_CASES = [
    (None, "bf16", "cpu", True, True),  # the default where it was measured to pay off
    (None, "bf16", "cpu", False, False),  # inductor would fail without a compiler
    (None, "bf16", "cuda", False, True),  # Triton, not a host compiler
    (None, "fp32", "cpu", True, False),  # fp32 gained under 10%: eager
    (None, "fp32", "cuda", True, False),
    (True, "fp32", "cpu", False, True),  # an explicit choice always wins
    (False, "bf16", "cuda", True, False),
]


@pytest.mark.parametrize("compile_,precision,device,found,expected", COMPILE_CASES)
def test_compile_defaults_to_bf16_where_a_compiler_exists(
    compile_, precision, device, found, expected
):
    train = TrainConfig(compile=compile_, mixed_precision=Precision(precision))
    assert train.compile_enabled(device, found) is expected
