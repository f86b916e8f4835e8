"""Model specs: where a model's weights are, resolved once; loading its params and tokenizer.

A model spec is what a user types for a model (`checkpoint.init_from`, `resume_from`, `llama-jax
generate/eval/convert MODEL`, `api.load`):

    hf:DIR, or a directory holding config.json     a Hugging Face model
    a run directory, its checkpoints/ directory    the newest finished step in it
    a step directory (<run.dir>/checkpoints/<N>)   that step: a training checkpoint or a converted one
    ADAPTER@BASE, or ADAPTER alone                 a Hugging Face PEFT adapter directory (LoRA or prompt
                                                   tuning) on BASE, any spec above; alone, on the local
                                                   model its adapter_config.json names

A run with adapters (peft.method != none) is a model too: its base (found where its checkpoints say,
and checked against their digest) with its adapters, as inference runs them (peft.inference_params:
LoRA folded into the weights, a prompt-tuned model's prompt in params["prompt"]). A PEFT adapter directory
is one the same way (peft_format.py reads it; it records no digest, so its tensors' shapes are what is
checked against the base).

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
from typing import Any

import jax
from jax.sharding import Mesh

from llama_jax.checkpoint.durable import read_meta, resolve_step_dir, restore_params
from llama_jax.config import Config, ModelConfig, PeftConfig, load_config, validate
from llama_jax.config.choices import SHAPE_FIELDS
from llama_jax.data.tokenizer import Tokenizer
from llama_jax.data.tokenizer import load_tokenizer as load_tokenizer_file
from llama_jax.distributed import processes, sharding
from llama_jax.errors import ConfigError
from llama_jax.files import unreadable
from llama_jax.interop import hf, hf_config, peft_format
from llama_jax.model import peft
from llama_jax.model.llama import param_shapes
from llama_jax.model.stages import NATURAL, LayerOrder, in_order, relayout

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spm.model")
ADAPTER_ON = "@"  # ADAPTER@BASE: a PEFT adapter directory on a base model


@dataclass(frozen=True)
class ModelSpec:
    text: str  # as the user wrote it, for messages
    model: ModelConfig
    hf_dir: Path | None = None  # a Hugging Face directory, or
    step_dir: Path | None = None  # a llama-jax checkpoint step (absolute: Orbax requires it)
    adapter_dir: Path | None = None  # a PEFT adapter directory
    adapters: PeftConfig | None = None  # a peft run's adapters (in step_dir) or a PEFT adapter's ...
    base: dict | None = None  # ... and the base they adapt, as its checkpoints record it (peft.base_reference)

    @property
    def location(self) -> str:
        """Where the weights are, as a spec that does not depend on the working directory."""
        if self.adapter_dir is not None:
            return f"{self.adapter_dir.absolute()}{ADAPTER_ON}{self.base['path']}"
        return f"hf:{self.hf_dir.absolute()}" if self.hf_dir is not None else str(self.step_dir)

    @property
    def params_only(self) -> bool:
        """Parameters without optimizer state or data position: a Hugging Face model or adapter, or a
        converted checkpoint."""
        return self.hf_dir is not None or self.adapter_dir is not None or (self.step_dir / "params").is_dir()

    @property
    def home(self) -> Path:
        """The directory that holds the model's tokenizer: the Hugging Face directory, the run directory, or
        a PEFT adapter's directory when it has one (PEFT saves it there), else its base's home."""
        if self.adapter_dir is not None:
            if any((self.adapter_dir / name).is_file() for name in TOKENIZER_FILES):
                return self.adapter_dir
            return resolve(self.base["path"]).home
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
    if adapter := _peft_adapter(text):
        return adapter
    # Every kind of spec is a directory: one that is missing, a file or unreadable is named before anything
    # looks inside it (convert, eval, generate, checkpoint.init_from and resume_from all come through here).
    if problem := unreadable(Path(text.removeprefix("hf:")), "directory"):
        raise ConfigError(f"{problem}; a model is a run directory, its checkpoints/, a step directory or hf:DIR")
    directory = hf_directory(text)
    if directory is not None:
        return ModelSpec(text, hf_config.read_config(directory), hf_dir=directory)
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
    return ModelSpec(
        text,
        model,
        step_dir=step_dir,
        adapters=PeftConfig(**{k: v for k, v in settings.items() if k in fields}),
        base=meta.get("base"),
    )


def _peft_adapter(text: str) -> ModelSpec | None:
    """ADAPTER@BASE or ADAPTER (a directory holding adapter_config.json) resolved; None for other specs."""
    adapter, on, base_text = text, "", ""
    if not (Path(text).expanduser() / peft_format.ADAPTER_CONFIG).is_file():
        if ADAPTER_ON not in text or Path(text).expanduser().exists():
            return None
        adapter, on, base_text = text.partition(ADAPTER_ON)
        if not (Path(adapter).expanduser() / peft_format.ADAPTER_CONFIG).is_file():
            raise ConfigError(
                f"{adapter} is not a PEFT adapter directory (no {peft_format.ADAPTER_CONFIG}): "
                f"ADAPTER{ADAPTER_ON}BASE is a PEFT adapter and the base model it adapts"
            )
    directory = Path(adapter).expanduser()
    if not on:
        base_text = str(peft_format.read_config(directory).get("base_model_name_or_path") or "")
        if not base_text or unreadable(Path(base_text.removeprefix("hf:")).expanduser(), "directory"):
            raise ConfigError(
                f"{adapter} adapts {base_text or 'a base it does not name'}, which is not a model on "
                f"this machine; name the base: {adapter}{ADAPTER_ON}BASE (hf:DIR or a llama-jax run)"
            )
    base = resolve(base_text)
    if base.adapters is not None:
        raise ConfigError(
            f"{base_text} has adapters of its own; the base of {adapter} must be a model (hf:DIR, a run "
            "without peft.method, or a merged export)"
        )
    settings = peft_format.read_settings(directory, base.model)
    return ModelSpec(
        text, base.model, adapter_dir=directory, adapters=settings, base={"spec": base_text, "path": base.location}
    )


def load_params(spec: ModelSpec, target: Any = None, rotary: str = "half", layout: LayerOrder = NATURAL) -> Any:
    """The model's parameters, taking the shapes, dtypes and shardings of `target` (a ShapeDtypeStruct
    tree, e.g. TrainProgram.abstract_state().params or param_target(), or shardings alone) or, without
    one, the model's param_dtype on the default device. A training checkpoint's optimizer moments are
    not read; `rotary` is the q/k layout of a Hugging Face model's weights (hf_tensor_map.ROTARY_LAYOUTS); `layout`
    the pipeline layout whose layer order the params are wanted in (stages.py)."""
    if target is None:
        target = hf.single_device_target(spec.model)
    elif isinstance(jax.tree.leaves(target)[0], jax.sharding.Sharding):
        target = _placed(spec.model, target)
    if spec.adapters is not None:
        return _adapted(spec, target)
    if spec.hf_dir is not None:
        natural = in_order({"params": target}, layout, NATURAL)["params"]
        return relayout(
            {"params": hf.read_params(spec.hf_dir, spec.model, natural, rotary)}, NATURAL, layout, {"params": target}
        )["params"]
    return restore_params(spec.step_dir, target, layout)


def load_adapters(spec: ModelSpec, placement: jax.sharding.Sharding | None = None) -> dict:
    """The adapters of a peft run as trained (peft.split's first half), replicated on `placement`'s devices
    (default: this process's first device): they are small."""
    placement = placement or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(placement, jax.sharding.NamedSharding):
        placement = jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec())
    shapes = peft.split(param_shapes(spec.model, spec.adapters))[0]
    return read_adapters(
        spec, jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placement), shapes)
    )


