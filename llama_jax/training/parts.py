"""The parts of the training loop and the one protocol they share.

A part watches the steps go by and acts between them. The loop (loop.py, segments.py) calls each hook of every
part in one place, in the order of the parts (Loop.open):

    begin(at)                  the loop starts at `at` (restored or new), before its first step
    dispatch(step, run)        the function that runs step `step` on the devices: `run`, or `run` wrapped
    observe(result)            a step's result, read from the devices: time it, check it, log it; returns the
                               result with what this part adds to it (its seconds, the guard's verdict)
    due(step, read, stopping)  step `step` has just been dispatched; `read` is the newest step whose result is in
                               hand; `stopping`: the run saves and stops after it. Does this part act after it?
                               (Every part is asked, every process alike: asking may be a decision made together.)
    act(at)                    the step it was due after has been read and stands: act on it
    rolled_back(back, step)    the guard rolled the run back from `step` to the checkpoint of step `back`
    begin_stage(index)         a staged run enters stage `index` (its program is the run's current one)
    summary()                  what the part adds to the run's summary when the loop ends

Every hook does nothing by default; a part overrides the ones it needs. Adding a part is one class and one line
(Loop.open's list, or `train(config, parts=[...])` for a run's own).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llama_jax.checkpoint.checkpointer import Checkpointer
from llama_jax.perf.profiler import StepProfiler
from llama_jax.resilience.goodput import Goodput
from llama_jax.resilience.guards import SpikeGuard
from llama_jax.resilience.stragglers import HostWindow, StragglerDetector
from llama_jax.resilience.watchdog import HangWatchdog
from llama_jax.training.batches import evaluate
from llama_jax.training.metrics import MetricsLog, ThroughputMeter
from llama_jax.training.run import Run
from llama_jax.training.step import TrainState, model_flops_per_token


@dataclass(frozen=True)
class Position:
    """Where the loop stands between two steps: what the next segment, or the next step, starts from."""

    state: TrainState
    step: int  # the newest step dispatched (or restored)
    data_step: int  # the data position: batches read so far (a rollback skips ahead, it never goes back)
    read: int  # the newest step whose result the host holds (its metrics read, or the state restored)
    pending: Any = None  # a step dispatched whose result is not read yet (the loop runs one step ahead)
    batch: dict | None = None  # the next step's batch, already loaded and placed
    stopped: bool = False  # preempted: saved (unless bad) and stopping


@dataclass(frozen=True)
class StepResult:
    """A step's result as the host reads it, and what the parts that observed it before said."""

    step: int
    metrics: dict[str, float]
    compiled: bool  # the first step of its program in this process: its time is compilation's
    waited: float  # seconds waiting for the loader since the step before was read
    blocked: float  # seconds the host waited for the devices (reading, and in dispatches)
    seconds: float = 0.0  # the step's time, as goodput's clock measures it (GoodputClock)
    verdict: str = "ok"  # the guard's: ok, skipped, spike or rollback (Guard)


class Part:
    """A part of the loop; see the module's docstring for when each hook is called."""

    def begin(self, at: Position) -> None:
        pass

    def dispatch(self, step: int, run: Callable[..., Any]) -> Callable[..., Any]:
        return run

    def observe(self, result: StepResult) -> StepResult:
        return result

    def due(self, step: int, read: int, stopping: bool) -> bool:
        return False

    def act(self, at: Position) -> None:
        pass

    def rolled_back(self, back: int, step: int) -> None:
        pass

    def begin_stage(self, index: int) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {}


class Profile(Part):
    """Traces run.profile_steps (perf/profiler.py)."""

    def __init__(self, profiler: StepProfiler):
        self.profiler = profiler

    def dispatch(self, step: int, run: Callable[..., Any]) -> Callable[..., Any]:
        return functools.partial(self.profiler.step, step, run)


class GoodputClock(Part):
    """Goodput's step clock: each step's seconds (pauses between steps not counted), and a rollback's lost steps."""

    def __init__(self, goodput: Goodput):
        self.goodput = goodput

    def observe(self, result: StepResult) -> StepResult:
        return dataclasses.replace(result, seconds=self.goodput.time_step(result.step, result.waited, result.compiled))

    def rolled_back(self, back: int, step: int) -> None:
        self.goodput.discard(back, step)

    def summary(self) -> dict[str, Any]:
        return {"goodput": self.goodput.summary()}


