"""`train(config)`: what `llama-jax train` and `api.train` both run, and the training loop.

    train(config)          join a multi-process run, build the mesh, open the data, run the pre-flight check,
                           check the rest of the input (Run.setup, run.py: nothing in run.dir is written before
                           it passes), run the loop
    execute(run)           start (restore) -> the run's segments one after another (segments.py: a stage, or
                           the stretch after a rollback) -> finish
    train_segment(...)     a segment's steps: dispatch a step, place the next batch, read the step before; when
                           a part is due after the step, read it at once and let the due parts act

The host runs one step ahead of the devices: step n's metrics are read only after step n + 1 has been
dispatched, and that read is the loop's only device-to-host transfer, so the devices never wait for the
host between steps. A step a part acts on is read first (its guard verdict may roll back).

The parts (parts.py) decide for themselves when they are due and what they do: evaluation, the checkpointer
(checkpoint/checkpointer.py decides the intervals), goodput's step clock (resilience/goodput.py), the throughput
meter (metrics.py), the guard (resilience/guards.py: what a step's loss means and when to roll back), the
watchdog, straggler detection and the profiler (perf/profiler.py: which steps it traces). Where the run begins
is checkpoint/start.py's decision.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from llama_jax.checkpoint.average import average_decay
from llama_jax.config import Config
from llama_jax.config import summary as describe
from llama_jax.config.stages import Stage, not_reached, resolve
from llama_jax.data.streams import open_data
from llama_jax.distributed import processes, sharding
from llama_jax.distributed.peers import Peers, primary_first
from llama_jax.errors import EXIT_OK, EXIT_PREEMPTED, LAUNCHED_BY, ConfigError, DataError, InputError
from llama_jax.files import unwritable
from llama_jax.resilience import preflight
from llama_jax.resilience.flight import FlightRecorder
from llama_jax.resilience.goodput import StartClock
from llama_jax.resilience.inject import Injector
from llama_jax.resilience.lease import RunDirLease
from llama_jax.training.parts import Part, Position
from llama_jax.training.program import TrainProgram
from llama_jax.training.run import Run, RunStage, configure_process
from llama_jax.training.segments import Loop, Segment


def train(
    config: Config,
    print_fn: Callable[[str], None] = print,
    *,
    devices=None,
    started_at: float | None = None,
    describe_program: Callable[[TrainProgram], str] | None = None,
    parts: Sequence[Part] = (),
) -> dict:
    """Check the input, then train `config`, resuming from run.dir's newest checkpoint; returns the summary.

    Joins a multi-process run first when run.* keys or the environment describe one; then process 0
    speaks through print_fn and the others print only their warnings. Raises ConfigError or DataError
    (one line) on bad input before anything in run.dir is written, and CoordinatorUnavailable when the
    coordinator does not answer. `devices` (default: all) is for tests on part of the devices. describe_program:
    what a hang report says of the running stage's program (the command line and the API give planning's plan);
    parts: the caller's own parts of the loop (training/parts.py), called after its own.
    """
    # Goodput counts the start-up as restart overhead, and keeps where it went part by part (the command line
    # passes started_at: the process was launched for this run).
    clock = StartClock(started_at, launched=True) if started_at else StartClock(time.time())
    clock.mark("imports")
    processes.initialize(config.run)  # before anything touches the devices
    configure_process(config)  # before anything compiles or saves
    clock.mark("distributed_init")
    if problem := unwritable(Path(config.run.dir)):  # before anything compiles: one line, exit 2
        raise ConfigError(
            f"run.dir {config.run.dir} cannot be written: {problem}; choose a run.dir on a writable filesystem"
        )
    # A staged run's stages (config/stages.py), each on fewer processes as its own config says.
    stages = [
        dataclasses.replace(s, config=processes.on_fewer_processes(s.config, jax.process_count(), say=s.index == 0))
        for s in resolve(config)
    ]
    config = stages[0].config
    primary = jax.process_index() == 0
    f, injector = config.fault, Injector(config.inject, jax.process_index())
    peers = Peers(f.barrier_timeout_s, injected_stall_at=injector.stall_at)
    # One run.dir, one trainer: refused while a live run holds it, before anything is said or written (execute
    # takes this lease: a holder on another host found gone here is not waited for again).
    lease = RunDirLease.of(config)
    if held := peers.broadcast("run.dir holder", lease.problem() if primary else ""):
        raise ConfigError(held)
    print_fn = print_fn if primary else _warnings_only(print_fn)  # this process's voice
    _say_what_runs(config, stages, print_fn, primary)
    # What this process was last doing, published to the others: a hang names the process the run waits for.
    peers.recorder = FlightRecorder(
        Path(config.run.dir),
        peers.index,
        peers.count,
        processes.node_name(),
        capacity=f.flight_events,
        heartbeat_s=f.flight_heartbeat_s,
        client=peers.client,
    )
    with peers.recorder:
        return _train(stages, peers, print_fn, devices, clock, injector, describe_program, parts, lease)


def _say_what_runs(config: Config, stages: list[Stage], print_fn: Callable[[str], None], primary: bool) -> None:
    """Process 0 says the config and the stages (naming those the run does not reach); every process warns where a
    launcher restarts a run that saves nothing until its end."""
    if primary:
        print_fn(describe(config))
        for stage in stages if len(stages) > 1 else ():
            print_fn(stage.describe())
        if skipped := not_reached(config):
            print_fn(
                f"note: train.stages {skipped} begin after this run's {config.train.steps} steps (or after its decay "
                "phase begins): not trained"
            )
    if os.environ.get(LAUNCHED_BY) and not config.checkpoint.periodic:
        print_fn(
            f"warning: under {os.environ[LAUNCHED_BY]} a failed run restarts from its newest checkpoint, and this "
            "one saves none until it ends (checkpoint.every_steps=0, no every_minutes, no local tier): every "
            "restart starts again from step 0; set checkpoint.every_steps=auto"
        )


def _train(
    stages: list[Stage],
    peers: Peers,
    print_fn: Callable[[str], None],
    devices,
    clock: StartClock,
    injector: Injector,
    describe_program: Callable[[TrainProgram], str] | None,
    parts: Sequence[Part],
    lease: RunDirLease,
) -> dict:
    config = stages[0].config
    f = config.fault
    peers.recorder.record("setup", "building the mesh and opening the data")
    meshes = [sharding.make_mesh(s.config, devices=devices) for s in stages]
    mesh = meshes[0]
    # Process 0 prepares raw sources into the cache first, so processes sharing it never race.
    # A later stage's data says only its warnings: the first stage's has said what the data is.
    warnings = lambda line: print_fn(line) if line.startswith("warning") else None  # noqa: E731
    data = primary_first(
        lambda: [open_data(s.config, print_fn if s.index == 0 else warnings, s.first_row) for s in stages],
        (InputError,),
        peers,
    )
    for stage, stage_data in zip(stages[1:], data[1:]):  # one model, one vocabulary: every stage's tokens alike
        if stage_data.tokenizer.fingerprint()["sha256"] != data[0].tokenizer.fingerprint()["sha256"]:
            raise DataError(
                f"{stage.name}'s data ({', '.join(stage.config.data.sources)}) was prepared with another tokenizer "
                "than the first stage's; prepare every stage's sources with the same tokenizer"
            )
    staged = [RunStage(s, m, d) for s, m, d in zip(stages, meshes, data)] if len(stages) > 1 else []
    data = data[0]
    clock.mark("data")
    if f.preflight:  # a slow or faulty device is named before the step compiles or a checkpoint restores (exit 71)
        report = preflight.check(config, mesh, peers, print_fn, injector)
        print_fn(preflight.summary(report))
        preflight.enforce(report, Path(config.run.dir), create=True, peers=peers)  # a starting run: may make run.dir
        clock.mark("preflight")
    peers.recorder.record("setup", "compiling the train step")
    run = Run.setup(config, mesh, data, peers, staged)
    clock.mark("compile")
    if config.train.microbatches == "auto":
        print_fn(
            f"train.microbatches=auto: {run.config.train.microbatches}, the fewest whose step fits run.device_memory_gb"
        )
    return execute(run, print_fn, clock, injector, describe_program, parts, lease)


def _warnings_only(print_fn: Callable[[str], None]) -> Callable[[str], None]:
    """The voice of processes other than 0: their warnings (a straggler, a skipped step) still matter."""
    process = jax.process_index()

    def warnings(line: str) -> None:
        if line.startswith("warning"):
            print_fn(f"[process {process}] {line}")
            sys.stdout.flush()  # several processes share a terminal or a log file

    return warnings


def execute(
    run: Run,
    print_fn: Callable[[str], None] = print,
    clock: StartClock | None = None,
    injector: Injector | None = None,
    describe_program: Callable[[TrainProgram], str] | None = None,
    parts: Sequence[Part] = (),
    lease: RunDirLease | None = None,
) -> dict:
    """The training loop: the run's segments one after another, from where it starts to train.steps, a rollback
    re-entering where it went back to. Returns a summary: eval losses, throughput, MFU, goodput and the exit code
    (0, or EXIT_PREEMPTED after a SIGTERM/SIGINT made it save and stop). `parts`: a caller's own (parts.py);
    `lease`: run.dir's, as train() checked it (else a new one)."""
    t, run_dir, wall_start = run.config.train, Path(run.config.run.dir), time.perf_counter()
    summary: dict[str, Any] = {"run_dir": str(run_dir), "exit_code": EXIT_OK}
    if run.start.step and run.start.step >= t.steps:
        print_fn(f"{run_dir} is already trained to step {run.start.step}; raise train.steps to continue")
        devices = list(run.program.mesh.devices.flat)  # where the run stopped before its average was written
        average_decay(run.config, run.peers, devices, print_fn)
        return summary
    clock = clock or StartClock(time.time())
    lease = (lease or RunDirLease.of(run.config)).taken_for(run.peers)  # one run.dir, one trainer: before it writes
    try:
        loop = Loop.open(run, print_fn, clock, injector, describe_program, parts)
        try:
            with loop.running():
                at, segment = loop.start(clock)
                while True:
                    at = train_segment(loop, segment, at)
                    if at.stopped or at.step >= t.steps:
                        break
                    segment, at = loop.segment_after(segment, at)
                summary["exit_code"] = EXIT_PREEMPTED if at.stopped else EXIT_OK
                summary.update(loop.finish(at.step, preempted=at.stopped))
        finally:
            loop.checkpointer.close()  # also on errors: a pending asynchronous save is finished, not lost
        loop.conclude(at, summary, print_fn)
    finally:
        lease.release()  # the run writes nothing more into run.dir
    summary["wall_time_s"] = time.perf_counter() - wall_start
    return summary