def read_adapters(spec: ModelSpec, target: Any) -> dict:
    """The adapters of a peft run or PEFT adapter directory, in the shapes, dtypes and shardings of `target` (a
    tree like peft.split's first half): the adapters a peft run with the same settings continues to train."""
    if spec.adapter_dir is not None:
        return peft_format.read_adapter(spec.adapter_dir, spec.model, spec.adapters, target)
    return restore_params(spec.step_dir, target)


def _adapted(spec: ModelSpec, target: Any) -> Any:
    """A peft run's inference params: its base (which must still be the one it was trained on) with its
    adapters, as peft.inference_params leaves them, in the shapes and shardings of `target`."""
    try:
        base_spec = resolve(spec.base["path"])
    except (ConfigError, KeyError, TypeError) as err:
        raise ConfigError(
            f"{spec.text} adapts a base model that cannot be read ({err}); its checkpoints name "
            f"{(spec.base or {}).get('path')}"
        ) from None
    base_target = {k: v for k, v in target.items() if k not in peft.PROMPTS}
    base = load_params(base_spec, base_target)
    peft.check_base(spec.base, peft.base_reference(base_spec.text, base_spec.location, base), spec.text)
    adapters = load_adapters(spec, jax.tree.leaves(base)[0].sharding)
    params = peft.inference_params(peft.merge(adapters, base), spec.model, spec.adapters)
    placed = {k: params[k] for k in target if k in peft.PROMPTS}  # the prompt, where the target wants it
    return params | jax.tree.map(
        lambda value, spec: jax.device_put(value, spec.sharding), placed, {k: target[k] for k in placed}
    )


