"""tune's search space: the candidates (mesh x sequence parallelism x micro-batching x recomputation), each with
its config, or the reason the config validator or the mesh checks refuse it; key=value overrides pin a searched key.
tune.py scores and measures them.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from llama_jax import config as config_lib
from llama_jax.config import Config
from llama_jax.distributed import sharding
from llama_jax.errors import ConfigError

SEARCHED_KEYS = (
    "mesh.pipeline",
    "mesh.pipeline_repeats",
    "mesh.pipeline_schedule",
    "mesh.pipeline_microbatches",
    "mesh.data",
    "mesh.fsdp",
    "mesh.tensor",
    "mesh.sequence",
    "mesh.sequence_parallel",
    "train.microbatches",
    "remat.policy",
    "remat.every_n_layers",
)
DEFAULT_POLICIES = ("none", "save_dot_except_mlp", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    data: int
    fsdp: int
    tensor: int
    sequence: int
    sequence_parallel: bool
    microbatches: int | str  # auto: the fewest that fit, as `llama-jax train` resolves it
    policy: str
    every_n_layers: int = 1
    pipeline: int = 1
    repeats: int = 1  # mesh.pipeline_repeats
    schedule: str = "gpipe"  # mesh.pipeline_schedule
    per_pass: int = 0  # mesh.pipeline_microbatches (0: all of them in one pass)

    @property
    def mesh_key(self) -> tuple:
        return self.pipeline, self.repeats, self.data, self.fsdp, self.tensor, self.sequence, self.sequence_parallel

    @property
    def label(self) -> str:
        sp = "+sp" if self.tensor > 1 and self.sequence_parallel else ""
        every = f"/{self.every_n_layers}" if self.every_n_layers > 1 else ""
        schedule = "-1f1b" if self.schedule == "1f1b" else ""
        stages = (
            f"p{self.pipeline}{f'x{self.repeats}' if self.repeats > 1 else ''}{schedule} " if self.pipeline > 1 else ""
        )
        passes = f"/{self.per_pass}" if self.per_pass else ""
        return (
            f"{stages}d{self.data} f{self.fsdp} t{self.tensor}{sp} s{self.sequence} "
            f"mb{self.microbatches}{passes} {self.policy}{every}"
        )


@dataclass
class Result:
    candidate: Candidate
    config: Config | None = None
    rejected: str | None = None  # why it cannot run (validator, mesh, memory)
    memory_bytes: float | None = None  # per device, from the compiled step
    hlo_flops: float | None = None  # per step, all devices
    collective_bytes: float | None = None  # per device per step
    tier_bytes: dict[str, float] | None = None  # the same by link tier (costmodel.TIERS)
    predicted_s: float | None = None
    measured_s: float | None = None


def factorizations(n: int, parts: int = 5) -> list[tuple[int, ...]]:
    """Every ordered way to write n as a product of `parts` positive factors."""
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, parts - 1)]


def pinned(overrides: list[str]) -> dict[str, str]:
    """The searched keys the user fixed with key=value."""
    values = dict(item.split("=", 1) for item in overrides if "=" in item)
    return {k: v.strip() for k, v in values.items() if k.strip() in SEARCHED_KEYS}


def candidate_space(
    devices: int,
    overrides: list[str],
    policies: tuple[str, ...],
    microbatches: tuple[int, ...],
    every_n_layers: tuple[int, ...] = (1,),
    pipeline_repeats: tuple[int, ...] = (1, 2),
    schedules: tuple[str, ...] = ("gpipe", "1f1b"),
    passes: tuple[int, ...] = (0,),
) -> list[Candidate]:
    """Every combination of the searched values; key=value overrides pin a searched key. With a pipeline,
    the micro-batch counts are multiples of its stages: each count times the stages; so are the micro-batches
    per pass (`passes`; 0: one pass of all), kept where fewer than all."""
    fixed = pinned(overrides)
    out = []
    for pipeline, data, fsdp, tensor, sequence in factorizations(devices):
        sizes = {
            "mesh.pipeline": pipeline,
            "mesh.data": data,
            "mesh.fsdp": fsdp,
            "mesh.tensor": tensor,
            "mesh.sequence": sequence,
        }
        if any(k in fixed and int(fixed[k]) not in (v, -1) for k, v in sizes.items()):
            continue
        sp_values = [True, False] if tensor > 1 else [True]
        if "mesh.sequence_parallel" in fixed:
            sp_values = [fixed["mesh.sequence_parallel"].lower() == "true"]
        mbs = (
            [_microbatches(fixed["train.microbatches"])]
            if "train.microbatches" in fixed
            else [pipeline * n for n in microbatches]
        )
        pols = [fixed["remat.policy"]] if "remat.policy" in fixed else list(policies)
        everys = [int(fixed["remat.every_n_layers"])] if "remat.every_n_layers" in fixed else list(every_n_layers)
        repeats = (
            [1]
            if pipeline == 1
            else [int(fixed["mesh.pipeline_repeats"])]
            if "mesh.pipeline_repeats" in fixed
            else list(pipeline_repeats)
        )
        kinds = ["gpipe"] if pipeline == 1 else [fixed.get("mesh.pipeline_schedule", s) for s in schedules]
        per_pass = (
            [0]
            if pipeline == 1
            else [int(fixed["mesh.pipeline_microbatches"])]
            if "mesh.pipeline_microbatches" in fixed
            else [pipeline * n for n in passes]
        )
        for sp, mb, policy, repeat, kind, size in itertools.product(
            sp_values, mbs, pols, repeats, dict.fromkeys(kinds), per_pass
        ):
            if size and (size > mb or size == mb and "mesh.pipeline_microbatches" not in fixed):
                continue  # passes of more than all the micro-batches, or of all: one pass (0)
            # Without recomputation there is nothing to spread over every n-th layer.
            for every in [1] if policy == "none" else everys:
                out.append(Candidate(data, fsdp, tensor, sequence, sp, mb, policy, every, pipeline, repeat, kind, size))
    return out


def _microbatches(value: str) -> int | str:
    """A pinned train.microbatches: a count, or auto (resolved when the candidate compiles, as train does)."""
    return "auto" if value.strip() == "auto" else int(value)


def candidate_config(base: Config, candidate: Candidate) -> Config:
    """The config `base` with the candidate's searched values, validated like `llama-jax train`'s."""
    c = candidate
    config = dataclasses.replace(
        base,
        mesh=dataclasses.replace(
            base.mesh,
            pipeline=c.pipeline,
            pipeline_repeats=c.repeats,
            data=c.data,
            fsdp=c.fsdp,
            tensor=c.tensor,
            sequence=c.sequence,
            sequence_parallel=c.sequence_parallel,
            pipeline_schedule=c.schedule,
            pipeline_microbatches=c.per_pass,
        ),
        train=dataclasses.replace(base.train, microbatches=c.microbatches),
        remat=dataclasses.replace(base.remat, policy=c.policy, every_n_layers=c.every_n_layers),
    )
    config_lib.validate(config)
    return config


def validate_candidates(base: Config, candidates: list[Candidate]) -> list[Result]:
    """Each candidate with its Config, or the validator's / mesh checks' reason it cannot run."""
    shape_checks: dict[tuple, str | None] = {}  # parameter shapes depend on the mesh sizes only
    results = []
    for candidate in candidates:
        result = Result(candidate)
        try:
            config = candidate_config(base, candidate)
            sizes = {
                "pipeline": candidate.pipeline,
                "data": candidate.data,
                "fsdp": candidate.fsdp,
                "tensor": candidate.tensor,
                "sequence": candidate.sequence,
            }
            sharding.check_divisibility(config, sizes)
            key = tuple(sizes.values())
            if key not in shape_checks:
                try:
                    sharding.check_parameter_shapes(config, sizes)
                    shape_checks[key] = None
                except ConfigError as err:
                    shape_checks[key] = str(err)
            if shape_checks[key]:
                raise ConfigError(shape_checks[key])
            result.config = config
        except ConfigError as err:
            result.rejected = str(err)
        results.append(result)
    return results


def default_candidate(config: Config, devices: int) -> Candidate:
    """The config as `llama-jax train` would run it (train.microbatches=auto stays auto: it is resolved when the
    candidate compiles, against the same budget), the baseline of every speed-up."""
    sizes = sharding.mesh_shape(config.mesh, devices)
    stages = sizes["pipeline"]
    return Candidate(
        sizes["data"],
        sizes["fsdp"],
        sizes["tensor"],
        sizes["sequence"],
        config.mesh.sequence_parallel or sizes["tensor"] == 1,
        config.train.microbatches,
        config.remat.policy,
        config.remat.every_n_layers,
        stages,
        config.mesh.pipeline_repeats if stages > 1 else 1,
        config.mesh.pipeline_schedule if stages > 1 else "gpipe",
        config.mesh.pipeline_microbatches if stages > 1 else 0,
    )


def format_candidates(results: list[Result]) -> str:
    """`--dry-run`: each candidate, valid or the reason it is not."""
    width = max(len(r.candidate.label) for r in results) + 2
    lines = [f"{r.candidate.label:<{width}}{'valid' if r.config is not None else r.rejected}" for r in results]
    valid = sum(r.config is not None for r in results)
    return "\n".join([*lines, f"{len(results)} candidates: {valid} valid, {len(results) - valid} invalid"])