class Watchdog(Part):
    """The hang watchdog learns how long a step takes (compilation says nothing about that)."""

    def __init__(self, watchdog: HangWatchdog):
        self.watchdog = watchdog

    def observe(self, result: StepResult) -> StepResult:
        self.watchdog.step_done(result.step, None if result.compiled else result.seconds)
        return result


class Throughput(Part):
    """Tokens per second and MFU, each stage's steps counted with its own tokens per step and FLOPs per token."""

    def __init__(self, meter: ThroughputMeter, run: Run):
        self.meter, self.run = meter, run
        self.per_stage: dict[int, tuple[int, float]] = {}

    def stage_figures(self, index: int) -> tuple[int, float]:
        if index not in self.per_stage:
            current = self.run.stages[index]
            self.per_stage[index] = (current.stage.tokens_per_step, model_flops_per_token(current.program.config))
        return self.per_stage[index]

    def observe(self, result: StepResult) -> StepResult:
        if not result.compiled:  # a step of the stage before may be read once the next has begun
            figures = self.stage_figures(self.run.stage_of(result.step)) if self.run.stages else ()
            self.meter.add(result.seconds, result.waited, *figures)
        return result

    def begin_stage(self, index: int) -> None:
        self.meter.tokens_per_step, self.meter.flops_per_token = self.stage_figures(index)

    def summary(self) -> dict[str, Any]:
        if not self.meter.records:
            return {}
        return {"tokens_per_s": self.meter.median_tokens_per_s, **self.meter.median_mfu()}


class Stragglers(Part):
    """In a multi-process run, a step much slower than this process's recent ones is named, and every
    fault.straggler_every_steps each host posts its window and process 0 scores the hosts (resilience/stragglers.py).
    A run of one process has no one to straggle behind: its slow step (a busy laptop) is the step time's, in
    metrics.jsonl, and no warning."""

    def __init__(self, factor: float, hosts: HostWindow, log: MetricsLog, goodput: Goodput):
        self.factor, self.hosts, self.log, self.goodput = factor, hosts, log, goodput
        self.begin_stage(0)

    def observe(self, result: StepResult) -> StepResult:
        if result.compiled:
            return result
        if self.detector and (warning := self.detector.observe(result.step, result.seconds, self.hosts.peers.index)):
            self.log.message(warning)
        self.hosts.add(result.seconds, max(0.0, result.seconds - result.blocked))
        if result.step % self.hosts.every == 0 and (scored := self.hosts.close(result.step)) is not None:
            scores, waited, warnings = scored
            for warning in warnings:
                self.log.message(warning)
            self.goodput.stragglers(waited, scores)
            named = [{k: s[k] for k in ("process", "host", "devices", "score")} for s in scores if s["straggler"]]
            self.log.log({"step": result.step, "host_score_max": scores[0]["score"], "straggler_hosts": named})
        return result

    def begin_stage(self, index: int) -> None:
        # A stage's steps take their own time.
        self.detector = StragglerDetector(self.factor) if self.hosts.peers.count > 1 else None


class Guard(Part):
    """The NaN/spike guard's verdict on each step's loss (resilience/guards.py); the loop rolls back on `rollback`."""

    def __init__(self, guard: SpikeGuard, log: MetricsLog):
        self.guard, self.log = guard, log

    def observe(self, result: StepResult) -> StepResult:
        metrics = dict(result.metrics)
        verdict = self.guard.observe(result.step, metrics["loss"], bool(metrics.pop("finite")))
        if verdict == "skipped":
            self.log.message(f"warning: step {result.step} skipped: non-finite loss or gradient norm")
        elif verdict == "spike":
            self.log.message(f"warning: step {result.step} loss spike: {metrics['loss']:.4f}")
        return dataclasses.replace(result, metrics=metrics, verdict=verdict)

    def summary(self) -> dict[str, Any]:
        return {"skipped_steps": self.guard.bad_steps_total}


class Metrics(Part):
    """A step's metrics record every train.log_every steps (and the first, last and compiled ones), with the
    throughput window; goodput.json is written alongside."""

    def __init__(self, log: MetricsLog, guard: SpikeGuard, meter: ThroughputMeter, goodput: Goodput, run: Run):
        self.log, self.guard, self.meter, self.goodput, self.run = log, guard, meter, goodput, run

    def observe(self, result: StepResult) -> StepResult:
        t, step = self.run.config.train, result.step
        if result.verdict != "rollback" and (result.compiled or step % t.log_every == 0 or step == t.steps):
            record = {"step": step, **result.metrics, "skipped_total": self.guard.bad_steps_total}
            self.log.log(record | self.meter.record() | ({"compile_s": result.seconds} if result.compiled else {}))
            self.goodput.flush()
        return result


