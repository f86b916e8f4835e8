"""Writes linen_run/: a run that the model wrote when it was Flax Linen (commit 464e997), for the test that such a
run resumes under the Flax NNX model (tests/test_train.py). A token store of 40 small documents (store/) and a
4-step run of a 13K-parameter model on it (run/), checkpointed at steps 2 and 4; its metrics.jsonl holds the
losses of the uninterrupted run. About 600 KB.

    PYTHONPATH=<a worktree of 464e997> .venv/bin/python tests/golden/make_linen_run.py
"""

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parent / "linen_run"
TRAIN = [
    "tiny",
    "model.vocab_size=288",
    "model.d_model=16",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=32",
    "model.max_seq_len=64",
    "model.compute_dtype=float32",
    "train.seq_len=16",
    "train.batch_size=4",
    "train.steps=4",
    "train.warmup_steps=0",
    "train.lr=1e-2",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.sample_tokens=0",
    "checkpoint.every_steps=2",
    "checkpoint.keep=2",
    "run.tensorboard=false",
]


def documents(directory: Path) -> None:
    """40 documents of 200 random words (the test suite's corpus fixture)."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]
    for i in range(40):
        (directory / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 200)))


if __name__ == "__main__":
    jaxlib = importlib.metadata.version("jaxlib")
    shutil.rmtree(ROOT, ignore_errors=True)
    documents(ROOT / "corpus")
    command = [sys.executable, "-m", "llama_jax"]
    # One CPU device, compiled as the test suite compiles (tests/conftest.py's flags: the same numbers, faster).
    flags = "--xla_backend_optimization_level=0" + (" --xla_cpu_use_fusion_emitters=false" if "0.10." in jaxlib else "")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    prepare = ["prepare", "corpus", "--out", "store", "--train-tokenizer", "288"]
    subprocess.run([*command, *prepare], cwd=ROOT, env=env, check=True)
    subprocess.run([*command, "train", *TRAIN, "data.sources=[store]", "run.dir=run"], cwd=ROOT, env=env, check=True)
    shutil.rmtree(ROOT / "corpus")
    (ROOT / "run" / "report.png").unlink()
