"""Model specs: where a model's weights are, resolved once; loading its params and tokenizer; conversion.

A model spec is what a user types for a model (`checkpoint.init_from`, `resume_from`, `llama-jax
generate/eval/convert MODEL`, `api.load`):

    hf:DIR, or a directory holding config.json     a Hugging Face model
    a run directory, its checkpoints/ directory    the newest finished step in it
    a step directory (<run.dir>/checkpoints/<N>)   that step: a training checkpoint or a converted one

A run with adapters (peft.method != none) is a model too: its base (found where its checkpoints say,
and checked against their digest) with its adapters, as inference runs them (peft.inference_params:
LoRA folded into the weights, a prompt-tuned model's prompt in params["prompt"]).

`resolve` reads it once into a ModelSpec: its directory and its architecture, read without loading any
weights. Everything else here takes the ModelSpec.

Placement: a model goes to one device, or, for models that do not fit one, is sharded over the mesh of
the `mesh.*` keys (inference_mesh) by the logical-axis table of sharding.py, as in training: each
device reads only its shards of the weights (hf.read_params, or Orbax for a checkpoint).
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
from jax.sharding import Mesh

from llama_jax import __version__, distributed, hf, peft, peft_format, sharding
from llama_jax.checkpoint import read_meta, resolve_step_dir, restore_params, save_params
from llama_jax.config import SHAPE_FIELDS, Config, ModelConfig, load_config, validate
from llama_jax.data.tokenizer import Tokenizer, load_tokenizer as load_tokenizer_file
from llama_jax.errors import ConfigError
from llama_jax.model import abstract_params
from llama_jax.peft_config import PeftConfig
from llama_jax.pipeline import relayout

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spm.model")


@dataclass(frozen=True)
class ModelSpec:
    text: str  # as the user wrote it, for messages
    model: ModelConfig
    hf_dir: Path | None = None  # a Hugging Face directory, or
    step_dir: Path | None = None  # a llama-jax checkpoint step (absolute: Orbax requires it)
    adapters: PeftConfig | None = None  # a peft run: its adapters (in step_dir) ...
    base: dict | None = None  # ... and the base they adapt, as its checkpoints record it (peft.base_reference)

    @property
    def location(self) -> str:
        """Where the weights are, as a spec that does not depend on the working directory."""
        return f"hf:{self.hf_dir.absolute()}" if self.hf_dir is not None else str(self.step_dir)

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
    settings = meta["config"].get("peft", {})
    if settings.get("method", "none") == "none":
        return ModelSpec(text, model, step_dir=step_dir)
    fields = {f.name for f in dataclasses.fields(PeftConfig)}
    return ModelSpec(text, model, step_dir=step_dir, adapters=PeftConfig(**{k: v for k, v in settings.items()
                                                                            if k in fields}), base=meta.get("base"))


def load_params(spec: ModelSpec, target: Any = None, rotary: str = "half", layout: tuple[int, int] = (1, 1)) -> Any:
    """The model's parameters, taking the shapes, dtypes and shardings of `target` (a ShapeDtypeStruct
    tree, e.g. TrainProgram.abstract_state().params or param_target(), or shardings alone) or, without
    one, the model's param_dtype on the default device. A training checkpoint's optimizer moments are
    not read; `rotary` is the q/k layout of a Hugging Face model's weights (hf.ROTARY_LAYOUTS); `layout`
    the pipeline (stages, repeats) whose layer order the params are wanted in (pipeline.py)."""
    if target is None:
        target = hf.single_device_target(spec.model)
    elif isinstance(jax.tree.leaves(target)[0], jax.sharding.Sharding):
        target = _placed(spec.model, target)
    if spec.adapters is not None:
        return _adapted(spec, target)
    if spec.hf_dir is not None:
        return relayout({"params": hf.read_params(spec.hf_dir, spec.model, target, rotary)}, (1, 1), layout)["params"]
    return restore_params(spec.step_dir, target, layout)


def load_adapters(spec: ModelSpec, placement: jax.sharding.Sharding | None = None) -> dict:
    """The adapters of a peft run as trained (peft.split's first half), replicated on `placement`'s devices
    (default: this process's first device): they are small."""
    placement = placement or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(placement, jax.sharding.NamedSharding):
        placement = jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec())
    shapes = peft.split(nn.meta.unbox(abstract_params(spec.model, spec.adapters)))[0]
    return restore_params(spec.step_dir, jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placement), shapes))


