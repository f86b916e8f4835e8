"""Model specs: where a model's weights are, resolved once; loading its params and tokenizer; conversion.

A model spec is what a user types for a model (`checkpoint.init_from`, `resume_from`, `llama-jax
generate/eval/convert MODEL`, `api.load`):

    hf:DIR, or a directory holding config.json     a Hugging Face model
    a run directory, its checkpoints/ directory    the newest finished step in it
    a step directory (<run.dir>/checkpoints/<N>)   that step: a training checkpoint or a converted one

`resolve` reads it once into a ModelSpec: its directory and its architecture, read without loading any
weights. Everything else here takes the ModelSpec.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np

from llama_jax import __version__, hf, sharding
from llama_jax.checkpoint import read_meta, resolve_step_dir, restore_params, save_params
from llama_jax.config import SHAPE_FIELDS, Config, ModelConfig, load_config, validate
from llama_jax.data.tokenizer import Tokenizer, load_tokenizer as load_tokenizer_file
from llama_jax.errors import ConfigError
from llama_jax.model import abstract_params

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spm.model")


@dataclass(frozen=True)
class ModelSpec:
    text: str  # as the user wrote it, for messages
    model: ModelConfig
    hf_dir: Path | None = None  # a Hugging Face directory, or
    step_dir: Path | None = None  # a llama-jax checkpoint step (absolute: Orbax requires it)

    @property
    def params_only(self) -> bool:
        """Parameters without optimizer state or data position: a Hugging Face model or a converted checkpoint."""
        return self.hf_dir is not None or (self.step_dir / "params").is_dir()

    @property
    def home(self) -> Path:
        """The directory that holds the model's tokenizer: the Hugging Face directory, or the run directory."""
        return self.hf_dir if self.hf_dir is not None else self.step_dir.parent.parent  # <run.dir>/checkpoints/<N>


def hf_directory(text: str) -> Path | None:
    """The directory of a Hugging Face model spec ("hf:DIR", or a directory holding config.json)."""
    directory = Path(text.removeprefix("hf:")).expanduser()
    if text.startswith("hf:") or (directory / "config.json").is_file():
        return directory
    return None


def resolve(text: str | ModelSpec) -> ModelSpec:
    """The spec a user typed, resolved (a ModelSpec passes through). Raises ConfigError, one line."""
    if isinstance(text, ModelSpec):
        return text
    directory = hf_directory(text)
    if directory is not None:
        return ModelSpec(text, hf.read_config(directory), hf_dir=directory)
    step_dir = resolve_step_dir(text)
    meta = read_meta(step_dir)
    if meta is None:
        raise ConfigError(f"{step_dir} has no readable meta item: it is not a llama-jax checkpoint or it is damaged")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in meta["config"]["model"].items() if k in names})
    return ModelSpec(text, model, step_dir=step_dir)


def load_params(spec: ModelSpec, target: Any = None, rotary: str = "half") -> Any:
    """The model's parameters, taking the shapes, dtypes and shardings of `target` (a ShapeDtypeStruct
    tree, e.g. TrainProgram.abstract_state().params, or shardings alone) or, without one, the model's
    param_dtype on the default device. A training checkpoint's optimizer moments are not read; `rotary`
    is the q/k layout of a Hugging Face model's weights (hf.ROTARY_LAYOUTS)."""
    if target is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
                              nn.meta.unbox(abstract_params(spec.model)))
    if spec.hf_dir is not None:
        shardings = jax.tree.map(lambda t: getattr(t, "sharding", t), target)
        return hf.read_params(spec.hf_dir, spec.model, shardings, np.dtype(spec.model.param_dtype), rotary)
    return restore_params(spec.step_dir, target)


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    """The tokenizer that belongs to the model: the Hugging Face directory's, or the one a llama-jax run
    keeps in its run directory."""
    return load_tokenizer_file(spec.home)


def inference_config(model: ModelConfig, overrides: list[str] = ()) -> Config:
    """A full Config around a loaded model: the mesh, batch and sequence settings of `overrides`, and
    the model settings that do not change its weights (model.compute_dtype, model.attention, ...)."""
    base = load_config(None, list(overrides))
    changed = {o.split("=", 1)[0].removeprefix("model.") for o in overrides if o.startswith("model.")}
    if changed & set(SHAPE_FIELDS):
        raise ConfigError(f"model.{sorted(changed & set(SHAPE_FIELDS))[0]} is fixed by the loaded weights; "
                          "only settings such as model.compute_dtype or model.attention can change")
    config = dataclasses.replace(base, model=dataclasses.replace(model, **{k: getattr(base.model, k) for k in changed}))
    validate(config)
    return config


def convert(source: str, out: str, overrides: list[str] = (), dtype: str = "float32", rotary: str = "half",
            print_fn: Callable[[str], None] = print) -> Path:
    """Hugging Face directory -> llama-jax checkpoint (params only, sharded for the mesh of `overrides`),
    or a llama-jax checkpoint -> Hugging Face directory (safetensors in `dtype`). The tokenizer files
    go along. `out` must not exist yet (or be empty): nothing is overwritten."""
    target = Path(out).expanduser()
    if target.exists() and any(target.iterdir()):
        raise ConfigError(f"{target} exists and is not empty; choose a new output directory")
    if rotary not in hf.ROTARY_LAYOUTS:
        raise ConfigError(f"--rotary must be one of {', '.join(hf.ROTARY_LAYOUTS)}, got '{rotary}'")
    spec = resolve(source)
    if spec.hf_dir is None and dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype must be float32, bfloat16 or float16, got '{dtype}'")
    if spec.hf_dir is not None:  # Hugging Face -> llama-jax
        config = inference_config(spec.model, overrides)
        params = load_params(spec, sharding.param_shardings(config, sharding.make_mesh(config)), rotary)
        meta = {"config": {"model": dataclasses.asdict(spec.model)}, "source": str(spec.hf_dir),
                "llama_jax": __version__, "jax": jax.__version__}
        print_fn(f"converted {spec.hf_dir} -> {save_params(target, params, meta)}")
    else:  # llama-jax -> Hugging Face
        hf.write_hf(target, load_params(spec), spec.model, dtype, rotary)
        print_fn(f"converted {source} -> {target} ({dtype})")
    for name in TOKENIZER_FILES:
        if (spec.home / name).is_file():
            shutil.copy2(spec.home / name, target / name)
    return target
