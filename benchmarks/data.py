"""How fast the loader delivers rows, against the loader of a base commit and what debug
training consumes; how long a resume seeks; how fast a corpus is prepared, against
``datasets.map``.

All measured in this run; the loader on the prepared corpus (``make prepare-data``)::

    python benchmarks/data.py --part loader [--base c8acc33] [--batches 2000] [--rounds 3]
    python benchmarks/data.py --part prepare [--prepare-mb 16] [--workers 2]

The loader part prints the training consumption (tokens/s of debug training steps); then, for
0 and 2 workers, plain and packed rows, one and two sources, this checkout's loader's rows/s
against the base commit's (checked out in a temporary git worktree, each measured in a fresh
process of its own, alternating, medians of ``--rounds``; target >= 1.0x); then the time from
``load_state_dict`` to the first batch at global row 10^3 and at row 10^9 (target: equal
within noise: a seek, never a replay). Then preparation: a Parquet file
of the embedded corpus (a row per stdlib file) tokenized by forge's preparation (read, tokenize,
shards with checksums, manifest) and by ``datasets.map`` (batched, ``num_proc`` = the same
worker count, the same tokenizer; its Arrow cache written), as tokens/s and a ratio (target
>= 1.0x). Preparation needs the ``data`` extra (``pip install -e '.[data]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from worktree import checked_out  # benchmarks/, beside this script

from forge.cli import summary
from forge.config import DataSource, JobConfig, load_config
from forge.data.batch import Batch
from forge.data.corpus import stdlib_files, stdlib_root
from forge.data.dataset import open_windows
from forge.data.loader import Sampling, TextLoader
from forge.data.mixture import block_uniforms, resolve_phases
from forge.data.sampler import epoch_permutation
from forge.data.shards import read_manifest
from forge.model.transformer import Transformer
from forge.optim import build_optimizer, resolve_schedule
from forge.training.setup.problems import cpu_flags
from forge.training.steps.spec import StepSpec
from forge.training.steps.text import make_text_step
from forge.types import LoopState

REPO = pathlib.Path(__file__).resolve().parents[1]


def training_tokens_per_s(config: JobConfig, steps: int) -> float:
    """Tokens/s the debug training step consumes (random tokens: the loader is not involved)."""
    torch.manual_seed(0)
    model = Transformer(config.model)
    opt = build_optimizer(model, config.optimizer)
    t = config.train
    schedule = resolve_schedule(config.scheduler, t.max_steps)
    spec = StepSpec(model, opt, schedule, config.optimizer.lr, t.mixed_precision, t.grad_clip_norm)
    step = make_text_step(spec)
    tokens = torch.randint(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1))
    group = tuple(Batch(tokens[:, :-1], tokens[:, 1:]) for _ in range(t.grad_accum_steps))
    step(group, LoopState())  # warm-up
    start = time.perf_counter()
    for i in range(steps):
        step(group, LoopState(step=i + 1))
    elapsed = time.perf_counter() - start
    return steps * t.batch_size * t.seq_len * t.grad_accum_steps / elapsed


def make_loader(config: JobConfig, sources: int, packed: bool, workers: int) -> TextLoader:
    folder = pathlib.Path(config.data.path)
    manifest = read_manifest(folder)
    windows = open_windows(folder, manifest, "train", config.train.seq_len, verify=False)
    named = [DataSource(f"s{i}", str(folder), weight=i + 1.0) for i in range(sources)]
    sampling = Sampling(
        sizes=(len(windows),) * sources,
        phases=resolve_phases(named, (), temperature=1.0),
        seed=0,
        batch_size=config.train.batch_size,
    )
    bos = int(manifest.tokenizer["bos_id"]) if packed else None
    return TextLoader([windows] * sources, sampling, bos_id=bos, num_workers=workers)


def loader_tokens_per_s(loader: TextLoader, batches: int) -> float:
    next(loader)  # workers started, first shard pages touched
    start = time.perf_counter()
    tokens = sum(next(loader).num_tokens for _ in range(batches))
    return tokens / (time.perf_counter() - start)


def seek_seconds(loader: TextLoader, state: dict) -> float:
    """Median time from ``load_state_dict`` to the first batch, over 5 seeks, each computing
    its epochs' permutations afresh (as a restarted process does)."""
    times = []
    for _ in range(5):
        epoch_permutation.cache_clear()
        block_uniforms.cache_clear()
        start = time.perf_counter()
        loader.load_state_dict(state)
        next(loader)
        times.append(time.perf_counter() - start)
    return sorted(times)[2]


