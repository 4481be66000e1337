"""Shared fixtures: a small prepared dataset and a tiny run config."""

from __future__ import annotations

import fcntl
import os
import pathlib
import pickle
import shutil
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from forge.data.corpus import Document, iter_documents, split_of, stdlib_files, stdlib_root
from forge.data.shards import write_dataset
from forge.data.tokenizer import ByteTokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
T = TypeVar("T")


def pytest_configure(config: pytest.Config) -> None:
    """One compute thread per process, and the tests' cache (the measured CPU peak) out of
    the user's home: one folder per session, shared by every run and script the tests start
    (they inherit both variables)."""
    import atexit
    import os
    import shutil
    import sys
    import tempfile

    # one compute thread per process: the suite runs two workers on two cores, and every
    # run they start inherits this; with two threads each, OpenMP's waiting threads cost
    # more than they compute on models this small (a 12-step run: 10-13 s against 7-9 s)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # bytecode caches written (to __pycache__, ignored by git) even where the machine turns
    # them off: else every fresh interpreter the tests start (torchrun's ranks, the scripts,
    # the zygote) compiles forge again, and an -OO start compiles torch too (~5 s each)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    import torch
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # inductor writes its cache folder into os.environ the first time it is asked for it (an
    # in-process training run asks): set now, so this worker's environment stays the one its
    # warm interpreter started with; else every script started after such a run differs in
    # a TORCHINDUCTOR_ variable and gets a fresh interpreter (~5 s of CPU each; tests/zygote.py)
    cache_dir()
    if not os.environ.get("FORGE_CACHE_DIR"):
        folder = tempfile.mkdtemp(prefix="forge-test-cache-")
        os.environ["FORGE_CACHE_DIR"] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def start_up_environment_kept() -> Iterator[None]:
    """A test leaves the worker's start-up variables (``tests/zygote.py``'s
    ``start_up_variables``: what an interpreter, torch or OpenMP read while starting) as it
    found them: one it changed would make every script the worker starts after it a fresh
    interpreter instead of a fork of the warm one (slower, and the zygote's own tests fail)."""
    from tests.zygote import kmp_runtime_loaded, start_up_variables

    kmp_runtime = kmp_runtime_loaded(os.getpid())  # once: a runtime the test loads changes nothing

    def variables() -> dict[str, str]:
        return start_up_variables(os.environ, kmp_runtime)

    before = variables()
    yield
    after = variables()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, "this test changed the worker's start-up variables: " + ", ".join(
        f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed
    )


# tests that cost minutes of this machine's two cores: run with FORGE_SLOW_TESTS=1
OPT_IN = (
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("FORGE_SLOW_TESTS") != "1", reason="opt-in: FORGE_SLOW_TESTS=1 (minutes)"
    ),
)


def layout_params(layouts: list[tuple[str, list[str]]], by_default: set[str]) -> list:
    """A layout table's ``(name, args)`` rows as pytest params named for the layout: the rows
    named in ``by_default`` run in default CI, the others are opt-in (``OPT_IN``)."""
    assert by_default <= {name for name, _ in layouts}, by_default
    return [
        pytest.param(args, id=name, marks=() if name in by_default else OPT_IN)
        for name, args in layouts
    ]


def once_per_session(
    factory: pytest.TempPathFactory, name: str, compute: Callable[[pathlib.Path], T]
) -> T:
    """``compute(folder)`` once per test session, by whichever xdist worker asks first; the
    others wait for it and read its (pickled) result. A module fixture runs once per worker
    that gets one of its tests, and worksteal hands a module's last tests to the idle worker:
    an expensive scenario would run twice. Without xdist it is computed here."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return compute(factory.mktemp(name))
    root = factory.getbasetemp().parent  # the session's, above every worker's own
    folder, done = root / name, root / f"{name}.pickle"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if done.is_file():
            return pickle.loads(done.read_bytes())
        shutil.rmtree(folder, ignore_errors=True)  # a worker's attempt that failed
        folder.mkdir()
        result = compute(folder)
        partial = done.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(result))
        partial.replace(done)  # whole or absent: a worker killed while writing leaves none
        return result


def make_dataset(out: pathlib.Path, docs: dict[str, list[Document]]) -> pathlib.Path:
    write_dataset(out, {k: iter(v) for k, v in docs.items()}, ByteTokenizer(), source="test")
    return out


def stdlib_packages(out: pathlib.Path, packages: tuple[str, ...]) -> pathlib.Path:
    """Some stdlib packages, tokenized like the default corpus (15% validation)."""
    root = stdlib_root()
    files = [f for f in stdlib_files(root) if f.relative_to(root).parts[0] in packages]
    names = {f: f.relative_to(root).as_posix() for f in files}
    splits = {
        s: list(iter_documents(root, [f for f in files if split_of(names[f], 15) == s]))
        for s in ("train", "validation")
    }
    return make_dataset(out, splits)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> pathlib.Path:
    """The stdlib's ``json`` and ``email`` packages."""
    return stdlib_packages(tmp_path_factory.mktemp("data") / "small", ("json", "email"))


