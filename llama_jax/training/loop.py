"""`train(config)`: what `llama-jax train` and `api.train` both run, and the training loop.

    train(config)   join a multi-process run, build the mesh, open the data, check the rest of the
                    input (Run.setup: nothing in run.dir is written before it passes), run the loop
    execute(run)    restore -> for each step: dispatch it, load and place the next batch, observe the step
                    before -> maybe observe this one and evaluate / save / stop -> finish

The host runs one step ahead of the devices: step n's metrics are read only after step n + 1 has been
dispatched, and that read is the loop's only device-to-host transfer, so the devices never wait for the
host between steps. A step that is evaluated or saved is observed first (its guard verdict may roll back).

The loop's parts decide for themselves: the checkpointer when a save is due (checkpoint/checkpointer.py), the
throughput meter its window (metrics.py), goodput its step clock (goodput.py), the guards what a step's
loss means and when to roll back (resilience/).
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import numpy as np
from jax.sharding import Mesh

from llama_jax import __version__
from llama_jax.checkpoint import specs
from llama_jax.distributed import processes, sharding
from llama_jax.model import peft, remat
from llama_jax.resilience import preflight
from llama_jax import config as config_lib
from llama_jax.checkpoint.checkpointer import Checkpointer
from llama_jax.checkpoint.durable import check_model, latest_checkpoint_step, read_meta, restore_step
from llama_jax.checkpoint.local import LocalTier, finished_steps, process_directory, read_manifest
from llama_jax.config import Config
from llama_jax.distributed.peers import Peers, primary_first
from llama_jax.resilience.stragglers import HostWindow
from llama_jax.data.streams import TrainData, open_data
from llama_jax.errors import ConfigError, EXIT_OK, EXIT_PREEMPTED, InputError
from llama_jax.files import cache_root
from llama_jax.inference.generate import sample_text
from llama_jax.resilience.goodput import Goodput, format_goodput
from llama_jax.perf.hardware import device_peak_flops
from llama_jax.training.metrics import MetricsLog, ThroughputMeter, WandbSettings, check_wandb
from llama_jax.model.llama import param_count
from llama_jax.training.plan import format_plan, make_plan
from llama_jax.training.report import write_report
from llama_jax.resilience.guards import SpikeGuard
from llama_jax.resilience.preemption import PreemptionGuard
from llama_jax.resilience.stragglers import HostScores, StragglerDetector
from llama_jax.resilience.watchdog import HangWatchdog
from llama_jax.training.step import TrainProgram, TrainState, model_flops_per_token
from llama_jax.checkpoint.specs import ModelSpec


@dataclass
class Run:
    """Everything a training run needs, built and checked before anything in run.dir is written."""

    config: Config
    program: TrainProgram
    data: TrainData
    start: int  # the newest checkpoint step in run.dir (0: none)
    peers: Peers  # the other processes, for every decision outside the jitted step
    source: ModelSpec | None = None  # checkpoint.resume_from / init_from, for a new run.dir (peft: the base)
    compile_seconds: float = 0.0  # compiling the train step ahead of time, to check its memory
    base: Any = None  # a peft run: the base model's params, loaded and checked by setup (frozen in the state)
    base_reference: dict | None = None  # ... and what checkpoints record of it (peft.base_reference)

    @classmethod
    def setup(cls, config: Config, mesh: Mesh, data: TrainData, peers: Peers | None = None) -> Run:
        """Raises ConfigError or DataError (one line each) on bad input; writes nothing. `peers` defaults to
        every process, with config's barrier timeout."""
        peers = peers or Peers(config.fault.barrier_timeout_s)
        run_dir, model = Path(config.run.dir), dataclasses.asdict(config.model)
        start, source, allowed = latest_checkpoint_step(run_dir), None, config.checkpoint.allow_model_changes
        check_wandb(config.run)
        meta = read_meta(run_dir / "checkpoints" / str(start)) if start else None
        if config.checkpoint.local_dir:  # the local tier may hold newer steps (each process sees its own)
            local = process_directory(config.checkpoint.local_dir, run_dir, peers.index)
            local_start = peers.reduce("newest local step", max(finished_steps(local), default=0), max)
            if local_start > start:
                start, meta = local_start, (read_manifest(local / str(local_start)) or {}).get("meta")
        if meta is not None:  # an unreadable one is set aside at restore time
            check_model(meta["config"]["model"], model, run_dir, allowed)
            peft.check_adapters(meta["config"].get("peft", {}), config.peft, run_dir)
        if config.peft.method != "none":  # the base model, also when resuming: checkpoints hold adapters only
            source = specs.resolve(config.checkpoint.init_from)
            check_model(dataclasses.asdict(source.model), model, source.text, allowed)
            if source.adapters is not None and source.adapters.virtual_tokens:
                raise ConfigError(f"{source.text} is a prompt-tuned run, not a model to adapt; set "
                                  f"checkpoint.init_from to its base, {source.base['spec']}")
        elif not start and (config.checkpoint.resume_from or config.checkpoint.init_from):
            source = specs.resolve(config.checkpoint.resume_from or config.checkpoint.init_from)
            if config.checkpoint.resume_from and source.params_only:
                raise ConfigError(f"{source.text} holds parameters only (no optimizer state or data position) and "
                                  "cannot be resumed; start from it with checkpoint.init_from")
            check_model(dataclasses.asdict(source.model), model, source.text, allowed)
        enable_compilation_cache(config)
        compiling = time.perf_counter()
        program = TrainProgram.build(config, mesh)  # train.microbatches=auto: the fewest that fit
        run = cls(program.config, program, data, start, peers, source)
        if config.peft.method != "none":  # the base, loaded into its shards and checked before compiling
            run.base = specs.load_params(source, target=program.abstract_state().frozen)
            run.base_reference = peft.base_reference(source.text, source.location, run.base)
            run.check_meta(meta)
        program.check_fits()  # the step compiled now, its memory against run.device_memory_gb
        run.compile_seconds = time.perf_counter() - compiling
        return run

    def check_meta(self, meta: dict | None) -> None:
        """A checkpoint's meta must describe this run's adapters and base (ConfigError, one line)."""
        if meta is None:
            return
        where = Path(self.config.run.dir)
        peft.check_adapters(meta.get("config", {}).get("peft", {}), self.config.peft, where)
        if self.base_reference is not None:
            peft.check_base(meta.get("base"), self.base_reference, where)