def corpus_parquet(folder: pathlib.Path, megabytes: float) -> tuple[pathlib.Path, list[str]]:
    """The embedded corpus's first ``megabytes`` MB as one Parquet file, a row per file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts, size = [], 0
    for path in stdlib_files(stdlib_root()):
        if size >= megabytes * 1e6:
            break
        texts.append(path.read_text("utf-8", errors="replace"))
        size += len(texts[-1].encode())
    out = folder / "corpus.parquet"
    pq.write_table(pa.table({"text": texts}), out, row_group_size=64)
    return out, texts


def bpe_tokenizer(texts: list[str], path: pathlib.Path, vocab: int) -> pathlib.Path:
    """A byte-level BPE ``tokenizer.json`` trained on the first texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(texts[:200], trainer)
    tok.save(str(path))
    return path


def cpu_seconds() -> float:
    """CPU seconds used so far by this process and its finished descendants: less sensitive
    than wall-clock time to other work on a shared machine."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def forge_preparation(
    parquet: pathlib.Path, tokenizer: pathlib.Path | None, workers: int, out: pathlib.Path
) -> tuple[int, float, float]:
    """Tokens, wall-clock and CPU seconds of ``scripts/prepare_data.py`` on the Parquet file,
    run as a user runs it (a fresh interpreter, spawned workers), from start to the manifest."""
    command = [sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--input", str(parquet)]
    command += ["--out", str(out), f"--workers={workers}", "--quiet"]
    command += ["--tokenizer", str(tokenizer)] if tokenizer is not None else []
    start, cpu = time.perf_counter(), cpu_seconds()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    manifest = read_manifest(out)
    return sum(s.num_tokens for s in manifest.splits.values()), elapsed, cpu


def datasets_map(
    parquet: pathlib.Path, frame: Callable[[dict], dict], workers: int, cache: pathlib.Path
) -> tuple[int, float, float, float]:
    """Tokens, load seconds (Parquet to datasets' Arrow cache), ``map`` wall-clock and CPU
    seconds (its worker processes included)."""
    import datasets

    datasets.disable_progress_bars()
    start = time.perf_counter()
    ds = datasets.load_dataset(
        "parquet", data_files=str(parquet), split="train", cache_dir=str(cache)
    )
    loaded, cpu = time.perf_counter(), cpu_seconds()
    mapped = ds.map(frame, batched=True, num_proc=workers, remove_columns=ds.column_names)
    done, cpu = time.perf_counter(), cpu_seconds() - cpu
    lengths = mapped.data.column("input_ids").combine_chunks().value_lengths()
    return int(sum(lengths.to_pylist())), loaded - start, done - loaded, cpu


class ByteFrame:
    """``datasets.map`` function: BOS + UTF-8 bytes + EOS, as forge's byte tokenizer frames."""

    def __call__(self, batch: dict) -> dict:
        return {"input_ids": [[256, *t.encode("utf-8"), 257] for t in batch["text"]]}


class BPEFrame:
    """``datasets.map`` function: BOS + ids + EOS with the tokenizer's batch encoding."""

    def __init__(self, path: pathlib.Path) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path))
        self.bos, self.eos = self.tok.token_to_id("<s>"), self.tok.token_to_id("</s>")

    def __call__(self, batch: dict) -> dict:
        encoded = self.tok.encode_batch(batch["text"], add_special_tokens=False)
        return {"input_ids": [[self.bos, *e.ids, self.eos] for e in encoded]}


