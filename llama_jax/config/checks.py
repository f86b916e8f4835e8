"""Checks of the values that the schema's types alone cannot check: choices, and fields that depend on each
other; the ranges of the numeric keys, checked first, are bounds.py's table. Each failure is one ConfigError line
saying what is wrong and how to fix it (the CLI prints it and exits 2 before anything is written). `validate` runs
them all, in a fixed order (the first that fails is the line a user sees); load.py calls it on every config it builds.
"""

from __future__ import annotations

import dataclasses
import math

from llama_jax.config import stages as staging
from llama_jax.config.bounds import BOUNDS, METHOD_BOUNDS, check_bounds
from llama_jax.config.choices import (
    ATTENTION_IMPLEMENTATIONS,
    BAD_RECORD_ACTIONS,
    DTYPES,
    FP8_RECIPES,
    FUNCTION_FIELDS,
    LOGICAL_AXES,
    LORA_TARGETS,
    LR_SCHEDULES,
    MESH_AXES,
    OPTIMIZERS,
    PACKINGS,
    PEFT_METHODS,
    PIPELINE_SCHEDULES,
    PROMPT_ENCODERS,
    REMAT_ACTIONS,
    REMAT_POLICIES,
    REMAT_TAGS,
    TEXT_UNITS,
)
from llama_jax.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    MeshConfig,
    ModelConfig,
    RematConfig,
    TrainConfig,
)
from llama_jax.errors import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(config: Config) -> None:
    m, t = config.model, config.train
    check_bounds(config, BOUNDS)
    _check_model(m)
    _check_batch(m, t)
    _check_schedule(t)
    _check_optimizer(t)
    _check_data(config.data)
    _check_mesh(config.mesh)
    _check_pipeline(config.mesh, m.n_layers, config.remat.every_n_layers)
    _check_checkpoint(config.checkpoint)
    _require(bool(config.run.dir.strip()), "run.dir must not be empty")
    _check_profile_steps(config.run.profile_steps, t.steps)
    _check_remat(config.remat, m.n_layers)
    _check_peft(config)
    _require(
        config.peft.method == "none" or config.mesh.pipeline == 1,
        f"peft.method={config.peft.method} with mesh.pipeline={config.mesh.pipeline}: adapters train without "
        "pipeline stages; shard the frozen model with mesh.fsdp and mesh.tensor",
    )
    _check_stages(config)
    _check_average_decay(config)


def _check_model(m: ModelConfig) -> None:
    """The model's shape (heads, rotary dimensions) and its choices of dtypes and kernels."""
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
    _require(m.fp8 in FP8_RECIPES, f"model.fp8 must be one of {', '.join(FP8_RECIPES)}, got '{m.fp8}'")
    _require(
        m.rope_high_freq_factor > m.rope_low_freq_factor,
        "model.rope_high_freq_factor must exceed model.rope_low_freq_factor",
    )


def _check_batch(m: ModelConfig, t: TrainConfig) -> None:
    """A training sequence fits the model, and a batch splits into its micro-batches."""
    _require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
        "lower train.seq_len or raise model.max_seq_len",
    )
    _require(
        t.microbatches == "auto" or t.batch_size % t.microbatches == 0,
        f"train.batch_size ({t.batch_size}) is not divisible by train.microbatches ({t.microbatches}); "
        f"valid microbatch counts: {_divisors(t.batch_size)}",
    )


def _check_mesh(mesh: MeshConfig) -> None:
    """Pipeline passes need a pipeline; at most one mesh axis fills the devices left over."""
    mesh_axes = {
        "mesh.data": mesh.data,
        "mesh.fsdp": mesh.fsdp,
        "mesh.tensor": mesh.tensor,
        "mesh.sequence": mesh.sequence,
    }
    _require(
        mesh.pipeline_microbatches == 0 or mesh.pipeline > 1,
        f"mesh.pipeline_microbatches={mesh.pipeline_microbatches} sends a pipeline's micro-batches through "
        "in passes, and there is no pipeline (mesh.pipeline=1); set mesh.pipeline > 1 or leave it at 0",
    )
    _require(
        sum(v == -1 for v in mesh_axes.values()) <= 1,
        "at most one mesh axis may be -1 (fill the remaining devices)",
    )


def _check_stages(config: Config) -> None:
    """Each later stage's whole config passes the checks of a run's, its line saying which stage it is."""
    if not config.train.stages:
        return
    for stage in staging.resolve(config)[1:]:
        train = dataclasses.replace(stage.config.train, stages=[])
        try:
            validate(dataclasses.replace(stage.config, train=train))
        except ConfigError as err:
            raise ConfigError(
                f"train.stages[{stage.listed - 1}] ({stage.name}, from step {stage.first_step}): {err}"
            ) from None


