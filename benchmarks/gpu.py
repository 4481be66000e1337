"""GPU throughput and MFU: the Llama-3 1B and 8B presets, bf16, FSDP2, compiled, on every GPU.

    .venv/bin/python benchmarks/gpu.py [--preset 1b 8b] [--steps 20] [--seq-len 4096]
    .venv/bin/python benchmarks/gpu.py --dry-run [--gpus 1] [--gpu-memory-gb 140]

For each preset (``configs/train/llama3_1b.toml``, ``configs/train/llama3_8b.toml``) runs
``scripts/train.py`` under torchrun with one process per visible GPU: bf16 compute, FSDP2 over
all GPUs (one GPU trains unsharded), blocks compiled, full activation checkpointing as the
presets set it, any ``--seq-len`` (``model.max_seq_len`` follows it), no evaluation or
checkpoints, a metrics record every step. It prints tokens/s per GPU and MFU, averaged over the
last ``--last`` steps, against the GPU's dense bf16 peak from forge's table
(``forge.metrics.flops.PEAKS``), and against KempnerForge's published figure: Llama-3 "7B"
(8.03B parameters) on one H200, seq 4096, bf16, full activation checkpointing, 57.8% MFU at
10,471 tokens/s, averaged over the last 5 of 20 steps. KempnerForge counts 6 × *all*
parameters, the embedding included; forge leaves the embedding lookup out (a gather), so both
MFUs are printed: forge's and the same tokens/s counted KempnerForge's way.

``--param-dtype auto`` keeps fp32 master weights where forge's memory plan puts the run under
85% of the GPU's memory, else trains in pure bf16 (8B on one GPU: 8B × 16 bytes of fp32
weights, gradients and AdamW state alone are 120 GiB). The data is the stdlib corpus (byte ids;
throughput does not depend on them), prepared into a temporary folder unless ``--data`` names
a prepared one. ``--dry-run`` does everything short of training: builds and validates each
preset's config, counts it on the meta device, plans its memory and prints the commands; it
needs no GPU. Without CUDA (and without ``--dry-run``) the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import attrs
import torch

from forge.cli import summary
from forge.config import ConfigError, JobConfig, Precision, load_config
from forge.metrics.flops import flops_per_token, table_peak_flops
from forge.model.transformer import Transformer, num_parameters
from forge.parallel.memory_plan import GIB, memory_plan
from forge.parallel.world import parallel_problems, resolve_dims

REPO = pathlib.Path(__file__).resolve().parents[1]

PRESETS = {"1b": ("llama3_1b.toml", 4), "8b": ("llama3_8b.toml", 2)}  # file, sequences/GPU
REFERENCE_MFU = 0.578  # KempnerForge, 8.03B Llama-3 on one H200 (benchmarks/mfu_scaling)
REFERENCE_TOKENS = 10_471  # tokens/s on that GPU
FP32_MAX_SHARE = 0.85  # of device memory the plan may take before auto picks pure bf16


def kempner_flops_per_token(cfg: JobConfig, seq_len: int, parameters: int) -> float:
    """KempnerForge's count: 6 × every parameter (the embedding too) + 12 × L × d × T."""
    return 6.0 * parameters + 12.0 * cfg.model.n_layers * cfg.model.dim * seq_len


def choose_param_dtype(requested: str, planned_bytes: float, device_bytes: float) -> Precision:
    """``fp32``/``bf16`` as asked; ``auto``: fp32 master weights if the fp32 plan takes at
    most ``FP32_MAX_SHARE`` of the device, else pure bf16."""
    if requested != "auto":
        return Precision(requested)
    fits = planned_bytes <= FP32_MAX_SHARE * device_bytes
    return Precision.FP32 if fits else Precision.BF16


def overrides(
    args: argparse.Namespace, batch: int, gpus: int, run_dir: str, data: str
) -> list[str]:
    """The command-line overrides every preset trains with (``--train.param_dtype`` apart)."""
    compile_on = str(not args.no_compile).lower()
    return [
        f"--run.dir={run_dir}", f"--data.path={data}", "--data.verify_checksum=false",
        f"--train.max_steps={args.steps}", f"--train.batch_size={batch}",
        f"--train.seq_len={args.seq_len}", f"--model.max_seq_len={args.seq_len}",
        "--train.grad_accum_steps=1", "--train.mixed_precision=bf16",
        f"--train.compile={compile_on}", f"--train.activation_checkpointing={args.ac}",
        "--scheduler.warmup_steps=5", "--eval.interval=0", "--checkpoint.enabled=false",
        "--checkpoint.async_mode=disabled", "--metrics.log_interval=1",
        f"--distributed.dp_shard={gpus}", f"--train.float8={args.float8}",
        f"--train.float8_check={args.float8_check}",
        f"--train.deterministic={str(args.deterministic).lower()}",
    ]  # fmt: skip


@attrs.frozen
class Planned:
    """One preset, ready to launch: its config file, overrides, validated config, counts."""

    name: str
    config_file: pathlib.Path
    overrides: tuple[str, ...]
    config: JobConfig
    parameters: int
    planned_bytes: float


