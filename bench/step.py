"""Training-step speed of a preset on the current devices, next to the hardware peak and the peer
(Hugging Face transformers + PyTorch, bench/peer.py), measured in this one invocation.

    .venv/bin/python bench/step.py [--preset bench] [--steps 5] [--peer] [--peer-python PY] [--no-peer-compile]
                                   [--ablation] [--versus "key=value ..."]... [--json out.json] [key=value ...]

Ours: the jitted train step (AdamW, clipping, the preset's remat policy and attention kernel) on random
tokens, 2 warm-up steps, then the median of --steps. MFU = model FLOPs (llama_jax.model.flops.train_flops_per_token,
attention halved when the kernel skips the masked half) / (peak x devices); the peak is the data-sheet
figure of a known accelerator, or on CPU the best fp32 matmul measured here, now. Peak memory is the
compiled step's footprint (XLA's memory analysis) and, on accelerators, the device's peak in use.
--peer runs bench/peer.py (with --peer-python, default this interpreter) on the same preset and overrides, eager
and under torch.compile (not with --no-peer-compile: it takes minutes on a CPU), and prints the ratios. Each
--versus measures the same preset and overrides with those key=value settings on top, in this run, e.g. a
4-stage pipeline against fsdp on the same devices and global batch:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 .venv/bin/python bench/step.py mesh.pipeline=4 \
        mesh.fsdp=1 train.microbatches=8 --versus "mesh.pipeline=1 mesh.fsdp=4"
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# The CPU fast path, one change at a time (--ablation): each row adds one to the row before.
ABLATION = [
    (
        "XLA attention, einsum backward, no recomputation",
        ["model.attention=xla", "model.cpu_projection=false", "remat.policy=none"],
    ),
    ("+ blocked (flash) attention", ["model.attention=auto", "model.cpu_projection=false", "remat.policy=none"]),
    ("+ CPU projection backward", ["model.attention=auto", "model.cpu_projection=true", "remat.policy=none"]),
    ("+ the preset's recomputation policy", []),
]


def measure_ours(preset: str, overrides: list[str], steps: int, peak: tuple[float, str] | None = None) -> dict:
    import jax

    from llama_jax.config import load_config
    from llama_jax.perf.hardware import MfuPeaks, measure_matmul_peak, table_peak_flops
    from llama_jax.training.batches import put_batch
    from llama_jax.training.program import TrainProgram
    from llama_jax.training.step import model_flops_per_token
    from llama_jax.training.timing import random_batch, time_train_steps

    config = load_config(preset, overrides)
    program = TrainProgram.for_config(config)
    mesh = program.mesh
    b, t = config.train.batch_size, config.train.seq_len
    with program.activate():
        state = program.init_state(jax.random.key(0))
        placed = put_batch(program, random_batch(config))
        memory = program.train_step.lower(state, placed).compile().memory_analysis()
        times, metrics = time_train_steps(program, state, placed, steps, warmup=2)
    device = jax.devices()[0]
    peak, peak_source = peak or (table_peak_flops(device.device_kind, config.model.compute_dtype), "data sheet")
    if peak is None:  # CPU: the whole machine's best matmul, shared by the simulated devices
        peak = max(measure_matmul_peak(config.model.compute_dtype, size) for size in (1024, 2048))
        peak /= jax.local_device_count() if device.platform == "cpu" else 1
        peak_source = f"{config.model.compute_dtype} matmul measured now"
    step_s = statistics.median(times)
    tokens_per_s = b * t / step_s
    flops = model_flops_per_token(config)
    stats = device.memory_stats() or {}
    return {
        "preset": preset,
        "overrides": overrides,
        "devices": mesh.devices.size,
        "mesh": dict(mesh.shape),
        "device": device.device_kind,
        "remat": config.remat.policy,
        "attention": config.model.attention,
        "step_s": step_s,
        "tokens_per_s": tokens_per_s,
        "model_flops_per_token": flops,
        "achieved_flops_per_s": tokens_per_s * flops,
        "peak_flops_per_device": peak,
        "peak_source": peak_source,
        # mfu against the compute dtype's peak; under model.fp8 mfu_fp8 against the fp8 peak (None on a CPU)
        **MfuPeaks.with_fp8(peak, peak_source, config.model.fp8, device.device_kind).fractions(
            tokens_per_s * flops, mesh.devices.size
        ),
        "compiled_bytes": memory.argument_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes,
        "device_peak_bytes": stats.get("peak_bytes_in_use"),
        "process_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "loss": float(metrics["loss"]),
        "jax": jax.__version__,
    }


def run_peer(python: str, preset: str, overrides: list[str], steps: int, compiled: bool = True) -> dict:
    """bench/peer.py's figures for the model ours measured (the preset with the same overrides), or its error line."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        proc = subprocess.run(
            [
                python,
                str(HERE / "peer.py"),
                "--preset",
                preset,
                "--steps",
                str(steps),
                *(["--compile"] if compiled else []),
                "--json",
                str(out),
                *overrides,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
        return json.loads(out.read_text())


def refuse_bad_settings(preset: str, overrides: list[str], versus: list[str]) -> None:
    """Every config this run would measure loads, or one line and exit 2 before anything is timed (a bad
    --versus used to surface as a traceback after minutes of measuring)."""
    from llama_jax.config import load_config
    from llama_jax.errors import ConfigError

    for settings in ["", *versus]:
        try:
            load_config(preset, [*overrides, *settings.split()])
        except ConfigError as error:
            print(f"bench/step.py: {error}" + (f" (in --versus '{settings}')" if settings else ""), file=sys.stderr)
            sys.exit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--peer", action="store_true", help="also time the Hugging Face + PyTorch peer")
    parser.add_argument("--peer-python", default=sys.executable, help="interpreter with torch + transformers")
    parser.add_argument(
        "--no-peer-compile",
        dest="peer_compile",
        action="store_false",
        help="time only the peer's eager step (torch.compile takes minutes on a CPU)",
    )
    parser.add_argument("--ablation", action="store_true", help="also time the CPU fast path one change at a time")
    parser.add_argument(
        "--versus",
        action="append",
        default=[],
        metavar="'key=value ...'",
        help="also measure with these settings on top of the overrides (repeatable)",
    )
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    refuse_bad_settings(args.preset, args.overrides, args.versus)

    ours = measure_ours(args.preset, args.overrides, args.steps)
    results = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "cores": os.cpu_count(), "ours": ours}
    if args.ablation:
        peak = (ours["peak_flops_per_device"], ours["peak_source"])
        results["ablation"] = [
            {"change": name, **measure_ours(args.preset, [*overrides, *args.overrides], args.steps, peak)}
            for name, overrides in ABLATION
        ]
    if args.versus:
        peak = (ours["peak_flops_per_device"], ours["peak_source"])
        results["versus"] = [
            measure_ours(args.preset, [*args.overrides, *settings.split()], args.steps, peak)
            for settings in args.versus
        ]
    if args.peer:
        results["peer"] = run_peer(args.peer_python, args.preset, args.overrides, args.steps, args.peer_compile)

    gib = 2**30
    print(
        f"{args.preset} {' '.join(args.overrides)} on {ours['devices']} x {ours['device']} ({results['cpu']}, "
        f"{results['cores']} cores), jax {ours['jax']}, remat {ours['remat']}, attention {ours['attention']}"
    )
    print(
        f"  ours: {ours['tokens_per_s']:9.1f} tokens/s  {ours['step_s']:.3f} s/step  "
        f"{ours['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s = MFU {100 * ours['mfu']:.1f}% of "
        f"{ours['peak_flops_per_device'] / 1e9:.1f} GFLOP/s per device ({ours['peak_source']})"
        + (f", {100 * ours['mfu_fp8']:.1f}% of the fp8 peak" if ours["mfu_fp8"] is not None else "")
    )
    print(
        f"        compiled step {ours['compiled_bytes'] / gib:.2f} GiB, process peak RSS "
        f"{ours['process_max_rss_bytes'] / gib:.2f} GiB"
        + (f", device peak {ours['device_peak_bytes'] / gib:.2f} GiB" if ours["device_peak_bytes"] else "")
    )
    for row, settings in zip(results.get("versus", []), args.versus):
        fp8 = f" ({100 * row['mfu_fp8']:.1f}% of fp8)" if row["mfu_fp8"] is not None else ""
        print(
            f"  with {settings}: {row['tokens_per_s']:9.1f} tokens/s  {row['step_s']:.3f} s/step  MFU "
            f"{100 * row['mfu']:.1f}%{fp8}, compiled step {row['compiled_bytes'] / gib:.2f} GiB, mesh {row['mesh']} "
            "-> "
            f"ours / this = {ours['tokens_per_s'] / row['tokens_per_s']:.2f}x"
        )
    previous = None
    for row in results.get("ablation", []):
        gain = f"  {row['tokens_per_s'] / previous - 1:+.0%}" if previous else ""
        print(f"  {row['change']:<50} {row['tokens_per_s']:8.1f} tokens/s  MFU {100 * row['mfu']:4.1f}%{gain}")
        previous = row["tokens_per_s"]
    peer = results.get("peer", {})
    for mode in ("eager", "compiled"):
        entry = peer.get(mode)
        if isinstance(entry, dict) and "tokens_per_s" in entry:
            print(
                f"  peer ({mode}, transformers {peer['transformers']}, torch {entry['torch']}): "
                f"{entry['tokens_per_s']:9.1f} tokens/s -> ours / peer = "
                f"{ours['tokens_per_s'] / entry['tokens_per_s']:.2f}x"
            )
        elif isinstance(entry, dict):
            print(f"  peer ({mode}): {entry.get('error')}")
    if "error" in peer:
        print(f"  peer: {peer['error']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
