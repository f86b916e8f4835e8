"""The Loop: the parts of the training loop that watch, account and decide around one run, and what each step
goes through with them (loop.py's execute runs them in order).

    Loop.open     write the run's config and tokenizer, start every part: metrics log, checkpointer, goodput,
                  throughput meter, guards, straggler detection, watchdog, preemption, profiler
    restore, begin, next_batch, dispatch     where the run starts; the first evaluation; a batch; a step
    observe, settle                          read a step's metrics, account for it, act on the guard's verdict
    due, act                                 what the parts want after a step: evaluate, save, stop
    roll_back, finish, conclude              back to a good checkpoint; the last save and summary; sample, report
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from llama_jax.checkpoint import start as starting
from llama_jax.checkpoint.average import average_decay_phase
from llama_jax.checkpoint.checkpointer import Checkpointer, Identity, Tiers
from llama_jax.checkpoint.durable import read_meta, step_directories
from llama_jax.checkpoint.local import LocalTier
from llama_jax.config import Config, to_yaml
from llama_jax.config.stages import decay_saves
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
from llama_jax.resilience.stragglers import HostScores, HostWindow, StragglerDetector
from llama_jax.resilience.watchdog import HangWatchdog
from llama_jax.training.batches import evaluate, local_rows, put_batch
from llama_jax.training.metrics import MetricsLog, ThroughputMeter, WandbSettings
from llama_jax.training.program import TrainProgram
from llama_jax.training.report import write_report
from llama_jax.training.run import Run
from llama_jax.training.step import TrainState, model_flops_per_token


@dataclass(frozen=True)
class Dispatched:
    """A step handed to the devices whose metrics the host has not read yet."""

    step: int
    metrics: dict  # device arrays: reading them waits for the step
    first: bool  # the first step of this process: its time is compilation's


@dataclass(frozen=True)
class Due:
    """What happens after a step, besides the next step: each part of the loop decides for itself."""

    evaluate: bool
    save: bool  # the durable tier: at its interval, at the last step, and on preemption
    local: bool  # the node-local tier
    stop: bool  # preempted: save and stop

    def __bool__(self) -> bool:
        return self.evaluate or self.save or self.local or self.stop


@dataclass
class Loop:
    """The parts of the loop that watch, account and decide, around one run."""

    run: Run
    log: MetricsLog  # also the voice of the loop: log.message prints without breaking the progress bar
    checkpointer: Checkpointer
    goodput: Goodput
    clock: StartClock  # this process's start, part by part (goodput.json keeps it with the attempt)
    meter: ThroughputMeter
    guard: SpikeGuard
    stragglers: StragglerDetector
    hosts: HostWindow
    watchdog: HangWatchdog
    preemption: PreemptionGuard
    eval_batches: int
    injector: Injector  # faults injected on purpose (resilience/inject.py): testing only, none in a real run
    profiler: StepProfiler  # traces run.profile_steps (perf/profiler.py)
    dispatch_wait_s: float = 0.0  # seconds spent in dispatches since the last observe()
    # Seconds waiting for the loader since the last observe(): charged to the step read next, whose time
    # they fall in (an upper bound of the devices' wait: they may have been busy with the step before).
    data_wait_s: float = 0.0
    first_step: int = 0  # the first step this process runs: its time is compilation's
    held: set[str] = field(default_factory=set)  # tiers whose save waits for a step the guard counts as good
    stage_first_step: int = 0  # a staged run: the first step of the current stage in this process (its program's first)
    _active: contextlib.ExitStack | None = None  # the current stage's program activated (active())
    figures: dict[int, tuple[int, float]] = field(default_factory=dict)  # a stage's tokens per step, FLOPs per token

    @classmethod
    def open(
        cls,
        run: Run,
        print_fn: Callable[[str], None],
        clock: StartClock,
        injector: Injector | None = None,
        describe_program: Callable[[TrainProgram], str] | None = None,
    ) -> Loop:
        """Write the run's config and tokenizer and start every part (Run.setup has checked the input). `injector`:
        the one train() built, else one from the config; `describe_program`: what a hang report says of the running
        stage's program (train())."""
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
            checkpointer = _checkpointer(run, log.message, injector)
            loop = cls(
                run=run,
                log=log,
                checkpointer=checkpointer,
                goodput=Goodput(run_dir, clock.started_at, write=primary, print_fn=log.message),
                clock=clock,
                meter=ThroughputMeter(
                    t.batch_size * t.seq_len, model_flops_per_token(config), peaks, mesh.devices.size
                ),
                guard=SpikeGuard(f.max_bad_steps, f.spike_zscore, f.spike_window),
                stragglers=StragglerDetector(f.straggler_factor),
                hosts=HostWindow(
                    run.peers,
                    HostScores(f.straggler_host_threshold),
                    f.straggler_every_steps,
                    host,
                    sorted(d.id for d in mesh.devices.flat if d.process_index == jax.process_index()),
                ),
                watchdog=HangWatchdog(
                    run_dir,
                    host,
                    factor=f.hang_factor,
                    min_timeout_s=f.hang_min_timeout_s,
                    startup_timeout_s=f.hang_startup_timeout_s,
                    recorder=run.peers.recorder,
                    # the stage running when it hangs: its program, mesh and micro-batches
                    describe=lambda: describe_program(run.program) if describe_program else "",
                ),
                preemption=PreemptionGuard(checkpointer.manager.reached_preemption if multi else None),
                eval_batches=min(t.eval_batches, run.data.val.batches_per_epoch()),
                injector=injector,
                profiler=StepProfiler.for_run(
                    run_dir, config.run.profile_steps, lambda: run.program.compile_step().as_text()
                ),
            )
        except BaseException:
            log.close()  # the loop never started: nothing else will close it
            raise
        loop.goodput.add("compile", run.compile_seconds)  # Run.setup compiled the step to check its memory
        clock.mark("loop_setup")
        return loop

    def restore(self) -> tuple[TrainState, int]:
        """(state, data position): where the run starts (checkpoint/start.py), carried out."""
        run, start = self.run, time.perf_counter()
        run.peers.barrier("restore")  # a process that never gets here is named, instead of a silent wait in Orbax
        with self.watchdog.paused("restore", run.config.checkpoint.timeout_s):
            restored = starting.restore(
                run.start, self.checkpointer, run.program.abstract_checkpoint(), self.log.message
            )
        for tier, seconds in restored.seconds.items():
            self.goodput.tier(f"restore_{tier}", seconds)
        if restored.tier:
            self.goodput.restored(restored.tier, restored.copies)
        if run.start.step or run.start.source is not None:
            self.goodput.add("checkpoint_restore", time.perf_counter() - start)
        saved_fingerprint = restored.data.get("fingerprint", run.data_fingerprint)
        if restored.state is not None and saved_fingerprint != run.data_fingerprint:
            self.log.message(
                f"warning: the data settings or sources changed since step {int(restored.state.step)} "
                "was saved; the batches from here on differ from the original run's"
            )
        return run.program.start_state(restored, run.base), restored.data_step

    def begin(self, state: TrainState, step: int, data_step: int, summary: dict) -> Iterator[dict]:
        """Goodput's clock starts; a new run is evaluated first; the loader starts at the data position."""
        self.first_step = step + 1
        self.clock.mark("restore")  # and the restored state placed in its shards (start_state)
        self.goodput.start_parts(self.clock.parts)
        self.goodput.begin(step)
        with self.goodput.pause(None):  # not part of the first step's time
            if step == 0:
                summary["initial_eval_loss"] = self.evaluate(state.model_params, step)
            return self.stage_batches(data_step)

    def stage_batches(self, data_step: int) -> Iterator[dict]:
        """The current stage's batches from the data position `data_step` on. A stage reads its stream from data
        position - its first step: the position of the straight run, and past every batch of its stream it read
        before a rollback (the position only grows). (A rollback into an earlier stage reads that stage's stream past
        its planned end, where a later stage of the same mix, which begins at the planned end, reads too.)"""
        run, config = self.run, self.run.config
        position = data_step - (run.stages[run.stage].stage.first_step if run.stages else 0)
        return run.data.train.iterate(
            position, position + 10**12, local_rows(run.program), config.data.loader_threads, config.data.prefetch
        )

    @contextlib.contextmanager
    def active(self):
        """The current stage's program activated (TrainProgram.activate) while the loop runs; enter_stage swaps it."""
        try:
            self._activate()
            yield
        finally:
            self._active.close()

    def _activate(self) -> None:
        if self._active is not None:
            self._active.close()
        self._active = contextlib.ExitStack()
        self._active.enter_context(self.run.program.activate())

    def _stage_figures(self, index: int) -> tuple[int, float]:
        """Stage `index`'s tokens per step and model FLOPs per token: what its steps count for throughput and MFU."""
        if index not in self.figures:
            current = self.run.stages[index]
            self.figures[index] = (current.stage.tokens_per_step, model_flops_per_token(current.program.config))
        return self.figures[index]

    def stage_change(self, step: int) -> int | None:
        """The stage that trains step `step` + 1 when it is not the current one (a boundary, or a rollback into an
        earlier stage), else None."""
        index = self.run.stage_of(step + 1)
        return index if index != self.run.stage else None

    def enter_stage(self, state: TrainState | None, index: int, step: int) -> TrainState | None:
        """Make stage `index` the current one: its program (compiled at setup) and data, the state (if any yet) moved
        to its shardings (its mesh may differ: mesh.sequence; the old buffers go), the throughput meter counting its
        tokens; said, and logged where it begins."""
        stage = self.run.enter(index).stage
        self._activate()
        if state is not None:
            self.checkpointer.wait()  # a save in flight may still read the buffers given up here
            state = jax.device_put(state, self.run.program.state_shardings, donate=True)
        config = self.run.program.config
        self.meter.tokens_per_step, self.meter.flops_per_token = self._stage_figures(index)
        self.stragglers = StragglerDetector(self.run.config.fault.straggler_factor)  # its steps take their own time
        self.eval_batches = min(config.train.eval_batches, self.run.data.val.batches_per_epoch())
        self.stage_first_step = step + 1
        t = config.train
        if step == stage.first_step:  # it begins (not a resume inside it, nor a rollback into it)
            self.log.message(stage.describe())
            self.log.log(
                {"step": step, "stage": index + 1, "stage_batch_size": t.batch_size, "stage_seq_len": t.seq_len}
            )
        else:
            self.log.message(f"continuing in {stage.name} at step {step + 1}")
        return state

    def next_batch(self, batches: Iterator[dict], data_step: int) -> dict:
        """The next batch, placed on the devices, with the injector's faults applied (data_wait_s: the wait)."""
        self.injector.before_step(data_step)
        self._record("data", f"loading batch {data_step}")
        start = time.perf_counter()
        batch = next(batches)
        self.data_wait_s += time.perf_counter() - start
        # The transfer starts now, the step need not wait for it.
        return put_batch(self.run.program, self.injector.batch(data_step, batch))

    def dispatch(self, state: TrainState, batch: dict, step: int) -> tuple[TrainState, Dispatched]:
        """Hand step `step` to the devices. The call returns at once unless the devices are still busy with
        earlier work (a full queue; on CPU a cross-process step runs inside the call): that wait is the
        devices', so observe() does not count it as the host's time."""
        self._record("step", f"dispatching step {step} (its collectives run on the devices)", step)
        start = time.perf_counter()
        state, metrics = self.profiler.step(step, self.run.program.train_step, state, batch)
        self.dispatch_wait_s += time.perf_counter() - start
        return state, Dispatched(step, metrics, step in (self.first_step, self.stage_first_step))

    def _record(self, kind: str, what: str, step: int | None = None) -> None:
        if self.run.peers.recorder is not None:
            self.run.peers.recorder.record(kind, what, step)

    def observe(self, done: Dispatched) -> str:
        """Read a dispatched step's metrics (waiting for it), account for it and log it when due; the guard's
        verdict: ok, skipped, spike or rollback. The only device-to-host transfer of a step."""
        t, print_fn, step, compiled = self.run.config.train, self.log.message, done.step, done.first
        self._record("step", f"waiting for step {step}'s result")
        reading = time.perf_counter()
        metrics = {k: float(v) for k, v in jax.device_get(done.metrics).items()}
        # Waiting for the devices, here and in dispatches since the last read; the rest was the host's own work.
        blocked, self.dispatch_wait_s = time.perf_counter() - reading + self.dispatch_wait_s, 0.0
        waited, self.data_wait_s = self.data_wait_s, 0.0
        seconds = self.goodput.time_step(step, waited, compiled)
        self.watchdog.step_done(step, None if compiled else seconds)  # compilation says nothing about step time
        if not compiled:
            self.meter.add(seconds, waited, *self._stage_figures(self.run.stage_of(step)) if self.run.stages else ())
            self.checkpointer.step_timed(seconds)
            if warning := self.stragglers.observe(step, seconds, process=jax.process_index()):
                print_fn(warning)
            self.hosts.add(seconds, max(0.0, seconds - blocked))
            if step % self.hosts.every == 0:
                self._score_hosts(step)
        verdict = self.guard.observe(step, metrics["loss"], bool(metrics.pop("finite")))
        if verdict == "skipped":
            print_fn(f"warning: step {step} skipped: non-finite loss or gradient norm")
        elif verdict == "spike":
            print_fn(f"warning: step {step} loss spike: {metrics['loss']:.4f}")
        if verdict != "rollback" and (compiled or step % t.log_every == 0 or step == t.steps):
            record = {"step": step, **metrics, "skipped_total": self.guard.bad_steps_total, **self.meter.record()}
            self.log.log(record | ({"compile_s": seconds} if compiled else {}))
            self.goodput.flush()
        return verdict

    def _score_hosts(self, step: int) -> None:
        """Every fault.straggler_every_steps: post this host's window; process 0 scores the previous one."""
        scored = self.hosts.close(step)
        if scored is None:
            return
        scores, waited, warnings = scored
        for warning in warnings:
            self.log.message(warning)
        self.goodput.stragglers(waited, scores)
        stragglers = [{k: s[k] for k in ("process", "host", "devices", "score")} for s in scores if s["straggler"]]
        self.log.log({"step": step, "host_score_max": scores[0]["score"], "straggler_hosts": stragglers})

    def settle(self, done: Dispatched, state: TrainState, step: int, data_step: int) -> tuple[TrainState, int] | None:
        """Read a dispatched step and act on the guard's verdict: after max_bad_steps bad steps in a row, roll
        back. (state, step) to continue from when it rolled back, None when the loop goes on as it was
        (without a checkpoint to go back to, the step stays, and is evaluated and saved as due)."""
        if self.observe(done) != "rollback":
            return None
        back, back_step = self.roll_back(state, step, data_step)
        return (back, back_step) if back_step != step else None

    def due(self, step: int, read: int) -> Due:
        """What happens after `step` (just dispatched; `read`: the newest step whose result is in hand): each part
        decides, every process alike; a save that waited for the guard (act) is due again."""
        stop = self.preemption.should_stop(step)
        local, durable = self.checkpointer.local_due(step), self.checkpointer.due(step, read=read)
        return Due(
            evaluate=self.eval_due(step),
            local=local or "local" in self.held,
            stop=stop,
            save=durable or step == self.run.config.train.steps or stop or "durable" in self.held,
        )

    def act(self, due: Due, state: TrainState, step: int, data_step: int, summary: dict) -> None:
        """Evaluate and save what is due after `step` (not step time), then say so if the run stops. A step the
        guard counts as bad (a skipped step, or a spike whose update was applied) is never saved: its saves wait
        for the next good step, so a rollback always finds a checkpoint from before the bad run."""
        tiers = [tier for tier, wanted in (("local", due.local), ("durable", due.save)) if wanted]
        bad = self.guard.consecutive > 0
        with self.goodput.pause(None):
            if due.evaluate:
                summary["final_eval_loss"] = self.evaluate(state.model_params, step)
            if bad and tiers:
                self.held.update(tiers)
                self.log.message(
                    f"warning: step {step} is counted as bad ({self.guard.consecutive} in a row): not "
                    "saved; the save waits for a good step"
                )
            elif tiers:
                for tier in tiers:
                    self.save(step, state, data_step, tier=tier)
                self.held.clear()
        self.injector.hang_after(step)
        if due.stop:
            saved = f"step {step} is counted as bad and not saved" if bad else f"saved step {step}"
            self.log.message(
                f"{self.preemption.signal_name or 'preemption'} received: {saved}, "
                f"stopping (exit {EXIT_PREEMPTED}); re-run the same command to continue"
            )

    def eval_due(self, step: int) -> bool:
        t = self.run.config.train
        return step == t.steps or (t.eval_every > 0 and step % t.eval_every == 0)

    def evaluate(self, params: Any, step: int) -> float:
        # Bounded like the steps it is made of (a peer that never joins an eval batch must not hang it).
        bound = self.watchdog.timeout_s * max(1, self.eval_batches)
        with self.watchdog.paused("eval", bound), self.goodput.pause("eval"):
            loss = evaluate(self.run.program, params, self.run.data.val, self.eval_batches)
        self.log.log({"step": step, "eval_loss": loss})
        return loss

    def save(self, step: int, state: TrainState, data_step: int, tier: str = "durable") -> None:
        """Save `step` to the durable tier (checkpoints/) or the local one; the blocked time is goodput's."""
        bound = self.run.config.checkpoint.timeout_s
        where = "local checkpoint" if tier == "local" else "checkpoint"
        with self.watchdog.paused(f"{where} save of step {step}", bound), self.goodput.pause("checkpoint_save"):
            data_state = {"next_step": data_step, "fingerprint": self.run.data_fingerprint}
            save = self.checkpointer.save_local if tier == "local" else self.checkpointer.save
            blocked = save(step, state.checkpointed(), data_state)
        self.goodput.tier(f"save_{tier}", blocked)

    def roll_back(self, state: TrainState, step: int, data_step: int) -> tuple[TrainState, int]:
        """After max_bad_steps bad steps in a row: back to the newest checkpoint before the first of them (a bad
        step is never saved), skipping the batches since."""
        guard, print_fn, config = self.guard, self.log.message, self.run.config
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
                return state, step
            back_step, back = found.step, found.state
            back = self.run.program.with_frozen(back, getattr(state, "frozen", None))  # the base stays as it is
        self.goodput.discard(back_step, step)
        self.held.clear()  # the bad run is gone with its held saves
        print_fn(
            f"warning: {guard.consecutive} bad steps in a row: rolled back from step {step} to {back_step}; "
            f"the data continues at batch {data_step}, skipping the {step - back_step} batches since"
        )
        guard.reset()
        return back, back_step

    def finish(self, step: int, preempted: bool) -> dict:
        """Wait for the last save; the run's throughput, MFU and goodput, also in the log."""
        summary: dict[str, Any] = {}
        if self.meter.records:
            summary["tokens_per_s"] = self.meter.median_tokens_per_s
            summary.update(self.meter.median_mfu())
        c = self.run.config.checkpoint
        with self.watchdog.paused("final save", c.timeout_s):
            self.goodput.add("checkpoint_save", self.checkpointer.finish_writes())
        if not preempted and step == self.run.config.train.steps and c.average_decay:
            # Bounded like the restores it is made of: one per averaged checkpoint.
            with (
                self.watchdog.paused("average of the decay phase", c.timeout_s * c.average_decay),
                self.goodput.pause(None),
            ):
                average_decay(self.run, self.log.message)
        local = self.checkpointer.local
        if local is not None:  # the background writes: their time and this host's bytes
            self.goodput.tier("write_local", sum(local.write_seconds), local.bytes_written, len(local.write_seconds))
        summary["goodput"] = self.goodput.summary()
        summary["skipped_steps"] = self.guard.bad_steps_total
        self.log.log({"step": step, **{f"goodput_{k}": v for k, v in summary["goodput"].items() if k != "tiers"}})
        self.goodput.finish(preempted=preempted)
        self.log.message(format_goodput(summary["goodput"]))
        if self.meter.records and (advice := self.checkpointer.advice(self.meter.median_step_s)):
            self.log.message(advice)
        return summary

    def conclude(self, state: TrainState, step: int, summary: dict, print_fn: Callable[[str], None]) -> None:
        """After the loop: a text sample of a run that trained to its end, and the report plot."""
        run, primary = self.run, jax.process_index() == 0
        run_dir = Path(run.config.run.dir)
        if run.config.train.sample_tokens and summary["exit_code"] == EXIT_OK and step > run.start.step:
            # Outside the mesh context: the prompt's length need not divide the sequence shards.
            summary["sample"] = sample_text(run.config, state.model_params, run.data.tokenizer)
            print_fn(f"sample after {run.config.train.steps} steps:\n{summary['sample']}")
        if not primary:
            return
        try:  # the run is trained and saved: a file that cannot be written now warns and stops nothing
            if "sample" in summary:
                (run_dir / "sample.txt").write_text(summary["sample"] + "\n")
            summary["report"] = str(write_report(run_dir))
        except OSError as err:
            self.log.message(f"warning: writing the sample or report into {run_dir} failed ({err.strerror or err})")


