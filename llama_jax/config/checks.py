"""Checks of the values that the schema's types alone cannot check: ranges, choices, and fields that depend
on each other. Each failure is one ConfigError line saying what is wrong and how to fix it (the CLI prints it
and exits 2 before anything is written). `validate` runs them all; load.py calls it on every config it builds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llama_jax.config import stages as staging
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
    PACKINGS,
    PEFT_METHODS,
    PIPELINE_SCHEDULES,
    PROMPT_ENCODERS,
    REMAT_ACTIONS,
    REMAT_POLICIES,
    REMAT_TAGS,
    TEXT_UNITS,
)
from llama_jax.config.schema import CheckpointConfig, Config, DataConfig, MeshConfig, RematConfig, TrainConfig
from llama_jax.errors import ConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class Bound:
    """The values a numeric key may take: from `low` on, or above it when `above`; up to `high` (below it when
    `below`) for a fraction; and `special`, one value under the range with a meaning of its own (-1: fill)."""

    low: float
    above: bool = False
    high: float | None = None
    below: bool = False
    special: int | None = None
    # The one word the key takes besides numbers: "auto" (a count or auto: train.microbatches, ...), "observed"
    # (checkpoint.mtbf_hours); "": numbers only.
    word: str = ""
    # What the lowest allowed value does ("off", "only at the end"): the message names it, so a user who typed
    # a value under it learns which value has a meaning. Without one the bound is a plain count or measure.
    means: str = ""

    def allows(self, value: float) -> bool:
        if value == self.special:
            return True
        if value < self.low or (self.above and value == self.low):
            return False
        return self.high is None or value < self.high or (not self.below and value == self.high)

    def describe(self) -> str:
        """'positive', '>= 0 (0: off)', 'at least 16', 'in (0, 1]', 'positive or -1 (-1: fill ...)',
        'a positive count or auto'."""
        if self.high is not None:
            return f"in {'(' if self.above else '['}{self.low:g}, {self.high:g}{')' if self.below else ']'}"
        if self.above:
            rule = "positive" if self.low == 0 else f"above {self.low:g}"
        else:
            rule = f">= {self.low:g}" if self.low <= 0 else f"at least {self.low:g}"
        if self.special is not None:
            rule = f"{rule} or {self.special} ({self.special}: {self.means})"
        elif self.means:
            rule = f"{rule} ({self.low:g}: {self.means})"
        if self.word == "auto":
            return "a positive count or auto" if rule == "positive" else f"a count {rule} or auto"
        return f"{rule} or {self.word}" if self.word else rule


POSITIVE = Bound(0, above=True)

# Every numeric key of the schema and the values it takes (see schema.py's comments for what they mean): a key that
# only makes sense positive -- a size, count, interval, timeout, rate -- refuses 0 and below, and a key whose 0 (or
# -1) is documented to mean something says what in its `means`. validate() checks these before anything relates
# two keys (a count of 0 would otherwise reach a division). test_config checks that no numeric key is missing.
BOUNDS: dict[str, Bound] = {
    "model.vocab_size": POSITIVE,
    "model.d_model": POSITIVE,
    "model.n_layers": POSITIVE,
    "model.n_heads": POSITIVE,
    "model.n_kv_heads": POSITIVE,
    "model.head_dim": Bound(0, means="d_model / n_heads"),
    "model.ffn_dim": POSITIVE,
    "model.max_seq_len": POSITIVE,
    "model.norm_eps": POSITIVE,
    "model.rope_theta": POSITIVE,
    "model.rope_scaling_factor": Bound(1, means="unscaled"),
    "model.rope_low_freq_factor": POSITIVE,  # and below rope_high_freq_factor (validate)
    "model.rope_high_freq_factor": POSITIVE,
    "model.rope_original_max_len": POSITIVE,
    "model.attention_max_segments": POSITIVE,
    "model.init_std": POSITIVE,
    "train.steps": Bound(0),
    "train.batch_size": POSITIVE,
    "train.seq_len": POSITIVE,
    "train.microbatches": Bound(0, above=True, word="auto"),
    "train.lr": POSITIVE,
    "train.warmup_fraction": Bound(0, high=1, below=True),  # below 1: a warmup ends before the run does
    "train.warmup_steps": Bound(0, special=-1, means="train.warmup_fraction of train.steps"),
    "train.min_lr_ratio": Bound(0, high=1),
    "train.decay_fraction": Bound(0, high=1),
    "train.decay_steps": Bound(0, special=-1, means="train.decay_fraction of train.steps"),
    "train.weight_decay": Bound(0),
    "train.b1": Bound(0, high=1, below=True),
    "train.b2": Bound(0, high=1, below=True),
    "train.eps": POSITIVE,  # Adam's denominator: a parameter without gradient (an unseen token's row) would be 0/0
    "train.grad_clip": Bound(0, means="no clipping"),
    "train.log_every": POSITIVE,
    "train.eval_every": Bound(0, means="only at the start and the end"),
    "train.eval_batches": POSITIVE,
    "train.sample_tokens": Bound(0, means="no sample"),
    "data.packing_window": POSITIVE,
    "data.val_every_nth_doc": Bound(2),
    "data.loader_threads": Bound(0, means="none: each batch is made when the step asks for it"),
    "data.prefetch": Bound(0, means="none"),
    "mesh.pipeline": POSITIVE,
    "mesh.pipeline_repeats": POSITIVE,
    "mesh.pipeline_microbatches": Bound(0, means="all of train.microbatches in one pass"),
    **{
        f"mesh.{axis}": Bound(0, above=True, special=-1, means="fill the devices left over")
        for axis in ("data", "fsdp", "tensor", "sequence")
    },
    "remat.every_n_layers": POSITIVE,  # and a divisor of model.n_layers (_check_remat)
    "checkpoint.every_steps": Bound(0, means="only at the end", word="auto"),
    "checkpoint.every_minutes": Bound(0, means="off"),
    "checkpoint.keep": POSITIVE,
    "checkpoint.average_decay": Bound(0, means="none"),
    "checkpoint.keep_every": Bound(0, means="no milestones"),
    # An MTBF of 0 has no meaning: the default, the MTBF this run observes (else 3 h), is the word "observed".
    "checkpoint.mtbf_hours": Bound(0, above=True, word="observed"),
    "checkpoint.timeout_s": Bound(1),
    "checkpoint.max_failed_saves": Bound(0, means="stop at the first"),
    "checkpoint.local_every_steps": Bound(0, means="no local tier", word="auto"),
    "checkpoint.local_keep": POSITIVE,
    "checkpoint.local_replicas": Bound(0, high=1),  # an int: 0 or 1 (a partner host keeps a copy)
    "fault.hang_factor": POSITIVE,
    "fault.hang_min_timeout_s": POSITIVE,
    "fault.hang_startup_timeout_s": POSITIVE,
    "fault.max_bad_steps": Bound(0, means="never roll back"),
    "fault.spike_zscore": Bound(0, means="off"),
    "fault.spike_window": Bound(2),
    "fault.straggler_factor": Bound(1, above=True),
    # At least 2: a window is scored once every process has posted it, which the train loop (one step
    # ahead of the devices) guarantees only a window of 2+ steps later (distributed.HostWindow).
    "fault.straggler_every_steps": Bound(2),
    "fault.straggler_host_threshold": POSITIVE,
    "fault.barrier_timeout_s": Bound(1),
    "fault.flight_events": Bound(16),
    "fault.flight_heartbeat_s": POSITIVE,
    "fault.preflight_min_ratio": Bound(0, above=True, high=1),
    "run.num_processes": Bound(0, means="from the environment"),
    "run.process_id": Bound(-1, means="from the environment"),
    "run.init_timeout_s": Bound(1),
    "run.heartbeat_timeout_s": Bound(1),
    "run.full_processes": Bound(0, means="this run's process count"),
    "run.device_memory_gb": Bound(0, means="what XLA may allocate"),
    # The testing section (schema.InjectConfig): faults injected on purpose.
    "inject.hang_step": Bound(-1, means="none"),
    "inject.process": Bound(-1, means="none"),
    "inject.step_delay_s": Bound(0),
    "inject.save_delay_s": Bound(0),
    "inject.slow_device": Bound(-1, means="none"),
    "inject.wrong_device": Bound(-1, means="none"),
}

# A peft method's own keys, checked only when that method is chosen: a prompt length never refuses a LoRA run.
METHOD_BOUNDS: dict[str, dict[str, Bound]] = {
    "lora": {"peft.rank": POSITIVE, "peft.alpha": POSITIVE, "peft.dropout": Bound(0, high=1, below=True)},
    "prompt": {"peft.prompt_tokens": POSITIVE},  # and below train.seq_len (_check_peft)
    "ptuning": {"peft.prompt_tokens": POSITIVE, "peft.encoder_hidden": Bound(0, means="model.d_model")},
}

# The numeric keys with no bound, and why.
UNBOUNDED = {"seed": "any integer seeds the random numbers"}


def value_of(config: Config, key: str):
    """The value of a dotted key, e.g. value_of(config, "train.lr")."""
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def check_bounds(config: Config, bounds: dict[str, Bound]) -> None:
    """One ConfigError line for the first key of `bounds` whose value is out of its bound."""
    for key, bound in bounds.items():
        value = value_of(config, key)
        ok = value == bound.word if isinstance(value, str) else bound.allows(value)
        _require(ok, f"{key} must be {bound.describe()}, got {value!r}")


def validate(config: Config) -> None:
    m, t = config.model, config.train
    check_bounds(config, BOUNDS)
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
    _check_schedule(t)
    _check_data(config.data)
    mesh_axes = {
        "mesh.data": config.mesh.data,
        "mesh.fsdp": config.mesh.fsdp,
        "mesh.tensor": config.mesh.tensor,
        "mesh.sequence": config.mesh.sequence,
    }
    _require(
        config.mesh.pipeline_microbatches == 0 or config.mesh.pipeline > 1,
        f"mesh.pipeline_microbatches={config.mesh.pipeline_microbatches} sends a pipeline's micro-batches through "
        "in passes, and there is no pipeline (mesh.pipeline=1); set mesh.pipeline > 1 or leave it at 0",
    )
    _require(
        sum(v == -1 for v in mesh_axes.values()) <= 1,
        "at most one mesh axis may be -1 (fill the remaining devices)",
    )
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
