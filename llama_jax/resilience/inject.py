"""Faults injected on purpose -- TESTING ONLY: the tests, the rehearsal (bench/rehearsal.py) and chaos drills
(bench/chaos.py) make a run fail in known ways to see that it survives them. No real run sets the config's
`inject` section (schema.InjectConfig), and this module is the one place that reads it.

An Injector is built from that section and this process's index; the production code calls it at named points
and, with the empty section (NO_INJECTION, or any real run), every call does nothing:

    before_step(step)           training/segments.py, before loading each batch: inject.step_delay_s (inject.process)
    batch(step, batch)          training/segments.py, each host batch: inject.nan_steps, inject.spike_steps
    hang_after(step)            training/loop.py and segments.py, once step n is read (and saved): inject.hang_step
    save_delay_s                checkpoint/checkpointer.py, each durable save: inject.save_delay_s (inject.process)
    save_failure(step)          checkpoint/checkpointer.py, each durable write: inject.save_failure_steps
                                (inject.process)
    stall_at                    distributed/peers.py's injected_stall_at: inject.stall_at (inject.process)
    check_devices(ids)          resilience/preflight.py: the injected device ids are the mesh's
    repeats(device), product()  resilience/preflight.py: inject.slow_device, inject.wrong_device
"""

from __future__ import annotations

import errno
import time

import numpy as np

from llama_jax.config import InjectConfig
from llama_jax.errors import ConfigError
from llama_jax.files import format_ranges

SLOW_FACTOR = 10  # inject.slow_device: its timed calls do 10 times the work, far beyond noise


class Injector:
    """The faults `section` (the config's inject section) injects into process `process`. The delays, the save
    failures and the stall apply to inject.process only; the bad batches, the hang and the bad devices to all."""

    def __init__(self, section: InjectConfig, process: int):
        self.section = section
        self.chosen = section.process != -1 and section.process == process  # this process is inject.process

    def before_step(self, step: int) -> None:
        """inject.step_delay_s: the chosen process sleeps before loading batch `step` (a straggler)."""
        if self.chosen and self.section.step_delay_s:
            time.sleep(self.section.step_delay_s)

    def batch(self, step: int, batch: dict) -> dict:
        """Batch `step` as loaded, or poisoned: inject.nan_steps make its loss mask NaN (a non-finite step),
        inject.spike_steps its targets all token 0 (a loss spike whose update is applied: a corrupt batch)."""
        if step in self.section.nan_steps:
            batch["loss_mask"] = np.full_like(batch["loss_mask"], np.nan)
        if step in self.section.spike_steps:
            batch["targets"] = np.zeros_like(batch["targets"])
        return batch

    def hang_after(self, step: int) -> None:
        """inject.hang_step: once step n is read (and saved, when due), the step after it never returns."""
        if step == self.section.hang_step:
            _injected_hang()

    @property
    def save_delay_s(self) -> float:
        """inject.save_delay_s: seconds the chosen process's durable saves take longer (0 elsewhere)."""
        return self.section.save_delay_s if self.chosen else 0.0

    def save_failure(self, step: int | None) -> OSError | None:
        """inject.save_failure_steps: the chosen process's durable write of `step` fails, no space left."""
        if self.chosen and step in self.section.save_failure_steps:
            return OSError(errno.ENOSPC, "injected: inject.save_failure_steps")
        return None

    @property
    def stall_at(self) -> str:
        """inject.stall_at: the barrier the chosen process never arrives at ("" elsewhere: none)."""
        return self.section.stall_at if self.chosen else ""

    def check_devices(self, ids: list[int]) -> None:
        """ConfigError for an injected device id (inject.slow_device, inject.wrong_device) not in `ids`."""
        for key, value in (("slow_device", self.section.slow_device), ("wrong_device", self.section.wrong_device)):
            if value != -1 and value not in ids:
                raise ConfigError(f"inject.{key}={value} is not a device of this run's mesh (ids {format_ranges(ids)})")

    def repeats(self, device_id: int) -> int:
        """inject.slow_device: each timed pre-flight call on that device runs SLOW_FACTOR times over."""
        return SLOW_FACTOR if device_id == self.section.slow_device else 1

    def product(self, device_id: int, result):
        """inject.wrong_device: that device's known product comes back with one element off by one."""
        return result.at[0, 0].add(1.0) if device_id == self.section.wrong_device else result


NO_INJECTION = Injector(InjectConfig(), process=0)  # injects nothing: every real run's


def _injected_hang() -> None:
    """inject.hang_step: stand-in for a collective that never returns (after step n has been read)."""
    while True:
        time.sleep(3600)
