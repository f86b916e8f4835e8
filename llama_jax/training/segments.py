"""A run as segments, and the Loop that runs them (loop.py's execute and train_segment read it top to bottom).

A segment is a stretch of steps with one program and one data stream: a stage of a staged run (the whole run
otherwise), re-entered after a rollback. The Loop holds what runs the segments and the parts that act between
their steps (parts.py):

    Loop.open                  write the run's config and tokenizer, start every part
    start                      where the run starts (checkpoint/start.py), carried out; the parts begin
    segment_after              the segment that trains the next step: the same one after a rollback inside it,
                               else the next (or an earlier) stage's, its program activated and the state moved
    next_batch, dispatch       a batch placed on the devices; a step handed to them
    read_step                  read a step's result, the parts observe it, a rollback on the guard's verdict
    due, act                   which parts act after a step, and their acts
    finish, conclude           the last save, the summary, the decay average; a sample and the report
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import jax

from llama_jax.checkpoint import start as run_start
from llama_jax.checkpoint.average import average_decay
from llama_jax.checkpoint.checkpointer import Checkpointer
from llama_jax.config import to_yaml
from llama_jax.errors import EXIT_OK, EXIT_PREEMPTED
from llama_jax.files import cache_root
from llama_jax.inference.generate import sample_text
from llama_jax.model import remat
from llama_jax.model.llama import param_count
from llama_jax.perf.hardware import mfu_peaks
from llama_jax.perf.profiler import StepProfiler
from llama_jax.resilience.goodput import Goodput, StartClock, format_goodput
from llama_jax.resilience.guards import SpikeGuard
from llama_jax.resilience.inject import Injector
from llama_jax.resilience.preemption import PreemptionGuard
from llama_jax.resilience.stragglers import HostScores, HostWindow
from llama_jax.resilience.watchdog import HangWatchdog
from llama_jax.training import parts as loop_parts
from llama_jax.training.batches import local_rows, put_batch
from llama_jax.training.metrics import MetricsLog, ThroughputMeter, WandbSettings
from llama_jax.training.parts import Part, Position, StepResult
from llama_jax.training.program import TrainProgram
from llama_jax.training.report import write_report
from llama_jax.training.run import Run, open_checkpointer
from llama_jax.training.step import TrainState, model_flops_per_token


@dataclass(frozen=True)
class Segment:
    """Steps up to `last` with one stage's program and data stream."""

    stage: int  # its index in a staged run (0 otherwise)
    last: int  # the last step it trains: its stage's last, or train.steps
    stream: Iterator[dict]  # its stage's batches (kept across a rollback inside the stage)
    compiled_at: tuple[int, ...]  # steps whose time is compilation's: this process's first, its stage's first


@dataclass(frozen=True)
class Dispatched:
    """A step handed to the devices whose result the host has not read yet."""

    step: int
    metrics: dict  # device arrays: reading them waits for the step
    compiled: bool  # the first step of its program in this process: its time is compilation's


@dataclass
class HostWaits:
    """The host's waits since the last step was read, charged to the step read next (whose time they fall in)."""

    dispatch_s: float = 0.0  # in dispatches: the devices' queue was full (theirs, not the host's, time)
    data_s: float = 0.0  # for the loader: an upper bound of the devices' wait (they may have been busy)

    def take(self) -> tuple[float, float]:
        taken, self.dispatch_s, self.data_s = (self.dispatch_s, self.data_s), 0.0, 0.0
        return taken


class ActiveProgram:
    """The current stage's program activated (TrainProgram.activate) while the loop runs; a stage change swaps it."""

    def __init__(self, run: Run):
        self.run, self.stack = run, contextlib.ExitStack()

    def switch(self) -> None:
        self.stack.close()
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(self.run.program.activate())

    def __enter__(self) -> ActiveProgram:
        self.switch()
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()


