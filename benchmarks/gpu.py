"""GPU throughput: a 1B-class Llama in bf16 with FSDP2 (and compile) on every visible GPU.

    .venv/bin/python benchmarks/gpu.py [--steps 30] [--no-compile] [--data data/stdlib]

Runs ``scripts/train.py`` under torchrun with one process per visible GPU, the model of
``configs/train/llama3_1b.toml``-like shapes (dim 2048, 16 layers, 32 heads, 8 KV heads, FFN
8192, vocab 128256, sequence 2048), bf16 compute over fp32 master weights, FSDP2 over all GPUs,
and reports tokens/s per GPU and MFU over the steady-state steps (after ``--warmup``), against
the GPU's dense bf16 peak. Needs CUDA; on a machine without it the script says so and exits 2.
The data is the prepared stdlib corpus (byte ids; the throughput does not depend on them).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]

# dense bf16 peak TFLOP/s per GPU (no sparsity), from the vendors' data sheets
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,  # SXM
    "A100": 312.0,
    "B200": 2250.0,
    "MI300X": 1307.0,
}

MODEL = {
    "dim": 2048,
    "n_layers": 16,
    "n_heads": 32,
    "n_kv_heads": 8,
    "ffn_hidden_dim": 8192,
    "vocab_size": 128256,
    "max_seq_len": 2048,
    "rope_theta": 500000.0,
    "tie_embeddings": True,
}


def peak_tflops(name: str) -> float | None:
    """The bf16 peak of the GPU whose name contains a known model, else None."""
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name.upper()), None)


def flops_per_token(seq_len: int) -> float:
    """6 × non-embedding parameters + 12 × layers × dim × seq (attention), per token."""
    m = MODEL
    d, L, f = m["dim"], m["n_layers"], m["ffn_hidden_dim"]
    head = d // m["n_heads"]
    attn = d * head * (m["n_heads"] * 2 + m["n_kv_heads"] * 2)
    per_layer = attn + 3 * d * f + 2 * d
    dense = L * per_layer + d * m["vocab_size"]  # the output head is a matmul per token
    return 6 * dense + 12 * L * d * seq_len


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the figures")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per GPU per step")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--no-compile", action="store_true", help="eager blocks")
    parser.add_argument("--data", default="data/stdlib", help="a prepared dataset")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device: benchmarks/gpu.py measures GPUs", file=sys.stderr)
        return 2
    n_gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = pathlib.Path(tmp) / "run"
        overrides = [f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}"
                     for k, v in MODEL.items()]  # fmt: skip
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={n_gpus}", str(REPO / "scripts" / "train.py"),
            str(REPO / "configs" / "train" / "debug.toml"), *overrides,
            f"--run.dir={run_dir}", f"--data.path={args.data}", "--data.verify_checksum=false",
            f"--train.max_steps={args.steps}", f"--train.batch_size={args.batch_size}",
            f"--train.seq_len={args.seq_len}", "--train.grad_accum_steps=1",
            "--train.mixed_precision=bf16", f"--train.compile={str(not args.no_compile).lower()}",
            "--scheduler.warmup_steps=5", "--eval.interval=0", "--checkpoint.enabled=false",
            "--metrics.log_interval=1", f"--distributed.dp_shard={n_gpus}",
        ]  # fmt: skip
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stderr[-4000:], file=sys.stderr)
            return out.returncode
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r["tokens_per_sec"] for r in records if r.get("step", 0) > args.warmup]
    tokens_per_gpu = statistics.median(steady) / n_gpus
    achieved = tokens_per_gpu * flops_per_token(args.seq_len) / 1e12
    peak = peak_tflops(name)
    print(f"{n_gpus} x {name}, compile={not args.no_compile}, batch {args.batch_size} x "
          f"{args.seq_len} per GPU, median of steps {args.warmup + 1}-{args.steps}")  # fmt: skip
    print(f"tokens/s per GPU: {tokens_per_gpu:,.0f}; achieved {achieved:.1f} TFLOP/s per GPU")
    if peak is not None:
        print(f"MFU: {achieved / peak:.1%} of the {peak:.0f} TFLOP/s bf16 peak")
    else:
        print(f"MFU: unknown peak for {name}; add it to PEAK_BF16_TFLOPS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
