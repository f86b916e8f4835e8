"""A staged run's stages, resolved: the steps each one trains and the whole config it trains them with.

Llama 3 pre-trained in stages: a batch ramp (4M tokens at 4,096, 8M at 8,192, then 16M), the data mix adjusted on
the way, context stages to 128K, and an annealing phase on its own mix. train.stages lists the stages after the
first; the first is the train.*, data.* and mesh.* settings themselves. A later stage names what changes (batch,
sequence length, micro-batches, sources and weights, mesh.sequence, remat.policy) and keeps the rest of the stage
before it.

    resolve(config)       every Stage the run reaches, first to last: its first and last step, and its Config
    not_reached(config)   the listed stages a shorter run does not reach
    decay_saves(config)   the steps checkpoint.average_decay averages, spread over the decay phase

Everything else of the run (the model, the optimizer, the learning-rate schedule over train.steps, checkpoints)
spans the stages. The step numbers are the one clock: a stage given by tokens begins at the step where the stages
before it have trained that many, so resuming anywhere finds the same stage boundaries.

The data of a stage (training/run.py) is its own stream of batches. Where a stage reads what the stages before it
read (the same sources, weights and packing), its stream starts where theirs stopped, counted in tokens and
rounded up to a row of its own length (first_row), so a batch ramp or a longer sequence length continues through
the corpus instead of starting it again; a stage with another mix starts that mix's stream at its beginning.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from llama_jax.config.schema import Config, StageConfig
from llama_jax.errors import ConfigError


@dataclass(frozen=True)
class Stage:
    index: int  # 0: the first stage (train.*); the stages the run reaches are numbered in order
    count: int  # how many stages the run reaches
    first_step: int  # steps trained when it begins: it trains steps first_step + 1 ... last_step
    last_step: int
    config: Config  # the run's config with this stage's batch, sequence length, micro-batches, data and mesh.sequence
    first_row: int = 0  # rows of its stream that the stages before it have read (module docstring)
    listed: int = 0  # where it is listed: 0 for the first stage, k for train.stages[k - 1]

    @property
    def tokens_per_step(self) -> int:
        return self.config.train.batch_size * self.config.train.seq_len

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step

    @property
    def name(self) -> str:
        return f"stage {self.index + 1}/{self.count}"

    def describe(self) -> str:
        t, d = self.config.train, self.config.data
        weights = f" weights {d.weights}" if d.weights else ""
        return (
            f"{self.name}: steps {self.first_step + 1}-{self.last_step}, batch {t.batch_size} x {t.seq_len} "
            f"({self.tokens_per_step:,} tokens), data {', '.join(d.sources) or '(none)'}{weights}, "
            f"mesh.sequence={self.config.mesh.sequence}, remat {self.config.remat.policy}"
        )


def resolve(config: Config) -> list[Stage]:
    """Every stage of `config` that the run reaches, first to last (one stage when train.stages is empty). Raises
    ConfigError (one line) for a stage that begins out of order, or whose settings contradict each other; the checks
    of each stage's whole config are checks.validate's. A stage that begins at or after the run's end, or after the
    decay phase's beginning when an at_decay stage follows it, is not trained: a quick run of a staged preset
    (train.steps=10) trains its first stage and its annealing (not_reached names the others)."""
    t, stages, tokens = config.train, [Stage(0, 0, 0, config.train.steps, config)], 0
    for index, entry in enumerate(t.stages, start=1):
        previous = stages[-1]
        first, reached = _begin(entry, index, previous, tokens, config)
        if first >= _limit(config, index):
            continue
        tokens = reached
        stages[-1] = dataclasses.replace(previous, last_step=first)
        stages.append(Stage(index, 0, first, t.steps, _apply(entry, index, previous.config), listed=index))
    stages = [dataclasses.replace(s, index=i, count=len(stages)) for i, s in enumerate(stages)]
    return [dataclasses.replace(s, first_row=_first_row(s, stages)) for s in stages]


def not_reached(config: Config) -> list[int]:
    """The indices of train.stages that begin too late for this run's train.steps (resolve), so are not trained."""
    trained = {s.listed for s in resolve(config)}
    return [i - 1 for i in range(1, len(config.train.stages) + 1) if i not in trained]


def _limit(config: Config, index: int) -> int:
    """The step train.stages[index - 1] must begin before: the run's end, or the decay phase's beginning when an
    at_decay stage comes after it (the annealing phase is trained even where a run is cut short)."""
    t = config.train
    if t.stages[index - 1].at_decay or not any(e.at_decay for e in t.stages[index:]):
        return t.steps
    return t.steps - t.resolved_decay_steps


