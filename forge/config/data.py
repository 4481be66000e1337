"""``[data]`` and ``[eval]``: token shards, mixtures, phases, packing, held-out loss."""

from __future__ import annotations

import attrs

from forge.config.ranges import Problem, non_negative, positive, usable_path


@attrs.frozen
class DataSource:
    """One tokenized corpus in a mixture: a folder made by ``scripts/prepare_data.py``."""

    name: str
    path: str
    weight: float = 1.0


@attrs.frozen
class DataPhase:
    """From step ``start_step`` on (as logged, 1-based): new source weights (by name; sources not
    named keep their base weight) and a multiplier on the scheduled LR."""

    start_step: int
    weights: dict[str, float] = attrs.field(factory=dict)
    lr_scale: float = 1.0


@attrs.frozen
class DataConfig:
    """Token shards prepared by ``scripts/prepare_data.py`` (folders with ``manifest.json``).

    One source: ``path``. A mixture: ``[[data.sources]]`` (``path`` is then unused), sampled with
    probabilities proportional to ``weight ** (1 / temperature)``. ``[[data.phases]]`` change the
    weights and scale the LR from a given step (with one source, only the LR scale applies).
    """

    path: str = "data/stdlib"
    train_split: str = "train"
    eval_split: str = "validation"
    verify_checksum: bool = True
    sources: tuple[DataSource, ...] = ()
    temperature: float = 1.0
    phases: tuple[DataPhase, ...] = ()
    pack_documents: bool = False  # block-diagonal attention, positions restart per document
    num_workers: int = 0  # loader worker processes (0: read in the training process)

    @property
    def source_list(self) -> tuple[DataSource, ...]:
        """The sources to sample: ``sources``, or ``path`` alone."""
        return self.sources or (DataSource(name="default", path=self.path),)

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        if not self.sources and not self.path:
            p.append(("data.path", "must name a folder made by scripts/prepare_data.py"))
        if not self.sources:
            usable_path(p, "data.path", self.path)
        names = [s.name for s in self.sources]
        for i, source in enumerate(self.sources):
            key = f"data.sources[{i}]"
            if not source.name:
                p.append((f"{key}.name", "must not be empty"))
            elif source.name in names[:i]:
                p.append((f"{key}.name", f"'{source.name}' is already the name of a source"))
            if not source.path:
                p.append((f"{key}.path", "must name a folder made by scripts/prepare_data.py"))
            usable_path(p, f"{key}.path", source.path)
            non_negative(p, f"{key}.weight", source.weight)
        if self.sources and sum(s.weight for s in self.sources) <= 0:
            p.append(("data.sources", "at least one source needs a weight > 0"))
        positive(p, "data.temperature", self.temperature)
        non_negative(p, "data.num_workers", self.num_workers)
        known = [s.name for s in self.source_list]
        previous = 0
        for i, phase in enumerate(self.phases):
            key = f"data.phases[{i}]"
            if phase.start_step <= previous:
                p.append(
                    (f"{key}.start_step", f"must be > {previous} (phases in step order), "
                     f"got {phase.start_step}")
                )  # fmt: skip
            previous = max(previous, phase.start_step)
            positive(p, f"{key}.lr_scale", phase.lr_scale)
            for name, weight in phase.weights.items():
                if name not in known:
                    p.append((f"{key}.weights.{name}", f"no such source (sources: {known})"))
                non_negative(p, f"{key}.weights.{name}", weight)
            if sum(phase.weights.get(s.name, s.weight) for s in self.source_list) <= 0:
                p.append((f"{key}.weights", "at least one source needs a weight > 0"))
        return p


@attrs.frozen
class EvalTask:
    """One ``[[eval.tasks]]`` entry: an lm-eval task (or group) by ``name``, found among
    lm-eval's own or in the task folder ``include_path``, on its first ``limit`` documents
    (None: all of them). See docs/evaluation.md."""

    name: str
    include_path: str | None = None
    limit: int | None = None


@attrs.frozen
class EvalConfig:
    """Held-out loss every ``interval`` steps over ``steps`` batches (interval 0: off), and
    beside it the downstream ``tasks`` through lm-eval, ``batch_size`` requests a forward.
    ``follow``: not in the loop but beside it, by ``scripts/eval_follow.py`` on the committed
    checkpoints of those steps (docs/evaluation.md#beside-training)."""

    interval: int = 0
    steps: int = 20
    tasks: tuple[EvalTask, ...] = ()
    batch_size: int = 8
    follow: bool = False

    @property
    def in_loop_interval(self) -> int:
        """How often the loop itself evaluates (0: never; a follower does it instead)."""
        return 0 if self.follow else self.interval

    def problems(self) -> list[Problem]:
        p: list[Problem] = []
        non_negative(p, "eval.interval", self.interval)
        positive(p, "eval.steps", self.steps)
        positive(p, "eval.batch_size", self.batch_size)
        for i, task in enumerate(self.tasks):
            key = f"eval.tasks[{i}]"
            if not task.name.strip():
                p.append((f"{key}.name", "must name an lm-eval task, e.g. 'hellaswag'"))
            if task.limit is not None:
                positive(p, f"{key}.limit", task.limit)
            usable_path(p, f"{key}.include_path", task.include_path)
        return p
