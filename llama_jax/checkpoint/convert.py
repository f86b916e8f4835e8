"""`llama-jax convert`: a model spec (specs.py) to another format, sharded over a mesh and streamed through
the host a block at a time: Hugging Face -> a parameters-only llama-jax checkpoint, a llama-jax run -> a
Hugging Face model, a run with adapters -> a PEFT adapter directory (or, merged, a Hugging Face model)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax
from jax.sharding import Mesh

from llama_jax import __version__
from llama_jax.checkpoint.durable import save_params
from llama_jax.checkpoint.specs import (
    ModelSpec,
    copy_tokenizer,
    inference_config,
    inference_mesh,
    load_adapters,
    load_params,
    param_target,
    resolve,
)
from llama_jax.config import Config
from llama_jax.data.tokenizer import HFTokenizer, load_tokenizer
from llama_jax.distributed import processes, sharding
from llama_jax.distributed.peers import Peers
from llama_jax.errors import ConfigError
from llama_jax.files import unwritable
from llama_jax.interop import hf, hf_tensor_map, peft_format


def convert(
    source: str,
    out: str,
    overrides: list[str] = (),
    dtype: str = "float32",
    rotary: str = "half",
    print_fn: Callable[[str], None] = print,
    devices=None,
    merge: bool = False,
) -> Path:
    """Hugging Face directory -> llama-jax checkpoint (params only), or a llama-jax checkpoint -> Hugging
    Face directory (safetensors in `dtype`). A run with adapters (peft) becomes a PEFT adapter directory
    (peft_format.py), or with `merge` (LoRA) its base with the adapters folded in, as a Hugging Face
    model. Either way the model is loaded sharded over the mesh of `overrides` over `devices` (default:
    all; mesh.fsdp=-1 unless mesh.* keys say otherwise), and only a block of one tensor at a time passes
    through the host. The tokenizer files go along. `out` must not exist yet (or be empty): nothing is
    overwritten. Every process of a multi-process run (run.* keys or the environment) runs it; process 0
    writes the Hugging Face files."""
    target = Path(out).expanduser()
    spec = _checked_spec(source, out, target, dtype, rotary, merge)
    config = inference_config(spec.model, overrides, batches=False)
    processes.initialize(config.run)
    # Every process has checked `out` before any writes to it; a process that never comes is named.
    Peers(config.fault.barrier_timeout_s).barrier("llama-jax convert")
    mesh, primary = inference_mesh(config, devices), jax.process_index() == 0
    done = _write(spec, target, config, mesh, dtype, rotary, merge)
    if primary:
        print_fn(f"converted {spec.hf_dir or source} -> {done}")
    if primary:
        copy_tokenizer(spec.home, target)
        if spec.hf_dir is None and (target / "config.json").is_file():
            name_special_tokens(target)
    return target


def name_special_tokens(directory: Path) -> None:
    """A Hugging Face model written from a run names its tokenizer's BOS and EOS, in tokenizer_config.json
    (unless the run's tokenizer came with one) and as config.json's bos/eos_token_id: without them transformers
    knows no EOS, so its generation (and lm-eval's hf backend's) would not stop where ours does, nor have a
    prefix for an empty context. The tokenizer.json itself is copied unchanged."""
    if not (directory / "tokenizer.json").is_file():
        return
    tokenizer = load_tokenizer(directory)
    if not isinstance(tokenizer, HFTokenizer):
        return
    bos = None if tokenizer.bos_id is None else tokenizer.hf.id_to_token(tokenizer.bos_id)
    eos = tokenizer.hf.id_to_token(tokenizer.eos_id)
    if not (directory / "tokenizer_config.json").is_file():
        settings = {"bos_token": bos, "eos_token": eos}
        (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    config = json.loads((directory / "config.json").read_text())
    config["bos_token_id"] = tokenizer.bos_id if config.get("bos_token_id") is None else config["bos_token_id"]
    config["eos_token_id"] = tokenizer.eos_id if config.get("eos_token_id") is None else config["eos_token_id"]
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _checked_spec(source: str, out: str, target: Path, dtype: str, rotary: str, merge: bool) -> ModelSpec:
    """The spec `source` names, once `out` can be written and is new, and the options fit it; ConfigError if not."""
    if problem := unwritable(target):
        raise ConfigError(f"the output directory {out} cannot be written: {problem}; choose a new output directory")
    if target.exists() and any(target.iterdir()):
        raise ConfigError(f"{target} exists and is not empty; choose a new output directory")
    if rotary not in hf_tensor_map.ROTARY_LAYOUTS:
        raise ConfigError(f"--rotary must be one of {', '.join(hf_tensor_map.ROTARY_LAYOUTS)}, got '{rotary}'")
    spec = resolve(source)
    if spec.hf_dir is None and dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype must be float32, bfloat16 or float16, got '{dtype}'")
    if merge and (spec.adapters is None or spec.adapters.method != "lora"):
        kind = (
            "has no adapters"
            if spec.adapters is None
            else f"adds a learned prompt (peft.method="
            f"{spec.adapters.method}), which a Llama checkpoint cannot hold; convert it without --merge"
        )
        raise ConfigError(f"--merge folds a run's LoRA adapters into its base model, and {source} {kind}")
    return spec


def _write(spec: ModelSpec, target: Path, config: Config, mesh: Mesh, dtype: str, rotary: str, merge: bool) -> str:
    """Write the converted model to `target`; what was written, for the closing line."""
    if spec.adapters is not None and not merge:  # the adapters alone: the base is not even read
        adapters = load_adapters(spec, sharding.replicated(mesh))
        base_model = (spec.base or {}).get("path", "").removeprefix("hf:")
        peft_format.write_adapter(target, adapters, spec.model, spec.adapters, base_model, dtype, rotary)
        return f"{target} (PEFT adapter, peft.method={spec.adapters.method}, {dtype})"
    if spec.hf_dir is not None:  # Hugging Face -> llama-jax
        meta = {
            "config": {"model": dataclasses.asdict(spec.model)},
            "source": str(spec.hf_dir),
            "llama_jax": __version__,
            "jax": jax.__version__,
        }
        return str(save_params(target, load_params(spec, param_target(config, mesh), rotary), meta))
    # llama-jax -> Hugging Face (a LoRA run: its base with the adapters folded in)
    hf.write_hf(target, load_params(spec, param_target(config, mesh)), spec.model, dtype, rotary)
    return f"{target} ({dtype}{', LoRA merged' if merge else ''})"