@dataclass
class Loop:
    """What runs a run's segments, and the parts that act between their steps."""

    run: Run
    log: MetricsLog  # also the voice of the loop: log.message prints without breaking the progress bar
    checkpointer: Checkpointer
    goodput: Goodput
    watchdog: HangWatchdog
    preemption: PreemptionGuard
    injector: Injector  # faults injected on purpose (resilience/inject.py): testing only, none in a real run
    parts: tuple[Part, ...]  # called in this order (parts.py)
    waits: HostWaits
    active: ActiveProgram

    @classmethod
    def open(
        cls,
        run: Run,
        print_fn: Callable[[str], None],
        clock: StartClock,
        injector: Injector | None = None,
        describe_program: Callable[[TrainProgram], str] | None = None,
        extra_parts: Sequence[Part] = (),
    ) -> Loop:
        """Write the run's config and tokenizer and start every part (Run.setup has checked the input). `injector`:
        the one train() built, else one from the config; `describe_program`: what a hang report says of the running
        stage's program (train()); `extra_parts`: a caller's own parts, after the loop's."""
        config, mesh = run.config, run.program.mesh
        t, f, run_dir = config.train, config.fault, Path(config.run.dir)
        multi, primary = jax.process_count() > 1, jax.process_index() == 0
        run_dir.mkdir(parents=True, exist_ok=True)
        if primary:
            (run_dir / "config.yaml").write_text(to_yaml(config))
            run.data.tokenizer.save(run_dir)  # `llama-jax generate` and `eval` find the run's tokenizer here
        peaks = mfu_peaks(config.model.compute_dtype, config.model.fp8, cache_root(config.data.cache_dir))
        print_fn(
            f"{param_count(config.model) / 1e6:.2f}M parameters on {mesh.devices.size} "
            f"{jax.local_devices()[0].platform} device(s), mesh {dict(mesh.shape)}; {peaks.describe()}"
        )
        print_fn(remat.describe(config.remat))
        host = socket.gethostname() + (f"-p{jax.process_index()}" if multi else "")
        log = MetricsLog(
            run_dir,
            total_steps=t.steps,
            start_step=run.start.step,
            tensorboard=config.run.tensorboard,
            print_fn=print_fn,
            enabled=primary,
            wandb=WandbSettings.from_config(config),
        )
        injector = injector or Injector(config.inject, jax.process_index())
        try:
            checkpointer = open_checkpointer(run, log.message, injector)
            goodput = Goodput(run_dir, clock.started_at, write=primary, print_fn=log.message)
            watchdog = HangWatchdog(
                run_dir,
                host,
                factor=f.hang_factor,
                min_timeout_s=f.hang_min_timeout_s,
                startup_timeout_s=f.hang_startup_timeout_s,
                recorder=run.peers.recorder,
                # the stage running when it hangs: its program, mesh and micro-batches
                describe=lambda: describe_program(run.program) if describe_program else "",
            )
            parts = (*_own_parts(run, log, checkpointer, goodput, watchdog, peaks, host), *extra_parts)
            preemption = PreemptionGuard(checkpointer.manager.reached_preemption if multi else None)
            waits, active = HostWaits(), ActiveProgram(run)
            loop = cls(run, log, checkpointer, goodput, watchdog, preemption, injector, parts, waits, active)
        except BaseException:
            log.close()  # the loop never started: nothing else will close it
            raise
        goodput.add("compile", run.compile_seconds)  # Run.setup compiled the step to check its memory
        clock.mark("loop_setup")
        return loop

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The watchdog, the preemption handler, the current program, the log and every part with a context (the
        profiler) while the loop runs."""
        with self.watchdog, self.preemption, self.active, self.log, contextlib.ExitStack() as contexts:
            for part in self.parts:
                if hasattr(part, "__enter__"):
                    contexts.enter_context(part)
            yield

    def start(self, clock: StartClock) -> tuple[Position, Segment]:
        """Restore where the run starts (a staged run: in the stage of that step), start goodput's clock and the
        parts (a new run is evaluated first); the first segment, its stream at the data position."""
        run, stage_first = self.run, None
        if (index := run.stage_of(run.start.step + 1)) != run.stage:  # resuming inside a later stage: restore there
            self._enter_stage(None, index, run.start.step)
            stage_first = run.start.step + 1
        state, data_step = _restore(self)
        step = int(state.step)
        if (index := run.stage_of(step + 1)) != run.stage:  # it restored another step (the newest was damaged)
            state, stage_first = self._enter_stage(state, index, step), step + 1
        clock.mark("restore")  # and the restored state placed in its shards (start_state)
        self.goodput.start_parts(clock.parts)
        self.goodput.begin(step)
        at = Position(state, step, data_step, read=step)
        with self.goodput.pause(None):  # not part of the first step's time
            for part in self.parts:
                part.begin(at)
            compiled_at = (step + 1, step + 1 if stage_first is None else stage_first)
            return at, Segment(run.stage, _last_step(run, run.stage), self._stream(data_step), compiled_at)

    def segment_after(self, segment: Segment, at: Position) -> tuple[Segment, Position]:
        """The segment that trains step at.step + 1: `segment` itself after a rollback inside its stage (its stream
        and the batch loaded ahead go on), else that step's stage's, entered."""
        index = self.run.stage_of(at.step + 1)
        if index == segment.stage:
            return segment, at
        state = self._enter_stage(at.state, index, at.step)
        compiled_at = (segment.compiled_at[0], at.step + 1)
        stream = self._stream(at.data_step)
        return Segment(index, _last_step(self.run, index), stream, compiled_at), dataclasses.replace(
            at, state=state, batch=None
        )

    def _enter_stage(self, state: TrainState | None, index: int, step: int) -> TrainState | None:
        """Make stage `index` the current one: its program (compiled at setup) and data, the state (if any yet) moved
        to its shardings (its mesh may differ: mesh.sequence; the old buffers go), the parts told; said, and logged
        where it begins."""
        stage = self.run.enter(index).stage
        self.active.switch()
        if state is not None:
            self.checkpointer.wait()  # a save in flight may still read the buffers given up here
            state = jax.device_put(state, self.run.program.state_shardings, donate=True)
        for part in self.parts:
            part.begin_stage(index)
        t = self.run.program.config.train
        if step == stage.first_step:  # it begins (not a resume inside it, nor a rollback into it)
            self.log.message(stage.describe())
            self.log.log(
                {"step": step, "stage": index + 1, "stage_batch_size": t.batch_size, "stage_seq_len": t.seq_len}
            )
        else:
            self.log.message(f"continuing in {stage.name} at step {step + 1}")
        return state

    def _stream(self, data_step: int) -> Iterator[dict]:
        """The current stage's batches from the data position `data_step` on. A stage reads its stream from data
        position - its first step: the position of the straight run, and past every batch of its stream it read
        before a rollback (the position only grows). (A rollback into an earlier stage reads that stage's stream past
        its planned end, where a later stage of the same mix, which begins at the planned end, reads too.)"""
        run, config = self.run, self.run.config
        position = data_step - (run.stages[run.stage].stage.first_step if run.stages else 0)
        return run.data.train.iterate(
            position, position + 10**12, local_rows(run.program), config.data.loader_threads, config.data.prefetch
        )

    def next_batch(self, segment: Segment, data_step: int) -> dict:
        """The next batch, placed on the devices, with the injector's faults applied."""
        self.injector.before_step(data_step)
        _record(self.run, "data", f"loading batch {data_step}")
        start = time.perf_counter()
        batch = next(segment.stream)
        self.waits.data_s += time.perf_counter() - start
        # The transfer starts now, the step need not wait for it.
        return put_batch(self.run.program, self.injector.batch(data_step, batch))

    def dispatch(self, segment: Segment, state: TrainState, batch: dict, step: int) -> tuple[TrainState, Dispatched]:
        """Hand step `step` to the devices. The call returns at once unless the devices are still busy with
        earlier work (a full queue; on CPU a cross-process step runs inside the call): that wait is the
        devices', so read_step() does not count it as the host's time."""
        _record(self.run, "step", f"dispatching step {step} (its collectives run on the devices)", step)
        run_step = self.run.program.train_step
        for part in self.parts:
            run_step = part.dispatch(step, run_step)
        start = time.perf_counter()
        state, metrics = run_step(state, batch)
        self.waits.dispatch_s += time.perf_counter() - start
        return state, Dispatched(step, metrics, step in segment.compiled_at)

    def read_step(self, done: Dispatched, state: TrainState, step: int, data_step: int) -> Position | None:
        """Read a dispatched step's metrics (waiting for it: the only device-to-host transfer of a step), the parts
        observe it; after fault.max_bad_steps bad steps in a row, roll back. The position to go on from when it
        rolled back, None when the loop goes on as it was (without a checkpoint to go back to, the step stays)."""
        _record(self.run, "step", f"waiting for step {done.step}'s result")
        reading = time.perf_counter()
        metrics = {k: float(v) for k, v in jax.device_get(done.metrics).items()}
        dispatch_s, data_s = self.waits.take()
        result = StepResult(done.step, metrics, done.compiled, data_s, time.perf_counter() - reading + dispatch_s)
        for part in self.parts:
            result = part.observe(result)
        return self._roll_back(state, step, data_step) if result.verdict == "rollback" else None

    def due(self, step: int, read: int, stopping: bool) -> tuple[Part, ...]:
        """The parts that act after `step` (just dispatched; `read`: the newest step whose result is in hand; every
        part is asked, on every process alike)."""
        wanted = [part.due(step, read, stopping) for part in self.parts]
        return tuple(part for part, due in zip(self.parts, wanted) if due)

    def act(self, due: tuple[Part, ...], at: Position, stopping: bool) -> None:
        """The parts due after at.step act on it (not step time); then, when the run stops, it says so."""
        with self.goodput.pause(None):
            for part in due:
                part.act(at)
        self.injector.hang_after(at.step)
        if stopping:
            bad = _part(self.parts, loop_parts.Guard).guard.consecutive > 0
            saved = f"step {at.step} is counted as bad and not saved" if bad else f"saved step {at.step}"
            self.log.message(
                f"{self.preemption.signal_name or 'preemption'} received: {saved}, "
                f"stopping (exit {EXIT_PREEMPTED}); re-run the same command to continue"
            )

    def _roll_back(self, state: TrainState, step: int, data_step: int) -> Position | None:
        """Back to the newest checkpoint before the first of the bad steps (a bad step is never saved), skipping the
        batches since; None without such a checkpoint (the guard starts counting again)."""
        guard, print_fn, config = _part(self.parts, loop_parts.Guard).guard, self.log.message, self.run.config
        with self.watchdog.paused("rollback", config.checkpoint.timeout_s), self.goodput.pause(None):
            self.checkpointer.wait()
            # As at start-up: the newest step that restores on every process, one decision for all.
            found = self.checkpointer.restore_newest(
                self.run.program.abstract_checkpoint(), print_fn, before=guard.first_bad_step
            )
            if found.state is None:
                print_fn(
                    f"warning: {guard.consecutive} bad steps in a row at step {step} and no checkpoint to roll back to"
                )
                guard.reset()
                return None
            back = self.run.program.with_frozen(found.state, getattr(state, "frozen", None))  # the base stays
        for part in self.parts:
            part.rolled_back(found.step, step)
        print_fn(
            f"warning: {guard.consecutive} bad steps in a row: rolled back from step {step} to {found.step}; "
            f"the data continues at batch {data_step}, skipping the {step - found.step} batches since"
        )
        guard.reset()
        return None if found.step == step else Position(back, found.step, data_step, read=found.step)

    def finish(self, step: int, preempted: bool) -> dict:
        """Wait for the last save, average the decay phase, and gather the parts' summaries (throughput, MFU,
        goodput, eval losses), also in the log."""
        c, run = self.run.config.checkpoint, self.run
        with self.watchdog.paused("final save", c.timeout_s):
            self.goodput.add("checkpoint_save", self.checkpointer.finish_writes())
        if not preempted and step == run.config.train.steps and c.average_decay:
            # Bounded like the restores it is made of: one per averaged checkpoint.
            with (
                self.watchdog.paused("average of the decay phase", c.timeout_s * c.average_decay),
                self.goodput.pause(None),
            ):
                average_decay(run.config, run.peers, list(run.program.mesh.devices.flat), self.log.message)
        local = self.checkpointer.local
        if local is not None:  # the background writes: their time and this host's bytes
            self.goodput.tier("write_local", sum(local.write_seconds), local.bytes_written, len(local.write_seconds))
        summary: dict[str, Any] = {}
        for part in self.parts:
            summary.update(part.summary())
        self.log.log({"step": step, **{f"goodput_{k}": v for k, v in summary["goodput"].items() if k != "tiers"}})
        self.goodput.finish(preempted=preempted)
        self.log.message(format_goodput(summary["goodput"]))
        meter = _part(self.parts, loop_parts.Throughput).meter
        if meter.records and (advice := self.checkpointer.advice(meter.median_step_s)):
            self.log.message(advice)
        return summary

    def conclude(self, at: Position, summary: dict, print_fn: Callable[[str], None]) -> None:
        """After the loop: a text sample of a run that trained to its end, and the report plot."""
        run, primary = self.run, jax.process_index() == 0
        run_dir = Path(run.config.run.dir)
        if run.config.train.sample_tokens and summary["exit_code"] == EXIT_OK and at.step > run.start.step:
            # Outside the mesh context: the prompt's length need not divide the sequence shards.
            summary["sample"] = sample_text(run.config, at.state.model_params, run.data.tokenizer)
            print_fn(f"sample after {run.config.train.steps} steps:\n{summary['sample']}")
        if not primary:
            return
        try:  # the run is trained and saved: a file that cannot be written now warns and stops nothing
            if "sample" in summary:
                (run_dir / "sample.txt").write_text(summary["sample"] + "\n")
            summary["report"] = str(write_report(run_dir))
        except OSError as err:
            self.log.message(f"warning: writing the sample or report into {run_dir} failed ({err.strerror or err})")


