"""What a failure costs besides the lost steps: how long a checkpoint save blocks training
(asynchronous vs synchronous Orbax saves of the same state, and the node-local tier's save), how long a
restore takes from each tier, and how long a restarted run takes to its first step (JAX's persistent
compilation cache cold vs warm). All measured in this invocation.

    .venv/bin/python bench/restart.py [--presets tiny bench] [--saves 5] [--restarts 3] [--json out.json]

Saves: the preset's full train state (params + AdamW moments) on one CPU device, saved --saves times
each way: durable saves (Orbax, into the run's checkpoints/) and local-tier saves (llama_jax/checkpoint/local.py,
into --local-dir, /dev/shm by default); "blocking" is the time the training loop waits in save(), "total"
includes waiting for the write to finish; "restore" reads the newest saved step back onto the device
(the median of --saves restores).
Restarts: a run of the first preset is trained to a checkpoint, then resumed in a new process (copied
run directory, same command) with an empty compilation cache and with the cache the first run filled;
the time from process start to the first resumed step's metrics record is the restart-to-first-step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_JAX = [sys.executable, "-m", "llama_jax"]


def environment() -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")


def bench_saves(preset: str, saves: int, work: Path, local_dir: Path) -> dict:
    import jax

    from llama_jax.checkpoint.checkpointer import Checkpointer, Tiers
    from llama_jax.checkpoint.local import LocalTier
    from llama_jax.config import load_config
    from llama_jax.distributed.peers import Peers
    from llama_jax.model.llama import param_count
    from llama_jax.training.program import TrainProgram

    config = load_config(preset, ["mesh.fsdp=1"])
    program = TrainProgram.for_config(config, devices=jax.devices()[:1])
    results = {"preset": preset, "params": param_count(config.model)}
    with program.activate():
        state = program.init_state(jax.random.key(0))
        jax.block_until_ready(state)
        results["state_mb"] = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e6
        for mode in ("async", "sync"):
            checkpoint = dataclasses.replace(config.checkpoint, async_save=mode == "async", keep=2)
            checkpointer = Checkpointer(Tiers(work / f"{preset}-{mode}"), checkpoint)
            blocking, total = [], []
            try:
                for step in range(1, saves + 1):
                    start = time.perf_counter()
                    blocked = checkpointer.save(step, state, {"next_step": step})
                    checkpointer.wait()
                    blocking.append(blocked)
                    total.append(time.perf_counter() - start)
            finally:
                checkpointer.close()
            results[f"{mode}_blocking_s"] = statistics.median(blocking)
            results[f"{mode}_total_s"] = statistics.median(total)
            if mode == "async":
                results["durable_restore_s"] = timed(
                    lambda checkpointer=checkpointer: checkpointer.restore(saves, program.abstract_checkpoint()), saves
                )
        local = LocalTier(str(local_dir), work / f"{preset}-local", program.mesh, Peers(60.0), keep=2, replicas=0)
        blocking, total = [], []
        for step in range(1, saves + 1):
            start = time.perf_counter()
            blocking.append(local.save(step, state, {"next_step": step}, {}))
            local.wait()
            total.append(time.perf_counter() - start)
        results["local_blocking_s"], results["local_total_s"] = statistics.median(blocking), statistics.median(total)
        results["local_restore_s"] = timed(lambda: local.restore(saves, program.abstract_checkpoint()), saves)
        shutil.rmtree(local.directory.parent, ignore_errors=True)
    return results


def timed(restore, repeats: int) -> float:
    """Seconds to restore a state and have it on the device: the median of `repeats` restores (one alone
    varies by 2x and more here, with the host's page cache and allocator)."""
    import jax

    def once() -> float:
        start = time.perf_counter()
        restored = restore()
        jax.block_until_ready(restored[0])
        return time.perf_counter() - start

    return statistics.median(once() for _ in range(repeats))


def first_step_seconds(command: list[str], run_dir: Path, step: int, timeout: float = 600) -> float:
    """Start the command; seconds until metrics.jsonl has a loss record for `step`; then stop it."""
    from llama_jax.training.metrics import read_metrics

    start = time.perf_counter()
    proc = subprocess.Popen(command, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    path = run_dir / "metrics.jsonl"
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise SystemExit(
                    f"{' '.join(command)} exited {proc.returncode} before step {step}:\n{proc.stderr.read()}"
                )
            if path.exists() and any(r.get("step") == step and "loss" in r for r in read_metrics(path)):
                return time.perf_counter() - start
            time.sleep(0.01)
        raise SystemExit(f"no step {step} within {timeout}s")
    finally:
        proc.kill()
        proc.wait()


def bench_restarts(preset: str, restarts: int, work: Path) -> dict:
    steps, saved = 40, 20
    common = [
        preset,
        f"train.steps={steps}",
        f"checkpoint.every_steps={saved}",
        f"data.cache_dir={work / 'cache'}",
        "run.tensorboard=false",
        "train.eval_every=0",
    ]
    warm_cache = work / "jax_cache_warm"
    original = work / "original"
    first = subprocess.run(
        [*LLAMA_JAX, "train", *common, f"run.dir={original}", f"run.compilation_cache={warm_cache}"],
        env=environment(),
        capture_output=True,
        text=True,
    )
    if first.returncode != 0:
        raise SystemExit(f"the first run failed:\n{first.stderr}")
    shutil.rmtree(original / "checkpoints" / str(steps))  # resume from step `saved`
    results = {}
    for kind in ("cold", "warm"):
        times = []
        for attempt in range(restarts):
            run_dir = work / f"resume-{kind}-{attempt}"
            shutil.copytree(original, run_dir)
            (run_dir / "metrics.jsonl").unlink()
            cache = warm_cache if kind == "warm" else work / f"jax_cache_cold_{attempt}"
            command = [*LLAMA_JAX, "train", *common, f"run.dir={run_dir}", f"run.compilation_cache={cache}"]
            times.append(first_step_seconds(command, run_dir, saved + 1))
        results[f"restart_to_first_step_{kind}_s"] = statistics.median(times)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "bench"])
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument(
        "--local-dir",
        default="/dev/shm" if Path("/dev/shm").is_dir() else None,
        help="node-local storage for the local tier's saves (default /dev/shm; else the work dir)",
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    import jax

    results: dict = {"cpu_cores": os.cpu_count(), "jax": jax.__version__, "saves": [], "restart": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for preset in args.presets:
            local_dir = Path(args.local_dir) / f"llama-jax-bench-{os.getpid()}" if args.local_dir else work / "local"
            results["saves"].append(bench_saves(preset, args.saves, work, local_dir))
        results["restart"] = {"preset": args.presets[0], **bench_restarts(args.presets[0], args.restarts, work)}

    print(f"checkpoint saves (median of {args.saves}, one CPU device, jax {jax.__version__}):")
    print(
        f"{'preset':<8}{'params':>12}{'state MB':>10}{'async blocks':>14}{'async total':>13}"
        f"{'sync blocks':>13}{'blocking ratio':>16}{'local blocks':>14}{'local total':>13}"
        f"{'durable restore':>17}{'local restore':>15}"
    )
    for r in results["saves"]:
        print(
            f"{r['preset']:<8}{r['params']:>12,}{r['state_mb']:>10.1f}{r['async_blocking_s']:>13.3f}s"
            f"{r['async_total_s']:>12.3f}s{r['sync_blocking_s']:>12.3f}s"
            f"{r['sync_blocking_s'] / r['async_blocking_s']:>15.1f}x{r['local_blocking_s']:>13.3f}s"
            f"{r['local_total_s']:>12.3f}s{r['durable_restore_s']:>16.3f}s{r['local_restore_s']:>14.3f}s"
        )
    r = results["restart"]
    print(
        f"\nrestart to first step, {r['preset']} (median of {args.restarts}): "
        f"cold compilation cache {r['restart_to_first_step_cold_s']:.2f}s, "
        f"warm {r['restart_to_first_step_warm_s']:.2f}s"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
