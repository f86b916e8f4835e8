"""The range of every numeric key: the values it may take and, where its 0 or -1 means something, what. A table
(BOUNDS, and METHOD_BOUNDS for the keys of one peft method) rather than a check per key, so that a new numeric key
cannot go unchecked (test_config compares it with the schema) and every refusal reads the same: one ConfigError line
naming the key and its range. checks.py runs these before anything relates two keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from llama_jax.config.schema import Config
from llama_jax.errors import ConfigError


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
# -1) is documented to mean something says what in its `means`. checks.validate() checks these before anything relates
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
    "model.rope_low_freq_factor": POSITIVE,  # and below rope_high_freq_factor (checks.validate)
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
    "train.muon.momentum": Bound(0, high=1, below=True),
    "train.muon.ns_steps": POSITIVE,
    "train.muon.rms_scale": POSITIVE,
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
    "remat.every_n_layers": POSITIVE,  # and a divisor of model.n_layers (checks._check_remat)
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
    "run.lease_s": Bound(1),
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
    "prompt": {"peft.prompt_tokens": POSITIVE},  # and below train.seq_len (checks._check_peft)
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
        if not ok:
            raise ConfigError(f"{key} must be {bound.describe()}, got {value!r}")
