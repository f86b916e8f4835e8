"""Throughput accounting (peak FLOP/s, MFU) and what a user sees while a run trains.

MFU = achieved model FLOP/s / (peak FLOP/s of one device x number of devices). The peak comes from a
table of vendor data-sheet figures (dense, never the 2x "with sparsity" numbers) or, on CPU and on
accelerators the table does not know, from a matmul timed on this machine and cached, so every run
on the same machine/software divides by the same number. Never a hard-coded A100 peak.

MetricsLog is the single sink for training metrics: metrics.jsonl (the interface scripts rely on),
TensorBoard, and a tqdm bar (terminal) or one plain line per log call (log files, CI, Slurm).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from llama_jax.files import atomic_path

# Peak dense TFLOP/s of ONE jax device as (bf16, fp16, fp32); None = no figure we trust -> measure.
# fp32 is the plain CUDA-core figure, not TF32. Note JAX's default matmul precision may use TF32 on
# Ampere+, so fp32 "MFU" can then exceed 100%; set jax_default_matmul_precision=highest to compare.
# Sources (dense columns): NVIDIA H100 data sheet (SXM / PCIe / NVL), H200 data sheet (SXM / NVL;
# GH200 has the H100/H200 SXM GPU), A100 40/80GB data sheet (SXM = PCIe peaks), A10, L4 and L40S data
# sheets (their tensor figures marked * are sparse: halved here), V100 (SXM2 / PCIe) and T4 data
# sheets (fp16 tensor cores, no bf16), HGX B200 data sheet (per GPU = 1/8; fp32 left to measurement),
# AMD Instinct MI300X data sheet, Google Cloud TPU system-architecture pages (bf16 per chip; v2/v3
# expose each of a chip's 2 cores as a jax device, hence half the chip figure).
# "A10G" (AWS) is deliberately absent: no vendor data sheet, so it is measured.
_PEAK_TFLOPS: dict[str, tuple[float | None, float | None, float | None]] = {
    "H100": (989.0, 989.0, 67.0),
    "H100 PCIe": (756.0, 756.0, 51.0),
    "H100 NVL": (835.0, 835.0, 60.0),
    "H200": (989.0, 989.0, 67.0),
    "H200 NVL": (835.0, 835.0, 60.0),
    "GH200": (989.0, 989.0, 67.0),
    "A100": (312.0, 312.0, 19.5),
    "A10": (125.0, 125.0, 31.2),
    "L4": (121.0, 121.0, 30.3),
    "L40S": (362.0, 362.0, 91.6),
    "V100": (None, 125.0, 15.7),
    "V100-PCIE": (None, 112.0, 14.0),
    "T4": (None, 65.0, 8.1),
    "B200": (2250.0, 2250.0, None),
    "MI300X": (1307.4, 1307.4, 163.4),
    "TPU v2": (22.5, None, None),
    "TPU v3": (61.5, None, None),
    "TPU v4": (275.0, None, None),
    "TPU v5 lite": (197.0, None, None), "TPU v5e": (197.0, None, None),  # jax says "v5 lite"
    "TPU v5": (459.0, None, None), "TPU v5p": (459.0, None, None),
    "TPU v6 lite": (918.0, None, None), "TPU v6e": (918.0, None, None),
}
_COLUMN = {"bfloat16": 0, "float16": 1, "float32": 2}
_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _dtype_name(dtype: Any) -> str:
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    if name not in _COLUMN:
        raise ValueError(f"compute dtype must be one of {sorted(_COLUMN)}, got {dtype!r}")
    return name


def table_key(device_kind: str) -> str | None:
    """The data-sheet name of a device kind (e.g. "NVIDIA H100 80GB HBM3" -> "H100"), or None: the longest
    table key found in device_kind as a whole word ("L4" must not match "L40S")."""
    kind = device_kind.lower()
    hits = [k for k in _PEAK_TFLOPS
            if re.search(rf"(?<![a-z0-9]){re.escape(k.lower())}(?![a-z0-9])", kind)]
    return max(hits, key=len) if hits else None


def table_peak_flops(device_kind: str, dtype: str) -> float | None:
    """Data-sheet dense peak FLOP/s of one device of this kind, or None if unknown."""
    column = _COLUMN[_dtype_name(dtype)]  # validate dtype even for unknown devices
    key = table_key(device_kind)
    tflops = None if key is None else _PEAK_TFLOPS[key][column]
    return None if tflops is None else tflops * 1e12


def measure_matmul_peak(dtype: str = "float32", size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a jitted square matmul on the default device: best of `repeats` timed chains."""
    chain = 4  # back-to-back matmuls per timing, so dispatch overhead is amortised
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (size, size), jnp.float32).astype(dtype)
    # Scaling by 1/sqrt(size) keeps unit variance along the chain: no overflow, no subnormals.
    b = (jax.random.normal(key_b, (size, size), jnp.float32) / math.sqrt(size)).astype(dtype)
    matmul = jax.jit(jnp.matmul)

    def run() -> None:
        x = a
        for _ in range(chain):  # each product feeds the next: none can be skipped or overlapped
            x = matmul(x, b)
        x.block_until_ready()

    run()  # compile and warm up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return chain * 2.0 * size**3 / best