def _where(index: int) -> str:
    return f"train.stages[{index - 1}]"


def _begin(entry: StageConfig, index: int, previous: Stage, tokens: int, config: Config) -> tuple[int, int]:
    """(the step the stage begins after, the tokens trained by then); `tokens`: those trained when `previous` began."""
    t, where = config.train, _where(index)
    given = [entry.start_step >= 0, entry.start_tokens >= 0, entry.at_decay]
    if sum(given) != 1:
        raise ConfigError(
            f"{where} must say where it begins with one of start_step, start_tokens or at_decay: true "
            f"({sum(given)} given)"
        )
    if entry.start_step >= 0:
        step = entry.start_step
    elif entry.start_tokens >= 0:
        step = previous.first_step + math.ceil(max(0.0, entry.start_tokens - tokens) / previous.tokens_per_step)
    else:
        if not t.resolved_decay_steps:
            raise ConfigError(
                f"{where} begins at the decay phase (at_decay), and the run has none; set train.decay_fraction "
                "or train.decay_steps"
            )
        step = t.steps - t.resolved_decay_steps
    if step <= previous.first_step:
        before = "the first stage" if previous.listed == 0 else _where(previous.listed)
        raise ConfigError(
            f"{where} begins at step {step}, not after {before} (from step {previous.first_step}); list the "
            "stages in the order they begin (the first stage is train.*, data.* and mesh.*, from step 0)"
        )
    return step, tokens + (step - previous.first_step) * previous.tokens_per_step


def _apply(entry: StageConfig, index: int, before: Config) -> Config:
    """The stage before's config with what `entry` changes."""
    where, t, d = _where(index), before.train, before.data
    if entry.batch_size and entry.batch_tokens:
        raise ConfigError(f"{where} gives both batch_size and batch_tokens; give one")
    seq_len = entry.seq_len or t.seq_len
    batch_size = entry.batch_size or t.batch_size
    if entry.batch_tokens:
        if entry.batch_tokens % seq_len:
            raise ConfigError(
                f"{where}.batch_tokens ({entry.batch_tokens}) is not a multiple of its sequence length ({seq_len}); "
                f"use a multiple, e.g. {max(1, entry.batch_tokens // seq_len) * seq_len}"
            )
        batch_size = entry.batch_tokens // seq_len
    sources = list(entry.sources) or list(d.sources)
    weights = list(entry.weights) if entry.sources or entry.weights else list(d.weights)
    if weights and len(weights) != len(sources):
        raise ConfigError(
            f"{where}.weights has {len(weights)} value(s) for its {len(sources)} source(s) ({', '.join(sources)}); "
            "give one weight per source, or none (by their token counts)"
        )
    return dataclasses.replace(
        before,
        train=dataclasses.replace(
            t, batch_size=batch_size, seq_len=seq_len, microbatches=entry.microbatches or t.microbatches
        ),
        data=dataclasses.replace(d, sources=sources, weights=weights),
        mesh=dataclasses.replace(before.mesh, sequence=entry.sequence or before.mesh.sequence),
        remat=dataclasses.replace(before.remat, policy=entry.remat or before.remat.policy),
    )


def _mix(stage: Stage) -> tuple:
    d = stage.config.data
    return tuple(d.sources), tuple(d.weights), d.packing, d.packing_window


def _first_row(stage: Stage, stages: list[Stage]) -> int:
    """Rows of the stage's stream the stages before it read, counted in tokens at their planned steps."""
    tokens = sum(
        s.steps * s.config.train.batch_size * (s.config.train.seq_len + 1)
        for s in stages[: stage.index]
        if _mix(s) == _mix(stage)
    )
    return math.ceil(tokens / (stage.config.train.seq_len + 1))


def stage_at(stages: list[Stage], step: int) -> Stage:
    """The stage that trains step `step` (1-based: the step the state reaches); step 0 is the first stage's."""
    return next((s for s in stages if s.first_step < step <= s.last_step), stages[0] if step <= 0 else stages[-1])


def decay_saves(config: Config) -> list[int]:
    """The checkpoints checkpoint.average_decay averages: that many steps spread evenly over the decay phase, the
    last one its end. The checkpointer saves and keeps them whatever checkpoint.every_steps and keep say."""
    t, count = config.train, config.checkpoint.average_decay
    decay = t.resolved_decay_steps
    if not count or not decay:
        return []
    return [t.steps - decay + math.ceil(decay * (i + 1) / count) for i in range(count)]
