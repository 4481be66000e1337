"""The pure decisions of scoring lm-eval requests: how text becomes a scored row, which rows a
rank takes, how they are batched and how generated text is cut. No torch here."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

DEFAULT_MAX_GEN_TOKS = 256
NOT_METRICS = frozenset({"sample_len", "sample_count", "samples"})  # counts in lm-eval's table


@attrs.frozen
class Share:
    """The part of every request list one data-parallel rank scores: every ``count``-th
    request from ``index``."""

    index: int = 0
    count: int = 1

    def of(self, n: int) -> list[int]:
        """This share's positions among ``n`` requests."""
        return list(range(self.index, n, self.count))

    def largest(self, n: int) -> int:
        """The most requests any share of ``n`` holds (ranks in lockstep all run this many)."""
        return -(-n // self.count)


@attrs.frozen
class Row:
    """One forward's worth of a request: the tokens fed in and how many of the last ones are
    the scored continuation."""

    tokens: tuple[int, ...]
    scored: int

    @property
    def inputs(self) -> tuple[int, ...]:
        """What the model reads: every token but the last (it only predicts)."""
        return self.tokens[:-1]


def split_whitespace(context: str, continuation: str) -> tuple[str, str]:
    """``(context, continuation)`` with the context's trailing spaces moved to the
    continuation, so that a tokenizer that merges a space with the next word sees them
    together (lm-eval's convention for every backend)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        return context[:-spaces], context[-spaces:] + continuation
    return context, continuation


def scored_row(context: Sequence[int], continuation: Sequence[int], max_len: int) -> Row:
    """The row scoring ``continuation`` after ``context``, cut from the left to the model's
    ``max_len`` inputs (the continuation is kept whole while it fits)."""
    if not continuation:
        raise ValueError("an empty continuation has no log-likelihood")
    tokens = (tuple(context) + tuple(continuation))[-(max_len + 1) :]
    return Row(tokens, min(len(continuation), len(tokens) - 1))


def length_order(rows: Sequence[Row]) -> list[int]:
    """Row positions longest first (ties by position): batches of similar lengths pad little,
    and an out-of-memory batch comes first, not after an hour."""
    return sorted(range(len(rows)), key=lambda i: (-len(rows[i].inputs), i))


def batches_of(order: Sequence[int], batch_size: int, count: int | None = None) -> list[list[int]]:
    """``order`` in batches of ``batch_size``; with ``count``, padded with empty batches to
    that many (a rank in lockstep runs as many forwards as its busiest peer)."""
    out = [list(order[i : i + batch_size]) for i in range(0, len(order), batch_size)]
    if count is not None:
        out += [[] for _ in range(count - len(out))]
    return out


def batch_count(n: int, share: Share, batch_size: int) -> int:
    """The number of batches the busiest share of ``n`` rows needs."""
    return math.ceil(share.largest(n) / batch_size)


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (tensor parallel shards sequences)."""
    return -(-length // multiple) * multiple


@attrs.frozen
class GenerationArgs:
    """What an lm-eval ``generate_until`` request asks for: greedy decoding, stopped at any of
    ``until`` or after ``max_gen_toks`` tokens."""

    until: tuple[str, ...] = ()
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS


def generation_args(kwargs: Mapping[str, Any], eos: str | None) -> GenerationArgs:
    """``GenerationArgs`` of a request's ``gen_kwargs``; sampling is refused (forge scores
    greedy decoding only, so that a score is a function of the weights)."""
    if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
        raise ValueError(
            "generate_until asked for sampling (do_sample / temperature > 0): forge's "
            "lm-eval backend decodes greedily; set the task's generation_kwargs to greedy"
        )
    until = kwargs.get("until", [])
    stops = (until,) if isinstance(until, str) else tuple(until)
    if eos and eos not in stops:
        stops += (eos,)
    return GenerationArgs(stops, int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)))


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    end = len(text)
    for stop in until:
        if stop:
            at = text.find(stop)
            if at != -1:
                end = min(end, at)
    return text[:end]


def flat_metrics(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """lm-eval's ``results`` table as ``eval/<task>/<metric>`` scalars: ``acc,none`` becomes
    ``acc``, another filter keeps its name (``exact_match,flexible``  becomes
    ``exact_match_flexible``), standard errors, sample counts and non-numbers are left out."""
    out: dict[str, float] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if "_stderr" in name or name in NOT_METRICS or isinstance(value, bool):
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            metric = name if filt in ("", "none") else f"{name}_{filt}"
            out[f"eval/{task}/{metric}"] = float(value)
    return out
