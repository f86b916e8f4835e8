"""Capturing a profile of chosen training steps (run.profile_steps=[FIRST, LAST]) with `jax.profiler`.

The loop runs every step through `StepProfiler.step`; the profiler decides for itself when a trace is due. Steps
FIRST..LAST are traced into `<run.dir>/profile/`, jax's own layout, which XProf and TensorBoard's profile plugin
read (`tensorboard --logdir RUN_DIR/profile`):

    profile/plugins/profile/<timestamp>/<host>.xplane.pb       the trace, as the profiler recorded it
    profile/plugins/profile/<timestamp>/<host>.trace.json.gz   the same, converted by jax to Chrome's trace format
    profile/step.hlo.txt                                       the compiled step's optimized HLO: what each op is

Each step is named with a `StepTraceAnnotation("train", step_num=...)`, so XProf sees the step boundaries. The
step before FIRST is finished before the trace starts, and LAST's outputs before it stops, so the trace holds
whole steps and nothing else of the run's. In a multi-process run every process writes its own trace; processes
sharing a host would write the same <host> file, so there each writes under profile/process-<i>/.
`llama-jax profile RUN_DIR` (profile.py) reads the newest trace back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from llama_jax.files import atomic_path

HLO_FILE = "step.hlo.txt"


@dataclass
class StepProfiler:
    """Traces steps first..last (none when first > last) into `directory`."""

    directory: Path
    first: int = 1
    last: int = 0
    hlo_text: Callable[[], str] = str  # the compiled step's optimized HLO text, read when the trace starts
    tracing: bool = False
    done: bool = False  # traced once: a rollback or a second pass over the range traces nothing more

    @classmethod
    def for_run(cls, run_dir: Path, profile_steps: list[int], hlo_text: Callable[[], str]) -> StepProfiler:
        first, last = profile_steps or (1, 0)
        directory = run_dir / "profile"
        if jax.process_count() > 1:
            directory = directory / f"process-{jax.process_index()}"
        return cls(directory, first, last, hlo_text)

    def step(self, step: int, train_step: Callable[..., Any], state: Any, batch: Any) -> Any:
        """`train_step(state, batch)`, run as step `step`: traced and named when the step is in the range."""
        if self.done or not self.first <= step <= self.last:
            return train_step(state, batch)
        if not self.tracing:
            jax.block_until_ready(state)  # the step before ends before the trace starts
            self.directory.mkdir(parents=True, exist_ok=True)
            with atomic_path(self.directory / HLO_FILE) as tmp:  # names each op of the trace (profile.py)
                tmp.write_text(self.hlo_text())
            jax.profiler.start_trace(str(self.directory))
            self.tracing = True
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            outputs = train_step(state, batch)
        if step == self.last:
            jax.block_until_ready(outputs)  # the trace holds the whole of the last step
            self.stop()
        return outputs

    def stop(self) -> None:
        """End a trace in progress and write it (a run that stops inside the range keeps what it traced)."""
        if self.tracing:
            self.tracing, self.done = False, True
            jax.profiler.stop_trace()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