def _check_average_decay(config: Config) -> None:
    """checkpoint.average_decay: two or more distinct checkpoints of a decay phase."""
    count, decay = config.checkpoint.average_decay, config.train.resolved_decay_steps
    if not count:
        return
    _require(
        count >= 2,
        "checkpoint.average_decay=1 averages one checkpoint, which is that checkpoint; average 2 or more (0: none)",
    )
    _require(
        decay > 0,
        f"checkpoint.average_decay={count} averages the decay phase's checkpoints, and the run has no decay phase; "
        "set train.decay_fraction (e.g. 0.1) or train.decay_steps",
    )
    _require(
        config.peft.method == "none",
        f"checkpoint.average_decay with peft.method={config.peft.method}: the mean of adapters is not the mean of the "
        "adapted models; average a run that trains the whole model (0: none)",
    )
    _require(
        count <= decay,
        f"checkpoint.average_decay={count} checkpoints of a decay phase of {decay} step(s): average at most {decay}, "
        "one per step, or lengthen the decay phase (train.decay_steps)",
    )


def _check_optimizer(t: TrainConfig) -> None:
    """The optimizer's name, and Muon's Newton-Schulz polynomial (its numeric ranges are bounds.py's)."""
    _require(t.optimizer in OPTIMIZERS, f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got '{t.optimizer}'")
    coefficients = t.muon.ns_coefficients
    _require(
        len(coefficients) == 3 and all(math.isfinite(c) for c in coefficients) and coefficients[0] > 0,
        f"train.muon.ns_coefficients must be three finite numbers a, b, c with a > 0 (the iteration "
        f"X <- aX + b(XX^T)X + c(XX^T)^2X), got {coefficients}; the default is [3.4445, -4.7750, 2.0315]",
    )


def _check_schedule(t: TrainConfig) -> None:
    """Warmup, the schedule between, and the decay phase fit in the run, each given in steps or as a fraction."""
    _require(t.schedule in LR_SCHEDULES, f"train.schedule must be one of {', '.join(LR_SCHEDULES)}, got '{t.schedule}'")
    _require(
        t.steps == 0 or t.warmup_steps < t.steps,
        f"train.warmup_steps ({t.warmup_steps}) is not below train.steps ({t.steps}): the learning rate would "
        f"never reach train.lr nor decay; warm up for a fraction of the run instead (train.warmup_steps=-1: "
        f"train.warmup_fraction, {t.warmup_fraction:g} here) or raise train.steps",
    )
    warmup, decay = t.resolved_warmup_steps, t.resolved_decay_steps
    _require(
        t.schedule != "wsd" or t.steps == 0 or decay > 0,
        f"train.schedule=wsd holds train.lr until a decay phase, and it has none (train.decay_steps={decay}); set "
        "train.decay_fraction (e.g. 0.2) or train.decay_steps",
    )
    given = {
        "warmup": "train.warmup_steps" if t.warmup_steps >= 0 else f"train.warmup_fraction={t.warmup_fraction:g}",
        "decay": "train.decay_steps" if t.decay_steps >= 0 else f"train.decay_fraction={t.decay_fraction:g}",
    }
    _require(
        warmup + decay <= t.steps or t.steps == 0,
        f"warmup ({warmup} steps, {given['warmup']}) and decay ({decay} steps, {given['decay']}) add up to more "
        f"than train.steps ({t.steps}); shorten one of them or raise train.steps",
    )


def _check_profile_steps(steps: list[int], train_steps: int) -> None:
    _require(
        not steps or (len(steps) == 2 and 1 <= steps[0] <= steps[1] <= train_steps),
        f"run.profile_steps must be [FIRST, LAST] with 1 <= FIRST <= LAST <= train.steps ({train_steps}), or [] "
        f"for none; got {steps}; e.g. run.profile_steps=[{min(5, train_steps)},{min(7, train_steps)}]",
    )


def _check_data(d: DataConfig) -> None:
    _require(
        not d.weights or len(d.weights) == len(d.sources),
        f"data.weights has {len(d.weights)} value(s) for {len(d.sources)} source(s); give one per source or none",
    )
    _require(all(w > 0 for w in d.weights), f"data.weights must all be > 0, got {d.weights}")
    for key, value, allowed in [
        ("data.packing", d.packing, PACKINGS),
        ("data.text_unit", d.text_unit, TEXT_UNITS),
        ("data.on_bad_record", d.on_bad_record, BAD_RECORD_ACTIONS),
    ]:
        _require(value in allowed, f"{key} must be one of {', '.join(allowed)}, got '{value}'")


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
        raise ConfigError(
            f"mesh.rules.{logical}={value}: unknown mesh axis '{bad[0]}'; use a comma-separated "
            f"list of {', '.join(MESH_AXES)}, or none"
        )


def _check_pipeline(mesh: MeshConfig, n_layers: int, every_n_layers: int) -> None:
    _require(
        mesh.pipeline_schedule in PIPELINE_SCHEDULES,
        f"mesh.pipeline_schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got '{mesh.pipeline_schedule}'",
    )
    layers = mesh.pipeline_stage_layers
    if not layers:
        return
    groups = mesh.pipeline * mesh.pipeline_repeats
    repeats = f" × mesh.pipeline_repeats ({mesh.pipeline_repeats})" if mesh.pipeline_repeats > 1 else ""
    _require(
        len(layers) == groups,
        f"mesh.pipeline_stage_layers has {len(layers)} entries; it needs one per stage"
        f"{' and repeat' if repeats else ''}: mesh.pipeline ({mesh.pipeline}){repeats} = {groups}",
    )
    _require(
        all(isinstance(n, int) and n > 0 for n in layers) and sum(layers) == n_layers,
        f"mesh.pipeline_stage_layers {list(layers)} must be positive layer counts adding up to model.n_layers "
        f"({n_layers}); they add up to {sum(layers)}",
    )
    _require(
        all(n % every_n_layers == 0 for n in layers),
        f"remat.every_n_layers ({every_n_layers}) must divide every entry of mesh.pipeline_stage_layers {list(layers)}",
    )


def _check_remat(remat: RematConfig, n_layers: int) -> None:
    if remat.policy not in REMAT_POLICIES:
        raise ConfigError(f"unknown remat.policy '{remat.policy}'; valid policies: {', '.join(REMAT_POLICIES)}")
    for tag, action in remat.custom.items():
        if tag not in REMAT_TAGS:
            raise ConfigError(f"remat.custom.{tag}: unknown tag; valid tags: {', '.join(REMAT_TAGS)}")
        if action not in REMAT_ACTIONS:
            raise ConfigError(f"remat.custom.{tag}={action}: the action must be one of {', '.join(REMAT_ACTIONS)}")
    if remat.custom and remat.policy == "none":
        raise ConfigError(
            "remat.custom refines a recomputation policy; set remat.policy to one of "
            f"{', '.join(p for p in REMAT_POLICIES if p != 'none')} (e.g. full: recompute all but your "
            "tags)"
        )
    if n_layers % remat.every_n_layers:  # positive: BOUNDS
        raise ConfigError(
            f"remat.every_n_layers ({remat.every_n_layers}) must be a positive divisor of model.n_layers ({n_layers})"
        )


def _check_checkpoint(c: CheckpointConfig) -> None:
    _require(not (c.resume_from and c.init_from), "set checkpoint.resume_from or checkpoint.init_from, not both")
    _require(
        bool(c.local_dir.strip()) == (c.local_every_steps != 0),
        "checkpoint.local_dir and checkpoint."
        "local_every_steps go together: set both (e.g. local_dir=/dev/shm/llama-jax local_every_steps=50) or "
        "neither",
    )
    bad = sorted(set(c.allow_model_changes) - set(FUNCTION_FIELDS))
    _require(
        not bad,
        f"checkpoint.allow_model_changes: {', '.join(bad)} cannot change under a checkpoint; "
        f"allowed: {', '.join(FUNCTION_FIELDS)}",
    )


def _check_peft(config: Config) -> None:
    """A method's own keys are checked only when it is chosen (a prompt length never refuses a LoRA run)."""
    peft, seq_len, init_from, resume_from = (
        config.peft,
        config.train.seq_len,
        config.checkpoint.init_from,
        config.checkpoint.resume_from,
    )
    _require(peft.method in PEFT_METHODS, f"peft.method must be one of {', '.join(PEFT_METHODS)}, got '{peft.method}'")
    if peft.method == "none":
        return
    check_bounds(config, METHOD_BOUNDS[peft.method])
    _require(
        bool(init_from),
        f"peft.method={peft.method} adapts a trained model: set checkpoint.init_from to its run "
        "directory, checkpoint or hf:DIR",
    )
    _require(
        not resume_from,
        "checkpoint.resume_from does not apply to peft runs; re-run the same command on the "
        "same run.dir to resume (checkpoint.init_from names the base model)",
    )
    if peft.method == "lora":
        unknown = [t for t in peft.targets if t not in LORA_TARGETS]
        _require(
            not unknown,
            f"peft.targets: unknown target '{unknown[0] if unknown else ''}'; choose from {', '.join(LORA_TARGETS)}",
        )
        _require(
            len(peft.targets) > 0 and len(set(peft.targets)) == len(peft.targets),
            f"peft.targets must name each projection at most once, and at least one, got {peft.targets}",
        )
        return
    _require(
        peft.prompt_tokens < seq_len,
        f"peft.prompt_tokens ({peft.prompt_tokens}) must be positive and leave room for text in train.seq_len "
        f"({seq_len}); lower peft.prompt_tokens or raise train.seq_len",
    )
    _require(
        peft.prompt_encoder in PROMPT_ENCODERS,
        f"peft.prompt_encoder must be one of {', '.join(PROMPT_ENCODERS)}, got '{peft.prompt_encoder}'",
    )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