def train(config: Config, print_fn: Callable[[str], None] = print, *, devices=None,
          started_at: float | None = None) -> dict:
    """Check the input, then train `config`, resuming from run.dir's newest checkpoint; returns the summary.

    Joins a multi-process run first when run.* keys or the environment describe one; then process 0
    speaks through print_fn and the others print only their warnings. Raises ConfigError or DataError
    (one line) on bad input before anything in run.dir is written, and CoordinatorUnavailable when the
    coordinator does not answer. `devices` (default: all) is for tests on part of the devices.
    """
    started_at = started_at or time.time()  # goodput counts the start-up as restart overhead
    processes.initialize(config.run)  # before anything touches the devices
    primary = jax.process_index() == 0
    say = print_fn if primary else _warnings_only(print_fn)
    if primary:
        print_fn(config_lib.summary(config))
    f = config.fault
    peers = Peers(f.barrier_timeout_s, stall_at=f.inject_stall_at if f.inject_process == jax.process_index() else "")
    mesh = sharding.make_mesh(config, devices=devices)
    # Process 0 prepares raw sources into the cache first, so processes sharing it never race.
    data = primary_first(lambda: open_data(config, log=say), (InputError,), peers)
    if f.preflight:  # a slow or faulty device is named before the step compiles or a checkpoint restores (exit 71)
        report = preflight.check(config, mesh, peers)
        say(preflight.summary(report))
        preflight.enforce(report, Path(config.run.dir), create=True, peers=peers)  # a starting run: may make run.dir
    run = Run.setup(config, mesh, data, peers)
    if config.train.microbatches == "auto":
        say(f"train.microbatches=auto: {run.config.train.microbatches}, the fewest whose step fits run.device_memory_gb")
    return execute(run, say, started_at)