@pytest.fixture(scope="session")
def second_corpus(tmp_path_factory) -> pathlib.Path:
    """The stdlib's ``unittest`` package: a second source for mixtures."""
    return stdlib_packages(tmp_path_factory.mktemp("data") / "second", ("unittest",))


@pytest.fixture(scope="session")
def short_documents(tmp_path_factory) -> pathlib.Path:
    """The ``json`` package cut into documents of 1 to 5 lines: a packed row of 33 tokens
    holds several of them, so rows differ in how many labels survive the boundary mask."""
    root = stdlib_root()
    files = sorted(f for f in stdlib_files(root) if f.relative_to(root).parts[0] == "json")
    docs: dict[str, list[Document]] = {"train": [], "validation": []}
    for f in files:
        lines = f.read_bytes().splitlines(keepends=True)
        i = 0
        while i < len(lines):
            size = 1 + (i * 7 + len(lines[i])) % 5  # 1..5 lines, fixed by the file's bytes
            name = f"{f.name}:{i}"
            docs["validation" if split_of(name, 15) == "validation" else "train"].append(
                Document(name, b"".join(lines[i : i + size]))
            )
            i += size
    return make_dataset(tmp_path_factory.mktemp("data") / "short", docs)


TINY = """\
[model]
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
vocab_size = 259
max_seq_len = 32

[train]
batch_size = 4
seq_len = 32
max_steps = 12
mixed_precision = "fp32"
seed = 3

[optimizer]
lr = 3e-3

[scheduler]
warmup_steps = 2

[data]
path = "{data}"

[checkpoint]
interval = 5

[metrics]
log_interval = 1
"""


@pytest.fixture
def tiny_config(tmp_path: pathlib.Path, small_corpus: pathlib.Path) -> pathlib.Path:
    """A config for a ~30k-parameter model on the small corpus, its run dir under tmp_path."""
    path = tmp_path / "tiny.toml"
    path.write_text(TINY.format(data=small_corpus) + f'\n[run]\ndir = "{tmp_path / "run"}"\n')
    return path


def write_shapes(out: pathlib.Path, n: int, size: int = 16, seed: int = 0) -> pathlib.Path:
    """A procedural image–caption dataset (``scripts/prepare_vlm_data.py``'s), 10% held out."""
    from forge.data.image_text import write_image_text_dataset
    from forge.data.scenes import procedural_pairs

    n_val = max(1, n // 10)
    splits = {
        "train": procedural_pairs(n - n_val, size, seed),
        "validation": procedural_pairs(n_val, size, seed + 1),
    }
    write_image_text_dataset(out, splits, ByteTokenizer(), size, source="test shapes")
    return out


@pytest.fixture(scope="session")
def small_shapes(tmp_path_factory) -> pathlib.Path:
    """440 shapes images of 16 x 16 with their captions (400 train, 40 validation)."""
    return write_shapes(tmp_path_factory.mktemp("data") / "shapes", 440)


TINY_VLM = """\
[model]
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
vocab_size = 259
max_seq_len = 112
vlm = "{arch}"

[model.vision]
image_size = 16
patch_size = 4
dim = 16
n_layers = 1
n_heads = 2
cross_attention_every = 1

[train]
batch_size = 4
seq_len = 96
max_steps = 12
mixed_precision = "fp32"
seed = 3

[optimizer]
lr = 3e-3

[scheduler]
warmup_steps = 2

[data]
path = "{data}"

[checkpoint]
interval = 5

[metrics]
log_interval = 1
"""


def tiny_vlm_config(
    folder: pathlib.Path, data: pathlib.Path, arch: str = "joint_decoder"
) -> pathlib.Path:
    """A ~60k-parameter vision-language config on ``data``, its run dir under ``folder``."""
    path = folder / "tiny_vlm.toml"
    path.write_text(TINY_VLM.format(arch=arch, data=data) + f'\n[run]\ndir = "{folder / "run"}"\n')
    return path


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on 127.0.0.1, once per worker (``tests/object_store.py``)."""
    from tests.object_store import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch) -> str:
    """A new, empty bucket; the AWS variables point this process and its children at it."""
    from tests.object_store import ENV, new_bucket

    for name, value in {**ENV, "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(name, value)
    return new_bucket(s3_endpoint)