class Evaluation(Part):
    """The eval loss on the validation stream: before a new run's first step, every train.eval_every steps and
    after the last."""

    def __init__(self, run: Run, watchdog: HangWatchdog, goodput: Goodput, log: MetricsLog):
        self.run, self.watchdog, self.goodput, self.log = run, watchdog, goodput, log
        self.losses: dict[str, float] = {}

    def begin(self, at: Position) -> None:
        if at.step == 0:
            self.losses["initial_eval_loss"] = self.evaluate(at.state.model_params, at.step)

    def due(self, step: int, read: int, stopping: bool) -> bool:
        t = self.run.config.train
        return step == t.steps or (t.eval_every > 0 and step % t.eval_every == 0)

    def act(self, at: Position) -> None:
        self.losses["final_eval_loss"] = self.evaluate(at.state.model_params, at.step)

    def evaluate(self, params: Any, step: int) -> float:
        """The current stage's eval loss: train.eval_batches of its validation stream (at most one epoch)."""
        batches = min(self.run.program.config.train.eval_batches, self.run.data.val.batches_per_epoch())
        # Bounded like the steps it is made of (a peer that never joins an eval batch must not hang it).
        with self.watchdog.paused("eval", self.watchdog.timeout_s * max(1, batches)), self.goodput.pause("eval"):
            loss = evaluate(self.run.program, params, self.run.data.val, batches)
        self.log.log({"step": step, "eval_loss": loss})
        return loss

    def summary(self) -> dict[str, Any]:
        return dict(self.losses)


class Saves(Part):
    """Checkpoints: the node-local tier at its interval, the durable one at its interval, at the last step and on
    preemption (checkpoint/checkpointer.py decides the intervals). A step the guard counts as bad (a skipped step,
    or a spike whose update was applied) is never saved: its saves wait for the next good step, so a rollback
    always finds a checkpoint from before the bad run."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        guard: SpikeGuard,
        run: Run,
        watchdog: HangWatchdog,
        goodput: Goodput,
        log: MetricsLog,
    ):
        self.checkpointer, self.guard, self.run, self.watchdog = checkpointer, guard, run, watchdog
        self.goodput, self.log = goodput, log
        self.tiers: list[str] = []  # due after the step just dispatched
        self.waiting: set[str] = set()  # tiers whose save waits for a step the guard counts as good

    def observe(self, result: StepResult) -> StepResult:
        if not result.compiled:
            self.checkpointer.step_timed(result.seconds)  # what automatic intervals are worked out from
        return result

    def due(self, step: int, read: int, stopping: bool) -> bool:
        local, durable = self.checkpointer.local_due(step), self.checkpointer.due(step, read=read)
        durable = durable or step == self.run.config.train.steps or stopping
        wanted = (("local", local), ("durable", durable))
        self.tiers = [tier for tier, due in wanted if due or tier in self.waiting]
        return bool(self.tiers)

    def act(self, at: Position) -> None:
        if self.guard.consecutive > 0:
            self.waiting.update(self.tiers)
            self.log.message(
                f"warning: step {at.step} is counted as bad ({self.guard.consecutive} in a row): not "
                "saved; the save waits for a good step"
            )
            return
        for tier in self.tiers:
            self.save(at, tier)
        self.waiting.clear()

    def save(self, at: Position, tier: str) -> None:
        """Save to the durable tier (checkpoints/) or the local one; the blocked time is goodput's."""
        where = "local checkpoint" if tier == "local" else "checkpoint"
        bound = self.run.config.checkpoint.timeout_s
        with self.watchdog.paused(f"{where} save of step {at.step}", bound), self.goodput.pause("checkpoint_save"):
            data_state = {"next_step": at.data_step, "fingerprint": self.run.data_fingerprint}
            save = self.checkpointer.save_local if tier == "local" else self.checkpointer.save
            blocked = save(at.step, at.state.checkpointed(), data_state)
        self.goodput.tier(f"save_{tier}", blocked)

    def rolled_back(self, back: int, step: int) -> None:
        self.waiting.clear()  # the bad run is gone with its waiting saves