def _warnings_only(print_fn: Callable[[str], None]) -> Callable[[str], None]:
    """The voice of processes other than 0: their warnings (a straggler, a skipped step) still matter."""
    process = jax.process_index()

    def say(line: str) -> None:
        if line.startswith("warning"):
            print_fn(f"[process {process}] {line}")
            sys.stdout.flush()  # several processes share a terminal or a log file

    return say


def execute(run: Run, print_fn: Callable[[str], None] = print, started_at: float | None = None) -> dict:
    """The training loop. Returns a summary: eval losses, throughput, MFU, goodput and the exit code
    (0, or EXIT_PREEMPTED after a SIGTERM/SIGINT made it save and stop)."""
    config, program, t, run_dir = run.config, run.program, run.config.train, Path(run.config.run.dir)
    wall_start = time.perf_counter()
    summary: dict[str, Any] = {"run_dir": str(run_dir), "exit_code": EXIT_OK}
    if run.start and run.start >= t.steps:
        print_fn(f"{run_dir} is already trained to step {run.start}; raise train.steps to continue")
        return summary
    loop = Loop.open(run, print_fn, started_at or time.time())
    loop.goodput.add("compile", run.compile_seconds)  # Run.setup compiled the step to check its memory
    try:
        with loop.watchdog, loop.preemption, program.activate(), loop.log:
            state, data_step = loop.restore()
            step = int(state.step)
            loop.goodput.begin(step)
            with loop.goodput.pause(None):  # not part of the first step's time
                if step == 0:
                    summary["initial_eval_loss"] = loop.evaluate(state.model_params, step)
                batches = run.data.train.iterate(data_step, data_step + 10**12, program.local_rows(),
                                                 config.data.loader_threads, config.data.prefetch)
            first_step, batch, unread = step + 1, None, None
            while step < t.steps:
                if batch is None:
                    batch = loop.next_batch(batches, data_step)
                state, metrics = loop.dispatch(state, batch)  # returns before the step runs
                step, data_step, batch = step + 1, data_step + 1, None
                current = Dispatched(step, metrics, step == first_step)
                if step < t.steps:  # the next batch is loaded and placed on the devices while this step runs
                    batch = loop.next_batch(batches, data_step)
                # The previous step's metrics: reading them waits for that step only, the one just
                # dispatched is already queued behind it, so the devices never wait for the host.
                if unread is not None and loop.observe(unread) == "rollback":
                    state, back_step = loop.roll_back(state, step, data_step)  # this step's state goes too
                    if back_step != step:
                        step, unread = back_step, None
                        continue
                if unread is not None:
                    loop.hang_if_injected(unread.step)
                unread = current
                stop = loop.preemption.should_stop(step)
                save = loop.checkpointer.due(step) or step == t.steps or stop
                local = loop.checkpointer.local_due(step)
                if not (save or local or stop or loop.eval_due(step)):
                    continue
                # This step's state is evaluated or saved: its verdict first (the next step would donate it).
                unread = None
                if loop.observe(current) == "rollback":
                    state, back_step = loop.roll_back(state, step, data_step)
                    if back_step != step:
                        step = back_step
                        continue
                    # Without a checkpoint to go back to the step stays, and is evaluated and saved as due.
                with loop.goodput.pause(None):  # evaluation and saves are not step time
                    if loop.eval_due(step):
                        summary["final_eval_loss"] = loop.evaluate(state.model_params, step)
                    if local:
                        loop.save(step, state, data_step, tier="local")
                    if save:
                        loop.save(step, state, data_step)
                loop.hang_if_injected(step)
                if stop:
                    loop.log.message(f"{loop.preemption.signal_name or 'preemption'} received: saved step {step}, "
                                     f"stopping (exit {EXIT_PREEMPTED}); re-run the same command to continue")
                    summary["exit_code"] = EXIT_PREEMPTED
                    break
            summary.update(loop.finish(step, preempted=summary["exit_code"] == EXIT_PREEMPTED))
    finally:
        loop.checkpointer.close()  # also on errors: a pending asynchronous save is finished, not lost
    primary = jax.process_index() == 0
    if t.sample_tokens and summary["exit_code"] == EXIT_OK and step > run.start:
        # Outside the mesh context: the prompt's length need not divide the sequence shards.
        summary["sample"] = sample_text(config, state.model_params, run.data.tokenizer)
        print_fn(f"sample after {t.steps} steps:\n{summary['sample']}")
        if primary:
            (run_dir / "sample.txt").write_text(summary["sample"] + "\n")
    if primary:
        summary["report"] = str(write_report(run_dir))
    summary["wall_time_s"] = time.perf_counter() - wall_start
    return summary


