"""forge's lm-eval backend against direct computations from forge's own logits: log-likelihoods,
greedy flags, rolling log-likelihoods and greedy generation, text and mixture-of-experts."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

from forge.config import ModelConfig
from forge.data.tokenizer import ByteTokenizer
from forge.harness.backend import ForgeLM, Scoring
from forge.harness.requests import Row, Share, split_whitespace
from forge.model.generate import sample
from forge.model.transformer import Transformer, split_moe_output

TOK = ByteTokenizer()
DENSE = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48)
MOE = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=48, moe_num_experts=4, moe_top_k=2)
PAIRS = [
    ("def f(x):\n    return", " x + 1"),
    ("import ", "os"),
    ("", "hello"),  # no context: scored after BOS alone
    ("# " + "a long comment that overflows the model's context " * 2, "end"),
    ("class A:\n    ", "pass"),
]


def model_of(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.init_weights(seed)
    return model.eval()


def backend(model: Transformer, batch_size: int = 8, share: Share | None = None) -> ForgeLM:
    scoring = Scoring(batch_size, share or Share())
    return ForgeLM(model, TOK, torch.device("cpu"), scoring)


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]  # type: ignore[arg-type]


@torch.no_grad()
def direct_loglikelihood(model: Transformer, context: str, continuation: str) -> float:
    """log P(continuation | BOS + context) from one forward over the last max_len inputs,
    the context's trailing spaces scored with the continuation (lm-eval's convention)."""
    context, continuation = split_whitespace(context, continuation)
    ctx, cont = TOK.encode(context, bos=True), TOK.encode(continuation)
    tokens = (ctx + cont)[-(model.cfg.max_seq_len + 1) :]
    logits = split_moe_output(model(torch.tensor([tokens[:-1]])), model.cfg.moe)[0][0]
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    scored = min(len(cont), len(tokens) - 1)
    targets = tokens[-scored:]
    positions = range(len(tokens) - 1 - scored, len(tokens) - 1)
    return float(sum(logprobs[p, t] for p, t in zip(positions, targets, strict=True)))


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_loglikelihood_equals_a_direct_computation_from_forges_logits(cfg):
    model = model_of(cfg)
    got = backend(model).loglikelihood(requests("loglikelihood", PAIRS))
    for (context, continuation), (value, _) in zip(PAIRS, got, strict=True):
        assert value == pytest.approx(direct_loglikelihood(model, context, continuation), abs=1e-5)


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_scores_do_not_depend_on_the_batch_size(batch_size):
    model = model_of(DENSE)
    reference = backend(model, 8).loglikelihood(requests("loglikelihood", PAIRS))
    got = backend(model, batch_size).loglikelihood(requests("loglikelihood", PAIRS))
    assert [g for _, g in got] == [g for _, g in reference]
    for (a, _), (b, _) in zip(got, reference, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_the_greedy_flag_says_whether_argmax_decoding_gives_the_continuation():
    model = model_of(DENSE)
    prompt = TOK.encode("def ", bos=True)
    greedy = sample(model, prompt, 4, temperature=0.0)[len(prompt) :]
    other = [*greedy[:-1], (greedy[-1] + 1) % 256]
    rows = [Row((*prompt, *greedy), 4), Row((*prompt, *other), 4)]
    assert [flag for _, flag in backend(model).score(rows)] == [True, False]


def test_a_share_scores_only_its_requests():
    model = model_of(DENSE)
    full = backend(model).loglikelihood(requests("loglikelihood", PAIRS))
    sent: dict = {}

    def gather(results: dict) -> dict:  # the other ranks' results, as an all-gather brings
        sent.update(results)
        return dict(enumerate(full)) | results

    lm = ForgeLM(model, TOK, torch.device("cpu"), Scoring(8, Share(1, 2), gather=gather))
    got = lm.loglikelihood(requests("loglikelihood", PAIRS))
    assert sorted(sent) == Share(1, 2).of(len(PAIRS))
    for (a, _), (b, _) in zip(got, full, strict=True):
        assert a == pytest.approx(b, abs=1e-6)


def forwards(model: Transformer, run) -> int:
    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        run()
    finally:
        handle.remove()
    return len(calls)


@pytest.mark.parametrize("kind", ["loglikelihood", "generate_until"])
def test_in_lockstep_every_share_runs_the_busiest_shares_forwards(kind):
    model = model_of(DENSE)
    if kind == "loglikelihood":
        asks = requests(kind, PAIRS)  # 5 requests: shares of 3 and 2, batches of 2
        method = "loglikelihood"
    else:
        asks = requests(kind, [("x", {"max_gen_toks": 3})] * 3)  # shares of 2 and 1
        method = "generate_until"
    counts = []
    for index in (0, 1):
        scoring = Scoring(2, Share(index, 2), lockstep=True, gather=lambda r: dict.fromkeys(
            range(len(asks)), (0.0, False) if kind == "loglikelihood" else "") | r)  # fmt: skip
        lm = ForgeLM(model, TOK, torch.device("cpu"), scoring)
        counts.append(forwards(model, lambda lm=lm: getattr(lm, method)(asks)))
    assert counts[0] == counts[1] > 0


@torch.no_grad()
def test_rolling_loglikelihood_of_a_short_text_is_its_log_probability_after_bos():
    model = model_of(DENSE)
    text = "for i in range(3):\n    print(i)"
    (got,) = backend(model).loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    ids = TOK.encode(text, bos=True)
    logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), dim=-1)
    expected = float(sum(logprobs[i, t] for i, t in enumerate(ids[1:])))
    assert got == pytest.approx(expected, abs=1e-5)


@torch.no_grad()
def direct_rolling(model: Transformer, ids: list[int]) -> float:
    """The sum over lm-eval's disjoint windows, computed here: the first window reads BOS and
    the first L-1 tokens and predicts L; each next one predicts the next (up to) L tokens
    from the L tokens before its last."""
    length, total, done = model.cfg.max_seq_len, 0.0, 0
    while done < len(ids):
        if done == 0:
            inputs, count = [TOK.bos_id, *ids[: length - 1]], min(length, len(ids))
        else:
            count = min(len(ids) - done, length)
            end = done + count
            inputs = ids[max(0, end - length - 1) : end - 1]
        logits = model(torch.tensor([inputs]))[0].double()
        logprobs = torch.log_softmax(logits[len(inputs) - count :], dim=-1)
        targets = ids[done : done + count]
        total += float(sum(logprobs[i, t] for i, t in enumerate(targets)))
        done += count
    return total


def test_rolling_loglikelihood_of_a_long_text_sums_its_disjoint_windows():
    model = model_of(DENSE)
    text = "x = 1\n" * 30  # 180 bytes: windows of 48, 48, 48 and 36
    (total,) = backend(model).loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))
    assert total == pytest.approx(direct_rolling(model, TOK.encode(text)), abs=1e-5)


def test_an_empty_continuation_is_certain():
    model = model_of(DENSE)
    got = backend(model).loglikelihood(requests("loglikelihood", [("abc", ""), ("ab", "c")]))
    assert got[0] == (0.0, True) and got[1][0] < 0


def test_a_stop_string_ends_cached_decoding_early():
    model = model_of(DENSE, seed=1)
    ids = TOK.encode("def f(", bos=True)
    text = TOK.decode(sample(model, ids, 12, temperature=0.0)[len(ids) :])
    stop = text[1:3]
    lm = backend(model)
    asks = requests("generate_until", [("def f(", {"until": [stop], "max_gen_toks": 12})])
    assert forwards(model, lambda: lm.generate_until(asks)) < 12
    assert lm.generate_until(asks) == [text[: text.find(stop)]]


def test_in_lockstep_requests_of_different_lengths_run_the_same_forwards():
    """A group's subtasks may ask for different ``max_gen_toks``: every rank still runs the
    longest, and each request keeps its own length."""
    model = model_of(DENSE)
    asks = requests("generate_until", [("x", {"max_gen_toks": 2}), ("y", {"max_gen_toks": 9})])
    counts, texts = [], {}
    for index in (0, 1):

        def gather(r: dict) -> dict:
            texts.update(r)
            return dict.fromkeys(range(2), "") | r

        lm = ForgeLM(model, TOK, torch.device("cpu"), Scoring(2, Share(index, 2), True, 1, gather))
        counts.append(forwards(model, lambda lm=lm: lm.generate_until(asks)))
    assert counts == [9, 9]
    cached = backend(model).generate_until(asks)
    assert [texts[0], texts[1]] == cached


@pytest.mark.parametrize("lockstep", [False, True], ids=["kv-cache", "lockstep"])
def test_generate_until_is_forges_greedy_sample_cut_at_the_stop(lockstep):
    model = model_of(DENSE, seed=1)
    prompt = "def f("
    ids = TOK.encode(prompt, bos=True)
    expected_ids = sample(model, ids, 12, temperature=0.0, stop_id=TOK.eos_id)[len(ids) :]
    expected = TOK.decode(expected_ids)
    stop = expected[3:5] if len(expected) > 5 else "\x00"
    lm = ForgeLM(model, TOK, torch.device("cpu"), Scoring(4, lockstep=lockstep))
    asks = [(prompt, {"until": [stop], "max_gen_toks": 12}), (prompt, {"max_gen_toks": 12})]
    cut, whole = lm.generate_until(requests("generate_until", asks))
    assert whole == expected
    assert cut == expected[: expected.find(stop)] if stop in expected else cut == expected


def test_sampling_generation_is_refused_with_the_reason():
    lm = backend(model_of(DENSE))
    with pytest.raises(ValueError, match="decodes greedily"):
        lm.generate_until(requests("generate_until", [("x", {"do_sample": True})]))
