"""Multi-process runs on this machine, side by side with one process: the losses of 1 x 8 and 2 x 4
simulated CPU devices, and how long the survivor of a 2-process run takes to stop after its peer is
SIGKILLed (JAX's heartbeat), then how long the supervisor needs to bring both back to the end.

    .venv/bin/python bench/multihost.py [--steps 10] [--heartbeat 30] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / "launch" / "local.sh"
TINY = [
    "model.vocab_size=320",
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "train.batch_size=8",
    "train.seq_len=32",
    "train.log_every=1",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "run.tensorboard=false",
]


def environment() -> dict:
    return dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", LLAMA_JAX=str(Path(sys.executable).parent / "llama-jax"))


def losses(run_dir: Path) -> dict[int, float]:
    from llama_jax.training.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--heartbeat", type=float, default=30.0, help="run.heartbeat_timeout_s")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()

    from llama_jax.checkpoint.durable import latest_checkpoint_step

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        common = [
            *TINY,
            f"data.cache_dir={work / 'cache'}",
            f"run.compilation_cache={work / 'jax_cache'}",
            *args.overrides,
        ]
        runs = {}
        for processes in (1, 2):
            run_dir = work / f"p{processes}"
            start = time.perf_counter()
            proc = subprocess.run(
                [
                    str(LOCAL),
                    "--processes",
                    str(processes),
                    "--devices",
                    str(8 // processes),
                    "--",
                    "train",
                    *common,
                    f"train.steps={args.steps}",
                    f"run.dir={run_dir}",
                ],
                env=environment(),
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                sys.exit(f"{processes} process(es) failed:\n{proc.stderr}")
            runs[processes] = (losses(run_dir), time.perf_counter() - start)
        print(f"{'step':>5} {'1 process x 8 devices':>22} {'2 processes x 4 devices':>24} {'relative difference':>20}")
        for step in sorted(runs[1][0]):
            a, b = runs[1][0][step], runs[2][0][step]
            print(f"{step:>5} {a:>22.7f} {b:>24.7f} {abs(a - b) / abs(a):>20.2e}")
        print(f"wall time: 1 process {runs[1][1]:.1f}s, 2 processes {runs[2][1]:.1f}s")

        # Kill process 1 of 2 after a checkpoint; the survivor must stop on its own; the supervisor restarts both.
        run_dir, steps = work / "killed", 4 * args.steps
        supervisor = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llama_jax",
                "supervise",
                "--backoff",
                "1",
                "--",
                str(LOCAL),
                "--processes",
                "2",
                "--devices",
                "4",
                "--",
                "train",
                *common,
                f"train.steps={steps}",
                "checkpoint.every_steps=5",
                f"run.heartbeat_timeout_s={args.heartbeat:g}",
                f"run.dir={run_dir}",
            ],
            env=environment(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        pids, lines = {}, []
        while len(pids) < 2:
            lines.append(supervisor.stderr.readline())
            if match := re.match(r"multiprocess: process (\d) started \(pid (\d+)\)", lines[-1]):
                pids[int(match.group(1))] = int(match.group(2))
        while latest_checkpoint_step(run_dir) < 5:
            time.sleep(0.1)
        os.kill(pids[1], 9)
        killed_at = time.perf_counter()
        _, rest = supervisor.communicate()
        log = "".join(lines) + rest
        died = float(re.search(r"process 1 exited with status 137 after ([\d.]+)s", log).group(1))
        survivor = re.search(r"process 0 exited with status (\d+) after ([\d.]+)s", log)
        print(
            f"\nSIGKILL to process 1 of 2 (heartbeat timeout {args.heartbeat:g}s): process 0 stopped by itself "
            f"{float(survivor.group(2)) - died:.1f}s later (status {survivor.group(1)}); the supervisor's restart "
            f"reached step {max(losses(run_dir))} of {steps} {time.perf_counter() - killed_at:.1f}s after the kill "
            f"(exit {supervisor.returncode})"
        )


if __name__ == "__main__":
    main()