def plan(
    name: str, args: argparse.Namespace, gpus: int, device_bytes: float, run_dir: str, data: str
) -> Planned:
    """Build and validate a preset's config (``ConfigError`` with its problems), count its
    parameters on the meta device and pick its parameter dtype from its memory plan."""
    file, default_batch = PRESETS[name]
    config_file = REPO / "configs" / "train" / file
    base = overrides(args, args.batch_size or default_batch, gpus, run_dir, data)

    def validated(param_dtype: Precision) -> JobConfig:
        """The preset with ``param_dtype``, checked as a launch at ``gpus`` ranks would be."""
        config = load_config([str(config_file), *base, f"--train.param_dtype={param_dtype.value}"])
        problems = [f"{k}: {m}" for k, m in parallel_problems(config.config, gpus)]
        if problems:
            raise ConfigError(problems)
        return config.config

    fp32 = validated(Precision.FP32)
    dims = resolve_dims(fp32.distributed, gpus)
    dtype = choose_param_dtype(args.param_dtype, memory_plan(fp32, dims).total, device_bytes)
    config = validated(dtype)
    with torch.device("meta"):  # counted, not allocated
        parameters = num_parameters(Transformer(config.model))
    final = (*base, f"--train.param_dtype={dtype.value}")
    return Planned(name, config_file, final, config, parameters, memory_plan(config, dims).total)


def command(planned: Planned, gpus: int) -> list[str]:
    """torchrun over ``gpus`` processes of ``scripts/train.py``."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={gpus}", str(REPO / "scripts" / "train.py"),
        str(planned.config_file), *planned.overrides,
    ]  # fmt: skip


def describe(planned: Planned, device_bytes: float) -> list[str]:
    """What a preset's run is: sizes, FLOPs per token both ways, dtype and memory."""
    t, m = planned.config.train, planned.config.model
    forge_flops = flops_per_token(m, t.seq_len)
    kempner = kempner_flops_per_token(planned.config, t.seq_len, planned.parameters)
    share = planned.planned_bytes / device_bytes
    return [
        f"{planned.name}: {planned.parameters:,} parameters, {t.batch_size} x {t.seq_len} tokens "
        f"per GPU and step, bf16 compute, {t.param_dtype.value} weights, activation "
        f"checkpointing {t.activation_checkpointing.value}",
        f"  FLOPs per token: {forge_flops / 1e9:.2f} G (forge), {kempner / 1e9:.2f} G "
        f"(KempnerForge's count)",
        f"  planned memory per GPU: {planned.planned_bytes / GIB:.1f} GiB, "
        f"{share:.0%} of {device_bytes / GIB:.0f} GiB",
    ]


@attrs.frozen
class Measured:
    """Tokens/s per GPU over the measured steps: their mean, lowest and highest."""

    mean: float
    low: float
    high: float
    steps: tuple[int, ...]


def measured(records: Sequence[dict], last: int) -> Measured | None:
    """The last ``last`` step records' tokens/s per device (None without any)."""
    steps = [r for r in records if "tokens_per_sec_per_device" in r and "step" in r][-last:]
    if not steps:
        return None
    rates = [float(r["tokens_per_sec_per_device"]) for r in steps]
    ids = tuple(int(r["step"]) for r in steps)
    return Measured(statistics.fmean(rates), min(rates), max(rates), ids)


def result_lines(planned: Planned, result: Measured, peak: float | None) -> list[str]:
    """tokens/s per GPU and both MFUs against the peak (and KempnerForge's 8B figure)."""
    t = planned.config.train
    forge_flops = flops_per_token(planned.config.model, t.seq_len)
    kempner = kempner_flops_per_token(planned.config, t.seq_len, planned.parameters)
    steps = f"steps {result.steps[0]}-{result.steps[-1]}"
    lines = [
        f"  tokens/s per GPU: {result.mean:,.0f} (mean of {steps}; {result.low:,.0f} to "
        f"{result.high:,.0f}); achieved {result.mean * forge_flops / 1e12:.1f} TFLOP/s per GPU"
    ]
    if peak is None:
        return [*lines, "  MFU: unknown peak for this GPU; add it to forge.metrics.flops.PEAKS"]
    lines.append(
        f"  MFU: {result.mean * forge_flops / peak:.1%} (forge's count), "
        f"{result.mean * kempner / peak:.1%} (KempnerForge's count) of {peak / 1e12:.0f} TFLOP/s"
    )
    if planned.name == "8b":
        lines.append(
            f"  KempnerForge, 8.03B on one H200 at seq 4096: {REFERENCE_MFU:.1%} MFU (its count), "
            f"{REFERENCE_TOKENS:,} tokens/s"
        )
    return lines


def result_mfu(planned: Planned, result: Measured, peak: float) -> float:
    """The measured mean's MFU, forge's count."""
    t = planned.config.train
    return result.mean * flops_per_token(planned.config.model, t.seq_len) / peak