@dataclass(frozen=True)
class Dispatched:
    """A step handed to the devices whose metrics the host has not read yet."""

    step: int
    metrics: dict  # device arrays: reading them waits for the step
    first: bool  # the first step of this process: its time is compilation's


@dataclass
class Loop:
    """The parts of the loop that watch, account and decide, around one run."""

    run: Run
    log: MetricsLog  # also the voice of the loop: log.message prints without breaking the progress bar
    checkpointer: Checkpointer
    goodput: Goodput
    meter: ThroughputMeter
    guard: SpikeGuard
    stragglers: StragglerDetector
    hosts: HostWindow
    watchdog: HangWatchdog
    preemption: PreemptionGuard
    eval_batches: int
    dispatch_wait_s: float = 0.0  # seconds spent in dispatches since the last observe()
    # Seconds waiting for the loader since the last observe(): charged to the step read next, whose time
    # they fall in (an upper bound of the devices' wait: they may have been busy with the step before).
    data_wait_s: float = 0.0

    @classmethod
    def open(cls, run: Run, print_fn: Callable[[str], None], started_at: float) -> Loop:
        """Write the run's config and tokenizer and start every part (Run.setup has checked the input)."""
        config, mesh = run.config, run.program.mesh
        t, f, run_dir = config.train, config.fault, Path(config.run.dir)
        multi, primary = jax.process_count() > 1, jax.process_index() == 0
        run_dir.mkdir(parents=True, exist_ok=True)
        if primary:
            (run_dir / "config.yaml").write_text(config_lib.to_yaml(config))
            run.data.tokenizer.save(run_dir)  # `llama-jax generate` and `eval` find the run's tokenizer here
        peak, peak_source = device_peak_flops(config.model.compute_dtype, cache_root(config.data.cache_dir))
        print_fn(f"{param_count(config.model) / 1e6:.2f}M parameters on {mesh.devices.size} "
                 f"{jax.local_devices()[0].platform} device(s), mesh {dict(mesh.shape)}; peak {peak / 1e9:.1f} GFLOP/s "
                 f"per device ({peak_source})")
        print_fn(remat.describe(config.remat))
        host = socket.gethostname() + (f"-p{jax.process_index()}" if multi else "")
        log = MetricsLog(run_dir, total_steps=t.steps, start_step=run.start, tensorboard=config.run.tensorboard,
                         print_fn=print_fn, enabled=primary, wandb=WandbSettings.from_config(config))
        injected = f.inject_process == jax.process_index()
        try:
            meta = run_metadata(config, mesh) | ({"base": run.base_reference} if run.base_reference else {})
            c = config.checkpoint
            local = LocalTier(c.local_dir, run_dir, mesh, run.peers, c.local_keep, c.local_replicas,
                              log=log.message) if c.local_dir else None
            checkpointer = Checkpointer(run_dir, c, meta=meta, log=log.message,
                                        peers=run.peers, save_delay_s=f.inject_save_delay_s if injected else 0.0,
                                        layout=layer_order(config, mesh), local=local)
            return cls(
                run=run, log=log, checkpointer=checkpointer, goodput=Goodput(run_dir, started_at, write=primary),
                meter=ThroughputMeter(t.batch_size * t.seq_len, model_flops_per_token(config), peak,
                                      mesh.devices.size),
                guard=SpikeGuard(f.max_bad_steps, f.spike_zscore, f.spike_window),
                stragglers=StragglerDetector(f.straggler_factor),
                hosts=HostWindow(run.peers, HostScores(f.straggler_host_threshold), f.straggler_every_steps, host,
                                 sorted(d.id for d in mesh.devices.flat if d.process_index == jax.process_index())),
                watchdog=HangWatchdog(run_dir, host, factor=f.hang_factor, min_timeout_s=f.hang_min_timeout_s,
                                      startup_timeout_s=f.hang_startup_timeout_s,
                                      describe=lambda: format_plan(make_plan(config, mesh))),
                preemption=PreemptionGuard(checkpointer.manager.reached_preemption if multi else None),
                eval_batches=min(t.eval_batches, run.data.val.batches_per_epoch()))
        except BaseException:
            log.close()  # the loop never started: nothing else will close it
            raise

    def restore(self) -> tuple[TrainState, int]:
        """(state, data position): run.dir's newest good checkpoint, else resume_from or init_from, else new."""
        run, start = self.run, time.perf_counter()
        run.peers.barrier("restore")  # a process that never gets here is named, instead of a silent wait in Orbax
        with self.watchdog.paused("restore", run.config.checkpoint.timeout_s):
            state, data_step = self._restored(run.program.abstract_checkpoint())
        for tier, seconds in self.checkpointer.restore_seconds.items():
            self.goodput.tier(f"restore_{tier}", seconds)
        if self.checkpointer.restored_from:
            self.goodput.restored(self.checkpointer.restored_from, self.checkpointer.restored_copies)
        if state is None:
            return run.program.init_state(jax.random.key(run.config.seed)), 0
        self.goodput.add("checkpoint_restore", time.perf_counter() - start)
        return state, data_step

    def _restored(self, abstract: TrainState) -> tuple[TrainState | None, int]:
        run, say = self.run, self.log.message
        if run.start:
            found = self.checkpointer.restore_newest(abstract, dataclasses.asdict(run.config.model), say,
                                                     run.config.checkpoint.allow_model_changes, run.check_meta)
            if found:
                step, state, data_state = found
                state = run.program.with_frozen(state, run.base)
                where = self.checkpointer.local.directory if self.checkpointer.restored_from == "local" else \
                    self.checkpointer.directory
                say(f"resumed from {where / str(step)}")
                if data_state.get("fingerprint") != run.data.fingerprint:
                    say(f"warning: the data settings or sources changed since step {step} was saved; "
                        "the batches from here on differ from the original run's")
                return state, int(data_state["next_step"])
            say("warning: no checkpoint in run.dir restores; starting from scratch")
        if run.source is not None and run.config.checkpoint.resume_from:
            state, data_state = restore_step(run.source.step_dir, abstract, self.checkpointer.layout)
            say(f"resumed from {run.source.text}")
            return state, int(data_state["next_step"])
        if run.base is not None:
            say(f"adapting {run.source.text} (peft.method={run.config.peft.method}); its params stay frozen")
            return run.program.fresh_state(jax.random.key(run.config.seed), frozen=run.base), 0
        if run.source is not None:
            params = specs.load_params(run.source, target=abstract.params, layout=self.checkpointer.layout)
            say(f"initialised the params from {run.source.text}")
            return run.program.init_state(jax.random.key(run.config.seed)).replace(params=params), 0
        return None, 0

    def next_batch(self, batches: Iterator[dict], data_step: int) -> dict:
        """The next batch, placed on the devices, with fault.* injections applied (data_wait_s: the wait)."""
        fault = self.run.config.fault
        if fault.inject_process == jax.process_index():
            time.sleep(fault.inject_step_delay_s)
        start = time.perf_counter()
        batch = next(batches)
        self.data_wait_s += time.perf_counter() - start
        if data_step in fault.inject_nan_steps:
            batch["loss_mask"] = np.full_like(batch["loss_mask"], np.nan)
        return self.run.program.put(batch)  # the transfer starts now, the step need not wait for it

    def dispatch(self, state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        """Hand a step to the devices. The call returns at once unless the devices are still busy with
        earlier work (a full queue; on CPU a cross-process step runs inside the call): that wait is the
        devices', so observe() does not count it as the host's time."""
        start = time.perf_counter()
        result = self.run.program.train_step(state, batch)
        self.dispatch_wait_s += time.perf_counter() - start
        return result

    def hang_if_injected(self, step: int) -> None:
        """fault.inject_hang_step: once step n is read (and saved, when due), the step after it never returns."""
        if step == self.run.config.fault.inject_hang_step:
            _injected_hang()

    def observe(self, done: Dispatched) -> str:
        """Read a dispatched step's metrics (waiting for it), account for it and log it when due; the guard's
        verdict: ok, skipped, spike or rollback. The only device-to-host transfer of a step."""
        t, say, step, compiled = self.run.config.train, self.log.message, done.step, done.first
        reading = time.perf_counter()
        metrics = {k: float(v) for k, v in jax.device_get(done.metrics).items()}
        # Waiting for the devices, here and in dispatches since the last read; the rest was the host's own work.
        blocked, self.dispatch_wait_s = time.perf_counter() - reading + self.dispatch_wait_s, 0.0
        waited, self.data_wait_s = self.data_wait_s, 0.0
        seconds = self.goodput.time_step(step, waited, compiled)
        self.watchdog.step_done(step, None if compiled else seconds)  # compilation says nothing about step time
        if not compiled:
            self.meter.add(seconds, waited)
            if warning := self.stragglers.observe(step, seconds, process=jax.process_index()):
                say(warning)
            self.hosts.add(seconds, max(0.0, seconds - blocked))
            if step % self.hosts.every == 0:
                self._score_hosts(step)
        verdict = self.guard.observe(step, metrics["loss"], bool(metrics.pop("finite")))
        if verdict == "skipped":
            say(f"warning: step {step} skipped: non-finite loss or gradient norm")
        elif verdict == "spike":
            say(f"warning: step {step} loss spike: {metrics['loss']:.4f}")
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

    def eval_due(self, step: int) -> bool:
        t = self.run.config.train
        return step == t.steps or (t.eval_every > 0 and step % t.eval_every == 0)

    def evaluate(self, params: Any, step: int) -> float:
        # Bounded like the steps it is made of (a peer that never joins an eval batch must not hang it).
        bound = self.watchdog.timeout_s * max(1, self.eval_batches)
        with self.watchdog.paused("eval", bound), self.goodput.pause("eval"):
            loss = self.run.program.evaluate(params, self.run.data.val, self.eval_batches)
        self.log.log({"step": step, "eval_loss": loss})
        return loss

    def save(self, step: int, state: TrainState, data_step: int, tier: str = "durable") -> None:
        """Save `step` to the durable tier (checkpoints/) or the local one; the blocked time is goodput's."""
        bound = self.run.config.checkpoint.timeout_s
        where = "local checkpoint" if tier == "local" else "checkpoint"
        with self.watchdog.paused(f"{where} save of step {step}", bound), self.goodput.pause("checkpoint_save"):
            data_state = {"next_step": data_step, "fingerprint": self.run.data.fingerprint}
            save = self.checkpointer.save_local if tier == "local" else self.checkpointer.save
            blocked = save(step, state.checkpointed(), data_state, step_s=self.meter.median_step_s)
        self.goodput.tier(f"save_{tier}", blocked)

    def roll_back(self, state: TrainState, step: int, data_step: int) -> tuple[TrainState, int]:
        """After max_bad_steps bad steps in a row: back to the newest checkpoint, skipping the batches since."""
        guard, say, config = self.guard, self.log.message, self.run.config
        with self.watchdog.paused("rollback", config.checkpoint.timeout_s), self.goodput.pause(None):
            self.checkpointer.wait()
            # As at start-up: the newest step that restores on every process, one decision for all.
            found = self.checkpointer.restore_newest(self.run.program.abstract_checkpoint(),
                                                     dataclasses.asdict(config.model), say,
                                                     config.checkpoint.allow_model_changes, self.run.check_meta)
            if found is None:
                say(f"warning: {guard.consecutive} bad steps in a row at step {step} and no checkpoint to roll "
                    "back to")
                guard.reset()
                return state, step
            back_step, back, _ = found
            back = self.run.program.with_frozen(back, getattr(state, "frozen", None))  # the base stays as it is
        self.goodput.discard(back_step, step)
        say(f"warning: {guard.consecutive} bad steps in a row: rolled back from step {step} to {back_step}; "
            f"the data continues at batch {data_step}, skipping the {step - back_step} batches since")
        guard.reset()
        return back, back_step

    def finish(self, step: int, preempted: bool) -> dict:
        """Wait for the last save; the run's throughput, MFU and goodput, also in the log."""
        summary: dict[str, Any] = {}
        if self.meter.throughputs:
            summary["tokens_per_s"] = self.meter.median_tokens_per_s
            summary["mfu"] = self.meter.mfu(summary["tokens_per_s"])
        with self.watchdog.paused("final save", self.run.config.checkpoint.timeout_s):
            self.goodput.add("checkpoint_save", self.checkpointer.wait())
        local = self.checkpointer.local
        if local is not None:  # the background writes: their time and this host's bytes
            self.goodput.tier("write_local", sum(local.write_seconds), local.bytes_written, len(local.write_seconds))
        summary["goodput"] = self.goodput.summary()
        summary["skipped_steps"] = self.guard.bad_steps_total
        self.log.log({"step": step, **{f"goodput_{k}": v for k, v in summary["goodput"].items() if k != "tiers"}})
        self.goodput.finish(preempted=preempted)
        self.log.message(format_goodput(summary["goodput"]))
        if self.checkpointer.save_seconds and self.meter.throughputs:
            self.log.message(self.checkpointer.advice(self.meter.median_step_s))
        return summary


def enable_compilation_cache(config: Config) -> None:
    """JAX's persistent compilation cache: a restarted run loads its compiled steps instead of compiling."""
    setting = config.run.compilation_cache
    if setting == "off":
        return
    directory = Path(setting).expanduser() if setting else cache_root(config.data.cache_dir) / "jax_compilation_cache"
    jax.config.update("jax_compilation_cache_dir", str(directory))


def layer_order(config: Config, mesh: Mesh) -> tuple[int, int]:
    """(stages, repeats): the order of the layers in this run's state (pipeline.py)."""
    return mesh.shape["pipeline"], config.mesh.pipeline_repeats


def run_metadata(config: Config, mesh: Mesh) -> dict:
    return {"config": config_lib.to_dict(config), "llama_jax": __version__, "jax": jax.__version__,
            "mesh": dict(mesh.shape), "processes": jax.process_count(), "devices": mesh.devices.size}


def _injected_hang() -> None:
    """fault.inject_hang_step: stand-in for a collective that never returns (after step n has been read)."""
    while True:
        time.sleep(3600)


def load_checkpoint(config: Config, step: int, devices=None) -> tuple[TrainState, dict]:
    """(train state, loader state) saved at `step` in config.run.dir, restored onto `devices` (default:
    all) in config's mesh: to inspect a run's parameters or compare two runs (a peft run's: its adapters)."""
    program = TrainProgram.for_config(config, devices)
    checkpointer = Checkpointer(Path(config.run.dir), config.checkpoint, layout=layer_order(config, program.mesh))
    try:
        with program.activate():
            return checkpointer.restore(step, program.abstract_checkpoint())
    finally:
        checkpointer.close()
