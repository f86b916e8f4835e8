"""Shared fixtures. Every test process sees 8 simulated CPU devices (set before jax is imported)."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import threading

# --xla_backend_optimization_level=0: XLA:CPU's LLVM code generation without its optimisation passes. The tests
# compile hundreds of small programs and run each a few steps, so compiling dominates: a third less CPU time for
# the suite; the programs compute the same numbers (the HLO passes are XLA's, not LLVM's).
# --xla_cpu_use_fusion_emitters=false (jaxlib 0.10; 0.12 no longer has the flag and refuses it): XLA:CPU's elemental
# emitter for loop fusions instead of its MLIR fusion emitters, which compile slower. An 8-device step compiles in
# 2.3 s instead of 3.8 s with the same losses, bit for bit.
# The tests' own llama-jax subprocesses get them too (subprocess_environment), without the device count.
COMPILE_FLAGS = "--xla_backend_optimization_level=0" + (
    " --xla_cpu_use_fusion_emitters=false" if importlib.metadata.version("jaxlib").startswith("0.10.") else ""
)
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8", COMPILE_FLAGS]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole session, shared by the xdist workers and the subprocesses
# they start (all inherit the controller's environment): the suite compiles the same tiny programs in many
# tests, and a hit costs ~0.1 s where a compile costs seconds. Empty at the start of every session, removed
# at its end (pytest_sessionfinish), so nothing carries over between runs.
if "LLAMA_JAX_TEST_CACHE" not in os.environ:
    os.environ["LLAMA_JAX_TEST_CACHE"] = tempfile.mkdtemp(prefix="llama-jax-test-compilation-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["LLAMA_JAX_TEST_CACHE"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The user cache (prepared data stores, plans, the measured matmul rate: files.cache_root) is the session's too, in
# the same folder: a test neither reads what an earlier run left in ~/.cache nor leaves anything there, so a run
# here costs what it costs on CI's clean machine.
os.environ["XDG_CACHE_HOME"] = os.path.join(os.environ["LLAMA_JAX_TEST_CACHE"], "user")

import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from llama_jax.config import Config, DataConfig, ModelConfig, RunConfig, TrainConfig  # noqa: E402

# A model small enough to compile in a second or two, with GQA (4 query heads, 2 kv heads).
# Its vocab fits a byte-level BPE of 256 bytes + 2 special tokens + a few merges.
TINY_MODEL = ModelConfig(
    vocab_size=320,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=128,
    max_seq_len=128,
    rope_theta=10000.0,
    compute_dtype="float32",
)


def tiny_config(tmp_path=None, **sections) -> Config:
    """A Config built around TINY_MODEL; keyword arguments replace whole sections or fields,
    e.g. tiny_config(train=dict(steps=3), mesh=dict(fsdp=1))."""
    base = Config(
        model=TINY_MODEL,
        train=TrainConfig(
            steps=4,
            batch_size=8,
            seq_len=32,
            warmup_steps=0,
            log_every=1,
            eval_every=0,
            eval_batches=1,
            sample_tokens=0,
        ),
        data=DataConfig(cache_dir=str(tmp_path / "cache") if tmp_path else ""),
        run=RunConfig(dir=str(tmp_path / "run") if tmp_path else "runs/test", tensorboard=False),
    )
    for section, fields in sections.items():
        base = dataclasses.replace(base, **{section: dataclasses.replace(getattr(base, section), **fields)})
    return base


@pytest.fixture
def tiny():
    return tiny_config


def forward(model, params, *args, **kwargs):
    """`model` (an NNX module; an abstract one, llama.abstract_model, will do) run with `params`, a plain dict like
    the train state's: the functional call every program of the package makes (nnx.merge of its graph)."""
    from flax import nnx

    return nnx.merge(nnx.graphdef(model), params)(*args, **kwargs)


def subprocess_environment() -> dict:
    """The environment of a test's llama-jax subprocesses: CPU, the compile flags above, no device count (one
    device each, or the launcher's --devices), and this venv's llama-jax for launch/multiprocess.py."""
    return dict(
        os.environ,
        XLA_FLAGS=COMPILE_FLAGS,
        JAX_PLATFORMS="cpu",
        LLAMA_JAX=str(Path(sys.executable).parent / "llama-jax"),
    )


class Supervised:
    """`command` (a `llama-jax supervise -- ...` line) in the background; `lines` gathers its stdout and stderr
    lines as they come, so a test can watch them while the processes run."""

    def __init__(self, command: list[str], env: dict):
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.readers = [
            threading.Thread(target=lambda s=stream: self.lines.extend(iter(s.readline, "")), daemon=True)
            for stream in (self.process.stdout, self.process.stderr)
        ]
        for reader in self.readers:
            reader.start()

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float) -> int:
        """The exit status, once every line it wrote is in `lines`."""
        status = self.process.wait(timeout=timeout)
        for reader in self.readers:
            reader.join(timeout=10)
        return status


def write_tiny_yaml(root, **sections):
    """A config file around TINY_MODEL for subprocess runs, with the data store cached under root (shared by the
    runs of a module) and the compiled steps in the session's cache; sections update the defaults' fields."""
    config = {
        "model": dataclasses.asdict(TINY_MODEL),
        "train": {
            "steps": 12,
            "batch_size": 8,
            "seq_len": 32,
            "warmup_steps": 0,
            "log_every": 1,
            "eval_every": 0,
            "eval_batches": 1,
            "sample_tokens": 0,
            "lr": 1e-2,
        },
        "checkpoint": {"every_steps": 2, "keep": 20},
        "data": {"cache_dir": str(root / "cache")},
        "run": {"tensorboard": False},  # compiled steps: the session's cache (JAX_COMPILATION_CACHE_DIR above)
    }
    for section, fields in sections.items():
        config[section].update(fields)
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """40 small text documents of random words."""
    directory = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]
    for i in range(40):
        (directory / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 200)))
    return directory


def pytest_sessionfinish(session):
    """The controller (or a run without xdist) removes the session's compilation cache; workers leave it."""
    if not hasattr(session.config, "workerinput"):
        shutil.rmtree(os.environ["LLAMA_JAX_TEST_CACHE"], ignore_errors=True)


# The files whose real multi-process runs take a minute or more on CI's 2 cores, started first (the Makefile
# turns off xdist's own order, most tests first, which left them for the end): the two workers then end on short
# files and finish together, and those runs' waits (barriers, restarts, injected delays) overlap other work.
STARTED_FIRST = (
    "test_slurm.py",
    "test_goodput_projection.py",
    "test_elastic.py",
    "test_flight.py",
    "test_multihost.py",
    "test_local_tier.py",
)


def pytest_collection_modifyitems(items):
    """STARTED_FIRST, then the other files by their number of tests, most first; a file's tests keep their order."""
    count: dict[str, int] = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1
    first = {name: rank for rank, name in enumerate(STARTED_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(
        key=lambda item: (
            first.get(item.path.name, len(first)),
            -count[item.path.name],
            item.path.name,
            order[id(item)],
        )
    )
