"""The Checkpointer of a run: when a save is due, saving to the durable tier (Orbax, asynchronous) and the
node-local one (local.py), and restoring the newest step that every process can read from the fastest tier
holding it whole.

Saves are asynchronous: the device arrays are copied to host and written by a background thread while
training continues. All processes call save and restore (each writes and reads its own shards).

The checkpointer decides when a save is due: every `checkpoint.every_steps`, every
`checkpoint.every_minutes` (process 0's clock decides for all processes), or, with
`checkpoint.every_steps=auto`, at the Young/Daly interval (interval.py).

Restoring walks from the newest step down: a step that fails to restore on any process (a truncated
or missing array file, a missing manifest, an empty directory) is moved to ``checkpoints/corrupt/`` by
every process together -- never deleted -- with a warning, and the next older step is tried. A step
whose model differs from the config (shapes, or the function: RoPE, norm epsilon) is not corruption:
it stops the run with a message naming the fields, unless checkpoint.allow_model_changes lists them.

Storage failures. A durable write that fails surfaces when the checkpointer next waits for it: before the next
save, or at the end of the run. Every process brings its outcome to the agreement that precedes each save, so all
see the same failures, and failed_saves.py handles them alike everywhere (a warning and the next interval, or, in
the end, exit 74). A failure that is not the storage's is a bug and is raised as it is.
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as preservation

from llama_jax.checkpoint.durable import ITEMS, check_model, read_meta, read_step, saved_layer_order
from llama_jax.checkpoint.failed_saves import FailedSaves
from llama_jax.checkpoint.interval import DEFAULT_MTBF_S, Figures, Interval
from llama_jax.checkpoint.local import LocalTier
from llama_jax.checkpoint.relayout import covered_steps, restore_moved
from llama_jax.checkpoint.storage_failures import check_room, failure_record
from llama_jax.config import CheckpointConfig
from llama_jax.distributed.peers import Peers
from llama_jax.errors import ConfigError
from llama_jax.model.stages import NATURAL, LayerOrder
from llama_jax.resilience.goodput import observed_mtbf_s
from llama_jax.resilience.inject import NO_INJECTION, Injector

STEP_WINDOW = 50  # the latest step times an automatic interval takes the median of


@dataclass(frozen=True)
class Restored:
    """What a restore found (Checkpointer.restore_newest; checkpoint/start.py's `restore` too): a checkpointed
    state to continue with its loader state, or params to start a new state from (init_from), or neither (a new
    model, a peft run's base with new adapters, or no step that restores). Returned, not kept on the Checkpointer:
    each restore says what it found and what it cost."""

    state: Any = None
    data: dict = dataclasses.field(default_factory=dict)  # the loader state: next_step, fingerprint
    params: Any = None
    step: int = 0  # the step `state` was saved at (0: no step restored)
    tier: str = ""  # the tier that served it: "local" or "durable" ("" for none, or another run's step)
    copies: str = ""  # with the local tier: whose copies served ("own copies", or a partner's too)
    path: str = ""  # where it was read: a step directory, or a host's process directories
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # per tier: spent restoring, or trying to

    @property
    def data_step(self) -> int:
        return int(self.data.get("next_step", 0))


@dataclass(frozen=True)
class Tiers:
    """Where a run's checkpoints are: the durable tier (checkpoints/ in the run's directory unless `directory`) and
    the node-local one (local.py), if the run has it."""

    run_dir: Path  # the run's directory: also where the failures an automatic interval's MTBF counts are read
    directory: Path | None = None  # the durable tier's directory, if not run_dir/checkpoints
    local: LocalTier | None = None


@dataclass(frozen=True)
class Identity:
    """What the run's steps are saved with and must hold to be restored: `meta` (the run's config, versions and
    mesh: training/run.py's run_metadata) goes into every step; `model` (the run's model config as a dict) and
    `check` (start.meta_check: a peft run's adapters and base) are what every step restore_newest considers must
    hold, config.allow_model_changes letting function fields differ; `layout` is the run's pipeline layer order,
    which restored layers are put in. The defaults hold for any step (a tool reading a step it names)."""

    meta: dict = dataclasses.field(default_factory=dict)
    model: dict | None = None
    check: Callable[[dict | None], None] | None = None
    layout: LayerOrder = NATURAL


class Checkpointer:
    """The checkpoints of one run. Every decision all processes must share is made once, through `peers`
    (Peers, bounded waits): when to save, the auto interval, which steps exist, and whether
    a step restores (a step that fails on any one process is set aside by all)."""

    def __init__(
        self,
        tiers: Tiers,
        config: CheckpointConfig,
        identity: Identity | None = None,
        peers: Peers | None = None,
        print_fn: Callable[[str], None] = print,
        injector: Injector = NO_INJECTION,
        keep_steps: tuple[int, ...] = (),
    ):
        """`tiers`: where the checkpoints are; `identity`: what steps are saved with and must hold (Identity; by
        default any step); `peers`: the other processes, every shared decision goes through them; `injector`
        (resilience/inject.py, testing only) may delay this process's saves or fail its writes; `keep_steps`: steps
        saved when reached and never deleted (checkpoint.average_decay's)."""
        self.keep_steps = tuple(keep_steps)
        identity = identity or Identity()
        run_dir = Path(tiers.run_dir)
        self.config, self.meta, self.print_fn, self.local = config, identity.meta, print_fn, tiers.local
        self.model, self.check = identity.model, identity.check or (lambda meta: None)
        self.layout = identity.layout  # the pipeline layout of this run: restored layers are put in its order
        self.peers = peers or Peers(timeout_s=600.0)
        self.directory = Path(tiers.directory or run_dir / "checkpoints").absolute()
        # MTBF for the Young/Daly interval: configured, else observed in this run (read before this
        # attempt is recorded), else a big run's figure.
        self.mtbf_s = config.mtbf_setting_s or observed_mtbf_s(run_dir) or DEFAULT_MTBF_S
        self.durable = Interval.of("checkpoint.every_steps", config.every_steps, self.mtbf_s)
        self.local_interval = Interval.of("checkpoint.local_every_steps", config.local_every_steps, self.mtbf_s)
        self.step_times: deque[float] = deque(maxlen=STEP_WINDOW)  # the latest timed steps (step_timed)
        self.timed_steps = 0  # steps timed since the compile: an automatic interval's first save waits for some
        self.last_save_time = time.monotonic()
        self.announced_save: int | None = None  # process 0: the step of the save it announced last
        self.pending: int | None = None  # the step whose durable write runs in the background
        self.failure: dict | None = None  # this process's failed durable write, not yet agreed on
        self.injector = injector  # testing only: injected save delays and failures
        self.manager = self._open()
        self.failed_saves = FailedSaves(self.directory, self.manager, self.peers, config, self.local, print_fn)

    def _open(self) -> ocp.CheckpointManager:
        if self.keep_steps:  # the newest `keep`, every keep_every-th, and keep_steps, each kept by its own rule
            kept = [preservation.LatestN(self.config.keep), preservation.CustomSteps(list(self.keep_steps))]
            if self.config.keep_every:
                kept.append(preservation.EveryNSteps(self.config.keep_every))
            retention = dict(preservation_policy=preservation.AnyPreservationPolicy(kept))
        else:
            retention = dict(max_to_keep=self.config.keep, keep_period=self.config.keep_every or None)
        options = ocp.CheckpointManagerOptions(
            **retention, enable_async_checkpointing=self.config.async_save, create=True
        )
        return ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def step_timed(self, seconds: float) -> None:
        """A step's time (not the compile's): what automatic intervals are worked out from."""
        self.step_times.append(seconds)
        self.timed_steps += 1

    def due(self, step: int, *, read: int) -> bool:
        """Whether `step` (just dispatched) is saved: its step interval or its time interval. Every process calls
        it after every step, with `read`, the newest step whose result it has in hand; with a time interval
        process 0's clock decides (see _time_due)."""
        time_due = self._time_due(step, read)  # asked on every step: process 0 announces ahead
        return time_due or self.durable.due(step, self.timed_steps) or step in self.keep_steps

    def _time_due(self, step: int, read: int) -> bool:
        """checkpoint.every_minutes, decided by process 0's clock ahead of the steps it decides for: after
        dispatching `step`, with step `read`'s result in hand (the host runs step - read steps ahead of the
        devices), it announces a save at step + 1 + (step - read). Every process asks about that step once it has
        dispatched it and read the result of the step as far behind it, step + 1, which cannot finish anywhere
        before process 0 has dispatched it, that is after the announcement. So no process waits. (training/loop.py
        runs one step ahead: the save is announced two steps ahead.)"""
        minutes = self.config.every_minutes
        if minutes <= 0:
            return False
        due = self.peers.announced("save", step)
        pending = self.announced_save is not None and step < self.announced_save
        if self.peers.index == 0 and time.monotonic() - self.last_save_time >= minutes * 60 and not (due or pending):
            ahead = step + 1 + (step - read)
            self.peers.announce("save", ahead)
            self.announced_save = ahead
        return due

    def save(self, step: int, state: Any, data_state: dict) -> float:
        """Start an asynchronous save; returns the seconds it blocked (copying arrays off the device, or waiting
        for the previous write): the save's cost, for every_steps=auto and the advice (interval.py). A previous
        write that failed on any process is known to every process here (storage failures, in this module's
        docstring); the bound on failures in a row stops the run (StorageFailure, exit 74)."""
        start = time.perf_counter()
        failed = self._written()
        # Every process meets here with its figures and its last write's outcome: a process that never comes is
        # named here, not in Orbax, and a write that failed anywhere is known everywhere.
        self._settle(self.durable, f"save of step {step}", failed)
        time.sleep(self.injector.save_delay_s)
        meta = {**self.meta, "step": step, "saved_at": datetime.datetime.now(datetime.UTC).isoformat()}
        try:
            check_room(state, self.directory)
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)
                ),
                force=True,
            )
            self.pending = step
        except Exception as err:  # the save could not even start: reported with the next save's outcome
            self.failure = self._failure(step, err)
        self.last_save_time = time.monotonic()
        return self._measured(self.durable, time.perf_counter() - start, self._write_seconds)

    def _write_seconds(self) -> float:
        """An automatic interval's first save: the seconds its write took (it is waited for here); a failed write
        is kept for the next agreement."""
        start = time.perf_counter()
        self.failure = self._written()
        return time.perf_counter() - start

    def _written(self) -> dict | None:
        """Wait for this process's pending durable write: what failed, if anything ({step, process, reason}); a
        save that could not start comes first. A failure that is not the storage's is a bug: it is raised."""
        failure, self.failure = self.failure, None
        try:
            self.manager.wait_until_finished()
        except Exception as err:  # Orbax and TensorStore report a failed write as ValueError, OSError, ...
            failure = failure or self._failure(self.pending, err)
        if failure is None and (injected := self.injector.save_failure(self.pending)) is not None:
            failure = self._failure(self.pending, injected)
        self.pending = None
        return failure

    def _failure(self, step: int | None, err: BaseException) -> dict:
        return failure_record(step, self.peers.index, err, self.directory)

    def finish_writes(self) -> float:
        """The end of a run: wait for every pending write, every process agreeing on the outcome; a last save that
        failed anywhere stops the run (StorageFailure: it cannot end without its checkpoint). The seconds waited."""
        start = time.perf_counter()
        failed = self._written()
        failures = self.peers.reduce("checkpoints written", failed, lambda all_: [f for f in all_ if f])
        if self.local is not None:
            self.local.wait()
        if failures:
            self.failed_saves.handle(failures, last=True)
        return time.perf_counter() - start

    def save_local(self, step: int, state: Any, data_state: dict) -> float:
        """A local save of `step`; returns the seconds it blocked the loop (the background write not included)."""
        self._settle(self.local_interval, f"local save of step {step}")
        meta = {**self.meta, "step": step, "saved_at": datetime.datetime.now(datetime.UTC).isoformat()}
        blocked = self.local.save(step, state, data_state, meta)
        return self._measured(self.local_interval, blocked, self._local_write)

    def _local_write(self) -> float:
        """The seconds the local tier's background write of the save just started takes."""
        self.local.wait()
        return self.local.write_seconds[-1]

    def _settle(self, interval: Interval, what: str, failed: dict | None = None) -> None:
        """Every process brings its step time, its tier's last save cost and (durable tier) its last write's failure
        to a save; an automatic interval is worked out again when the slowest process's figures moved
        (interval.py), and a failed write is handled alike everywhere (failed_saves.py)."""
        step_s = statistics.median(self.step_times) if self.step_times else 0.0
        mine = {"figures": [step_s, interval.costs[-1] if interval.costs else 0.0, 0.0], "failed": failed}
        agreed = self.peers.reduce(
            what,
            mine,
            lambda all_: {
                "figures": Figures.slowest([v["figures"] for v in all_]),
                "failed": [v["failed"] for v in all_ if v["failed"]],
            },
        )
        if agreed["failed"]:
            self.failed_saves.handle(agreed["failed"])
        elif interval is self.durable and interval.costs:
            self.failed_saves.in_a_row = 0  # the last save was written everywhere
        figures = Figures(*agreed["figures"])
        if interval.figures is not None and figures.step_s > 0 and figures.save_s > 0:
            self._say(interval.settle(Figures(figures.step_s, figures.save_s, interval.figures.write_s)))

    def _measured(self, interval: Interval, blocked: float, write: Callable[[], float]) -> float:
        """Record a save's cost; an automatic interval's first save is waited for to its end, and the interval is
        worked out from every process's figures (the slowest's: all arrive at the same one)."""
        interval.costs.append(blocked)
        if interval.measuring and self.step_times:  # not a save before any step was timed (the last, or on a signal)
            mine = [statistics.median(self.step_times), blocked, write()]
            self._say(interval.settle(Figures(*self.peers.reduce(f"{interval.key} interval", mine, Figures.slowest))))
        return blocked

    def _say(self, line: str | None) -> None:
        if line:
            self.print_fn(line)

    def advice(self, step_s: float) -> str:
        """The Young/Daly interval for the median save cost so far, next to the interval in use (per tier)."""
        return "\n".join(i.advice(step_s) for i in (self.durable, self.local_interval) if i.costs)

    # The local tier (local.py): its own interval, decided by step number alone so that every
    # process saves the same steps (its saves are collectives when partners keep copies).

    def local_due(self, step: int) -> bool:
        return self.local is not None and self.local_interval.due(step, self.timed_steps)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """(train state, loader state) of `step`; the state takes the shapes, dtypes and shardings of
        `abstract_state` (a ShapeDtypeStruct tree), so it may be restored onto another mesh.

        Read by Orbax's handler, not its manager: the manager ends a restore in a device barrier without a
        timeout, which a process whose read failed never reaches, so the others would wait there forever.
        The processes agree on the outcome afterwards instead (restore_newest)."""
        return read_step(self.directory / str(step), abstract_state, self.layout)

    def steps(self) -> list[int]:
        """The finished steps, newest first, as process 0 sees them (one list for all processes)."""
        return self.peers.broadcast("checkpoint steps", sorted(self.manager.all_steps(), reverse=True))

    def restore_newest(
        self, abstract_state: Any, print_fn: Callable[[str], None], before: int | None = None
    ) -> Restored:
        """The newest step that restores on every process, from the fastest tier holding it whole (the local
        tier, then checkpoints/); a Restored without a state if none (its `seconds` still say what trying cost).
        A copy that does not restore is set aside in its tier (a durable step's damage may be in one process's
        shards only) and the next copy or step is tried. A step of another model, or one the run's `check`
        refuses, stops the run (ConfigError). `before`: only steps older than it (a rollback: the first bad
        step's). The result says which tier served, from where, and what each tier cost."""
        local = self._local_steps()
        durable = self.steps()
        seconds: dict[str, float] = {}
        for step in sorted(set(local) | set(durable), reverse=True):
            if before is not None and step >= before:
                continue
            for tier in ("local", "durable"):
                if step not in (local if tier == "local" else durable):
                    continue
                start = time.perf_counter()
                found = (
                    self._restore_local(step, abstract_state, print_fn, local[step])
                    if tier == "local"
                    else self._restore_durable(step, abstract_state, print_fn)
                )
                seconds[tier] = seconds.get(tier, 0.0) + time.perf_counter() - start
                if found is not None:
                    return dataclasses.replace(found, tier=tier, seconds=seconds)
        return Restored(seconds=seconds)

    def _local_steps(self) -> dict[int, int]:
        """The local steps the hosts of this run hold whole, newest first, each with the process count that saved
        it (relayout.covered_steps), if their meta says they hold this run's model in its layer order. A step saved
        on this mesh comes back through the partners (LocalTier.restore); one saved on another process count or
        mesh is laid out on this one (relayout.restore_moved)."""
        if self.local is None:
            return {}
        steps: dict[int, int] = {}
        for step, processes in covered_steps(self.local.host_dir, self.peers):
            steps.setdefault(step, processes)  # a step saved on two counts: the larger (covered_steps)
        if not steps:
            return {}
        meta = self.local.meta(next(iter(steps))) or {}
        if saved_layer_order(meta) != self.layout:
            self.print_fn(
                "the local tier's steps were saved in another pipeline layer order; restoring from checkpoints/"
            )
            return {}
        self._check(meta, self.local.directory)
        return steps

    def _restore_local(self, step, abstract_state, print_fn, processes: int) -> Restored | None:
        """A local step: through the partners when it was saved on this mesh and every process is served so
        (LocalTier.agreed_steps), else laid out on this mesh from the shards the hosts hold."""
        meta = self.local.meta(step) or {}
        same_mesh = processes == self.meta.get("processes") and meta.get("mesh") == self.meta.get("mesh")
        if same_mesh and step in self.local.agreed_steps():
            restored = self.local.restore(step, abstract_state)
            path = str(self.local.directory / str(step))
        else:
            restored = restore_moved(self.local, step, processes, abstract_state)
            path = f"{self.local.host_dir}/process-*/{step}"  # the process directories of each host
        if isinstance(restored, str):
            print_fn(f"warning: {restored}; trying the next copy")
            return None
        state, data_state, copies = restored
        self.print_fn(f"restored step {step} from the local tier ({copies})")
        return Restored(state=state, data=data_state, step=step, copies=copies, path=path)

    def _restore_durable(self, step, abstract_state, print_fn) -> Restored | None:
        meta = read_meta(self.directory / str(step))
        if meta is not None:
            self._check(meta, self.directory)
        failure, restored = None, None
        try:
            if meta is None:
                raise ValueError("its meta item is missing or unreadable")
            restored = self.restore(step, abstract_state)
        except (ConfigError, KeyboardInterrupt):
            raise
        except Exception as err:  # Orbax/TensorStore raise many types for damaged files
            reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
            failure = f"process {self.peers.index}: {type(err).__name__}: {reason}"
        failures = self.peers.reduce(f"restore of step {step}", failure, lambda all_: [f for f in all_ if f])
        if not failures:
            state, data_state = restored
            return Restored(state=state, data=data_state, step=step, path=str(self.directory / str(step)))
        moved = self.set_aside(step)
        more = f" and {len(failures) - 1} more" if len(failures) > 1 else ""
        print_fn(
            f"warning: checkpoint step {step} does not restore ({failures[0]}{more}); moved it to {moved} "
            "and trying the previous one"
        )
        return None

    def _check(self, meta: dict, where: Path) -> None:
        """A step must hold this run's model (unless allow_model_changes lists a field) and pass its check."""
        if self.model is not None:
            check_model(meta.get("config", {}).get("model", {}), self.model, where, self.config.allow_model_changes)
        self.check(meta)

    def set_aside(self, step: int) -> Path:
        """Move a step out of Orbax's sight into checkpoints/corrupt/ (process 0), keeping its data."""
        target = self.directory / "corrupt" / f"{step}-{time.strftime('%Y%m%dT%H%M%S')}"
        target = Path(self.peers.broadcast(f"set aside step {step}", str(target)))  # one name: clocks differ
        if self.peers.index == 0:
            target.parent.mkdir(exist_ok=True)
            shutil.move(str(self.directory / str(step)), str(target))
        self.peers.barrier(f"step {step} set aside")
        self.manager.reload()
        return target

    def wait(self) -> float:
        """Block until pending writes (of both tiers) are done; returns the seconds waited. A failed durable write
        is kept for the next agreement (save, finish_writes), not raised here."""
        start = time.perf_counter()
        self.failure = self._written()
        if self.local is not None:
            self.local.wait()
        return time.perf_counter() - start

    def close(self) -> None:
        """Wait for pending writes, then release Orbax's threads."""
        self.wait()
        self.manager.close()
