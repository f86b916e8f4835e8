"""Writes init_stats.json: the mean and standard deviation of every freshly initialised tensor of a llama3_1b-shaped
model (its widths, vocabulary and tied embeddings; 2 layers), plain and with each kind of adapter, as the model
drew them when it was written in Flax Linen (commit 464e997): tests/test_model.py checks that the Flax NNX model
draws each from the same initializer and scale, within sampling error.

    PYTHONPATH=<a worktree of 464e997> .venv/bin/python tests/golden/make_init_stats.py
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from llama_jax.config import PeftConfig, load_config

CASES = {
    "plain": PeftConfig(),
    "lora": PeftConfig(method="lora", rank=8, targets=["q", "k", "v", "o", "gate", "up", "down"]),
    "prompt": PeftConfig(method="prompt", prompt_tokens=16),
    "ptuning_lstm": PeftConfig(method="ptuning", prompt_tokens=16, prompt_encoder="lstm", encoder_hidden=256),
}


def model_config():
    return load_config("llama3_1b", ["model.n_layers=2"]).model


def init_params(cfg, peft, key):
    """The model's fresh params: with the Linen model where this runs at 464e997, else the NNX model's init_params."""
    from llama_jax.model import llama

    if hasattr(llama, "init_params"):
        return llama.init_params(cfg, key, peft)
    import flax.linen as nn

    return nn.meta.unbox(llama.Llama(cfg, peft=peft).init(key, jnp.zeros((1, 8), jnp.int32))["params"])


def statistics(cfg, peft, seed: int = 0, adapters_only: bool = False) -> dict[str, dict]:
    """{path: {"mean", "std", "count"}} of every param (or only the adapters'), computed where they are made (nothing
    copied to the host; the params left out are never drawn)."""
    from llama_jax.model import peft as adapters

    def summarise(key):
        params = init_params(cfg, peft, key)
        params = adapters.split(params)[0] if adapters_only else params
        return jax.tree.map(lambda x: (jnp.mean(x, dtype=jnp.float32), jnp.std(x, dtype=jnp.float32)), params)

    # The whole model with LLVM's optimisations, which the test suite turns off (tests/conftest.py): drawing its 385M
    # numbers is what the program costs, 21 s without them and 6 s with them on 2 cores (the adapters: a second).
    key = jax.random.key(seed)
    options = {} if adapters_only else {"xla_backend_optimization_level": 3}
    stats = jax.jit(summarise).lower(key).compile(options)(key)
    shapes = jax.eval_shape(lambda: init_params(cfg, peft, jax.random.key(seed)))
    shapes = adapters.split(shapes)[0] if adapters_only else shapes
    out = {}
    for (path, (mean, std)), shape in zip(
        jax.tree_util.tree_flatten_with_path(stats, is_leaf=lambda x: isinstance(x, tuple))[0], jax.tree.leaves(shapes)
    ):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        out[name] = {"mean": float(mean), "std": float(std), "count": int(shape.size)}
    return out


if __name__ == "__main__":
    cfg = model_config()
    table = {name: statistics(cfg, peft) for name, peft in CASES.items()}
    (Path(__file__).parent / "init_stats.json").write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
