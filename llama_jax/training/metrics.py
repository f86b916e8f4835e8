"""Throughput accounting (tokens/s, MFU) and what a user sees while a run trains.

MFU = achieved model FLOP/s / (peak FLOP/s of one device x number of devices), with the peak of
hardware.py: a data-sheet figure or a matmul measured on this machine, never a hard-coded A100 peak.

MetricsLog is the single sink for training metrics: metrics.jsonl (the interface scripts rely on),
TensorBoard, Weights & Biases (optional: run.wandb=true), and a tqdm bar (terminal) or one plain line
per log call (log files, CI, Slurm).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import secrets
import statistics
import sys
from collections.abc import Callable
from typing import Any

from tensorboardX import SummaryWriter
from tqdm import tqdm

from llama_jax.config import Config, RunConfig, to_dict
from llama_jax.errors import ConfigError
from llama_jax.files import atomic_path, format_clock
from llama_jax.perf.hardware import MfuPeaks


def _plain(value: Any) -> Any:
    """numpy/jax scalars -> Python bool/int/float so json and TensorBoard accept them. Lists and dicts of
    them (e.g. the straggler hosts of a window) go to metrics.jsonl only."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        return _plain(value.item())
    raise TypeError(f"metrics values must be scalars, strings, or lists and dicts of them, got {type(value).__name__}")


def _drop_partial_last_line(path: pathlib.Path) -> None:
    """A run killed mid-write leaves a line without "\\n"; cut it so appends start on a fresh line."""
    if not path.exists():
        return
    with path.open("r+b") as f:
        tail_start = max(0, f.seek(0, os.SEEK_END) - 65536)  # lines are far shorter than 64 KiB
        f.seek(tail_start)
        tail = f.read()
        if tail and not tail.endswith(b"\n"):
            f.truncate(tail_start + tail.rfind(b"\n") + 1)  # no newline at all: rfind -1 -> start


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    """The Weights & Biases run MetricsLog sends its scalars to (the run.wandb_* keys)."""

    project: str = "llama-jax"
    name: str = ""  # "": the run directory's name
    entity: str = ""  # "": the user's default entity
    config: dict = dataclasses.field(default_factory=dict)  # the W&B run's config: the resolved Config

    @classmethod
    def from_config(cls, config: Config) -> WandbSettings | None:
        """None unless run.wandb is set."""
        r = config.run
        return cls(r.wandb_project, r.wandb_name, r.wandb_entity, to_dict(config)) if r.wandb else None


def check_wandb(run: RunConfig) -> None:
    """Raise ConfigError (one line) when run.wandb is set and wandb cannot be imported. Call it while
    checking the input, before anything in run.dir is written (MetricsLog imports it too late for that)."""
    if not run.wandb:
        return
    try:
        import wandb  # noqa: F401  (optional dependency; imported here only to see that it loads)
    except ImportError as e:
        reason = (str(e) or type(e).__name__).splitlines()[0]
        raise ConfigError(
            f"run.wandb=true but wandb cannot be imported ({reason}); "
            "pip install 'llama-jax[wandb]' or set run.wandb=false"
        ) from None


def wandb_run_id(run_dir: pathlib.Path) -> str:
    """The W&B run id of run_dir, kept in run_dir/wandb/run_id: every restart of a run continues the same
    W&B run, and a new run directory starts a new one (delete the file to start a new W&B run)."""
    path = run_dir / "wandb" / "run_id"
    if path.is_file() and (run_id := path.read_text(encoding="utf-8").strip()):
        return run_id
    path.parent.mkdir(parents=True, exist_ok=True)
    run_id = secrets.token_hex(6)  # W&B ids are letters, digits, "-" and "_"
    with atomic_path(path) as tmp:
        tmp.write_text(run_id + "\n", encoding="utf-8")
    return run_id


def _start_wandb(run_dir: pathlib.Path, settings: WandbSettings) -> Any:
    import wandb  # optional dependency: pip install 'llama-jax[wandb]'

    run = wandb.init(
        project=settings.project,
        entity=settings.entity or None,
        name=settings.name or run_dir.resolve().name,
        id=wandb_run_id(run_dir),
        resume="allow",
        dir=str(run_dir),
        config=settings.config,
    )
    # The x-axis is our "step", not W&B's own counter, which only increases: a run restarted from an
    # earlier checkpoint logs its steps again, as TensorBoard shows them, instead of W&B dropping them.
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run