def train_segment(loop: Loop, segment: Segment, at: Position) -> Position:
    """Steps at.step + 1 to segment.last, the host one step ahead of the devices: step n's result is read once step
    n + 1 is dispatched (reading waits for step n alone; n + 1 is queued behind it), unless a part is due after step
    n: then it is read at once, for its verdict, before the part acts. Returns where the run goes on: the segment's
    end (its last step maybe still unread), a preemption stop, or the checkpoint a rollback went back to."""
    state, step, data_step, read, pending, batch = at.state, at.step, at.data_step, at.read, at.pending, at.batch
    while step < segment.last:
        state, current = loop.dispatch(segment, state, batch or loop.next_batch(segment, data_step), step + 1)
        step, data_step = step + 1, data_step + 1
        batch = loop.next_batch(segment, data_step) if step < segment.last else None  # placed while the step runs
        if pending is not None:
            if rollback := loop.read_step(pending, state, step, data_step):  # the step just dispatched goes too
                return dataclasses.replace(rollback, batch=batch)
            loop.injector.hang_after(pending.step)
            read, pending = pending.step, None
        stopping = loop.preemption.should_stop(step)
        if not (due := loop.due(step, read, stopping)):
            pending = current
            continue
        if rollback := loop.read_step(current, state, step, data_step):
            return dataclasses.replace(rollback, batch=batch)
        read = step
        loop.act(due, Position(state, step, data_step, read), stopping)
        if stopping:
            return Position(state, step, data_step, read, stopped=True)
    return Position(state, step, data_step, read, pending, batch)