def preparation(megabytes: float, workers: int, vocab: int, rounds: int) -> None:
    """Print forge's preparation against ``datasets.map``, for the byte tokenizer and BPE."""
    flags = cpu_flags()
    print(
        f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"avx2: {'avx2' in flags}, avx512: {'avx512f' in flags}; TOKENIZERS_PARALLELISM="
        f"{os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        parquet, texts = corpus_parquet(folder, megabytes)
        bpe = bpe_tokenizer(texts, folder / "tokenizer.json", vocab)
        size = sum(len(t.encode()) for t in texts)
        print(
            f"input: {len(texts)} stdlib files, {size / 1e6:.1f} MB, as Parquet; {workers} "
            f"workers = num_proc; medians of {rounds} rounds, alternating which runs first"
        )
        for name, tokenizer, frame in [
            ("byte", None, ByteFrame()),
            (f"BPE {vocab}", bpe, BPEFrame(bpe)),
        ]:
            compare(
                name, parquet, tokenizer, frame, workers, rounds, folder / name.replace(" ", "")
            )


def compare(
    name: str,
    parquet: pathlib.Path,
    tokenizer: pathlib.Path | None,
    frame: Callable[[dict], dict],
    workers: int,
    rounds: int,
    folder: pathlib.Path,
) -> None:
    """One line: forge's tokens/s, ``datasets.map``'s (load excluded), their ratio, and the CPU
    seconds each used."""
    ours: list[tuple[float, float]] = []  # (wall-clock, CPU) seconds
    theirs: list[tuple[float, float]] = []
    loads: list[float] = []
    for r in range(rounds):
        for side in ("forge", "datasets") if r % 2 == 0 else ("datasets", "forge"):
            if side == "forge":
                tokens, wall, cpu = forge_preparation(parquet, tokenizer, workers, folder / f"o{r}")
                ours.append((wall, cpu))
            else:
                mapped, load, wall, cpu = datasets_map(parquet, frame, workers, folder / f"c{r}")
                theirs.append((wall, cpu))
                loads.append(load)
    assert tokens == mapped, (tokens, mapped)  # the same documents, framed alike
    forge_s, map_s = (statistics.median(w for w, _ in side) for side in (ours, theirs))
    forge_cpu, map_cpu = (statistics.median(c for _, c in side) for side in (ours, theirs))
    ratios = ", ".join(f"{b[0] / a[0]:.2f}" for a, b in zip(ours, theirs, strict=True))
    print(
        f"prepare, {name:<9} forge {tokens / forge_s:>10,.0f} tokens/s ({forge_s:.2f} s) | "
        f"datasets.map {tokens / map_s:>10,.0f} tokens/s ({map_s:.2f} s; loading the Parquet "
        f"first: {statistics.median(loads):.2f} s more) | ratio {map_s / forge_s:.2f}x "
        f"(rounds: {ratios}) | CPU s: forge {forge_cpu:.1f}, datasets.map {map_cpu:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--batches", type=int, default=2000, help="micro-batches a measure")
    parser.add_argument("--train-steps", type=int, default=6)
    parser.add_argument(
        "--base",
        default="c8acc33",
        help="the commit whose loader this one is measured against (default: the last "
        "commit whose rows depended on the split of a step)",
    )
    parser.add_argument("--part", choices=["all", "loader", "prepare"], default="all")
    parser.add_argument("--prepare-mb", type=float, default=16.0, help="input size, MB")
    parser.add_argument("--workers", type=int, default=2, help="preparation processes")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each comparison")
    args = parser.parse_args()
    if args.part in ("all", "loader"):
        loader_benchmark(args)
    if args.part in ("all", "prepare"):
        if importlib.util.find_spec("datasets") is None:
            print("preparation: not measured, it needs the 'data' extra: pip install -e '.[data]'")
            return
        preparation(args.prepare_mb, args.workers, args.vocab, args.rounds)


# Runs in a fresh interpreter: the forge of the checkout at argv[1] (the editable install's
# finder set aside), its loader over the prepared corpus, rows per second over argv[6] batches.
MEASURE = """
import sys, time
sys.meta_path = [f for f in sys.meta_path if "__editable__" not in repr(f)]
sys.path.insert(0, sys.argv[1])
import forge
assert forge.__file__.startswith(sys.argv[1]), forge.__file__
import pathlib
from forge.config import DataSource
from forge.data.dataset import open_windows
from forge.data.loader import Sampling, TextLoader
from forge.data.mixture import resolve_phases
from forge.data.shards import read_manifest
folder = pathlib.Path(sys.argv[2])
seq, sources, packed, workers, batches, batch = map(int, sys.argv[3:9])
manifest = read_manifest(folder)
windows = open_windows(folder, manifest, "train", seq, verify=False)
named = [DataSource(f"s{i}", str(folder), weight=i + 1.0) for i in range(sources)]
sampling = Sampling((len(windows),) * sources, resolve_phases(named, (), 1.0), 0, batch,
                    grad_accum_steps=2)
bos = int(manifest.tokenizer["bos_id"]) if packed else None
loader = TextLoader([windows] * sources, sampling, bos_id=bos, num_workers=workers)
next(loader)  # workers started, first shard pages touched
start = time.perf_counter()
rows = sum(next(loader).inputs.shape[0] for _ in range(batches))
print(rows / (time.perf_counter() - start))
loader.close()
"""


def rows_per_s(root: pathlib.Path, config: JobConfig, setup: tuple, batches: int) -> float:
    """Rows/s of the loader of the checkout at ``root`` in ``setup`` (sources, packed,
    workers), measured in a fresh process."""
    sources, packed, workers = setup
    t = config.train
    argv = [config.data.path, t.seq_len, sources, int(packed), workers, batches, t.batch_size]
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(root), *map(str, argv)],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def loader_benchmark(args: argparse.Namespace) -> None:
    """Print the training consumption, the loader against the base commit's in every set-up,
    and the resume seek at row 10^3 against row 10^9."""
    config = load_config([args.config]).config
    print(f"CPU: {platform.processor() or platform.machine()}, flags: {cpu_flags_line()}")
    consumed = training_tokens_per_s(config, args.train_steps)
    t = config.train
    print(
        f"debug training consumes {consumed / t.seq_len:,.1f} rows/s "
        f"(batch {t.batch_size} x {t.seq_len} x {t.grad_accum_steps} micro-batches)"
    )
    setups = [
        (sources, packed, workers)
        for workers in (0, 2)
        for packed in (False, True)
        for sources in (1, 2)
    ]
    with checked_out(args.base) as base:
        if base is None:
            return
        for setup in setups:
            ours, theirs = [], []
            for r in range(args.rounds):  # alternating, so drift hits both alike
                for side in ("ours", "base") if r % 2 == 0 else ("base", "ours"):
                    root = REPO if side == "ours" else base
                    rate = rows_per_s(root, config, setup, args.batches)
                    (ours if side == "ours" else theirs).append(rate)
            sources, packed, workers = setup
            name = f"{sources} source{'s' if sources > 1 else ''}, " + (
                f"{'packed' if packed else 'plain'}, {workers} workers"
            )
            mine, old = statistics.median(ours), statistics.median(theirs)
            rounds = ", ".join(f"{a / b:.2f}" for a, b in zip(ours, theirs, strict=True))
            print(
                f"loader, {name:<28} {mine:>10,.0f} rows/s | base {old:>10,.0f} rows/s | "
                f"ratio {mine / old:.2f}x (rounds: {rounds}) | "
                f"{mine / (consumed / t.seq_len):,.0f}x training"
            )
    for sources in (1, 2):
        loader = make_loader(config, sources, packed=False, workers=0)
        at = {row: seek_seconds(loader, position_at(row, loader)) for row in (10**3, 10**9)}
        n = loader.sampling.sizes[0]
        print(
            f"resume seek, {sources} source{'s' if sources > 1 else ' '}  row 10^3 "
            f"{at[10**3] * 1e3:6.2f} ms | row 10^9 (epoch ~{10**9 // sources // n:,}) "
            f"{at[10**9] * 1e3:6.2f} ms | ratio {at[10**9] / at[10**3]:.2f}"
        )


def position_at(row: int, loader: TextLoader) -> dict:
    """A saved position ``row`` rows in, at a step boundary, shared between the sources
    (mid-epoch for each)."""
    s = loader.sampling
    row -= row % s.step_rows
    n = len(s.sizes)
    cursors = [row // n + (1 if i < row % n else 0) for i in range(n)]
    digest = "0" * 16  # any: the seek does not read it
    return {"rows": row, "steps": row // s.step_rows, "step_rows": 0, "cursors": cursors,
            "digest": digest}  # fmt: skip


def cpu_flags_line() -> str:
    """The CPU's vector flags that matter here."""
    flags = cpu_flags()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return ", ".join(shown) or "none of avx2/avx512"


if __name__ == "__main__":
    main()
