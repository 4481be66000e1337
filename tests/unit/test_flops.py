"""FLOPs per token, the peak table, the CPU peak (its measurement and cache), the MFU clamp
and the throughput record, against hand-computed values."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from forge.cache import cache_dir
from forge.config.sections import ModelConfig, Precision
from forge.metrics import cpu_peak as cpu_peak_module
from forge.metrics.cpu_peak import (
    CACHE_FILE,
    best_peak,
    cached_peaks,
    cpu_identity,
    measure_matmul_peak,
    next_size_fits,
    peak_cache_key,
    write_cached_peak,
)
from forge.metrics.flops import (
    Mfu,
    PeakFlops,
    PeakSource,
    flops_per_token,
    mfu_of,
    non_embedding_parameters,
    peak_line,
    table_peak_flops,
    throughput,
    throughput_record,
    under_measured_line,
)
from forge.model.transformer import Transformer, num_parameters

TINY = ModelConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=259, ffn_hidden_dim=96, max_seq_len=32
)
LLAMA3_8B = ModelConfig(
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    vocab_size=128256,
    ffn_hidden_dim=14336,
    max_seq_len=8192,
)

# (config, seq_len, non-embedding parameters, FLOPs per token), worked by hand:
#   tiny: attention 2·32·32 + 2·32·16 = 3072, FFN 3·32·96 = 9216, norms 64 -> 12352 per block;
#         2 blocks + final norm 32 + head 259·32 = 33024; 6·33024 + 12·2·32·32 = 222720
#   Llama-3 8B: attention 2·4096² + 2·4096·1024 = 41943040, FFN 3·4096·14336 = 176160768,
#         norms 8192 -> 218112000 per block; ·32 + 4096 + 128256·4096 = 7504924672
#         (+ the 525336576 embedding = 8.03B, the model card's count);
#         6·7504924672 + 12·32·4096·8192 = 57914449920
# Qwen3-0.6B: heads of 128 beside dim 1024 / 16 heads, so the attention's q/k/v width (2048)
# is twice dim: a block is 2·1024·16·128 + 2·1024·8·128 + 2·128 (q/k norms) + 3·1024·3072 +
# 2·1024 = 15,730,944; 28 blocks, the final norm and the (tied) head 151936·1024 make
# 596,049,920; FLOPs 6·that + 12·28·(16·128)·4096 (the scores over the 2048-wide heads)
QWEN3_0_6B = ModelConfig(
    dim=1024,
    n_layers=28,
    n_heads=16,
    n_kv_heads=8,
    head_dim=128,
    vocab_size=151936,
    ffn_hidden_dim=3072,
    qk_norm=True,
    tie_embeddings=True,
)
FLOP_CASES = [
    (TINY, 32, 33_024, 222_720),
    (LLAMA3_8B, 8192, 7_504_924_672, 57_914_449_920),
    (QWEN3_0_6B, 4096, 596_049_920, 6_394_871_808),
]


@pytest.mark.parametrize(
    ("cfg", "seq_len", "params", "flops"), FLOP_CASES, ids=["tiny", "8b", "qwen3_0_6b"]
)
def test_flops_per_token_equal_hand_computed_values(cfg, seq_len, params, flops):
    assert non_embedding_parameters(cfg) == params
    assert flops_per_token(cfg, seq_len) == flops


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("head_dim", [None, 48])
def test_non_embedding_parameters_count_the_built_model_without_its_embedding(
    tied, qk_norm, head_dim
):
    """Tied: the one matrix is the head a token passes through, counted once. A head size of
    its own (``model.head_dim``, Qwen3's) widens the attention projections and q/k norms."""
    import attrs

    cfg = attrs.evolve(TINY, tie_embeddings=tied, qk_norm=qk_norm, head_dim=head_dim)
    with torch.device("meta"):
        model = Transformer(cfg)
    embedding = 0 if tied else cfg.vocab_size * cfg.dim
    assert non_embedding_parameters(cfg) == num_parameters(model) - embedding


# the names torch.cuda.get_device_name reports
PEAK_CASES = [
    ("NVIDIA H100 80GB HBM3", Precision.BF16, 989e12),  # the SXM5 card
    ("NVIDIA H100 PCIe", Precision.BF16, 756e12),  # not shadowed by "H100"
    ("NVIDIA H100 PCIe", Precision.FP32, 51e12),
    ("NVIDIA H100 NVL", Precision.FP32, 60e12),
    ("NVIDIA H100 NVL", Precision.BF16, 835e12),
    ("NVIDIA H200", Precision.BF16, 989e12),
    ("NVIDIA H200 NVL", Precision.BF16, 835e12),  # not shadowed by "H200"
    ("NVIDIA GH200 480GB", Precision.BF16, 989e12),  # "GH200", not "H200"
    ("NVIDIA H800 PCIe", Precision.BF16, 756e12),
    ("NVIDIA A100-SXM4-80GB", Precision.FP32, 19.5e12),
    ("NVIDIA A100-SXM4-40GB", Precision.BF16, 312e12),
    ("NVIDIA A100-PCIE-40GB", Precision.BF16, 312e12),
    ("NVIDIA A100 80GB PCIe", Precision.BF16, 312e12),
    ("NVIDIA B200", Precision.BF16, 2250e12),
    ("NVIDIA L40S", Precision.BF16, 362e12),
    ("AMD Instinct MI300X", Precision.BF16, 1307.4e12),
    ("Tesla T4", Precision.BF16, None),  # unknown: no MFU rather than a wrong one
]


@pytest.mark.parametrize(("name", "dtype", "peak"), PEAK_CASES)
def test_peak_flops_by_device_name_and_dtype(name, dtype, peak):
    assert table_peak_flops(name, dtype) == peak


def test_the_h100_pcie_and_sxm_cards_have_different_peaks():
    pcie = table_peak_flops("NVIDIA H100 PCIe", Precision.BF16)
    sxm = table_peak_flops("NVIDIA H100 80GB HBM3", Precision.BF16)
    assert pcie is not None and sxm is not None and pcie < sxm


def test_throughput_record_is_per_device():
    record = throughput_record(8000.0, 4, 1e9, peak=4e12)
    assert record == {"tokens_per_sec_per_device": 2000.0, "tflops": 2.0, "mfu": 0.5}
    assert "mfu" not in throughput_record(8000.0, 4, 1e9, peak=None)


@pytest.mark.parametrize(
    ("achieved", "peak", "mfu"),
    [
        (2e12, 4e12, Mfu(0.5, False)),
        (4e12, 4e12, Mfu(1.0, False)),  # exactly at the peak: honest, no warning
        (4.58e12, 4e12, Mfu(1.0, True)),  # the 1.145 a loaded machine's peak gave: clamped
        (0.0, 4e12, Mfu(0.0, False)),
    ],
)
def test_an_mfu_above_one_is_clamped_and_flagged(achieved, peak, mfu):
    assert mfu_of(achieved, peak) == mfu


def test_the_throughput_record_never_reports_an_mfu_above_one():
    result = throughput(8000.0, 1, 1e9, peak=4e12)  # 8 TFLOP/s against a 4 TFLOP/s peak
    assert result.mfu == Mfu(1.0, True) and result.record()["mfu"] == 1.0
    assert result.record()["tflops"] == 8.0  # the achieved rate itself is not clamped


# --- a CPU's peak ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("samples", "peak"),
    [
        ([(256, 1e-3), (512, 4e-3)], 2 * 512**3 / 4e-3),  # the larger matmul ran faster
        ([(512, 4e-3), (512, 2e-3), (512, 8e-3)], 2 * 512**3 / 2e-3),  # the fastest repeat
        ([(1024, 0.5), (256, 1e-4)], 2 * 256**3 / 1e-4),  # a loaded large one: not it
        ([], 0.0),
    ],
)
def test_the_cpu_peak_is_the_best_rate_of_any_timed_matmul(samples, peak):
    assert best_peak(samples) == pytest.approx(peak)


