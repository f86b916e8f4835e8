"""Bad steps: the jitted step already skips an update whose loss or gradient norm is not finite; the guard
here counts those steps and loss spikes and decides when the loop rolls back to a checkpoint."""

from __future__ import annotations

import math
import statistics
from collections import deque

SPIKE_MIN_HISTORY = 10  # good losses needed before a standard deviation means anything


class SpikeGuard:
    """Host-side bookkeeping for bad steps. The jitted step already skips updates with a non-finite loss
    or grad norm; here: count them, apply the loss-spike rule, decide when to roll back.
    A spike's update was applied (it is only seen afterwards); max_bad_steps 0 never rolls back."""

    def __init__(self, max_bad_steps: int = 3, zscore: float = 0.0, window: int = 100):
        self.max_bad_steps, self.zscore = max_bad_steps, zscore
        self._losses: deque[float] = deque(maxlen=window)
        self.bad_steps_total = 0
        self.consecutive = 0
        self.first_bad_step: int | None = None  # where the current run of bad steps began (a rollback goes before it)

    def observe(self, step: int, loss: float, finite: bool) -> str:
        """ "ok", "skipped" (non-finite), "spike" or "rollback" (max_bad_steps bad steps in a row)."""
        if not finite or not math.isfinite(loss):
            verdict = "skipped"
        elif self._is_spike(loss):
            verdict = "spike"  # kept out of the window, so a run of spikes cannot raise the bar
        else:
            self._losses.append(loss)
            self.consecutive, self.first_bad_step = 0, None
            return "ok"
        self.bad_steps_total += 1
        self.consecutive += 1
        if self.consecutive == 1:
            self.first_bad_step = step
        return "rollback" if 0 < self.max_bad_steps <= self.consecutive else verdict

    def _is_spike(self, loss: float) -> bool:
        if self.zscore <= 0 or len(self._losses) < min(SPIKE_MIN_HISTORY, self._losses.maxlen or 0):
            return False
        return loss > statistics.fmean(self._losses) + self.zscore * statistics.pstdev(self._losses)

    def reset(self) -> None:
        """After a rollback: the bad run is over (the losses of good steps stay, they were good)."""
        self.consecutive, self.first_bad_step = 0, None