def _adapted(spec: ModelSpec, target: Any) -> Any:
    """A peft run's inference params: its base (which must still be the one it was trained on) with its
    adapters, as peft.inference_params leaves them, in the shapes and shardings of `target`."""
    try:
        base_spec = resolve(spec.base["path"])
    except (ConfigError, KeyError, TypeError) as err:
        raise ConfigError(f"{spec.text} adapts a base model that cannot be read ({err}); its checkpoints name "
                          f"{(spec.base or {}).get('path')}") from None
    base_target = {k: v for k, v in target.items() if k not in peft.PROMPTS}
    base = load_params(base_spec, base_target)
    peft.check_base(spec.base, peft.base_reference(base_spec.text, base_spec.location, base), spec.text)
    adapters = load_adapters(spec, jax.tree.leaves(base)[0].sharding)
    params = peft.inference_params(peft.merge(adapters, base), spec.model, spec.adapters)
    placed = {k: params[k] for k in target if k in peft.PROMPTS}  # the prompt, where the target wants it
    return params | jax.tree.map(lambda value, spec: jax.device_put(value, spec.sharding), placed,
                                 {k: target[k] for k in placed})


def names_a_mesh(overrides: list[str]) -> bool:
    """Whether `overrides` set any mesh.* key: what places a model on a mesh instead of one device."""
    return any(o.split("=", 1)[0].strip().startswith("mesh.") for o in overrides)


def inference_mesh(config: Config, devices=None) -> Mesh:
    """The mesh of config's mesh.* keys over `devices` (default: all), for inference and conversion: the
    checks of training batches against it (batch size, sequence length) do not apply."""
    devices = jax.devices() if devices is None else devices
    if config.mesh.pipeline > 1:
        raise ConfigError(f"mesh.pipeline={config.mesh.pipeline}: pipeline parallelism is for training; place a model "
                          "for inference or conversion with mesh.fsdp, mesh.tensor and mesh.data")
    sizes = sharding.mesh_shape(config.mesh, len(devices))
    train = dataclasses.replace(config.train, batch_size=sizes["data"] * sizes["fsdp"], microbatches=1,
                                seq_len=2 * sizes["sequence"] * sizes["tensor"])
    return sharding.make_mesh(dataclasses.replace(config, train=train), devices)


def param_target(config: Config, mesh: Mesh) -> Any:
    """Shapes, dtypes and shardings of the model's parameters on `mesh`: a target for load_params."""
    return _placed(config.model, sharding.param_shardings(config, mesh))


def _placed(model: ModelConfig, shardings: Any) -> Any:
    """The model's abstract parameters, each with its sharding from `shardings`."""
    return jax.tree.map(lambda s, placement: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placement),
                        nn.meta.unbox(abstract_params(model)), shardings)


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    """The tokenizer that belongs to the model: the Hugging Face directory's, or the one a llama-jax run
    keeps in its run directory."""
    return load_tokenizer_file(spec.home)


def inference_config(model: ModelConfig, overrides: list[str] = (), batches: bool = True) -> Config:
    """A full Config around a loaded model: the mesh, batch and sequence settings of `overrides`, and
    the model settings that do not change its weights (model.compute_dtype, model.attention, ...).
    batches=False (generation, conversion): no training batches are made, so train.seq_len is not
    checked against the model."""
    base = load_config(None, list(overrides))
    changed = {o.split("=", 1)[0].strip().removeprefix("model.") for o in overrides if o.startswith("model.")}
    if changed & set(SHAPE_FIELDS):
        raise ConfigError(f"model.{sorted(changed & set(SHAPE_FIELDS))[0]} is fixed by the loaded weights; "
                          "only settings such as model.compute_dtype or model.attention can change")
    config = dataclasses.replace(base, model=dataclasses.replace(model, **{k: getattr(base.model, k) for k in changed}))
    if not batches:
        config = dataclasses.replace(config, train=dataclasses.replace(
            config.train, seq_len=min(config.train.seq_len, config.model.max_seq_len)))
    validate(config)
    return config