def load_model(
    model: str | ModelSpec, compute_dtype: str | None = "float32", target=None, overrides: list[str] = (), devices=None
) -> tuple[ModelConfig, Any]:
    """(config, params) of a model spec, placed as api.load says (its docstring): the one way the commands
    and the evaluation backend load a model."""
    spec = resolve(model)
    config = inference_config(spec.model, overrides, batches=False)
    cfg = config.model
    if compute_dtype and not any(o.strip().startswith("model.compute_dtype=") for o in overrides):
        cfg = dataclasses.replace(cfg, compute_dtype=compute_dtype)
    processes.initialize(config.run)
    if target is None and (devices is not None or names_a_mesh(overrides)):
        target = param_target(config, inference_mesh(config, devices))
    return cfg, load_params(spec, target)


def names_a_mesh(overrides: list[str]) -> bool:
    """Whether `overrides` set any mesh.* key: what places a model on a mesh instead of one device."""
    return any(o.split("=", 1)[0].strip().startswith("mesh.") for o in overrides)


def inference_mesh(config: Config, devices=None) -> Mesh:
    """The mesh of config's mesh.* keys over `devices` (default: all), for inference and conversion: the
    checks of training batches against it (batch size, sequence length) do not apply."""
    devices = jax.devices() if devices is None else devices
    if config.mesh.pipeline > 1:
        raise ConfigError(
            f"mesh.pipeline={config.mesh.pipeline}: pipeline parallelism is for training; place a model "
            "for inference or conversion with mesh.fsdp, mesh.tensor and mesh.data"
        )
    sizes = sharding.mesh_shape(config.mesh, len(devices))
    train = dataclasses.replace(
        config.train,
        batch_size=sizes["data"] * sizes["fsdp"],
        microbatches=1,
        seq_len=2 * sizes["sequence"] * sizes["tensor"],
    )
    return sharding.make_mesh(dataclasses.replace(config, train=train), devices)


def param_target(config: Config, mesh: Mesh) -> Any:
    """Shapes, dtypes and shardings of the model's parameters on `mesh`: a target for load_params."""
    return _placed(config.model, sharding.param_shardings(config, mesh))


def _placed(model: ModelConfig, shardings: Any) -> Any:
    """The model's abstract parameters, each with its sharding from `shardings`."""
    return jax.tree.map(
        lambda s, placement: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placement), param_shapes(model), shardings
    )


def copy_tokenizer(home: Path, target: Path) -> None:
    """The tokenizer files of `home` (a model's home, a run directory) copied into `target`, beside the weights
    written there, so the written model loads with its tokenizer."""
    for name in TOKENIZER_FILES:
        if (home / name).is_file():
            shutil.copy2(home / name, target / name)


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
        raise ConfigError(
            f"model.{sorted(changed & set(SHAPE_FIELDS))[0]} is fixed by the loaded weights; "
            "only settings such as model.compute_dtype or model.attention can change"
        )
    config = dataclasses.replace(base, model=dataclasses.replace(model, **{k: getattr(base.model, k) for k in changed}))
    if not batches:
        config = dataclasses.replace(
            config, train=dataclasses.replace(config.train, seq_len=min(config.train.seq_len, config.model.max_seq_len))
        )
    validate(config)
    return config
