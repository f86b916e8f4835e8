"""`train(config)`: what `llama-jax train` and `api.train` both run, and the training loop.

    train(config)   join a multi-process run, build the mesh, open the data, run the pre-flight check, check
                    the rest of the input (Run.setup, run.py: nothing in run.dir is written before it passes),
                    run the loop
    execute(run)    restore -> for each step: dispatch it, load and place the next batch, settle the step
                    before -> when something is due: settle this one and evaluate / save / stop -> finish

The host runs one step ahead of the devices: step n's metrics are read only after step n + 1 has been
dispatched, and that read is the loop's only device-to-host transfer, so the devices never wait for the
host between steps. A step that is evaluated or saved is settled first (its guard verdict may roll back).

The loop's parts (loop_parts.py: the Loop) decide for themselves: the checkpointer when a save is due
(checkpoint/checkpointer.py), the throughput meter its window (metrics.py), goodput its step clock
(resilience/goodput.py), the guards what a step's loss means and when to roll back (resilience/guards.py), the
start decision where the run begins (checkpoint/start.py), the profiler which steps it traces (perf/profiler.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

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
from llama_jax.training.loop_parts import Loop, average_decay
from llama_jax.training.program import TrainProgram
from llama_jax.training.run import Run, StagePart, configure_process


def train(
    config: Config,
    print_fn: Callable[[str], None] = print,
    *,
    devices=None,
    started_at: float | None = None,
    describe_program: Callable[[TrainProgram], str] | None = None,
) -> dict:
    """Check the input, then train `config`, resuming from run.dir's newest checkpoint; returns the summary.

    Joins a multi-process run first when run.* keys or the environment describe one; then process 0
    speaks through print_fn and the others print only their warnings. Raises ConfigError or DataError
    (one line) on bad input before anything in run.dir is written, and CoordinatorUnavailable when the
    coordinator does not answer. `devices` (default: all) is for tests on part of the devices. describe_program:
    what a hang report says of the running stage's program (the command line and the API give planning's plan).
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
    print_fn = print_fn if primary else _warnings_only(print_fn)  # this process's voice
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
    f, injector = config.fault, Injector(config.inject, jax.process_index())
    peers = Peers(f.barrier_timeout_s, injected_stall_at=injector.stall_at)
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
        return _train(stages, peers, print_fn, devices, clock, injector, describe_program)


def _train(
    stages: list[Stage],
    peers: Peers,
    print_fn: Callable[[str], None],
    devices,
    clock: StartClock,
    injector: Injector,
    describe_program: Callable[[TrainProgram], str] | None,
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
    staged = [StagePart(s, m, d) for s, m, d in zip(stages, meshes, data)] if len(stages) > 1 else []
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
    return execute(run, print_fn, clock, injector, describe_program)


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
) -> dict:
    """The training loop. Returns a summary: eval losses, throughput, MFU, goodput and the exit code
    (0, or EXIT_PREEMPTED after a SIGTERM/SIGINT made it save and stop)."""
    t, run_dir, wall_start = run.config.train, Path(run.config.run.dir), time.perf_counter()
    summary: dict[str, Any] = {"run_dir": str(run_dir), "exit_code": EXIT_OK}
    if run.start.step and run.start.step >= t.steps:
        print_fn(f"{run_dir} is already trained to step {run.start.step}; raise train.steps to continue")
        average_decay(run, print_fn)  # where the run stopped before its average was written
        return summary
    loop = Loop.open(run, print_fn, clock or StartClock(time.time()), injector, describe_program)
    try:
        with loop.watchdog, loop.preemption, loop.active(), loop.log, loop.profiler:
            if (index := loop.stage_change(run.start.step)) is not None:  # resuming inside a later stage: restore there
                loop.enter_stage(None, index, run.start.step)
            state, data_step = loop.restore()
            step = int(state.step)
            if (index := loop.stage_change(step)) is not None:  # it restored another step (the newest was damaged)
                state = loop.enter_stage(state, index, step)
            batches = loop.begin(state, step, data_step, summary)
            # read: the newest step whose result the host holds (its metrics read, or the state restored); the
            # loop runs one step ahead of the devices, and tells the parts that decide ahead (Loop.due) so.
            batch, unread, read = None, None, step
            while step < t.steps:
                if (index := loop.stage_change(step)) is not None:  # a staged run: the next step is another stage's
                    state, batch = loop.enter_stage(state, index, step), None
                    batches = loop.stage_batches(data_step)
                state, current = loop.dispatch(state, batch or loop.next_batch(batches, data_step), step + 1)
                step, data_step = step + 1, data_step + 1
                # The next batch is loaded and placed on the devices while this step runs (a stage's first is
                # loaded by its own stream, once the stage begins).
                batch = (
                    loop.next_batch(batches, data_step) if step < t.steps and loop.stage_change(step) is None else None
                )
                # The previous step's metrics: reading them waits for that step only, the one just
                # dispatched is already queued behind it, so the devices never wait for the host.
                if unread is not None:
                    if back := loop.settle(unread, state, step, data_step):  # this step's state goes too
                        (state, step), unread, read = back, None, back[1]
                        continue
                    loop.injector.hang_after(unread.step)
                    read = unread.step
                unread, due = current, loop.due(step, read)
                if not due:
                    continue
                unread = None  # this step is evaluated or saved: its verdict first (the next step would donate it)
                if back := loop.settle(current, state, step, data_step):
                    (state, step), read = back, back[1]
                    continue
                read = step
                loop.act(due, state, step, data_step, summary)
                if due.stop:
                    summary["exit_code"] = EXIT_PREEMPTED
                    break
            summary.update(loop.finish(step, preempted=summary["exit_code"] == EXIT_PREEMPTED))
    finally:
        loop.checkpointer.close()  # also on errors: a pending asynchronous save is finished, not lost
    loop.conclude(state, step, summary, print_fn)
    summary["wall_time_s"] = time.perf_counter() - wall_start
    return summary