@pytest.mark.parametrize(
    ("seconds", "size", "next_size", "remaining", "fits"),
    [
        (0.01, 512, 1024, 0.16, True),  # 2 × 0.01 × 8 = 0.16
        (0.01, 512, 1024, 0.15, False),
        (0.05, 1024, 2048, 0.5, False),  # 0.8 s for a warm-up and one 2048 matmul
    ],
)
def test_a_larger_size_is_measured_only_if_it_fits_the_budget(
    seconds, size, next_size, remaining, fits
):
    assert next_size_fits(seconds, size, next_size, remaining) is fits


def test_the_measurement_takes_the_best_of_several_sizes_within_its_budget():
    peak = measure_matmul_peak(torch.float32, sizes=(32, 64), budget_s=0.05)
    assert 1e6 < peak < 1e14  # a rate in FLOP/s, not a time


def test_measuring_the_peak_leaves_the_global_generator_alone():
    """A run measures the CPU peak only when no cache has it: its saved RNG state must not
    depend on that."""
    torch.manual_seed(11)
    before = torch.get_rng_state()
    measure_matmul_peak(torch.float32, sizes=(16,), budget_s=0.01)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(
    ("environ", "home", "expected"),
    [
        ({"FORGE_CACHE_DIR": "/c", "XDG_CACHE_HOME": "/x"}, "/h", "/c"),
        ({"XDG_CACHE_HOME": "/x"}, "/h", "/x/forge"),
        ({"FORGE_CACHE_DIR": ""}, "/h", "/h/.cache/forge"),  # empty: unset
        ({}, "/h", "/h/.cache/forge"),
        ({}, None, None),  # no home directory: no cache, the peak is measured
    ],
)
def test_the_cache_folder(environ, home, expected):
    folder = cache_dir(environ, None if home is None else pathlib.Path(home))
    assert folder == (None if expected is None else pathlib.Path(expected))


CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2 avx512f amx_bf16
processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx2 avx512f amx_bf16
"""


def test_the_cpu_is_named_and_its_flags_digested():
    name, flags = cpu_identity(CPUINFO)
    assert name == "Intel(R) Xeon(R) Processor"
    avx2_only = cpu_identity(CPUINFO.replace(" avx512f amx_bf16", ""))[1]
    assert flags != avx2_only and len(flags) == 12  # same name, other machine: other key
    assert cpu_identity(CPUINFO.replace("avx2 avx512f", "avx512f avx2"))[1] == flags  # order
    assert cpu_identity("") == ("", "none")


BASE = ("Xeon", "abc", 2, 2, torch.float32, "2.13.0")


@pytest.mark.parametrize(
    "other",
    [
        ("EPYC", "abc", 2, 2, torch.float32, "2.13.0"),
        ("Xeon", "def", 2, 2, torch.float32, "2.13.0"),
        ("Xeon", "abc", 4, 2, torch.float32, "2.13.0"),  # more cores
        ("Xeon", "abc", 2, 1, torch.float32, "2.13.0"),  # fewer torch threads
        ("Xeon", "abc", 2, 2, torch.bfloat16, "2.13.0"),
        ("Xeon", "abc", 2, 2, torch.float32, "2.14.0"),
    ],
)
def test_the_cache_key_changes_with_everything_the_rate_depends_on(other):
    assert peak_cache_key(*BASE) == peak_cache_key(*BASE)
    assert peak_cache_key(*other) != peak_cache_key(*BASE)


def test_a_written_peak_is_read_back_and_others_are_kept(tmp_path):
    path = tmp_path / "sub" / CACHE_FILE  # the folder is created
    assert write_cached_peak(path, "a", 1e11) is None
    assert write_cached_peak(path, "b", 2e11) is None
    assert cached_peaks(path) == {"a": 1e11, "b": 2e11}
    assert [p.name for p in path.parent.iterdir()] == [CACHE_FILE]  # no temporary left


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"{not json",
        b"\xff\xfe\x00garbage",  # not UTF-8
        b"[1, 2]",
        b'{"version": 99, "peaks": {"k": 1e11}}',  # another format
        b'{"version": 1, "peaks": ["k"]}',
        b'{"version": 1, "peaks": {"k": "fast"}}',
        b'{"version": 1, "peaks": {"k": -1}}',
        b'{"version": 1, "peaks": {"k": true}}',
        b'{"version": 1, "peaks": {"k": NaN}}',
    ],
)
def test_a_corrupt_cache_reads_as_empty_and_is_replaced(tmp_path, content):
    path = tmp_path / CACHE_FILE
    path.write_bytes(content)
    assert cached_peaks(path) == {}
    assert write_cached_peak(path, "k", 3e11) is None
    assert cached_peaks(path) == {"k": 3e11}


def test_a_missing_or_unreadable_cache_reads_as_empty(tmp_path):
    assert cached_peaks(tmp_path / "absent.json") == {}
    assert cached_peaks(tmp_path) == {}  # a folder where the file should be


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_an_unwritable_cache_says_why_and_raises_nothing(tmp_path):
    tmp_path.chmod(0o500)
    try:
        failure = write_cached_peak(tmp_path / CACHE_FILE, "k", 1e11)
    finally:
        tmp_path.chmod(0o700)
    assert failure is not None and "PermissionError" in failure


def test_a_cache_folder_that_is_a_file_says_why_and_raises_nothing(tmp_path):
    (tmp_path / "file").write_text("x")
    failure = write_cached_peak(tmp_path / "file" / CACHE_FILE, "k", 1e11)
    assert failure is not None and "Error" in failure


def fake_measure(calls: list[torch.dtype]):
    def measure(dtype: torch.dtype) -> float:
        calls.append(dtype)
        return 5e10

    return measure


def test_the_cpu_peak_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path))
    calls: list[torch.dtype] = []
    monkeypatch.setattr(cpu_peak_module, "measure_matmul_peak", fake_measure(calls))
    cpu_peak_module._cpu_peak.cache_clear()  # a fresh process
    first = cpu_peak_module.cpu_peak(torch.float32)
    assert (first.flops, first.from_cache) == (5e10, False)
    assert first.detail == f"cached in {tmp_path / CACHE_FILE}"
    cpu_peak_module._cpu_peak.cache_clear()  # the next run on this machine
    second = cpu_peak_module.cpu_peak(torch.float32)
    assert (second.flops, second.from_cache, second.detail) == (
        5e10,
        True,
        str(tmp_path / CACHE_FILE),
    )
    assert calls == [torch.float32]
    cpu_peak_module._cpu_peak.cache_clear()
    cpu_peak_module.cpu_peak(torch.bfloat16)  # another dtype: another entry
    assert calls == [torch.float32, torch.bfloat16]
    assert len(json.loads((tmp_path / CACHE_FILE).read_text())["peaks"]) == 2
    cpu_peak_module._cpu_peak.cache_clear()


def test_a_corrupt_or_unwritable_cache_only_costs_a_measurement(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")  # the cache folder is a file: nothing can be written
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "file"))
    calls: list[torch.dtype] = []
    monkeypatch.setattr(cpu_peak_module, "measure_matmul_peak", fake_measure(calls))
    cpu_peak_module._cpu_peak.cache_clear()
    peak = cpu_peak_module.cpu_peak(torch.float32)
    cpu_peak_module._cpu_peak.cache_clear()
    assert peak.flops == 5e10 and not peak.from_cache and peak.detail.startswith("not cached: ")


@pytest.mark.parametrize(
    ("peak", "fragment"),
    [
        (
            PeakFlops(989e12, PeakSource.DATASHEET, "NVIDIA H200"),
            "from the datasheet table (NVIDIA H200)",
        ),
        (PeakFlops(3e11, PeakSource.CACHE, "/c/cpu_peak_flops.json"), "from the cache file /c/"),
        (PeakFlops(3e11, PeakSource.MEASURED, "cached in /c/x.json"), "measured now"),
        (None, "no peak known for 'Tesla T4'"),
    ],
)
def test_the_run_logs_where_its_peak_came_from(peak, fragment):
    assert fragment in peak_line(peak, "Tesla T4")


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        (PeakSource.CACHE, "the achieved rate is cached as this CPU's peak for later runs"),
        (PeakSource.MEASURED, "measured low"),
        (PeakSource.DATASHEET, "overcount"),
    ],
)
def test_the_clamp_warning_says_what_to_do(source, fragment):
    line = under_measured_line(PeakFlops(4e12, source, "/c/cpu_peak_flops.json"), 4.58e12)
    assert "4.58 TFLOP/s" in line and "reported as 1.0" in line and fragment in line


def test_a_run_logs_its_peak_once_and_warns_once_when_the_mfu_is_clamped(monkeypatch, capsys):
    """Rank 0's throughput meter: the first log says where the peak came from, a clamped MFU
    warns once, and no MFU goes above 1."""
    from forge.metrics import mfu

    peak = PeakFlops(4e12, PeakSource.CACHE, "/c/cpu_peak_flops.json")
    lookups = []
    monkeypatch.setattr(mfu, "device_peak", lambda *a: lookups.append(a) or peak)
    meter = mfu.MfuMeter(torch.device("cpu"), Precision.FP32, world_size=1, flops_per_token=1e9)
    records = [meter.record(tps) for tps in (2000, 5000, 6000)]
    assert [r["mfu"] for r in records] == [0.5, 1.0, 1.0]
    assert [r["tflops"] for r in records] == [2.0, 5.0, 6.0]
    err = capsys.readouterr().err.splitlines()
    assert len(lookups) == 1
    assert (
        err[0]
        == "[forge] mfu peak: 4.00 TFLOP/s from the cache file /c/cpu_peak_flops.json (measured on this machine before)"
    )
    assert len(err) == 2 and err[1].startswith("[forge] warning: achieved 5.00 TFLOP/s")


@pytest.mark.parametrize(
    ("cached", "achieved", "after"),
    [(1e11, 3e11, 3e11), (5e11, 3e11, 5e11), (None, 2e11, 2e11)],
    ids=["raised", "kept: already higher", "none cached"],
)
def test_an_achieved_rate_above_the_cached_peak_raises_it(
    monkeypatch, tmp_path, cached, achieved, after
):
    from forge.metrics.cpu_peak import (
        CACHE_FILE,
        cached_peaks,
        raise_cached_peak,
        this_machine_key,
        write_cached_peak,
    )

    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path))
    key = this_machine_key(torch.float32, torch.get_num_threads())
    if cached is not None:
        assert write_cached_peak(tmp_path / CACHE_FILE, key, cached) is None
    assert raise_cached_peak(torch.float32, achieved) is None
    assert cached_peaks(tmp_path / CACHE_FILE)[key] == after
