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
"""

from __future__ import annotations

import datetime
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import orbax.checkpoint as ocp

from llama_jax.checkpoint.durable import ITEMS, check_model, read_meta, read_step, saved_layer_order
from llama_jax.checkpoint.interval import DEFAULT_MTBF_S, auto_checkpoint_steps, interval_advice
from llama_jax.checkpoint.local import LocalTier
from llama_jax.config import CheckpointConfig
from llama_jax.distributed.peers import Peers
from llama_jax.errors import ConfigError
from llama_jax.model.stages import NATURAL, LayerOrder
from llama_jax.resilience.goodput import observed_mtbf_s


class Checkpointer:
    """The checkpoints of one run. Every decision all processes must share is made once, through `peers`
    (Peers, bounded waits): when to save, the auto interval, which steps exist, and whether
    a step restores (a step that fails on any one process is set aside by all)."""

    def __init__(self, run_dir: Path, config: CheckpointConfig, meta: dict | None = None,
                 directory: Path | None = None, log: Callable[[str], None] = print, peers: Peers | None = None,
                 save_delay_s: float = 0.0, layout: LayerOrder = NATURAL, local: LocalTier | None = None,
                 model: dict | None = None, check: Callable[[dict | None], None] | None = None):
        """`model` (the run's model config as a dict) and `check` (start.meta_check: a peft run's adapters and
        base) are what every step restore_newest considers must hold; config.allow_model_changes lets function
        fields differ."""
        self.config, self.meta, self.log, self.local = config, meta or {}, log, local
        self.model, self.check = model, check or (lambda meta: None)
        self.layout = layout  # the pipeline layout of this run: restored layers are put in its order
        self.peers = peers or Peers(timeout_s=600.0)
        self.save_delay_s = save_delay_s  # fault injection: this process's saves take longer
        self.directory = Path(directory or Path(run_dir) / "checkpoints").absolute()
        self.every_steps = config.every_steps if isinstance(config.every_steps, int) else 0
        # MTBF for the Young/Daly interval: configured, else observed in this run (read before this
        # attempt is recorded), else a big run's figure.
        self.mtbf_s = config.mtbf_hours * 3600 or observed_mtbf_s(Path(run_dir)) or DEFAULT_MTBF_S
        self.last_save_time = time.monotonic()
        self.announced_save: int | None = None  # process 0: the step of the save it announced last
        self.save_seconds: list[float] = []  # how long each save blocked the loop
        self.local_every_steps = config.local_every_steps if isinstance(config.local_every_steps, int) else 0
        self.restored_from = ""  # the tier the last restore came from: "local" or "durable"
        self.restored_copies = ""  # with the local tier: whose copies served ("own copies", or a partner's too)
        self.restore_seconds: dict[str, float] = {}  # seconds spent restoring (or trying to) from each tier
        self.manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.config.keep, keep_period=self.config.keep_every or None,
            enable_async_checkpointing=self.config.async_save, create=True)
        return ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    @property
    def auto(self) -> bool:
        return self.config.every_steps == "auto"

    def due(self, step: int) -> bool:
        """Whether `step` is saved: its step interval or its time interval. Every process calls it after
        every step; with a time interval process 0's clock decides (see _time_due)."""
        if self.auto and not self.save_seconds:
            return True  # the first save is measured to choose the interval
        interval_due = self.every_steps > 0 and step % self.every_steps == 0
        return self._time_due(step) or interval_due

    def _time_due(self, step: int) -> bool:
        """checkpoint.every_minutes, decided by process 0's clock two steps ahead: after dispatching step n
        it announces a save at n + 2. Every process asks about step n + 2 once it has dispatched it and read
        step n + 1's result (training/loop.py: the host runs one step ahead), and step n + 1 cannot finish anywhere
        before process 0 has dispatched it, that is after the announcement. So no process waits."""
        minutes = self.config.every_minutes
        if minutes <= 0:
            return False
        due = self.peers.announced("save", step)
        pending = self.announced_save is not None and step < self.announced_save
        if self.peers.index == 0 and time.monotonic() - self.last_save_time >= minutes * 60 and not (due or pending):
            self.peers.announce("save", step + 2)
            self.announced_save = step + 2
        return due

    def save(self, step: int, state: Any, data_state: dict, step_s: float | None = None) -> float:
        """Start an asynchronous save; returns the seconds it blocked (copying arrays off the device).

        With every_steps=auto the first save is waited for in full, and with its time and the step time
        `step_s` (1 s if unknown) it sets the interval of the saves after it: the slowest process's
        times, so that every process arrives at the same interval."""
        self.peers.barrier(f"save of step {step}")  # a process that never comes is named here, not in Orbax
        start = time.perf_counter()
        time.sleep(self.save_delay_s)
        meta = {**self.meta, "step": step, "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        data=ocp.args.JsonSave(data_state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)
        self.last_save_time = time.monotonic()
        self.save_seconds.append(time.perf_counter() - start)
        if self.auto and len(self.save_seconds) == 1:
            mine = [self.save_seconds[0] + self.wait(), step_s or 1.0]
            save_s, step_s = self.peers.reduce("checkpoint interval", mine, lambda all_: list(map(max, zip(*all_))))
            self.every_steps = auto_checkpoint_steps(save_s, self.mtbf_s, step_s)
            self.log(interval_advice(save_s, self.mtbf_s, step_s, self.every_steps, auto=True))
        return self.save_seconds[-1]

    def advice(self, step_s: float) -> str:
        """The Young/Daly interval for the median save time so far, next to the interval in use (per tier)."""
        lines = [interval_advice(statistics.median(self.save_seconds), self.mtbf_s, step_s, self.every_steps)]
        if self.local is not None and self.local.save_seconds:
            cost = statistics.median(self.local.save_seconds)
            lines.append(interval_advice(cost, self.mtbf_s, step_s, self.local_every_steps,
                                         key="checkpoint.local_every_steps"))
        return "\n".join(lines)

    # The local tier (local.py): its own interval, decided by step number alone so that every
    # process saves the same steps (its saves are collectives when partners keep copies).

    def local_due(self, step: int) -> bool:
        if self.local is None:
            return False
        if self.config.local_every_steps == "auto" and not self.local.save_seconds:
            return True  # the first local save is measured to choose the interval
        return self.local_every_steps > 0 and step % self.local_every_steps == 0

    def save_local(self, step: int, state: Any, data_state: dict, step_s: float | None = None) -> float:
        """A local save of `step`; returns the seconds it blocked the loop (the background write not
        included). With local_every_steps=auto the first one is waited for in full and sets the interval."""
        meta = {**self.meta, "step": step, "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
        blocked = self.local.save(step, state, data_state, meta)
        if self.config.local_every_steps == "auto" and len(self.local.save_seconds) == 1:
            mine = [blocked + self.local.wait(), step_s or 1.0]
            save_s, step_s = self.peers.reduce("local interval", mine, lambda all_: list(map(max, zip(*all_))))
            self.local_every_steps = auto_checkpoint_steps(save_s, self.mtbf_s, step_s)
            self.log(interval_advice(save_s, self.mtbf_s, step_s, self.local_every_steps, auto=True,
                                     key="checkpoint.local_every_steps"))
        return blocked

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

    def restore_newest(self, abstract_state: Any, warn: Callable[[str], None]) -> tuple[int, Any, dict] | None:
        """The newest step that restores on every process, from the fastest tier holding it whole (the local
        tier, then checkpoints/); None if none. A copy that does not restore is set aside in its tier (a
        durable step's damage may be in one process's shards only) and the next copy or step is tried.
        A step of another model, or one the run's `check` refuses, stops the run (ConfigError).
        restored_from and restore_seconds say which tier served and what each cost."""
        local = self._local_steps()
        durable = self.steps()
        for step in sorted(set(local) | set(durable), reverse=True):
            for tier in ("local", "durable"):
                if step not in (local if tier == "local" else durable):
                    continue
                start = time.perf_counter()
                found = (self._restore_local if tier == "local" else self._restore_durable)(
                    step, abstract_state, warn)
                self.restore_seconds[tier] = self.restore_seconds.get(tier, 0.0) + time.perf_counter() - start
                if found is not None:
                    self.restored_from = tier
                    return found
        return None

    def _local_steps(self) -> list[int]:
        """The local steps every process can be served, if their meta says they fit this run: the same
        model, process count and layer order (the local tier keeps shards as they lie on this mesh; another
        layout restores from checkpoints/, which any mesh can read)."""
        if self.local is None:
            return []
        steps = self.local.agreed_steps()
        if not steps:
            return []
        meta = self.local.meta(steps[0]) or {}
        saved = (meta.get("processes"), saved_layer_order(meta), meta.get("mesh"))
        if saved != (self.meta.get("processes"), self.layout, self.meta.get("mesh")):
            self.log(f"the local tier's steps were saved on another mesh or process count ({meta.get('mesh')}); "
                     "restoring from checkpoints/")
            return []
        self._check(meta, self.local.directory)
        return steps

    def _restore_local(self, step, abstract_state, warn) -> tuple[int, Any, dict] | None:
        restored = self.local.restore(step, abstract_state)
        if isinstance(restored, str):
            warn(f"warning: {restored}; trying the next copy")
            return None
        state, data_state, self.restored_copies = restored
        self.log(f"restored step {step} from the local tier ({self.restored_copies})")
        return step, state, data_state

    def _restore_durable(self, step, abstract_state, warn) -> tuple[int, Any, dict] | None:
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
            return (step, *restored)
        moved = self.set_aside(step)
        more = f" and {len(failures) - 1} more" if len(failures) > 1 else ""
        warn(f"warning: checkpoint step {step} does not restore ({failures[0]}{more}); moved it to {moved} "
             "and trying the previous one")
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
        """Block until pending writes (of both tiers) are done; returns the seconds waited."""
        start = time.perf_counter()
        self.manager.wait_until_finished()
        if self.local is not None:
            self.local.wait()
        return time.perf_counter() - start

    def close(self) -> None:
        """Wait for pending writes, then release Orbax's threads."""
        self.wait()
        self.manager.close()