class MetricsLog:
    """Writes each record to metrics.jsonl, TensorBoard and (optionally) Weights & Biases and shows
    progress (enabled on process 0 only).

    Records carry "step" and optionally "loss", "eval_loss", "tokens_per_s", "mfu" (a fraction)
    and any other scalars. Non-finite floats are written to JSONL as null (strict JSON).
    `wandb` (WandbSettings.from_config(config)) also sends the scalars TensorBoard gets to W&B, to the
    run of wandb_run_id(run_dir) with files under run_dir/wandb.
    """

    def __init__(
        self,
        run_dir: pathlib.Path,
        total_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        interactive: bool | None = None,
        print_fn: Callable[[str], Any] = print,
        enabled: bool = True,
        wandb: WandbSettings | None = None,
    ) -> None:
        self.enabled = enabled  # False on processes other than 0 of a multi-process run: log nothing
        self._bar = self._writer = self._file = self._wandb = None
        self._print = print_fn
        self._failed: set[str] = set()  # sinks whose writes failed (warned once; still tried each time)
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if wandb is not None:  # first: if it fails, nothing else is open
            self._wandb = _start_wandb(run_dir, wandb)
        path = run_dir / "metrics.jsonl"
        _drop_partial_last_line(path)
        self._file = path.open("a", encoding="utf-8")  # append: a resumed run continues the file
        self._total = total_steps
        self._step_time: float | None = None  # latest measured seconds per step, for the ETA
        self._shown: dict[str, Any] = {}  # latest value of each displayed field
        if tensorboard:
            self._writer = SummaryWriter(logdir=str(run_dir / "tensorboard"))
        if interactive is None:
            interactive = sys.stdout.isatty()
        if interactive:
            # initial=start_step: the bar of a resumed run starts where it left off and tqdm's
            # rate/ETA count only the steps done in this process.
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", file=sys.stdout, dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if "step" not in record:
            raise ValueError(f"metrics record needs a 'step' field, got keys {sorted(record)}")
        if not self.enabled:
            return
        rec = {str(k): _plain(v) for k, v in record.items()}
        step = int(rec["step"])
        safe = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in rec.items()}
        line = json.dumps(safe, allow_nan=False) + "\n"
        self._sink("metrics.jsonl", lambda: (self._file.write(line), self._file.flush()))  # a crash loses one line
        scalars = {
            k: v for k, v in rec.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self._writer is not None:
            self._sink(
                "TensorBoard", lambda: [self._writer.add_scalar(k, v, global_step=step) for k, v in scalars.items()]
            )
        if self._wandb is not None and scalars:
            self._sink("Weights & Biases", lambda: self._wandb.log({"step": step, **scalars}))
        if isinstance(rec.get("step_time_s"), (int, float)):
            self._step_time = rec["step_time_s"]
        if self._bar is None:
            self._print(
                f"step {step:>{len(str(self._total))}}/{self._total} | "
                + " | ".join(self._fields(rec) + self._eta(step))
            )
            return
        self._shown.update(
            {k: rec[k] for k in ("loss", "eval_loss", "tokens_per_s", "mfu", "mfu_fp8") if rec.get(k) is not None}
        )
        self._bar.set_postfix_str(", ".join(self._fields(self._shown)), refresh=False)
        self._bar.update(max(0, min(step, self._total) - self._bar.n))
        self._bar.refresh()
        if "eval_loss" in rec and "loss" not in rec:  # eval results stay on screen
            self._bar.write(f"step {step}: " + " | ".join(self._fields(rec)), file=sys.stdout)

    def _sink(self, name: str, write: Callable[[], Any]) -> None:
        """A write to one of the log's sinks; one that fails (a full or read-only disk, a W&B outage) warns once
        and training goes on: the checkpoints, not the logs, are what a run cannot lose."""
        try:
            write()
        except Exception as err:  # noqa: BLE001 - OSError for files; W&B raises its own types
            if name not in self._failed:
                self._failed.add(name)
                text = getattr(err, "strerror", None) or str(err).strip()  # an OSError's reason, not its "[Errno N]"
                reason = text.splitlines()[0][:200] if text else type(err).__name__
                self.message(
                    f"warning: writing {name} failed ({reason}); training goes on without it until it "
                    "can be written again"
                )

    @staticmethod
    def _fields(rec: dict) -> list[str]:
        out = [f"{k} {rec[k]:.4f}" for k in ("loss", "eval_loss") if isinstance(rec.get(k), (int, float))]
        if isinstance(rec.get("stage"), int):  # a staged run's next stage begins
            out.append(f"stage {rec['stage']} begins")
        if isinstance(rec.get("tokens_per_s"), (int, float)):
            out.append(f"{rec['tokens_per_s']:,.0f} tok/s")
        if isinstance(rec.get("mfu"), (int, float)):
            out.append(f"MFU {100 * rec['mfu']:.1f}%")
        if isinstance(rec.get("mfu_fp8"), (int, float)):
            out.append(f"{100 * rec['mfu_fp8']:.1f}% of fp8")
        return out

    def _eta(self, step: int) -> list[str]:
        """From the measured step time, so compilation and evaluation pauses do not skew it."""
        if self._step_time is None:
            return []
        return [f"ETA {format_clock(max(0, self._total - step) * self._step_time)}"]

    def message(self, text: str) -> None:
        """Print a line (a warning, a resume notice) without breaking the progress bar. A disabled log
        (processes other than 0) still hands it to print_fn, which shows their warnings."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            self._print(text)

    def close(self, exit_code: int | None = None) -> None:
        """Idempotent: safe to call again, e.g. from both a finally block and __exit__. `exit_code`
        (default 0) is what the W&B run records: nonzero marks it failed."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._sink("TensorBoard", lambda: (self._writer.flush(), self._writer.close()))
            self._writer = None
        if self._file is not None and not self._file.closed:
            self._sink("metrics.jsonl", self._file.close)
        if self._wandb is not None:
            self._wandb.finish(exit_code=exit_code)
            self._wandb = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        self.close(exit_code=None if exc_type is None else 1)


def read_metrics(path: pathlib.Path) -> list[dict]:
    """Records of a metrics.jsonl; a truncated last line (run in progress or killed) is skipped."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records: list[dict] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: corrupt metrics line ({e})") from None
        records.append(record)
    return records


class ThroughputMeter:
    """Tokens/s, step time and MFU over the timed steps since the last record, and their medians over
    the run. A step's time excludes compilation, evaluation and checkpoint pauses (goodput.py's clock)."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peaks: MfuPeaks, n_devices: int):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peaks, self.n_devices = peaks, n_devices
        self.records: list[dict[str, float]] = []  # tokens_per_s, step_time_s and the MFU fractions of each record
        self._steps, self._seconds, self._data_wait, self._tokens, self._flops = 0, 0.0, 0.0, 0, 0.0

    def add(
        self, seconds: float, data_wait: float, tokens: int | None = None, flops_per_token: float | None = None
    ) -> None:
        """One timed step; `tokens` and `flops_per_token`: its own where they differ from the meter's (a staged
        run's step of another stage than the current one)."""
        tokens = self.tokens_per_step if tokens is None else tokens
        self._steps += 1
        self._seconds += seconds
        self._data_wait += data_wait
        self._tokens += tokens
        self._flops += tokens * (self.flops_per_token if flops_per_token is None else flops_per_token)

    def record(self) -> dict[str, float | None]:
        """The window's figures for a metrics record (None before any timed step), and a new window."""
        if not self._steps:
            return {"tokens_per_s": None, "mfu": None}
        per_step = self._seconds / self._steps
        # hardware.MfuPeaks: "mfu" against the compute dtype's peak[, "mfu_fp8" against the fp8 peak, under
        # model.fp8 where the device has one]
        fractions = self.peaks.fractions(self._flops / self._seconds, self.n_devices)
        fields = {
            "tokens_per_s": self._tokens / self._seconds,
            "step_time_s": per_step,
            **{k: v for k, v in fractions.items() if v is not None},
            "data_wait_s": self._data_wait / self._steps,
        }
        self.records.append({k: v for k, v in fields.items() if k != "data_wait_s"})
        self._steps, self._seconds, self._data_wait, self._tokens, self._flops = 0, 0.0, 0.0, 0, 0.0
        return fields

    @property
    def median_tokens_per_s(self) -> float | None:
        return statistics.median(r["tokens_per_s"] for r in self.records) if self.records else None

    @property
    def median_step_s(self) -> float | None:
        """The median of the records' seconds per step (None before the first record)."""
        return statistics.median(r["step_time_s"] for r in self.records) if self.records else None

    def median_mfu(self) -> dict[str, float]:
        """The median of each record's MFU fractions: a staged run's stages each count their own FLOPs per token."""
        keys = [k for k in ("mfu", "mfu_fp8") if self.records and k in self.records[-1]]
        return {k: statistics.median(r[k] for r in self.records if k in r) for k in keys}