def device_peak_flops(dtype: str, cache_dir: pathlib.Path) -> tuple[float, str]:
    """Peak FLOP/s of ONE device (jax.devices()[0]) for `dtype`, and where the figure came from.

    Unknown devices (always CPU) get a measured matmul, cached in cache_dir/peak_flops.json. One
    CPU device already uses every core, so the measurement is the whole machine's peak; simulated
    CPU devices (--xla_force_host_platform_device_count=N) share those cores, so each is credited
    with 1/N of it and MFU over N devices still divides by the machine's peak.
    """
    dtype = _dtype_name(dtype)
    device = jax.devices()[0]
    key = table_key(device.device_kind)
    peak = table_peak_flops(device.device_kind, dtype)
    if peak is not None:
        return peak, f"{key} table, {dtype} dense"
    where = f"measured {_SHORT[dtype]} matmul on {device.device_kind}"
    sharing = jax.local_device_count() if device.platform == "cpu" else 1
    if sharing > 1:
        where += f", split over {sharing} simulated devices sharing the cores"
    cache_key = "|".join([device.platform, device.device_kind, str(os.cpu_count()),
                          jax.__version__, dtype, os.environ.get("XLA_FLAGS", "")])
    path = cache_dir / "peak_flops.json"
    try:
        cache = json.loads(path.read_text(encoding="utf-8"))
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):  # missing or corrupt: measure and rewrite
        cache = {}
    cached = cache.get(cache_key)
    if isinstance(cached, (int, float)) and cached > 0:
        return float(cached) / sharing, where + ", cached"
    peak = measure_matmul_peak(dtype)
    cache[cache_key] = peak
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:  # a concurrent reader or a crash never sees half a cache
            tmp.write_text(json.dumps(cache, indent=1, sort_keys=True), encoding="utf-8")
    except OSError:  # read-only or full disk: the figure is still right, just not reused
        return peak / sharing, where + ", not cached"
    return peak / sharing, where


def mfu(model_flops_per_s: float, peak_per_device: float, n_devices: int) -> float:
    """Model FLOPs utilisation as a fraction (0.41 = 41%)."""
    if peak_per_device <= 0 or n_devices < 1:
        raise ValueError(f"need peak_per_device > 0 and n_devices >= 1, got "
                         f"{peak_per_device}, {n_devices}")
    return model_flops_per_s / (peak_per_device * n_devices)


def _plain(value: Any) -> Any:
    """numpy/jax scalars -> Python bool/int/float so json and TensorBoard accept them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        return _plain(value.item())
    raise TypeError(f"metrics values must be scalars or strings, got {type(value).__name__}")


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


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


class MetricsLog:
    """Writes each record to metrics.jsonl and TensorBoard and shows progress (enabled on process 0 only).

    Records carry "step" and optionally "loss", "eval_loss", "tokens_per_s", "mfu" (a fraction)
    and any other scalars. Non-finite floats are written to JSONL as null (strict JSON).
    """

    def __init__(self, run_dir: pathlib.Path, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, interactive: bool | None = None,
                 print_fn: Callable[[str], Any] = print, enabled: bool = True) -> None:
        self.enabled = enabled  # False on processes other than 0 of a multi-process run: log nothing
        self._bar = self._writer = self._file = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        _drop_partial_last_line(path)
        self._file = path.open("a", encoding="utf-8")  # append: a resumed run continues the file
        self._total = total_steps
        self._print = print_fn
        self._step_time: float | None = None  # latest measured seconds per step, for the ETA
        self._shown: dict[str, Any] = {}  # latest value of each displayed field
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported lazily: only needed when enabled
            self._writer = SummaryWriter(logdir=str(run_dir / "tensorboard"))
        if interactive is None:
            interactive = sys.stdout.isatty()
        if interactive:
            from tqdm import tqdm
            # initial=start_step: the bar of a resumed run starts where it left off and tqdm's
            # rate/ETA count only the steps done in this process.
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step",
                             file=sys.stdout, dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if "step" not in record:
            raise ValueError(f"metrics record needs a 'step' field, got keys {sorted(record)}")
        if not self.enabled:
            return
        rec = {str(k): _plain(v) for k, v in record.items()}
        step = int(rec["step"])
        safe = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in rec.items()}
        self._file.write(json.dumps(safe, allow_nan=False) + "\n")
        self._file.flush()  # a crash loses at most the line being written
        if self._writer is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._writer.add_scalar(k, v, global_step=step)
        if isinstance(rec.get("step_time_s"), (int, float)):
            self._step_time = rec["step_time_s"]
        if self._bar is None:
            self._print(f"step {step:>{len(str(self._total))}}/{self._total} | "
                        + " | ".join(self._fields(rec) + self._eta(step)))
            return
        self._shown.update({k: rec[k] for k in ("loss", "eval_loss", "tokens_per_s", "mfu")
                            if rec.get(k) is not None})
        self._bar.set_postfix_str(", ".join(self._fields(self._shown)), refresh=False)
        self._bar.update(max(0, min(step, self._total) - self._bar.n))
        self._bar.refresh()
        if "eval_loss" in rec and "loss" not in rec:  # eval results stay on screen
            self._bar.write(f"step {step}: " + " | ".join(self._fields(rec)), file=sys.stdout)

    @staticmethod
    def _fields(rec: dict) -> list[str]:
        out = [f"{k} {rec[k]:.4f}" for k in ("loss", "eval_loss")
               if isinstance(rec.get(k), (int, float))]
        if isinstance(rec.get("tokens_per_s"), (int, float)):
            out.append(f"{rec['tokens_per_s']:,.0f} tok/s")
        if isinstance(rec.get("mfu"), (int, float)):
            out.append(f"MFU {100 * rec['mfu']:.1f}%")
        return out

    def _eta(self, step: int) -> list[str]:
        """From the measured step time, so compilation and evaluation pauses do not skew it."""
        if self._step_time is None:
            return []
        return [f"ETA {_duration(max(0, self._total - step) * self._step_time)}"]

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            self._print(text)

    def close(self) -> None:
        """Idempotent: safe to call again, e.g. from both a finally block and __exit__."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
        if self._file is not None and not self._file.closed:
            self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
