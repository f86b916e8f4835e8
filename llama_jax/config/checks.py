"""Checks of the values that the schema's types alone cannot check: ranges, choices, and fields that depend
on each other. Each failure is one ConfigError line saying what is wrong and how to fix it (the CLI prints it
and exits 2 before anything is written). `validate` runs them all; load.py calls it on every config it builds.
"""

from __future__ import annotations

from llama_jax.config.choices import (ATTENTION_IMPLEMENTATIONS, BAD_RECORD_ACTIONS, DTYPES, FP8_RECIPES,
                                      FUNCTION_FIELDS, LOGICAL_AXES, LORA_TARGETS, MESH_AXES, PACKINGS, PEFT_METHODS,
                                      PIPELINE_SCHEDULES, PROMPT_ENCODERS, REMAT_ACTIONS, REMAT_POLICIES, REMAT_TAGS,
                                      TEXT_UNITS)
from llama_jax.config.schema import (CheckpointConfig, Config, DataConfig, FaultConfig, MeshConfig, PeftConfig,
                                     RematConfig)
from llama_jax.errors import ConfigError


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
    _require(m.fp8 in FP8_RECIPES, f"model.fp8 must be one of {', '.join(FP8_RECIPES)}, got '{m.fp8}'")
    _require(m.norm_eps > 0, f"model.norm_eps must be positive, got {m.norm_eps}")
    _require(m.init_std > 0, f"model.init_std must be positive, got {m.init_std}")
    _require(m.rope_original_max_len > 0,
             f"model.rope_original_max_len must be positive, got {m.rope_original_max_len}")
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
    _require(t.steps == 0 or t.warmup_steps < t.steps,
             f"train.warmup_steps ({t.warmup_steps}) is not below train.steps ({t.steps}): the learning rate would "
             f"never reach train.lr nor decay; warm up for a small fraction of the run (e.g. "
             f"train.warmup_steps={max(1, t.steps // 100)}) or raise train.steps")
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
             "mesh.pipeline and mesh.pipeline_repeats must be positive counts and mesh.pipeline_microbatches >= 0, "
             "got "
             f"{config.mesh.pipeline}, {config.mesh.pipeline_repeats} and {config.mesh.pipeline_microbatches}")
    _require(config.mesh.pipeline_microbatches == 0 or config.mesh.pipeline > 1,
             f"mesh.pipeline_microbatches={config.mesh.pipeline_microbatches} sends a pipeline's micro-batches through "
             "in passes, and there is no pipeline (mesh.pipeline=1); set mesh.pipeline > 1 or leave it at 0")
    _require(
        sum(v == -1 for v in mesh_axes.values()) <= 1,
        "at most one mesh axis may be -1 (fill the remaining devices)",
    )
    _check_pipeline(config.mesh, m.n_layers, config.remat.every_n_layers)
    _check_checkpoint(config.checkpoint)
    _check_fault(config.fault)
    _require(bool(config.run.dir.strip()), "run.dir must not be empty")
    _require(config.run.init_timeout_s >= 1 and config.run.heartbeat_timeout_s >= 1,
             "run.init_timeout_s and run.heartbeat_timeout_s must be at least 1 second")
    _require(config.run.full_processes >= 0, f"run.full_processes must be >= 0 (0: this run's process count), "
             f"got {config.run.full_processes}")
    _require(config.run.device_memory_gb >= 0, "run.device_memory_gb must be >= 0 (0: the device's memory less 10%)")
    _check_remat(config.remat, m.n_layers)
    _check_peft(config.peft, t.seq_len, config.checkpoint.init_from, config.checkpoint.resume_from)
    _require(config.peft.method == "none" or config.mesh.pipeline == 1,
             f"peft.method={config.peft.method} with mesh.pipeline={config.mesh.pipeline}: adapters train without "
             "pipeline stages; shard the frozen model with mesh.fsdp and mesh.tensor")

def _check_data(d: DataConfig) -> None:
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

def _check_pipeline(mesh: MeshConfig, n_layers: int, every_n_layers: int) -> None:
    _require(mesh.pipeline_schedule in PIPELINE_SCHEDULES, f"mesh.pipeline_schedule must be one of "
             f"{', '.join(PIPELINE_SCHEDULES)}, got '{mesh.pipeline_schedule}'")
    layers = mesh.pipeline_stage_layers
    if not layers:
        return
    groups = mesh.pipeline * mesh.pipeline_repeats
    repeats = f" × mesh.pipeline_repeats ({mesh.pipeline_repeats})" if mesh.pipeline_repeats > 1 else ""
    _require(len(layers) == groups, f"mesh.pipeline_stage_layers has {len(layers)} entries; it needs one per stage"
             f"{' and repeat' if repeats else ''}: mesh.pipeline ({mesh.pipeline}){repeats} = {groups}")
    _require(all(isinstance(n, int) and n > 0 for n in layers) and sum(layers) == n_layers,
             f"mesh.pipeline_stage_layers {list(layers)} must be positive layer counts adding up to model.n_layers "
             f"({n_layers}); they add up to {sum(layers)}")
    _require(all(n % every_n_layers == 0 for n in layers), f"remat.every_n_layers ({every_n_layers}) must divide "
             f"every entry of mesh.pipeline_stage_layers {list(layers)}")


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


