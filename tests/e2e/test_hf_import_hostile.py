"""``convert_checkpoint.py import`` on malformed Hugging Face folders, given as a hostile user
would: each row breaks one thing in a copy of a valid export, runs the script (its ``main`` in
this process, which an uncaught exception fails; a real process where the row needs another
environment or a resource limit) and asserts exit code 2, exactly one ``error:`` line naming
the file or key, no traceback, and no ``--out`` (nor a temporary sibling of it) afterwards."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pathlib
import resource
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable

import attrs
import pytest
import torch

from forge.config import ModelConfig
from forge.interop.export import TokenizerInfo, export_model
from forge.model.transformer import Transformer
from tests.conftest import REPO
from tests.e2e.test_train_script import load_script

SCRIPT = str(REPO / "scripts" / "convert_checkpoint.py")
CONVERT = load_script("convert_checkpoint")
CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
TOKENS = TokenizerInfo(bos_id=256, eos_id=257, pad_id=258, kind="byte")
WEIGHTS, CONFIG, INDEX = "model.safetensors", "config.json", "model.safetensors.index.json"

Probe = tuple[pathlib.Path, dict[str, str]]  # the folder to import, extra environment


@pytest.fixture(scope="module")
def source() -> dict[str, torch.Tensor]:
    """The weights of a tiny random model (GQA, untied)."""
    torch.manual_seed(0)
    return Transformer(CFG).state_dict()


@pytest.fixture(scope="module")
def valid_export(tmp_path_factory, source) -> pathlib.Path:
    """``source`` exported in fp32 by forge: the folder every row breaks a copy of."""
    out = tmp_path_factory.mktemp("hf") / "export"
    export_model(source, CFG, out, "float32", TOKENS)
    return out


@attrs.frozen
class Done:
    returncode: int
    stderr: str


def run_import(
    folder: pathlib.Path,
    out: pathlib.Path,
    env: dict[str, str],
    preexec: Callable[[], None] | None = None,
) -> Done | subprocess.CompletedProcess[str]:
    """``convert_checkpoint.py import folder --out out``: in this process (60 rows as
    processes took minutes), or as a real one for another environment or a limit."""
    if not env and preexec is None:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = CONVERT.main(["import", str(folder), "--out", str(out)])
        return Done(code, err.getvalue())
    command = [sys.executable, SCRIPT, "import", str(folder), "--out", str(out)]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=240,
        env={**os.environ, **env},
        preexec_fn=preexec,
        check=False,
    )


# --- setups: each breaks one thing in ``folder`` (a copy of the valid export) and returns
# the folder to import with the extra environment


def config(change: dict) -> Callable[[pathlib.Path], Probe]:
    """config.json with keys replaced (a value of ``...`` deletes the key)."""

    def setup(folder: pathlib.Path) -> Probe:
        doc = json.loads((folder / CONFIG).read_text())
        for key, value in change.items():
            if value is ...:
                doc.pop(key, None)
            else:
                doc[key] = value
        (folder / CONFIG).write_text(json.dumps(doc))
        return folder, {}

    return setup


def config_bytes(data: bytes) -> Callable[[pathlib.Path], Probe]:
    def setup(folder: pathlib.Path) -> Probe:
        (folder / CONFIG).write_bytes(data)
        return folder, {}

    return setup


def weights_bytes(make: Callable[[bytes], bytes]) -> Callable[[pathlib.Path], Probe]:
    """model.safetensors replaced by ``make(its bytes)``."""

    def setup(folder: pathlib.Path) -> Probe:
        path = folder / WEIGHTS
        path.write_bytes(make(path.read_bytes()))
        return folder, {}

    return setup


def tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[pathlib.Path], Probe]:
    """model.safetensors rewritten after ``change`` edited its tensors in place."""

    def setup(folder: pathlib.Path) -> Probe:
        from safetensors.torch import load_file, save_file

        state = load_file(str(folder / WEIGHTS))
        change(state)
        save_file(state, str(folder / WEIGHTS))
        return folder, {}

    return setup


def fp8_with_scales(folder: pathlib.Path) -> Probe:
    """An FP8 checkpoint as DeepSeek-V3 and Llama FP8 releases write one: the weight in
    F8_E4M3 beside its ``weight_scale_inv``."""

    def change(state: dict[str, torch.Tensor]) -> None:
        state[Q0] = state[Q0].to(torch.float8_e4m3fn)
        state[Q0 + "_scale_inv"] = torch.ones(1, 1)

    return tensors(change)(folder)


def single_and_sharded(folder: pathlib.Path) -> Probe:
    """The shards and their index, and a model.safetensors of other weights beside them."""
    from safetensors.torch import load_file, save_file

    other = {k: v + 1 for k, v in load_file(str(folder / WEIGHTS)).items()}
    sharded(None)(folder)
    save_file(other, str(folder / WEIGHTS))
    return folder, {}


def set_tensor(name: str, value: Callable[[torch.Tensor], torch.Tensor]):
    def change(state: dict[str, torch.Tensor]) -> None:
        state[name] = value(state[name]).contiguous()

    return tensors(change)


def add_tensor(name: str, value: torch.Tensor):
    def change(state: dict[str, torch.Tensor]) -> None:
        state[name] = value

    return tensors(change)


def drop_tensor(name: str):
    def change(state: dict[str, torch.Tensor]) -> None:
        del state[name]

    return tensors(change)


def header(
    doc: dict | bytes, claimed: int | None = None, size: int = 64
) -> Callable[[bytes], bytes]:
    """A safetensors file whose JSON header is ``doc`` (its length field ``claimed``), then
    ``size`` bytes of data."""

    def make(data: bytes) -> bytes:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        length = struct.pack("<Q", len(body) if claimed is None else claimed)
        return length + body + data[-size:]

    return make


def sharded(
    index: bytes | dict | None, drop_shard: bool = False
) -> Callable[[pathlib.Path], Probe]:
    """The weights split in two shards with an index (``None``: the real one)."""

    def setup(folder: pathlib.Path) -> Probe:
        from safetensors.torch import load_file, save_file

        state = load_file(str(folder / WEIGHTS))
        (folder / WEIGHTS).unlink()
        names = sorted(state)
        halves = {"model-00001-of-00002.safetensors": names[::2]}
        halves["model-00002-of-00002.safetensors"] = names[1::2]
        weight_map = {}
        for shard, keys in halves.items():
            save_file({k: state[k] for k in keys}, str(folder / shard))
            weight_map |= dict.fromkeys(keys, shard)
        if drop_shard:
            (folder / "model-00002-of-00002.safetensors").unlink()
        doc = {"metadata": {}, "weight_map": weight_map} if index is None else index
        data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        (folder / INDEX).write_bytes(data)
        return folder, {}

    return setup


def pickle_only(folder: pathlib.Path) -> Probe:
    """The weights as ``pytorch_model.bin`` (a pickle), as older checkpoints ship them."""
    (folder / WEIGHTS).rename(folder / "pytorch_model.bin")
    return folder, {}


def missing_folder(folder: pathlib.Path) -> Probe:
    return folder.parent / "nowhere", {}


def folder_is_a_file(folder: pathlib.Path) -> Probe:
    path = folder.parent / "afile"
    path.write_text("not a folder")
    return path, {}


def remove(name: str) -> Callable[[pathlib.Path], Probe]:
    def setup(folder: pathlib.Path) -> Probe:
        (folder / name).unlink()
        return folder, {}

    return setup


def directory_instead(name: str) -> Callable[[pathlib.Path], Probe]:
    def setup(folder: pathlib.Path) -> Probe:
        (folder / name).unlink()
        (folder / name).mkdir()
        return folder, {}

    return setup


def pipe_instead(name: str) -> Callable[[pathlib.Path], Probe]:
    """A named pipe in place of ``name``: reading it would block until a writer came."""

    def setup(folder: pathlib.Path) -> Probe:
        (folder / name).unlink()
        os.mkfifo(folder / name)
        return folder, {}

    return setup


def dangling_link(name: str) -> Callable[[pathlib.Path], Probe]:
    def setup(folder: pathlib.Path) -> Probe:
        (folder / name).unlink()
        (folder / name).symlink_to(folder / "gone")
        return folder, {}

    return setup


def no_safetensors(folder: pathlib.Path) -> Probe:
    """A ``safetensors`` package that cannot be imported, ahead of the real one on the path."""
    block = folder.parent / "block" / "safetensors"
    block.mkdir(parents=True, exist_ok=True)
    (block / "__init__.py").write_text("raise ImportError('No module named safetensors')\n")
    return folder, {"PYTHONPATH": f"{block.parent}{os.pathsep}{REPO}"}


Q0 = "model.layers.0.self_attn.q_proj.weight"
NAN, INF = math.nan, math.inf

# (case, setup, a fragment of the one error line)
ROWS = [
    ("the folder is missing", missing_folder, "nowhere: no such folder"),
    ("the folder is a file", folder_is_a_file, "afile: is a file"),
    ("config.json missing", remove(CONFIG), "config.json: missing"),
    ("config.json a directory", directory_instead(CONFIG), "config.json: is a directory"),
    ("config.json a named pipe", pipe_instead(CONFIG), "config.json: is not a regular file"),
    ("config.json a link to nothing", dangling_link(CONFIG), "config.json: missing"),
    ("config.json empty", config_bytes(b""), "config.json: not JSON"),
    ("config.json not JSON", config_bytes(b"{hidden_size: 32"), "config.json: not JSON"),
    ("config.json a list", config_bytes(b"[1, 2]"), "config.json: expected a JSON object"),
    ("config.json not UTF-8", config_bytes(b'{"model_type": "ll\xe9ma"}'), "config.json: not UTF-8"),
    ("config.json nested deep", config_bytes(b"[" * 100_000), "config.json: not JSON"),
    ("hidden_size missing", config({"hidden_size": ...}), "config.json: hidden_size: missing"),
    ("hidden_size a string", config({"hidden_size": "32"}), "hidden_size: expected an integer, got '32'"),
    ("hidden_size zero", config({"hidden_size": 0}), "hidden_size: must be > 0, got 0"),
    ("num_hidden_layers a billion", config({"num_hidden_layers": 10**9}), "num_hidden_layers is 1000000000 but model.safetensors holds 2 layers (0-1)"),
    ("hidden_size a billion", config({"hidden_size": 2**30}), "of another shape than config.json implies (model.embed_tokens.weight: shape [259, 32], config.json implies [259, 1073741824]"),
    ("vocab_size NaN", config({"vocab_size": NAN}), "vocab_size: expected an integer, got NaN"),
    ("rope_theta infinite", config({"rope_theta": INF, "rope_parameters": ...}), "rope_theta: expected a finite number, got Infinity"),
    ("tie_word_embeddings a string", config({"tie_word_embeddings": "yes"}), "tie_word_embeddings: expected true or false, got 'yes'"),
    ("hidden_size not divisible by heads", config({"num_attention_heads": 5, "head_dim": ...}), "hidden_size 32 is not divisible by num_attention_heads 5"),
    ("kv heads not dividing heads", config({"num_key_value_heads": 3}), "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ("another model_type", config({"model_type": "gpt2"}), "config.json: model_type 'gpt2'"),
    ("rope_scaling of another type", config({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}), "RoPE type 'yarn'"),
    ("llama3 rope_scaling without high_freq_factor", config({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}), "rope_scaling.high_freq_factor: missing; a 'llama3' RoPE states it"),
    ("rope_scaling a string", config({"rope_scaling": "linear"}), "rope_scaling: expected a JSON object, got 'linear'"),
    ("hidden_act not silu", config({"hidden_act": "gelu"}), "hidden_act 'gelu'"),
    ("Mixtral's model_type on Llama's architecture", config({"model_type": "mixtral", "num_local_experts": 4}), "forge imports model_type 'mixtral' as MixtralForCausalLM only"),
    ("model.safetensors missing", remove(WEIGHTS), "model.safetensors: missing"),
    ("model.safetensors a directory", directory_instead(WEIGHTS), "model.safetensors: is a directory"),
    ("model.safetensors a named pipe", pipe_instead(WEIGHTS), "model.safetensors: is not a regular file"),
    ("model.safetensors a link to nothing", dangling_link(WEIGHTS), "model.safetensors: missing; it is a link to nothing"),
    ("pytorch_model.bin instead", pickle_only, "pytorch_model.bin is a pickle, which could run code"),
    ("model.safetensors empty", weights_bytes(lambda d: b""), "model.safetensors: not a safetensors file"),
    ("model.safetensors truncated", weights_bytes(lambda d: d[: len(d) // 2]), "model.safetensors: not a safetensors file"),
    ("model.safetensors garbage", weights_bytes(lambda d: os.urandom(4096)), "model.safetensors: not a safetensors file"),
    ("a header claiming a huge size", weights_bytes(header(b"{}", claimed=2**62)), "model.safetensors: not a safetensors file"),
    ("a header with offsets past the end", weights_bytes(header({Q0: {"dtype": "F32", "shape": [1024, 1024], "data_offsets": [0, 4 * 2**20]}})), "model.safetensors: not a safetensors file"),
    ("a header with an unknown dtype", weights_bytes(header({Q0: {"dtype": "X9", "shape": [16], "data_offsets": [0, 64]}})), "model.safetensors: not a safetensors file"),
    ("a tensor of the wrong shape", set_tensor(Q0, lambda t: t[:16]), f"{Q0}: shape [16, 32], config.json implies [32, 32]"),
    ("a tensor missing", drop_tensor(Q0), f"missing 1 tensor config.json implies ({Q0})"),
    ("lm_head missing (untied)", drop_tensor("lm_head.weight"), "lm_head.weight"),
    ("an extra unknown tensor", add_tensor("model.layers.0.self_attn.q_proj.bias", torch.zeros(32)), "model.layers.0.self_attn.q_proj.bias"),
    ("fewer layers than config.json", config({"num_hidden_layers": 3}), "num_hidden_layers is 3 but model.safetensors holds 2 layers"),
    ("an integer tensor", set_tensor(Q0, lambda t: t.to(torch.int32)), f"{Q0}: dtype int32"),
    ("a NaN weight", set_tensor(Q0, lambda t: t.index_fill(0, torch.tensor([3]), NAN)), f"tensor holding NaN or infinity ({Q0})"),
    ("an infinite weight", set_tensor("model.norm.weight", lambda t: t.index_fill(0, torch.tensor([0]), INF)), "tensor holding NaN or infinity (model.norm.weight)"),
    ("index not JSON", sharded(b"{oops"), "model.safetensors.index.json: not JSON"),
    ("index without weight_map", sharded({"metadata": {}}), "model.safetensors.index.json: weight_map: missing"),
    ("index pointing at a missing shard", sharded(None, drop_shard=True), "model-00002-of-00002.safetensors: missing"),
    ("index pointing outside the folder", sharded({"weight_map": {Q0: "../x.safetensors"}}), "'../x.safetensors' is not a file name"),
    ("index naming a tensor its shard lacks", sharded({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}), "lists 1 tensor in model-00001-of-00002.safetensors that it does not hold (model.embed_tokens.weight)"),
    ("index listing no layer", sharded({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}), "num_hidden_layers is 2 but model.safetensors.index.json holds 0 layers;"),
    ("safetensors not installed", no_safetensors, "the safetensors package is not installed"),
    # a quantized model is refused naming the tensor and its dtype, never upcast in silence
    ("an FP8 weight without its scales", set_tensor(Q0, lambda t: t.to(torch.float8_e4m3fn)), f"a quantized model ({Q0}: F8_E4M3)"),
    ("FP8 weights with their scale tensors", fp8_with_scales, f"a quantized model ({Q0}: F8_E4M3, with 1 scale tensor)"),
    ("an FP8 E5M2 weight", set_tensor(Q0, lambda t: t.to(torch.float8_e5m2)), f"{Q0}: F8_E5M2"),
    ("a quantization_config", config({"quantization_config": {"quant_method": "fp8"}}), "a quantized model (config.json's quantization_config)"),
    ("model.safetensors beside a sharded index", single_and_sharded, "holds both model.safetensors and model.safetensors.index.json"),
]  # fmt: skip


@pytest.mark.parametrize(("setup", "fragment"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_a_malformed_folder_is_one_error_line_and_nothing_written(
    valid_export, tmp_path, setup, fragment
):
    folder = tmp_path / "hf"
    shutil.copytree(valid_export, folder)
    target, env = setup(folder)
    out = tmp_path / "imported"
    done = run_import(target, out, env)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], done.stderr
    assert done.returncode == 2
    assert not out.exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".imported")]


def below_a_file(root: pathlib.Path) -> pathlib.Path:
    (root / "afile").write_text("a file")
    return root / "afile" / "imported"


def small_file_limit() -> None:
    """A file-size limit of 64 KiB for the child (Python ignores SIGXFSZ: writes fail)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))