def convert(source: str, out: str, overrides: list[str] = (), dtype: str = "float32", rotary: str = "half",
            print_fn: Callable[[str], None] = print, devices=None, merge: bool = False) -> Path:
    """Hugging Face directory -> llama-jax checkpoint (params only), or a llama-jax checkpoint -> Hugging
    Face directory (safetensors in `dtype`). A run with adapters (peft) becomes a PEFT adapter directory
    (peft_format.py), or with `merge` (LoRA) its base with the adapters folded in, as a Hugging Face
    model. Either way the model is loaded sharded over the mesh of `overrides` over `devices` (default:
    all; mesh.fsdp=-1 unless mesh.* keys say otherwise), and only a block of one tensor at a time passes
    through the host. The tokenizer files go along. `out` must not exist yet (or be empty): nothing is
    overwritten. Every process of a multi-process run (run.* keys or the environment) runs it; process 0
    writes the Hugging Face files."""
    target = Path(out).expanduser()
    if target.exists() and any(target.iterdir()):
        raise ConfigError(f"{target} exists and is not empty; choose a new output directory")
    if rotary not in hf.ROTARY_LAYOUTS:
        raise ConfigError(f"--rotary must be one of {', '.join(hf.ROTARY_LAYOUTS)}, got '{rotary}'")
    spec = resolve(source)
    if spec.hf_dir is None and dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype must be float32, bfloat16 or float16, got '{dtype}'")
    if merge and (spec.adapters is None or spec.adapters.method != "lora"):
        kind = "has no adapters" if spec.adapters is None else f"adds a learned prompt (peft.method=" \
            f"{spec.adapters.method}), which a Llama checkpoint cannot hold; convert it without --merge"
        raise ConfigError(f"--merge folds a run's LoRA adapters into its base model, and {source} {kind}")
    config = inference_config(spec.model, overrides, batches=False)
    distributed.initialize(config.run)
    # Every process has checked `out` before any writes to it; a process that never comes is named.
    distributed.Peers(config.fault.barrier_timeout_s).barrier("llama-jax convert")
    mesh, primary = inference_mesh(config, devices), jax.process_index() == 0
    if spec.adapters is not None and not merge:  # the adapters alone: the base is not even read
        adapters = load_adapters(spec, sharding.replicated(mesh))
        base_model = (spec.base or {}).get("path", "").removeprefix("hf:")
        peft_format.write_adapter(target, adapters, spec.model, spec.adapters, base_model, dtype, rotary)
        done = f"{target} (PEFT adapter, peft.method={spec.adapters.method}, {dtype})"
    elif spec.hf_dir is not None:  # Hugging Face -> llama-jax
        meta = {"config": {"model": dataclasses.asdict(spec.model)}, "source": str(spec.hf_dir),
                "llama_jax": __version__, "jax": jax.__version__}
        done = str(save_params(target, load_params(spec, param_target(config, mesh), rotary), meta))
    else:  # llama-jax -> Hugging Face (a LoRA run: its base with the adapters folded in)
        hf.write_hf(target, load_params(spec, param_target(config, mesh)), spec.model, dtype, rotary)
        done = f"{target} ({dtype}{', LoRA merged' if merge else ''})"
    if primary:
        print_fn(f"converted {spec.hf_dir or source} -> {done}")
    for name in TOKENIZER_FILES:
        if primary and (spec.home / name).is_file():
            shutil.copy2(spec.home / name, target / name)
    return target