def _check_checkpoint(c: CheckpointConfig) -> None:
    _require(c.every_steps == "auto" or (isinstance(c.every_steps, int) and c.every_steps >= 0),
             f"checkpoint.every_steps must be a step count >= 0 (0: only at the end) or auto, got '{c.every_steps}'")
    _require(c.keep > 0, f"checkpoint.keep must be positive, got {c.keep}")
    _require(c.keep_every >= 0 and c.every_minutes >= 0 and c.mtbf_hours >= 0,
             "checkpoint.keep_every, checkpoint.every_minutes and checkpoint.mtbf_hours must be >= 0")
    _require(not (c.resume_from and c.init_from), "set checkpoint.resume_from or checkpoint.init_from, not both")
    _require(c.local_every_steps == "auto" or (isinstance(c.local_every_steps, int) and c.local_every_steps >= 0),
             f"checkpoint.local_every_steps must be a step count >= 0 or auto, got '{c.local_every_steps}'")
    _require(bool(c.local_dir.strip()) == (c.local_every_steps != 0), "checkpoint.local_dir and checkpoint."
             "local_every_steps go together: set both (e.g. local_dir=/dev/shm/llama-jax local_every_steps=50) or "
             "neither")
    _require(c.timeout_s >= 1, "checkpoint.timeout_s must be at least 1 second")
    _require(c.max_failed_saves >= 0, f"checkpoint.max_failed_saves must be >= 0, got {c.max_failed_saves}")
    _require(c.local_keep > 0 and c.local_replicas in (0, 1), f"checkpoint.local_keep must be positive and "
             f"checkpoint.local_replicas 0 or 1, got {c.local_keep} and {c.local_replicas}")
    bad = sorted(set(c.allow_model_changes) - set(FUNCTION_FIELDS))
    _require(not bad, f"checkpoint.allow_model_changes: {', '.join(bad)} cannot change under a checkpoint; "
             f"allowed: {', '.join(FUNCTION_FIELDS)}")


def _check_fault(f: FaultConfig) -> None:
    _require(f.hang_factor > 0 and f.hang_min_timeout_s > 0 and f.hang_startup_timeout_s > 0,
             "fault.hang_factor, fault.hang_min_timeout_s and fault.hang_startup_timeout_s must be positive")
    _require(f.max_bad_steps >= 0, f"fault.max_bad_steps must be >= 0 (0: never roll back), got {f.max_bad_steps}")
    _require(f.spike_zscore >= 0 and f.spike_window > 1, "fault.spike_zscore must be >= 0 and fault.spike_window > 1")
    _require(f.straggler_factor > 1, f"fault.straggler_factor must exceed 1, got {f.straggler_factor}")
    # At least 2: a window is scored once every process has posted it, which the train loop (one step
    # ahead of the devices) guarantees only a window of 2+ steps later (distributed.HostWindow).
    _require(f.straggler_every_steps >= 2 and f.straggler_host_threshold > 0,
             "fault.straggler_every_steps must be at least 2 and fault.straggler_host_threshold positive")
    _require(f.barrier_timeout_s >= 1, "fault.barrier_timeout_s must be at least 1 second")
    _require(f.flight_events >= 16 and f.flight_heartbeat_s > 0,
             f"fault.flight_events must be at least 16 and fault.flight_heartbeat_s positive, got {f.flight_events} "
             f"and {f.flight_heartbeat_s}")
    _require(f.inject_step_delay_s >= 0 and f.inject_save_delay_s >= 0, "fault.inject_*_delay_s must be >= 0")
    _require(0 < f.preflight_min_ratio <= 1,
             f"fault.preflight_min_ratio must be in (0, 1], got {f.preflight_min_ratio}")


def _check_peft(peft: PeftConfig, seq_len: int, init_from: str, resume_from: str) -> None:
    """A method's own keys are checked only when it is chosen (a prompt length never refuses a LoRA run)."""
    _require(peft.method in PEFT_METHODS, f"peft.method must be one of {', '.join(PEFT_METHODS)}, got '{peft.method}'")
    if peft.method == "none":
        return
    _require(bool(init_from), f"peft.method={peft.method} adapts a trained model: set checkpoint.init_from to its run "
                             "directory, checkpoint or hf:DIR")
    _require(not resume_from, "checkpoint.resume_from does not apply to peft runs; re-run the same command on the "
                             "same run.dir to resume (checkpoint.init_from names the base model)")
    if peft.method == "lora":
        unknown = [t for t in peft.targets if t not in LORA_TARGETS]
        _require(not unknown, f"peft.targets: unknown target '{unknown[0] if unknown else ''}'; "
                             f"choose from {', '.join(LORA_TARGETS)}")
        _require(len(peft.targets) > 0 and len(set(peft.targets)) == len(peft.targets),
                f"peft.targets must name each projection at most once, and at least one, got {peft.targets}")
        _require(peft.rank > 0, f"peft.rank must be positive, got {peft.rank}")
        _require(peft.alpha > 0, f"peft.alpha must be positive, got {peft.alpha}")
        _require(0 <= peft.dropout < 1, f"peft.dropout must be in [0, 1), got {peft.dropout}")
        return
    _require(0 < peft.prompt_tokens < seq_len,
            f"peft.prompt_tokens ({peft.prompt_tokens}) must be positive and leave room for text in train.seq_len "
            f"({seq_len}); lower peft.prompt_tokens or raise train.seq_len")
    _require(peft.prompt_encoder in PROMPT_ENCODERS,
            f"peft.prompt_encoder must be one of {', '.join(PROMPT_ENCODERS)}, got '{peft.prompt_encoder}'")
    _require(peft.encoder_hidden >= 0,
             f"peft.encoder_hidden must be >= 0 (0: model.d_model), got {peft.encoder_hidden}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
