"""scripts/generate.py on a trained run, given prompts as a hostile user would: raw bytes that
are not UTF-8 (as argv arrives on Linux), and prompts that fill or overflow the model's context.
Each row runs the script as a real process (forked from a warm interpreter: tests/zygote.py) and asserts its exit code, its one ``error:`` line
(or its output), no traceback, and a run directory left as it was."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from forge.data.tokenizer import ByteTokenizer, HFTokenizer
from forge.errors import UserInputError
from tests.conftest import REPO
from tests.e2e.sandbox import Run
from tests.e2e.test_train_script import load_script
from tests.zygote import run_script

GENERATE = load_script("generate")
SCRIPT = str(REPO / "scripts" / "generate.py")


def generate(run: Run, *args: str | bytes) -> subprocess.CompletedProcess[bytes]:
    """The script on the trained run, greedy; ``args`` may be bytes, as argv is on Linux."""
    return run_script([SCRIPT, str(run.dir), "--temperature", "0", *args])


def snapshot(folder: pathlib.Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time."""
    return {
        str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


X31, X40 = "x" * 31, "x" * 40  # with the BOS: 32 tokens (the model's max_seq_len), 41
TOO_LONG = "--prompt: too long for model.max_seq_len=32:"

# (case, options, the one error line after "error: ")
REFUSALS = [
    ("a prompt that fills the context", ["--prompt", X31], f"{TOO_LONG} 32 tokens (BOS included) leave no room; shorten it by at least 1 token to sample any"),
    ("a full prompt and new tokens asked", ["--prompt", X31, "--max-new-tokens", "5"], f"{TOO_LONG} 32 tokens (BOS included) leave no room; shorten it by at least 5 tokens to sample 5"),
    ("a prompt past the context", ["--prompt", X40], f"{TOO_LONG} 41 tokens (BOS included), 9 over; shorten it by at least 10 tokens to sample any"),
    ("a prompt past the context, no new tokens", ["--prompt", X40, "--max-new-tokens", "0"], f"{TOO_LONG} 41 tokens (BOS included), 9 over; shorten it by at least 9 tokens to fit"),
    ("a prompt past the context, new tokens asked", ["--prompt", X40, "--max-new-tokens", "20"], f"{TOO_LONG} 41 tokens (BOS included), 9 over; shorten it by at least 29 tokens to sample 20"),
    ("more new tokens than fit", ["--max-new-tokens", "40"], "--max-new-tokens: the prompt (5 tokens) + 40 new tokens exceed model.max_seq_len=32; ask for at most 27"),
]  # fmt: skip


@pytest.mark.parametrize("options,error", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_a_prompt_the_context_cannot_hold_is_one_coherent_line(trained, options, error):
    before = snapshot(trained.dir)
    done = generate(trained, *options)
    stderr = done.stderr.decode(errors="replace")
    assert "Traceback" not in stderr, stderr
    assert done.returncode == 2
    assert [x for x in stderr.splitlines() if x.startswith("error:")] == [f"error: {error}"]
    assert done.stdout == b""
    assert snapshot(trained.dir) == before


# (case, options, what stdout starts with, its length in characters at most)
ACCEPTED = [
    ("a prompt of bytes that are not UTF-8", [b"--prompt", b"\xff\xfedef "], "\ufffd\ufffddef ", 32),
    ("a prompt that leaves one token", ["--prompt", "x" * 30], "x" * 30, 31),
    ("a full prompt, no new tokens", ["--prompt", X31, "--max-new-tokens", "0"], X31, 31),
]  # fmt: skip


@pytest.mark.parametrize(
    "options,start,most", [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED]
)
def test_a_prompt_that_fits_is_continued(trained, options, start, most):
    before = snapshot(trained.dir)
    done = generate(trained, *options)
    stderr = done.stderr.decode(errors="replace")
    assert "Traceback" not in stderr, stderr
    assert done.returncode == 0, stderr
    text = done.stdout.decode("utf-8").removesuffix("\n")
    assert text.startswith(start) and len(text) <= most, text
    assert snapshot(trained.dir) == before


def argv(raw: bytes) -> str:
    """``raw`` as Python receives it in ``sys.argv`` on Linux."""
    return raw.decode("utf-8", "surrogateescape")


# (case, the prompt as sys.argv holds it, the byte tokenizer's ids)
BYTE_PROMPTS = [
    ("UTF-8 text", "café", [256, 99, 97, 102, 0xC3, 0xA9]),
    ("bytes that are not UTF-8", argv(b"caf\xe9"), [256, 99, 97, 102, 0xE9]),
    ("two stray bytes", argv(b"\xff\xfe"), [256, 0xFF, 0xFE]),
]  # fmt: skip


@pytest.mark.parametrize(
    "prompt,ids", [c[1:] for c in BYTE_PROMPTS], ids=[c[0] for c in BYTE_PROMPTS]
)
def test_the_byte_tokenizer_takes_the_prompts_bytes_as_they_are(prompt, ids):
    assert GENERATE.prompt_ids(ByteTokenizer(), prompt) == ids


def test_a_lone_surrogate_is_neither_text_nor_a_byte():
    with pytest.raises(UserInputError) as caught:
        GENERATE.prompt_ids(ByteTokenizer(), "ab\ud800")
    assert caught.value.lines == [
        "--prompt: character 2 (U+D800) is a lone surrogate, neither text nor a byte; pass "
        "text or bytes"
    ]


@pytest.fixture
def hf_tokenizer(tmp_path) -> HFTokenizer:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(
        ["def f(x): return x"] * 20,
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    return HFTokenizer(str(tmp_path / "tokenizer.json"), "<s>", "</s>")


def test_a_hugging_face_tokenizer_refuses_bytes_that_are_not_utf8(hf_tokenizer):
    assert GENERATE.prompt_ids(hf_tokenizer, "def ")[0] == hf_tokenizer.bos_id
    with pytest.raises(UserInputError) as caught:
        GENERATE.prompt_ids(hf_tokenizer, argv(b"caf\xe9"))
    assert caught.value.lines == [
        f"--prompt: byte 0xe9 at character 3 is not UTF-8 text, and the run's tokenizer "
        f"({hf_tokenizer.path}) encodes text only; pass the prompt as UTF-8"
    ]


def test_speculative_generation_without_depths_is_one_line(trained):
    done = generate(trained, "--speculative", "--max-new-tokens", "4")
    assert done.returncode == 2
    assert done.stderr.decode().strip() == (
        "error: --speculative: the model has no multi-token depths (model.mtp_depth = 0); "
        "train with model.mtp_depth > 0, or drop --speculative"
    )


def test_speculative_generation_prints_the_same_text_and_its_acceptance(tmp_path, small_corpus):
    from tests.e2e.sandbox import make_run, train_here

    run = make_run(tmp_path, small_corpus)
    assert train_here(run, "--model.mtp_depth=2", "--train.max_steps=5").code == 0
    plain = generate(run, "--max-new-tokens", "20")
    fast = generate(run, "--max-new-tokens", "20", "--speculative")
    assert plain.returncode == fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout  # greedy: the same text
    line = [x for x in fast.stderr.decode().splitlines() if x.startswith("# speculative:")]
    assert len(line) == 1 and "drafts kept" in line[0] and "x plain generation" in line[0]
