"""Parameter-efficient tuning on params: which ones learn, the base model's identity, and what is kept.

A peft run (the peft.* config section) trains the adapters the model adds (llama.py: LoRA's `lora_a`/`lora_b` in
the projections, the `prompt` embeddings or P-tuning's `prompt_encoder`) on top of a base model that
stays frozen:

    split / merge      the model's params <-> (adapters, base); the train step differentiates the
                       adapters only and the optimizer keeps state for them only (step.py)
    digest             a fingerprint of the base's values: a checkpoint holds the adapters plus the
                       base's path and digest, and a base that is not the one trained on is refused
    start_adapters     the adapters before step 0: prompts start as embeddings of sampled vocabulary
                       tokens of the base (Lester et al. 2021), LoRA as the model initialised it
    inference_params   what inference runs: LoRA folded into the weights it adapts, P-tuning's encoder
                       run once and dropped, leaving the prompt's embeddings (a prompt-tuned model)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from llama_jax.config import ModelConfig, PeftConfig
from llama_jax.errors import ConfigError
from llama_jax.model.prompt_encoder import encoded_prompt

LORA = ("lora_a", "lora_b")
PROMPTS = ("prompt", "prompt_encoder")  # the top-level entries of prompt tuning and P-tuning
# The peft.* fields that change a method's adapters (their shapes or what they compute): a checkpoint
# must agree on them. peft.dropout may change.
ADAPTER_FIELDS = {
    "lora": ("rank", "alpha", "targets"),
    "prompt": ("prompt_tokens",),
    "ptuning": ("prompt_tokens", "prompt_encoder", "encoder_hidden"),
}


def is_adapter(path: tuple[str, ...]) -> bool:
    """Whether the parameter at `path` (in the model's params tree) belongs to an adapter."""
    return path[0] in PROMPTS or path[-1] in LORA


def split(params: dict) -> tuple[dict, dict]:
    """The model's params -> (adapters, base), two trees that merge() puts back together."""
    flat = flatten_dict(params)
    return (
        unflatten_dict({k: v for k, v in flat.items() if is_adapter(k)}),
        unflatten_dict({k: v for k, v in flat.items() if not is_adapter(k)}),
    )


def merge(adapters: dict, base: dict) -> dict:
    """(adapters, base) -> the model's params (no copies: the same arrays in one tree)."""
    return unflatten_dict(flatten_dict(base) | flatten_dict(adapters))


# ---------------------------------------------------------------------------------------------
# The base model's identity


_MIX = (0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35)  # golden ratio, then MurmurHash3's finaliser constants


def _checksum(x: jax.Array) -> jax.Array:
    """A uint32 of every element's bits mixed with its index and summed (mod 2^32): changing any one element
    changes it, and integer sums do not depend on the order, so neither does the mesh the array is on."""
    bits = jax.lax.bitcast_convert_type(x, {4: jnp.uint32, 2: jnp.uint16}[x.dtype.itemsize]).astype(jnp.uint32)
    index, stride = jnp.zeros(x.shape, jnp.uint32), 1
    for axis in reversed(range(x.ndim)):  # the flat index, wrapped: no index array exists as a whole
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= x.shape[axis]
    k = bits ^ (index * jnp.uint32(_MIX[0]))
    k = (k ^ (k >> 16)) * jnp.uint32(_MIX[1])
    k = (k ^ (k >> 13)) * jnp.uint32(_MIX[2])
    return jnp.sum(k ^ (k >> 16), dtype=jnp.uint32)


@jax.jit
def _checksums(params: dict) -> dict:
    return jax.tree.map(_checksum, params)


def digest(params: dict) -> str:
    """A fingerprint of the values of a params tree (however sharded): every leaf's path, shape, dtype
    and checksum, hashed. Computed on the devices; a few reads of HBM."""
    sums = flatten_dict(jax.device_get(_checksums(params)))
    entries = sorted(
        ("/".join(path), list(leaf.shape), str(leaf.dtype), int(sums[path]))
        for path, leaf in flatten_dict(params).items()
    )
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def base_reference(spec_text: str, path: str, params: dict) -> dict:
    """What a checkpoint of a peft run records about its base: the spec as given, where it is, its digest."""
    return {"spec": spec_text, "path": path, "digest": digest(params)}


def check_base(saved: dict | None, current: dict, where: str) -> None:
    """The base model loaded now must be the one the adapters in `where` were trained on (ConfigError)."""
    if saved and saved.get("digest") and saved["digest"] != current["digest"]:  # a PEFT adapter records none
        raise ConfigError(
            f"{where} holds adapters trained on another base model ({saved.get('path')}, digest "
            f"{str(saved.get('digest'))[:12]}) than {current['spec']} (digest {current['digest'][:12]}); "
            f"set checkpoint.init_from to {saved.get('spec')} or use another run.dir"
        )


def differing_fields(saved: dict, peft: PeftConfig) -> list[str]:
    """The fields of ADAPTER_FIELDS that `saved` (a peft section) gives and `peft` has otherwise (targets in
    any order)."""
    current = dataclasses.asdict(peft)
    same = lambda k: sorted(saved[k]) == sorted(current[k]) if k == "targets" else saved[k] == current[k]  # noqa: E731
    return [k for k in ADAPTER_FIELDS.get(peft.method, ()) if k in saved and not same(k)]


def check_adapters(saved: dict, peft: PeftConfig, where: str) -> None:
    """A checkpoint's peft section must describe the adapters of `peft`: the same method, shapes, scale."""
    current, differ = dataclasses.asdict(peft), differing_fields(saved, peft)
    if saved.get("method", "none") != peft.method or differ:
        fields = "; ".join(f"peft.{k} {saved.get(k, 'none')} (saved) vs {current[k]}" for k in differ or ["method"])
        raise ConfigError(
            f"{where} holds checkpoints of other adapters ({fields}); use another run.dir or the saved peft settings"
        )


# ---------------------------------------------------------------------------------------------
# Starting and finishing


def start_adapters(adapters: dict, base: dict, seed: int) -> dict:
    """The adapters of step 0: a prompt's (or P-tuning encoder's) input embeddings replaced by the base's
    embeddings of vocabulary tokens sampled with `seed`, so the prompt starts in the region of embedding
    space the model knows; everything else as initialised (LoRA's B is zero)."""
    flat = flatten_dict(adapters)
    table = base["embed"]["embedding"]
    for path in [p for p in flat if p[0] in PROMPTS and p[-1] == "embedding"]:
        rows = np.random.default_rng(seed).integers(0, table.shape[0], flat[path].shape[0])
        flat[path] = jax.device_put(
            jnp.take(table, jnp.asarray(rows), axis=0).astype(flat[path].dtype), flat[path].sharding
        )
    return unflatten_dict(flat)


def fold_lora(params: dict, peft: PeftConfig) -> dict:
    """The model's params with every LoRA update folded into the weight it adapts: W + (alpha / rank) A B,
    computed in fp32 where W is, and the adapters dropped. Base-shaped params: any Llama runs them."""
    flat, out = flatten_dict(params), {}
    scale = peft.alpha / peft.rank if peft.method == "lora" else 0.0
    for path, value in flat.items():
        if path[-1] in LORA:
            continue
        owner = path[:-1]
        if path[-1] == "kernel" and owner + ("lora_a",) in flat:
            value = _folded(value, flat[owner + ("lora_a",)], flat[owner + ("lora_b",)], scale)
        out[path] = value
    return unflatten_dict(out)


def _folded(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    def fold(kernel, a, b):  # [layers, in..., out...] + [layers, in..., r] . [layers, r, out...]
        update = jax.vmap(lambda a, b: jnp.tensordot(a, b, 1))(a.astype(jnp.float32), b.astype(jnp.float32))
        return (kernel.astype(jnp.float32) + scale * update).astype(kernel.dtype)

    sharding = getattr(kernel, "sharding", None)
    return jax.jit(fold, out_shardings=sharding)(kernel, a, b)


def prompt_table(params: dict, cfg: ModelConfig, peft: PeftConfig) -> jax.Array:
    """[prompt_tokens, embed]: the virtual tokens' embeddings as the model uses them (P-tuning: the
    encoder's output)."""
    if peft.method == "ptuning":
        return encoded_prompt(cfg, peft, params["prompt_encoder"])
    return params["prompt"]["embedding"]


def inference_peft(peft: PeftConfig) -> PeftConfig:
    """The peft settings of inference_params' output: a prompt-tuned model for prompt methods, else none."""
    if peft.virtual_tokens:
        return PeftConfig(method="prompt", prompt_tokens=peft.prompt_tokens)
    return PeftConfig()


def inference_params(params: dict, cfg: ModelConfig, peft: PeftConfig) -> dict:
    """What inference runs (under inference_peft(peft)): LoRA folded into the weights, P-tuning's encoder
    replaced by its output; prompt tuning as it is."""
    if peft.method == "lora":
        return fold_lora(params, peft)
    if peft.method == "ptuning":
        base = split(params)[1]
        return merge({"prompt": {"embedding": prompt_table(params, cfg, peft)}}, base)
    return params


def prompt_tokens_of(params: dict) -> int:
    """The virtual tokens of inference params (0: none), as inference_params leaves them."""
    return int(params["prompt"]["embedding"].shape[0]) if "prompt" in params else 0


def with_prompt_slots(prompts: list[list[int]], prompt_tokens: int) -> list[list[int]]:
    """Token lists with the learned prompt's slots (ids -1 ... -prompt_tokens) in front, as the loader puts them."""
    slots = [-1 - k for k in range(prompt_tokens)]
    return [slots + list(p) for p in prompts]