def _own_parts(
    run: Run, log: MetricsLog, checkpointer: Checkpointer, goodput: Goodput, watchdog: HangWatchdog, peaks, host: str
) -> tuple[Part, ...]:
    """The loop's own parts, in the order the loop calls them: a part observes a step after those before it (the
    guard sees the step's seconds, the metrics its verdict), and evaluation acts before the saves."""
    config, mesh, f = run.config, run.program.mesh, run.config.fault
    t = config.train
    meter = ThroughputMeter(t.batch_size * t.seq_len, model_flops_per_token(config), peaks, mesh.devices.size)
    guard = SpikeGuard(f.max_bad_steps, f.spike_zscore, f.spike_window)
    own_devices = sorted(d.id for d in mesh.devices.flat if d.process_index == jax.process_index())
    hosts = HostWindow(run.peers, HostScores(f.straggler_host_threshold), f.straggler_every_steps, host, own_devices)
    run_dir = Path(config.run.dir)
    profiler = StepProfiler.for_run(run_dir, config.run.profile_steps, lambda: run.program.compile_step().as_text())
    return (
        loop_parts.Profile(profiler),
        loop_parts.GoodputClock(goodput),
        loop_parts.Watchdog(watchdog),
        loop_parts.Throughput(meter, run),
        loop_parts.Evaluation(run, watchdog, goodput, log),
        loop_parts.Saves(checkpointer, guard, run, watchdog, goodput, log),
        loop_parts.Stragglers(f.straggler_factor, hosts, log, goodput),
        loop_parts.Guard(guard, log),
        loop_parts.Metrics(log, guard, meter, goodput, run),
    )


