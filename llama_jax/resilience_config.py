"""The schema of checkpoints and fault handling: CheckpointConfig (durable and node-local tiers) and
FaultConfig (hangs, bad steps, stragglers, barriers, the pre-flight check, fault injection), with the
checks of their values.

Kept apart from config.py (which imports it) so the schema module stays short; like config.py it
imports nothing of llama_jax but errors.py and vocabulary.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from llama_jax.errors import ConfigError
from llama_jax.vocabulary import FUNCTION_FIELDS


@dataclass(frozen=True)
class CheckpointConfig:
    # Save every n steps (0: only at the end and on preemption), or "auto": the Young/Daly interval
    # sqrt(2 · save time · MTBF), from the measured save time and mtbf_hours (or observed failures).
    every_steps: Union[int, str] = 0
    every_minutes: float = 0.0  # also save when this much time passed since the last save (0: off)
    keep: int = 3  # the newest n are kept ...
    keep_every: int = 0  # ... plus every step divisible by this one, forever (milestones; 0: none)
    resume_from: str = ""  # a run dir or step dir to resume from when run.dir has no checkpoint yet
    init_from: str = ""  # a run dir or step dir whose params (same model) start a new run: fine-tuning
    mtbf_hours: float = 0.0  # mean time between failures for "auto" (0: observed in this run, else 3 h)
    async_save: bool = True  # write in a background thread while training continues (false: block until written)
    # Model fields (vocabulary.FUNCTION_FIELDS) that may differ from the checkpoint resumed or initialised
    # from, e.g. [rope_scaling_factor, rope_original_max_len] to extend the context; shapes never may.
    allow_model_changes: list[str] = field(default_factory=list)
    timeout_s: float = 1800.0  # a save or restore not finished in this time stops the run, naming it (exit 124)
    # The node-local tier (local_checkpoint.py): each process's shards on its own host (/dev/shm, NVMe; "" = off)
    # every local_every_steps (or auto), the newest local_keep; local_replicas=1: a partner host keeps a copy.
    local_dir: str = ""
    local_every_steps: Union[int, str] = 0
    local_keep: int = 2
    local_replicas: int = 1


@dataclass(frozen=True)
class FaultConfig:
    # Hang watchdog: no step within max(hang_min_timeout_s, hang_factor × median step time) -> dump
    # every thread's stack to <run.dir>/hang-<host>.txt and exit 124 (a supervisor restarts the job).
    hang_factor: float = 10.0
    hang_min_timeout_s: float = 300.0
    hang_startup_timeout_s: float = 3600.0  # before the first timed step: compilation, restore
    max_bad_steps: int = 3  # consecutive skipped (non-finite) or spiking steps before a rollback
    spike_zscore: float = 0.0  # a loss above mean + z·std of the last spike_window losses is a spike (0: off)
    spike_window: int = 100
    straggler_factor: float = 3.0  # warn when a step takes this many times the rolling median
    # Per-host straggler scores (multi-process): every n steps each process's host time per step is
    # gathered; a host costing the fleet more than this share of each step, two windows running, is named.
    straggler_every_steps: int = 50
    straggler_host_threshold: float = 0.1
    # Barriers and agreements outside the jitted step (start-up, data preparation, checkpoint decisions):
    # a process missing for this long stops the others, which name it (exit 76).
    barrier_timeout_s: float = 600.0
    # Pre-flight check before the step compiles (preflight.py, `llama-jax doctor`): a device below preflight_min_ratio
    # x the fleet median matmul rate or memory bandwidth, or with a wrong known product, is named; exit 71.
    preflight: bool = False
    preflight_min_ratio: float = 0.8
    # Fault injection, for tests and chaos drills: poison these steps' batches with NaN; hang at a step;
    # slow down one process's steps or saves, or stall it before the barrier named inject_stall_at.
    inject_nan_steps: list[int] = field(default_factory=list)
    inject_hang_step: int = -1
    inject_process: int = -1  # the process the delays and the stall apply to (-1: none)
    inject_step_delay_s: float = 0.0
    inject_save_delay_s: float = 0.0
    inject_stall_at: str = ""
    inject_slow_device: int = -1  # pre-flight: this device id's timed work runs 10 times over (-1: none)
    inject_wrong_device: int = -1  # pre-flight: this device id's known product comes back one element off


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_resilience(c: CheckpointConfig, f: FaultConfig) -> None:
    """One ConfigError line for the first bad checkpoint.* or fault.* value."""
    _require(c.every_steps == "auto" or (isinstance(c.every_steps, int) and c.every_steps >= 0),
             f"checkpoint.every_steps must be a step count >= 0 (0: only at the end) or auto, got '{c.every_steps}'")
    _require(c.keep > 0, f"checkpoint.keep must be positive, got {c.keep}")
    _require(c.keep_every >= 0 and c.every_minutes >= 0 and c.mtbf_hours >= 0,
             "checkpoint.keep_every, checkpoint.every_minutes and checkpoint.mtbf_hours must be >= 0")
    _require(not (c.resume_from and c.init_from), "set checkpoint.resume_from or checkpoint.init_from, not both")
    _require(c.local_every_steps == "auto" or (isinstance(c.local_every_steps, int) and c.local_every_steps >= 0),
             f"checkpoint.local_every_steps must be a step count >= 0 or auto, got '{c.local_every_steps}'")
    _require(bool(c.local_dir.strip()) == (c.local_every_steps != 0), "checkpoint.local_dir and checkpoint."
             "local_every_steps go together: set both (e.g. local_dir=/dev/shm/llama-jax local_every_steps=50) or neither")
    _require(c.local_keep > 0 and c.local_replicas in (0, 1), f"checkpoint.local_keep must be positive and "
             f"checkpoint.local_replicas 0 or 1, got {c.local_keep} and {c.local_replicas}")
    _require(f.hang_factor > 0 and f.hang_min_timeout_s > 0 and f.hang_startup_timeout_s > 0,
             "fault.hang_factor, fault.hang_min_timeout_s and fault.hang_startup_timeout_s must be positive")
    _require(f.max_bad_steps > 0, f"fault.max_bad_steps must be positive, got {f.max_bad_steps}")
    _require(f.spike_zscore >= 0 and f.spike_window > 1, "fault.spike_zscore must be >= 0 and fault.spike_window > 1")
    _require(f.straggler_factor > 1, f"fault.straggler_factor must exceed 1, got {f.straggler_factor}")
    # At least 2: a window is scored once every process has posted it, which the train loop (one step
    # ahead of the devices) guarantees only a window of 2+ steps later (distributed.HostWindow).
    _require(f.straggler_every_steps >= 2 and f.straggler_host_threshold > 0,
             "fault.straggler_every_steps must be at least 2 and fault.straggler_host_threshold positive")
    _require(f.barrier_timeout_s >= 1 and c.timeout_s >= 1,
             "fault.barrier_timeout_s and checkpoint.timeout_s must be at least 1 second")
    _require(f.inject_step_delay_s >= 0 and f.inject_save_delay_s >= 0, "fault.inject_*_delay_s must be >= 0")
    _require(0 < f.preflight_min_ratio <= 1, f"fault.preflight_min_ratio must be in (0, 1], got {f.preflight_min_ratio}")
    bad = sorted(set(c.allow_model_changes) - set(FUNCTION_FIELDS))
    _require(not bad, f"checkpoint.allow_model_changes: {', '.join(bad)} cannot change under a checkpoint; "
             f"allowed: {', '.join(FUNCTION_FIELDS)}")