# (case, the --out, a limit set in the child, a fragment of the one error line)
UNWRITABLE = [
    ("--out below a file", below_a_file, None, "afile/imported: the checkpoint could not be written (NotADirectoryError"),
    ("a file-size limit", lambda root: root / "imported", small_file_limit, "imported: the checkpoint could not be written"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("make_out", "preexec", "fragment"), [r[1:] for r in UNWRITABLE], ids=[r[0] for r in UNWRITABLE]
)
def test_an_output_that_cannot_be_written_is_one_line_and_leaves_nothing(
    valid_export, tmp_path, make_out, preexec, fragment
):
    out = make_out(tmp_path)
    done = run_import(valid_export, out, {}, preexec)
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: --out") and fragment in errors[0]
    assert done.returncode == 2
    assert not out.exists() and not list(out.parent.glob(".imported.tmp-*"))


def imported_weights(out: pathlib.Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model weights of the checkpoint the import wrote to ``out``."""
    from forge.checkpoint.store import load_checkpoint

    model = Transformer(cfg)
    load_checkpoint(out / "step_0", model, None, restore_rng_state=False)
    return model.state_dict()


def lenient(folder: pathlib.Path) -> Probe:
    """What readers accept though forge never writes it: fp64 weights, the RoPE buffers old
    transformers saved, a UTF-8 byte order mark and nulls for optional keys."""

    def change(state: dict[str, torch.Tensor]) -> None:
        state.update({k: v.double() for k, v in state.items()})
        state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    tensors(change)(folder)
    config({"rope_scaling": None, "head_dim": 8, "num_key_value_heads": 2})(folder)
    (folder / CONFIG).write_bytes(b"\xef\xbb\xbf" + (folder / CONFIG).read_bytes())
    return folder, {}


# (case, setup): folders the import takes, with the same weights
ACCEPTED = [
    ("the export unchanged", lambda folder: (folder, {})),
    ("a sharded checkpoint", sharded(None)),
    ("fp64, old RoPE buffers, a BOM, nulls", lenient),
    ("a context of 2**31 positions", config({"max_position_embeddings": 2**31})),
]  # fmt: skip


@pytest.mark.parametrize("setup", [r[1] for r in ACCEPTED], ids=[r[0] for r in ACCEPTED])
def test_a_sound_folder_imports_with_the_same_weights(valid_export, source, tmp_path, setup):
    """The rows' starting point is sound, and so are these variations of it. A long context
    costs nothing: the model is built on the meta device (no RoPE tables)."""
    folder = tmp_path / "hf"
    shutil.copytree(valid_export, folder)
    target, env = setup(folder)
    done = run_import(target, tmp_path / "imported", env)
    assert done.returncode == 0 and "error:" not in done.stderr, done.stderr
    weights = imported_weights(tmp_path / "imported", CFG)
    assert weights.keys() == source.keys()
    assert all(torch.equal(weights[k], source[k]) for k in source)


@pytest.mark.parametrize("with_head", [False, True])
def test_tied_embeddings_import_as_one_parameter(tmp_path, with_head):
    """A tied checkpoint leaves lm_head out (or holds a copy of the embedding, ignored)."""
    from safetensors.torch import load_file, save_file

    cfg = attrs.evolve(CFG, tie_embeddings=True)
    torch.manual_seed(1)
    state = Transformer(cfg).state_dict()
    export_model(state, cfg, tmp_path / "exp", "float32", TOKENS)
    if with_head:
        tensors = load_file(str(tmp_path / "exp" / WEIGHTS))
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file(tensors, str(tmp_path / "exp" / WEIGHTS))
    done = run_import(tmp_path / "exp", tmp_path / "imported", {})
    assert done.returncode == 0, done.stderr
    weights = imported_weights(tmp_path / "imported", cfg)
    assert torch.equal(weights["tok_embeddings.weight"], state["tok_embeddings.weight"])
    assert torch.equal(weights["output.weight"], state["tok_embeddings.weight"])
