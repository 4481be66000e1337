"""A forge model as an lm-eval ``LM``: log-likelihoods, rolling log-likelihoods and greedy
generation, each rank scoring its share of the requests, every rank ending with all results.

Importing this module imports ``lm_eval``: callers check ``forge.harness.tasks.lm_eval_problem``
first, so a missing extra is one line, not an ``ImportError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as torch_dist
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from forge.data.tokenizer import Tokenizer
from forge.harness.requests import (
    Row,
    Share,
    batch_count,
    batches_of,
    cut_at_stop,
    generation_args,
    length_order,
    scored_row,
    split_whitespace,
)
from forge.harness.scoring import Stops, greedy_tokens, score_rows

Gather = Callable[[dict[int, Any]], dict[int, Any]]  # this rank's results → every rank's


def local_only(results: dict[int, Any]) -> dict[int, Any]:
    """The gather of a single process: its own results."""
    return results


def over_ranks(results: dict[int, Any]) -> dict[int, Any]:
    """Every rank's results merged, on every rank (tensor-parallel peers send the same)."""
    gathered: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(gathered, results)
    return {k: v for part in gathered for k, v in part.items()}


@attrs.frozen
class Scoring:
    """How the backend runs: requests per forward, this rank's share, whether every rank
    runs the same forwards (FSDP and TP need that: their forwards are collectives), the
    sequence multiple TP needs, how results travel between ranks, and the longest row (None:
    ``model.max_seq_len``; a run's ``train.seq_len`` keeps scoring at trained lengths)."""

    batch_size: int = 8
    share: Share = attrs.Factory(Share)
    lockstep: bool = False
    multiple: int = 1
    gather: Gather = local_only
    max_len: int | None = None


class ForgeLM(LM):
    """lm-eval's model interface over a forge ``Transformer`` (text or mixture of experts)."""

    def __init__(
        self, model: nn.Module, tokenizer: Tokenizer, device: torch.device, scoring: Scoring
    ) -> None:
        super().__init__()
        self.model = model
        self.tok = tokenizer
        self._device = device
        self.scoring = scoring
        limit: int = model.cfg.max_seq_len  # type: ignore[assignment]
        self.max_len = min(limit, scoring.max_len or limit)

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's kind (lm-eval keys its request caches by it)."""
        return self.tok.name

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context (after BOS, as every training document starts) and continuation ids, split
        where encoding the whole text puts the boundary."""
        context, continuation = split_whitespace(context, continuation)
        whole = self.tok.encode(context + continuation, bos=True)
        head = self.tok.encode(context, bos=True)
        return whole[: len(head)], whole[len(head) :]

    def loglikelihood(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """Each request's ``(log P(continuation | context), whether it is the greedy one)``;
        a continuation that encodes to no tokens is certain: ``(0.0, True)``, as lm-eval's
        own backend has it."""
        pairs = [self.encode_pair(*r.args) for r in requests]
        scored = [i for i, (_, continuation) in enumerate(pairs) if continuation]
        rows = [scored_row(*pairs[i], self.max_len) for i in scored]
        out = [(0.0, True)] * len(pairs)
        for i, result in zip(scored, self.score(rows), strict=True):
            out[i] = result
        return out

    def loglikelihood_rolling(
        self, requests: list[Instance], disable_tqdm: bool = False
    ) -> list[float]:
        """Each text's log-likelihood, in disjoint windows of the model's context."""
        windows: list[list[Row]] = []
        for request in requests:
            ids = self.tok.encode(request.args[0])
            pairs = get_rolling_token_windows(ids, self.tok.bos_id, self.max_len, 1)
            windows.append([scored_row(*make_disjoint_window(p), self.max_len) for p in pairs])
        scores = iter(self.score([row for rows in windows for row in rows]))
        return [sum(next(scores)[0] for _ in rows) for rows in windows]

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Each request's greedy continuation, cut at its first stop string. In lockstep
        every rank runs the busiest share's count of requests, each for the most steps any
        request asks (its own are kept), so that all make the same forwards."""
        eos = self.tok.decode([self.tok.eos_id]) or None
        raw: list[tuple[Any, ...]] = [r.args for r in requests]
        asked = [(str(a[0]), generation_args(a[1], eos)) for a in raw]
        s = self.scoring
        mine = s.share.of(len(asked))
        runs = s.share.largest(len(asked)) if s.lockstep else len(mine)
        longest = max((min(g.max_gen_toks, self.max_len - 1) for _, g in asked), default=0)
        texts: dict[int, str] = {}
        for n in range(runs):
            i = mine[n] if n < len(mine) else mine[0] if mine else 0
            context, wanted = asked[i]
            own = min(wanted.max_gen_toks, self.max_len - 1)
            steps = longest if s.lockstep else own
            prompt = self.tok.encode(context, bos=True)[-(self.max_len - steps) :]
            stops = Stops((self.tok.eos_id,), wanted.until, self.tok.decode)
            new = greedy_tokens(
                self.model,
                prompt,
                steps,
                self._device,
                stops=stops,
                use_cache=not s.lockstep,
                pad_id=self.tok.eos_id,
                multiple=s.multiple,
            )[:own]
            if n < len(mine):
                texts[i] = cut_at_stop(self.tok.decode(new), wanted.until)
        everything = s.gather(texts)
        return [everything[i] for i in range(len(asked))]

    def score(self, rows: Sequence[Row]) -> list[tuple[float, bool]]:
        """``score_rows`` over this rank's share of ``rows``, longest first, then every
        rank's results in request order."""
        s = self.scoring
        mine = s.share.of(len(rows))
        order = [mine[i] for i in length_order([rows[i] for i in mine])]
        count = batch_count(len(rows), s.share, s.batch_size) if s.lockstep else None
        results: dict[int, tuple[float, bool]] = {}
        for batch in batches_of(order, s.batch_size, count):
            picked = [rows[i] for i in batch] or [rows[0]]  # an idle rank still runs a forward
            scores = score_rows(self.model, picked, self._device, self.tok.eos_id, s.multiple)
            results |= dict(zip(batch, scores, strict=False))
        everything = s.gather(results)
        return [everything[i] for i in range(len(rows))]