def _checkpointer(run: Run, print_fn: Callable[[str], None], injector: Injector) -> Checkpointer:
    """The run's Checkpointer: the durable tier in run.dir, the node-local one where checkpoint.local_dir is set."""
    c, run_dir, mesh = run.config.checkpoint, Path(run.config.run.dir), run.program.mesh
    local = (
        LocalTier(c.local_dir, run_dir, mesh, run.peers, c.local_keep, c.local_replicas, print_fn=print_fn)
        if c.local_dir
        else None
    )
    identity = Identity(
        meta=run.metadata(), model=run.metadata()["config"]["model"], check=run.check_meta, layout=run.layer_order
    )
    return Checkpointer(
        Tiers(run_dir, local=local),
        c,
        identity,
        peers=run.peers,
        print_fn=print_fn,
        injector=injector,
        keep_steps=tuple(decay_saves(run.config)),
    )


def average_decay(run: Run, print_fn: Callable[[str], None]) -> None:
    """checkpoint.average_decay, once the run has trained to its end and saved: the decay phase's checkpoints that
    exist averaged into run.dir/averaged (checkpoint/average.py), unless an average of those very steps is there. A
    planned checkpoint may be missing (a save the guard held for a bad step went to the next good one): the others
    are averaged, with a warning; with fewer than 2, none is, and the run still ends well. Every process."""
    config, run_dir = run.config, Path(run.config.run.dir)
    if not config.checkpoint.average_decay:
        return
    out = run_dir / "averaged"
    # Process 0's reading of the directories, for every process: on a shared filesystem two processes may see
    # them at different moments, and one deciding alone to skip would leave the others waiting in the average.
    steps = run.peers.broadcast("average decay: steps", _decay_steps_to_average(config, run_dir, out, print_fn))
    if not steps:
        return
    if jax.process_index() == 0 and out.exists():  # an earlier average: unfinished, or of other steps
        shutil.rmtree(out)
    run.peers.barrier("average decay")
    average_decay_phase(run_dir, steps, list(run.program.mesh.devices.flat), print_fn)


def _decay_steps_to_average(config: Config, run_dir: Path, out: Path, print_fn: Callable[[str], None]) -> list[int]:
    """The decay phase's checkpoints to average into `out`, or [] where there are fewer than 2 or `out` already
    holds their average."""
    planned = decay_saves(config)
    begin = config.train.steps - config.train.resolved_decay_steps
    steps = [s for s in step_directories(run_dir / "checkpoints") if begin < s <= config.train.steps]
    if steps != planned:
        print_fn(
            f"warning: checkpoint.average_decay planned steps {planned}; the decay phase's checkpoints are {steps}"
            + ("" if len(steps) >= 2 else ": fewer than 2, nothing averaged")
        )
    done = read_meta(out / "checkpoints" / "0")
    if len(steps) < 2 or (done is not None and done.get("averaged_steps") == steps):
        return []
    return steps
