"""Shared fixtures. Every test process sees 8 simulated CPU devices (set before jax is imported)."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from llama_jax.config import Config, DataConfig, ModelConfig, RunConfig, TrainConfig  # noqa: E402

# A model small enough to compile in a second or two, with GQA (4 query heads, 2 kv heads).
# Its vocab fits a byte-level BPE of 256 bytes + 2 special tokens + a few merges.
TINY_MODEL = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                         max_seq_len=128, rope_theta=10000.0, compute_dtype="float32")


def tiny_config(tmp_path=None, **sections) -> Config:
    """A Config built around TINY_MODEL; keyword arguments replace whole sections or fields,
    e.g. tiny_config(train=dict(steps=3), mesh=dict(fsdp=1))."""
    base = Config(model=TINY_MODEL,
                  train=TrainConfig(steps=4, batch_size=8, seq_len=32, warmup_steps=0, log_every=1,
                                    eval_every=0, eval_batches=1, sample_tokens=0),
                  data=DataConfig(cache_dir=str(tmp_path / "cache") if tmp_path else ""),
                  run=RunConfig(dir=str(tmp_path / "run") if tmp_path else "runs/test", tensorboard=False))
    for section, fields in sections.items():
        base = dataclasses.replace(base, **{section: dataclasses.replace(getattr(base, section), **fields)})
    return base


@pytest.fixture
def tiny():
    return tiny_config


def write_tiny_yaml(root, **sections):
    """A config file around TINY_MODEL for subprocess runs, with the data store and compiled steps
    cached under root (shared by the runs of a module); sections update the defaults' fields."""
    config = {"model": dataclasses.asdict(TINY_MODEL),
              "train": {"steps": 12, "batch_size": 8, "seq_len": 32, "warmup_steps": 0, "log_every": 1,
                        "eval_every": 0, "eval_batches": 1, "sample_tokens": 0, "lr": 1e-2},
              "checkpoint": {"every_steps": 2, "keep": 20},
              "data": {"cache_dir": str(root / "cache")},
              "run": {"tensorboard": False, "compilation_cache": str(root / "jax_cache")}}
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