PartType = TypeVar("PartType", bound=Part)


def _part(parts: Sequence[Part], kind: type[PartType]) -> PartType:
    """The loop's own part of type `kind` (the loop asks the guard and the meter for what it says itself)."""
    return next(part for part in parts if type(part) is kind)


def _last_step(run: Run, index: int) -> int:
    """The last step stage `index` trains (the run's last, without stages)."""
    steps = run.config.train.steps
    return min(run.stages[index].stage.last_step, steps) if run.stages else steps


def _record(run: Run, kind: str, what: str, step: int | None = None) -> None:
    """What this process is doing, for the flight recorder (a hang names the process the run waits for)."""
    if run.peers.recorder is not None:
        run.peers.recorder.record(kind, what, step)


def _restore(loop: Loop) -> tuple[TrainState, int]:
    """(state, data position): where the run starts (checkpoint/start.py), carried out."""
    run, start = loop.run, time.perf_counter()
    run.peers.barrier("restore")  # a process that never gets here is named, instead of a silent wait in Orbax
    with loop.watchdog.paused("restore", run.config.checkpoint.timeout_s):
        restored = run_start.restore(run.start, loop.checkpointer, run.program.abstract_checkpoint(), loop.log.message)
    for tier, seconds in restored.seconds.items():
        loop.goodput.tier(f"restore_{tier}", seconds)
    if restored.tier:
        loop.goodput.restored(restored.tier, restored.copies)
    if run.start.step or run.start.source is not None:
        loop.goodput.add("checkpoint_restore", time.perf_counter() - start)
    saved_fingerprint = restored.data.get("fingerprint", run.data_fingerprint)
    if restored.state is not None and saved_fingerprint != run.data_fingerprint:
        loop.log.message(
            f"warning: the data settings or sources changed since step {int(restored.state.step)} "
            "was saved; the batches from here on differ from the original run's"
        )
    return run.program.start_state(restored, run.base), restored.data_step
