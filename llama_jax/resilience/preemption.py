"""Preemption: SIGTERM or SIGINT becomes a flag the loop reads once per step, so it saves the current
step and stops (exit 75); in a multi-process run every process stops at the same step."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any


class PreemptionGuard:
    """SIGTERM/SIGINT -> a flag the loop polls once per step, so it can save the current step and exit.

    Multi-process runs (sync given, e.g. Orbax's CheckpointManager.reached_preemption): JAX's
    preemption notifier owns SIGTERM, and only sync(step) decides, because it is the point all
    processes agree on; a process that stopped on its own flag would leave the others waiting in a
    collective. So there SIGINT is turned into a SIGTERM to ourselves and the local flag only names it.
    """

    def __init__(self, sync: Callable[[int], bool] | None = None):
        self.sync = sync
        self.signal_name: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():
            return self  # Python only delivers signals to the main thread; sync still works
        ours = [signal.SIGINT] if self.sync is not None else [signal.SIGTERM, signal.SIGINT]
        for sig in ours:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            # None: the previous handler was installed from C and cannot be put back; default then.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the user insists: stop now, without the save
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
        if self.sync is not None:
            os.kill(os.getpid(), signal.SIGTERM)

    def should_stop(self, step: int) -> bool:
        if self.sync is not None:
            return bool(self.sync(step))
        return self.signal_name is not None
