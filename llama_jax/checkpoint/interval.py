"""How often to save: Young and Daly's optimum, sqrt(2 x save cost x MTBF), for a step time and a save cost.

A save's cost is the time it takes from training: how long it blocks the loop (the copy off the devices, and
any wait for the previous save's write). The write itself runs in the background, so it costs no training time,
but the next save waits for it: the interval is never shorter than one write. The same cost drives
`every_steps=auto` and the end-of-run advice.

An automatic interval (`Interval(auto=True)`) is measured, never assumed: the tier's first save comes after
STEADY_STEPS timed steps following the compile, is timed in full (its write waited for), and the interval is
worked out from the slowest process's figures (every process arrives at the same one). At every later save the
processes compare the figures again, and a step time or a save cost that moved by more than REDERIVE_FACTOR
works the interval out anew.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

DEFAULT_MTBF_S = 3 * 3600.0  # Llama 3 405B: one interruption every ~3 h on 16k GPUs (a big-run figure)
STEADY_STEPS = 5  # timed steps after the compile before an automatic interval's first save
REDERIVE_FACTOR = 2.0  # a step time or save cost this many times off the figures in use works the interval out anew


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum of the checkpoint interval: sqrt(2 × save cost × MTBF)."""
    if save_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need save_s >= 0 and mtbf_s > 0, got {save_s} and {mtbf_s}")
    return math.sqrt(2 * save_s * mtbf_s)


def auto_checkpoint_steps(save_s: float, mtbf_s: float, step_s: float, write_s: float = 0.0) -> int:
    """The Young/Daly interval in steps, at least one write long (a save waits for the previous write)."""
    if step_s <= 0:
        raise ValueError(f"step_s must be positive, got {step_s}")
    return max(1, round(young_daly_interval_s(save_s, mtbf_s) / step_s), math.ceil(write_s / step_s))


@dataclass(frozen=True)
class Figures:
    """What an interval is worked out from (the slowest process's, agreed by all)."""

    step_s: float  # median step time
    save_s: float  # a save's cost: the seconds it blocked the loop
    write_s: float = 0.0  # a save's background write

    @staticmethod
    def slowest(reports: list[list[float]]) -> list[float]:
        """Every process's [step_s, save_s, write_s] -> the largest of each (Peers.reduce's combine)."""
        return [max(values) for values in zip(*reports)]

    def moved(self, other: Figures) -> bool:
        """Whether the step time or the save cost moved by more than REDERIVE_FACTOR from `self`."""

        def far(a: float, b: float) -> bool:
            return min(a, b) > 0 and max(a, b) / min(a, b) > REDERIVE_FACTOR

        return far(self.step_s, other.step_s) or far(self.save_s, other.save_s)


@dataclass
class Interval:
    """One tier's save interval in steps: checkpoint.every_steps (or local_every_steps) = N, 0 (no periodic saves)
    or auto. A step is due when it divides by the interval, so every process saves the same steps."""

    key: str  # the config key, for the log
    every: int  # steps between saves; 0: none (or, for auto, not measured yet)
    auto: bool
    mtbf_s: float
    figures: Figures | None = None  # what an automatic interval was worked out from
    costs: list[float] = field(default_factory=list)  # the seconds each save blocked the loop

    @classmethod
    def of(cls, key: str, setting: int | str, mtbf_s: float) -> Interval:
        return cls(key, setting if isinstance(setting, int) else 0, setting == "auto", mtbf_s)

    def due(self, step: int, timed_steps: int) -> bool:
        """Whether `step` is saved; `timed_steps`: the steps this process has timed since the compile."""
        if self.auto and self.figures is None:
            return timed_steps >= STEADY_STEPS  # the first save is measured, to work the interval out
        return self.every > 0 and step % self.every == 0

    @property
    def measuring(self) -> bool:
        """The next save is an automatic interval's first: it is timed in full (its write waited for)."""
        return self.auto and self.figures is None

    def settle(self, figures: Figures) -> str | None:
        """An automatic interval from `figures` (agreed by every process): worked out the first time, and again
        when they moved by more than REDERIVE_FACTOR; the log line saying so, else None."""
        if not self.auto or (self.figures is not None and not self.figures.moved(figures)):
            return None
        before, self.figures = self.figures, figures
        self.every = auto_checkpoint_steps(figures.save_s, self.mtbf_s, figures.step_s, figures.write_s)
        why = (
            ""
            if before is None
            else (
                f" (worked out again: step {before.step_s:.3g}s -> {figures.step_s:.3g}s, "
                f"save {before.save_s:.3g}s -> {figures.save_s:.3g}s)"
            )
        )
        return f"{self.key}=auto: {self._derivation(figures.save_s, figures.step_s, figures.write_s)}{why}"

    def advice(self, step_s: float) -> str:
        """The end-of-run line: the Young/Daly interval for the median save cost so far, next to the one in use."""
        cost = statistics.median(self.costs)
        steps = auto_checkpoint_steps(cost, self.mtbf_s, step_s)
        return (
            f"checkpoint interval advice (Young/Daly): "
            f"sqrt(2 x save {cost:.2f}s x MTBF {self.mtbf_s / 3600:.2g} h) = "
            f"{young_daly_interval_s(cost, self.mtbf_s):.0f}s = {steps} steps; "
            f"{self.key} is {'auto, ' if self.auto else ''}{self.every or 'only at the end'}"
        )

    def _derivation(self, save_s: float, step_s: float, write_s: float) -> str:
        optimum = young_daly_interval_s(save_s, self.mtbf_s)
        floor = f", at least one write of {write_s:.2f}s" if write_s > optimum else ""
        return (
            f"sqrt(2 x save {save_s:.2f}s x MTBF {self.mtbf_s / 3600:.2g} h) = "
            f"{optimum:.0f}s{floor} at {step_s:.3f}s a step -> saving every "
            f"{self.every} steps"
        )