def prepared_data(folder: pathlib.Path) -> pathlib.Path:
    """The stdlib corpus, tokenized into ``folder`` (byte ids)."""
    workers = str(max(1, min(16, os.cpu_count() or 1)))
    cmd = [sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--out", str(folder)]
    subprocess.run([*cmd, "--workers", workers, "--quiet"], cwd=REPO, check=True)
    return folder


def run_group(cmd: Sequence[str], log: pathlib.Path, timeout_s: float) -> str | None:
    """Run ``cmd`` in its own process group, output to ``log``; None when it exits 0, else
    why not. On a timeout the whole group (torchrun and its workers, which hold the GPUs) is
    stopped, not torchrun alone."""
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # less fragmentation
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, None)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
            return f"no result within {timeout_s:.0f} s"
    return None if code == 0 else f"exit code {code}"


def train(planned: Planned, gpus: int, log: pathlib.Path, timeout_s: float) -> list[dict] | None:
    """Run one preset; its metrics records, or None (the log's tail printed) if it failed."""
    failed = run_group(command(planned, gpus), log, timeout_s)
    metrics = pathlib.Path(planned.config.run.dir or "") / "metrics.jsonl"
    if failed is None and metrics.is_file():
        return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    tail = log.read_text(errors="replace").splitlines()[-60:] if log.is_file() else []
    print(f"  FAILED ({failed or 'no metrics.jsonl'}); the end of its log:", *tail, sep="\n")
    return None


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=summary(__doc__), formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=["1b", "8b"])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per preset")
    parser.add_argument("--last", type=int, default=5, help="steps averaged (the last ones)")
    parser.add_argument("--batch-size", type=int, default=0, help="per GPU; 0: 1b 4, 8b 2")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--ac", choices=("none", "selective", "full"), default="full")
    parser.add_argument("--param-dtype", choices=("auto", "fp32", "bf16"), default="auto")
    parser.add_argument("--no-compile", action="store_true", help="eager blocks")
    parser.add_argument("--data", default=None, help="a prepared dataset (default: prepare)")
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds per preset")
    parser.add_argument("--log-dir", default=None, help="keep each preset's log here")
    parser.add_argument("--dry-run", action="store_true", help="validate and plan; no GPU")
    parser.add_argument("--gpus", type=int, default=1, help="with --dry-run: GPUs to plan for")
    parser.add_argument("--gpu-memory-gb", type=float, default=140.0, help="with --dry-run")
    parser.add_argument("--gpu-name", default="NVIDIA H200", help="with --dry-run: its peak")
    parser.add_argument(
        "--float8",
        choices=("off", "tensorwise", "rowwise"),
        default="off",
        help="train.float8 (docs/precision.md)",
    )
    parser.add_argument("--float8-check", type=int, default=0, help="train.float8_check")
    parser.add_argument("--deterministic", action="store_true", help="train.deterministic")
    parser.add_argument("--tag", default="bf16", help="this variant's name in the RESULT line")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Plan every preset (``--dry-run``: and stop), then train and report each."""
    args = parse(argv)
    if not 0 < args.last < args.steps:  # the first steps compile: never averaged in
        print(f"error: --last must be in [1, --steps), got {args.last}", file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device: benchmarks/gpu.py measures GPUs", file=sys.stderr)
        return 2
    if args.dry_run:
        gpus, device_bytes, name = args.gpus, args.gpu_memory_gb * GIB, args.gpu_name
    else:
        gpus, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
        device_bytes = float(torch.cuda.get_device_properties(0).total_memory)
    peak = table_peak_flops(name, Precision.BF16)
    print(
        f"{gpus} x {name}; bf16 peak {'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}"
    )
    with tempfile.TemporaryDirectory(prefix="forge-gpu-") as tmp:
        data = args.data or str(pathlib.Path(tmp) / "data")
        try:
            plans = [plan(p, args, gpus, device_bytes, f"{tmp}/run_{p}", data) for p in args.preset]
        except ConfigError as exc:
            print("error: a preset does not validate:", *exc.lines, sep="\n  ", file=sys.stderr)
            return 2
        for planned in plans:
            print(*describe(planned, device_bytes), sep="\n")
            if args.dry_run:
                print("  " + " ".join(command(planned, gpus)))
                print(f"RESULT {planned.name} {args.tag} dry-run dry-run")  # validated, not run
        if args.dry_run:
            return 0
        if args.data is None:
            prepared_data(pathlib.Path(data))
        failures = 0
        for planned in plans:
            print(f"training {planned.name} ...", flush=True)
            logs = pathlib.Path(args.log_dir) if args.log_dir else pathlib.Path(tmp)
            records = train(planned, gpus, logs / f"{planned.name}.log", args.timeout)
            result = None if records is None else measured(records, args.last)
            if result is None:
                failures += 1
                continue
            print(
                *describe(planned, device_bytes)[:1], *result_lines(planned, result, peak), sep="\n"
            )
            mfu = "nan" if peak is None else f"{result_mfu(planned, result, peak):.4f}"
            print(f"RESULT {planned.name} {args.tag} {result.mean:.1f} {mfu}")  # gpu_check's table
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
