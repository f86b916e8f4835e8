"""`llama-jax tune`: the fastest mesh x sequence parallelism x micro-batching x recomputation that fits.

1. Enumerate: every way to split the devices over (pipeline, data, fsdp, tensor, sequence), pipeline
   repeats, schedules (gpipe, 1f1b) and micro-batches per pass (when pipeline > 1), sequence parallelism on
   and off (when tensor > 1), micro-batch counts (with a pipeline: its micro-batches, multiples of the
   stages), remat policies and every-n-layers.
   A candidate the config validator or the mesh checks refuse is kept with the reason, and counted.
2. Score without running: each candidate's train step is compiled ahead of time (`llama-jax plan`).
   A candidate above the memory budget is rejected, and the rest are ranked by the cost model of
   costmodel.py: a roofline over the compiled step's operations plus exposed communication, each
   collective over the links (within a host, or between hosts) that its mesh axes cross. A pipeline's
   bubble is in the compiled loop's iterations (GPipe: every stage computes in each; 1F1B: each iteration
   at the pace of its busiest stage), and its point-to-point traffic crosses hosts like any collective on
   the outermost axis.
   Staged, so that minutes suffice: first every mesh with the config's own micro-batching and remat
   policy, then every micro-batch count and policy on the best --meshes meshes and the default mesh.
3. Measure the best --top-k for a few steps on the devices (on by default, except on simulated CPU
   devices, whose timings say little about real ones) and pick by measured step time.
4. Print the ranked table, with the Spearman correlation of predicted and measured step times, and
   write the winner's resolved config as YAML: `llama-jax train tune.yaml` trains with it.
Results are cached per candidate (`<data.cache_dir>/tune/`), so a re-run is instant.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import jax
from tqdm import tqdm

from llama_jax import __version__
from llama_jax import config as config_lib
from llama_jax.config import Config
from llama_jax.distributed import sharding
from llama_jax.errors import ConfigError
from llama_jax.files import atomic_path, cache_root, format_bytes
from llama_jax.perf.costmodel import (
    INTER_HOST,
    INTRA_HOST,
    CostModel,
    check_devices_per_host,
    default_cost_model,
    spearman,
)
from llama_jax.perf.hardware import MfuPeaks, compile_only, memory_budget, simulated_devices
from llama_jax.training import plan
from llama_jax.training.step import TrainProgram, model_flops_per_token, random_batch, time_train_steps

SEARCHED_KEYS = ("mesh.pipeline", "mesh.pipeline_repeats", "mesh.pipeline_schedule", "mesh.pipeline_microbatches",
                 "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.sequence", "mesh.sequence_parallel",
                 "train.microbatches", "remat.policy", "remat.every_n_layers")
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
        stages = f"p{self.pipeline}{f'x{self.repeats}' if self.repeats > 1 else ''}{schedule} " \
            if self.pipeline > 1 else ""
        passes = f"/{self.per_pass}" if self.per_pass else ""
        return (f"{stages}d{self.data} f{self.fsdp} t{self.tensor}{sp} s{self.sequence} "
                f"mb{self.microbatches}{passes} {self.policy}{every}")


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


def candidate_space(devices: int, overrides: list[str], policies: tuple[str, ...], microbatches: tuple[int, ...],
                    every_n_layers: tuple[int, ...] = (1,), pipeline_repeats: tuple[int, ...] = (1, 2),
                    schedules: tuple[str, ...] = ("gpipe", "1f1b"), passes: tuple[int, ...] = (0,)) -> list[Candidate]:
    """Every combination of the searched values; key=value overrides pin a searched key. With a pipeline,
    the micro-batch counts are multiples of its stages: each count times the stages; so are the micro-batches
    per pass (`passes`; 0: one pass of all), kept where fewer than all."""
    fixed = pinned(overrides)
    out = []
    for pipeline, data, fsdp, tensor, sequence in factorizations(devices):
        sizes = {"mesh.pipeline": pipeline, "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor,
                 "mesh.sequence": sequence}
        if any(k in fixed and int(fixed[k]) not in (v, -1) for k, v in sizes.items()):
            continue
        sp_values = [True, False] if tensor > 1 else [True]
        if "mesh.sequence_parallel" in fixed:
            sp_values = [fixed["mesh.sequence_parallel"].lower() == "true"]
        mbs = [_microbatches(fixed["train.microbatches"])] if "train.microbatches" in fixed else \
            [pipeline * n for n in microbatches]
        pols = [fixed["remat.policy"]] if "remat.policy" in fixed else list(policies)
        everys = [int(fixed["remat.every_n_layers"])] if "remat.every_n_layers" in fixed else list(every_n_layers)
        repeats = [1] if pipeline == 1 else \
            [int(fixed["mesh.pipeline_repeats"])] if "mesh.pipeline_repeats" in fixed else list(pipeline_repeats)
        kinds = ["gpipe"] if pipeline == 1 else [fixed.get("mesh.pipeline_schedule", s) for s in schedules]
        per_pass = [0] if pipeline == 1 else [int(fixed["mesh.pipeline_microbatches"])] \
            if "mesh.pipeline_microbatches" in fixed else [pipeline * n for n in passes]
        for sp, mb, policy, repeat, kind, size in itertools.product(sp_values, mbs, pols, repeats,
                                                                    dict.fromkeys(kinds), per_pass):
            if size and (size > mb or size == mb and "mesh.pipeline_microbatches" not in fixed):
                continue  # passes of more than all the micro-batches, or of all: one pass (0)
            # Without recomputation there is nothing to spread over every n-th layer.
            for every in ([1] if policy == "none" else everys):
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
        mesh=dataclasses.replace(base.mesh, pipeline=c.pipeline, pipeline_repeats=c.repeats, data=c.data, fsdp=c.fsdp,
                                 tensor=c.tensor, sequence=c.sequence, sequence_parallel=c.sequence_parallel,
                                 pipeline_schedule=c.schedule, pipeline_microbatches=c.per_pass),
        train=dataclasses.replace(base.train, microbatches=c.microbatches),
        remat=dataclasses.replace(base.remat, policy=c.policy, every_n_layers=c.every_n_layers))
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
            sizes = {"pipeline": candidate.pipeline, "data": candidate.data, "fsdp": candidate.fsdp,
                     "tensor": candidate.tensor, "sequence": candidate.sequence}
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


def _source_digest() -> str:
    """Of llama_jax's own code: a changed model or step must not be answered from an old compilation."""
    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + path.read_bytes())
    return digest.hexdigest()


class Cache:
    """One file per candidate (its plan's figures, its measured step time), in a directory named by a
    digest of everything else about the run: the config without the searched keys, devices, versions."""

    def __init__(self, directory: Path, config: Config, devices_per_host: int = 0, devices: tuple = ()):
        identity = config_lib.to_dict(config)
        for section, key in (k.split(".") for k in SEARCHED_KEYS):
            identity[section].pop(key, None)
        identity["run"] = {}  # where a run writes does not change its speed
        identity["checkpoint"] = identity["fault"] = {}
        # Hosts decide which collectives cross the network: the tier bytes cached depend on them.
        devices = devices or jax.devices()
        identity["platform"] = [devices[0].device_kind, compile_only(devices[0]), len(devices),
                                len({d.process_index for d in devices}), devices_per_host, jax.__version__,
                                __version__, os.environ.get("XLA_FLAGS", ""), _source_digest()]
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.directory = directory / digest

    def _path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def read(self, key: str) -> dict:
        try:
            entry = json.loads(self._path(key).read_text())
        except (OSError, ValueError):  # missing or damaged: computed again
            return {}
        return entry if isinstance(entry, dict) and entry.get("key") == key else {}

    def write(self, key: str, fields: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with atomic_path(self._path(key)) as tmp:  # an interrupted tune leaves no half-written entry
            tmp.write_text(json.dumps({**self.read(key), **fields, "key": key}))

    def get(self, candidate: Candidate) -> dict:
        return self.read(candidate.label)

    def put(self, candidate: Candidate, **fields) -> None:
        self.write(candidate.label, fields)


def score(result: Result, cache: Cache, model: CostModel, budget: float, devices_per_host: int = 0,
          devices: tuple = ()) -> None:
    """Compile the candidate (or read the cache) and fill in memory, FLOPs, traffic and the prediction."""
    entry = cache.get(result.candidate)
    if "tier_bytes" not in entry:
        try:
            mesh = sharding.make_mesh(result.config, devices or None)
            planned = plan.make_plan(result.config, mesh, devices_per_host)
        except Exception as err:  # noqa: BLE001 - a candidate the compiler refuses is a rejection, not a crash
            result.rejected = f"does not compile: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            return
        entry = {"memory_bytes": planned.total_bytes, "hlo_flops": planned.hlo_flops,
                 "collective_bytes": planned.collective_total, "tier_bytes": planned.collective_tiers,
                 "devices": planned.devices,
                 "operations": [[round(x) for x in operation] for operation in planned.operations]}
        cache.put(result.candidate, **entry)
    result.memory_bytes, result.hlo_flops = entry["memory_bytes"], entry["hlo_flops"]
    result.collective_bytes, result.tier_bytes = entry["collective_bytes"], entry["tier_bytes"]
    result.predicted_s = model.predict(entry["operations"], result.tier_bytes)
    if result.memory_bytes > budget:
        result.rejected = (f"needs {format_bytes(result.memory_bytes)} per device, over the budget of "
                           f"{format_bytes(budget)}")


def measure(result: Result, cache: Cache, steps: int) -> None:
    """Median time of `steps` train steps on random tokens, after one warm-up step."""
    entry = cache.get(result.candidate)
    if "measured_s" in entry:
        result.measured_s = entry["measured_s"]
        return
    program = TrainProgram.for_config(result.config)
    try:
        with program.activate():
            state = program.init_state(jax.random.key(0))
            times, _ = time_train_steps(program, state, program.put(random_batch(result.config)), steps, warmup=1)
    except Exception as err:  # noqa: BLE001 - e.g. out of memory at run time although the plan fitted
        result.rejected = f"failed when measured: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        return
    result.measured_s = statistics.median(times)
    cache.put(result.candidate, measured_s=result.measured_s)


@dataclass(frozen=True)
class Options:
    memory_gb: float = 0.0  # per-device budget; 0: this device's memory minus a margin
    budget_min: float = 10.0  # stop compiling new candidates after this many minutes
    top_k: int = 3  # candidates measured (the default configuration is measured too)
    measure: bool | None = None  # None: on real devices only
    steps: int = 3  # timed steps per measured candidate, after one warm-up step
    meshes: int = 3  # stage 2 explores this many of the best meshes
    policies: tuple[str, ...] = DEFAULT_POLICIES
    microbatches: tuple[int, ...] = (1, 2, 4)  # with a pipeline of P stages: P, 2P, 4P
    every_n_layers: tuple[int, ...] = (1, 2)
    pipeline_repeats: tuple[int, ...] = (1, 2)
    pipeline_schedules: tuple[str, ...] = ("gpipe", "1f1b")
    pass_microbatches: tuple[int, ...] = (0,)  # with P stages: these times P per pass (0: one pass)
    efficiency: float = 0.0  # 0: the cost model's default, for the peak FLOP/s reached
    bandwidth_gbs: float = 0.0  # 0: the cost model's default, GB/s per device for collectives within a host
    nic_gbs: float = 0.0  # 0: hardware.NIC_GBS, GB/s per device for collectives between hosts
    devices_per_host: int = 0  # 0: the hosts are this run's processes; else plan hosts of this many devices
    devices: tuple = ()  # compile-only GPUs of a cluster to plan for (--target, gpu_target.py); (): this run's
    overlap: float = -1.0  # -1: the cost model's default, fraction of communication hidden behind compute
    progress: bool = True


@dataclass
class Report:
    results: list[Result]
    default: Result
    winner: Result
    model: CostModel
    budget: float
    measured: bool
    correlation: float | None
    tokens: int  # per step
    model_flops: float  # per step
    devices: int
    hosts: int = 1
    device_kind: str = ""
    fp8: str = "none"  # model.fp8: MFU is also shown against the fp8 peak


class TuneError(ConfigError):
    """No candidate can run (all invalid, or none fits the memory budget): a bad input, exit 2."""


def default_candidate(config: Config, devices: int) -> Candidate:
    """The config as `llama-jax train` would run it (train.microbatches=auto stays auto: it is resolved when the
    candidate compiles, against the same budget), the baseline of every speed-up."""
    sizes = sharding.mesh_shape(config.mesh, devices)
    stages = sizes["pipeline"]
    return Candidate(sizes["data"], sizes["fsdp"], sizes["tensor"], sizes["sequence"],
                     config.mesh.sequence_parallel or sizes["tensor"] == 1, config.train.microbatches,
                     config.remat.policy, config.remat.every_n_layers, stages,
                     config.mesh.pipeline_repeats if stages > 1 else 1,
                     config.mesh.pipeline_schedule if stages > 1 else "gpipe",
                     config.mesh.pipeline_microbatches if stages > 1 else 0)


def _cost_model(options: Options, cache: Cache, dtype: str, cache_dir: Path) -> CostModel:
    """The cached (measured once) cost model, with the options' overrides."""
    stored = cache.read("cost model")
    stored.pop("key", None)
    try:
        model = CostModel(**stored)
    except TypeError:  # none yet, or from an older version (e.g. one link bandwidth for every collective)
        model = default_cost_model(dtype, cache_dir, options.devices[0] if options.devices else None)
        cache.write("cost model", dataclasses.asdict(model))
    return dataclasses.replace(
        model, efficiency=options.efficiency or model.efficiency,
        link_bandwidth=options.bandwidth_gbs * 1e9 if options.bandwidth_gbs else model.link_bandwidth,
        nic_bandwidth=options.nic_gbs * 1e9 if options.nic_gbs else model.nic_bandwidth,
        overlap=options.overlap if options.overlap >= 0 else model.overlap)


def enumerate_candidates(source: str | None, overrides: list[str], options: Options
                         ) -> tuple[Config, Candidate, list[Result]]:
    """The config, its own (default) candidate, and every candidate validated (step 1; compiles nothing)."""
    base = config_lib.load_config(source, overrides)
    if options.memory_gb:  # the budget a candidate's train.microbatches=auto resolves against, and the winner runs at
        base = dataclasses.replace(base, run=dataclasses.replace(base.run, device_memory_gb=options.memory_gb))
    devices = len(options.devices) or jax.device_count()
    check_devices_per_host(options.devices_per_host, devices)
    default = default_candidate(base, devices)
    space = candidate_space(devices, overrides, options.policies, options.microbatches, options.every_n_layers,
                            options.pipeline_repeats, options.pipeline_schedules, options.pass_microbatches)
    if default not in space:
        space.insert(0, default)  # the baseline every speed-up is measured against
    results = validate_candidates(base, space)
    if not any(r.config is not None for r in results):
        raise TuneError(f"none of the {len(results)} candidates is valid on {devices} devices; e.g. "
                        f"{results[0].candidate.label}: {results[0].rejected}")
    return base, default, results


def format_candidates(results: list[Result]) -> str:
    """`--dry-run`: each candidate, valid or the reason it is not."""
    width = max(len(r.candidate.label) for r in results) + 2
    lines = [f"{r.candidate.label:<{width}}{'valid' if r.config is not None else r.rejected}" for r in results]
    valid = sum(r.config is not None for r in results)
    return "\n".join([*lines, f"{len(results)} candidates: {valid} valid, {len(results) - valid} invalid"])


def tune(source: str | None, overrides: list[str], options: Options = Options()) -> Report:
    base, default, results = enumerate_candidates(source, overrides, options)
    devices = len(options.devices) or jax.device_count()
    device = options.devices[0] if options.devices else None
    valid = [r for r in results if r.config is not None]
    budget = memory_budget(options.memory_gb or base.run.device_memory_gb, device)
    root = cache_root(base.data.cache_dir)
    cache = Cache(root / "tune", base, options.devices_per_host, options.devices)
    model = _cost_model(options, cache, base.model.compute_dtype, root)
    deadline = time.monotonic() + 60 * options.budget_min

    quiet = None if options.progress else True  # None: a bar on terminals only

    def score_all(batch: list[Result], stage: str) -> None:
        todo = [r for r in batch if r.predicted_s is None and r.rejected is None]
        with tqdm(total=len(todo), desc=stage, unit="candidate", disable=quiet, leave=False) as bar:
            for result in todo:
                if "tier_bytes" in cache.get(result.candidate) or time.monotonic() < deadline:
                    score(result, cache, model, budget, options.devices_per_host, options.devices)
                bar.update()

    # Stage 1: every mesh once, with the default's micro-batching and recomputation where searched.
    one_per_mesh: dict[tuple, Result] = {}
    for r in valid:
        c = r.candidate
        like_default = (c.microbatches, c.policy, c.every_n_layers, c.schedule, c.per_pass) == \
            (default.microbatches, default.policy, default.every_n_layers, default.schedule, default.per_pass)
        if c.mesh_key not in one_per_mesh or like_default:
            one_per_mesh[c.mesh_key] = r
    stage1 = list(one_per_mesh.values())
    score_all(stage1, "stage 1: meshes")
    # Stage 2: every micro-batch count and policy on the best meshes (the leanest, if none fits).
    scored = [r for r in stage1 if r.predicted_s is not None]
    by_mesh = sorted(scored, key=lambda r: (r.rejected is not None, r.predicted_s if r.rejected is None
                                            else r.memory_bytes))
    best_meshes = list(dict.fromkeys(r.candidate.mesh_key for r in by_mesh))[:options.meshes]
    best_meshes.append(default.mesh_key)  # the default mesh with other settings: the plainest alternative
    score_all([r for r in valid if r.candidate.mesh_key in best_meshes], "stage 2: micro-batches x remat")
    default_result = next(r for r in results if r.candidate == default)
    if default_result.config is not None and default_result.predicted_s is None and default_result.rejected is None:
        score(default_result, cache, model, budget, options.devices_per_host, options.devices)

    fits = sorted((r for r in results if r.predicted_s is not None and r.rejected is None), key=lambda r: r.predicted_s)
    if not fits:
        over = [r for r in results if r.memory_bytes is not None]
        if not over:
            raise TuneError(f"no candidate was compiled within --budget-min {options.budget_min:g}; raise it")
        leanest = min(over, key=lambda r: r.memory_bytes)
        raise TuneError(f"no candidate fits the memory budget of {format_bytes(budget)} per device: the leanest, "
                        f"{leanest.candidate.label}, needs {format_bytes(leanest.memory_bytes)}, "
                        f"{format_bytes(leanest.memory_bytes - budget)} more; raise --memory-gb, lower "
                        f"train.batch_size or train.seq_len, or use more devices")

    # Compile-only GPUs cannot run; simulated CPU devices' timings say little about real ones.
    measuring = not options.devices and (options.measure if options.measure is not None else not simulated_devices())
    if measuring:
        chosen = fits[:options.top_k] + ([default_result] if default_result in fits[options.top_k:] else [])
        for result in tqdm(chosen, desc="measuring", unit="candidate", disable=quiet, leave=False):
            measure(result, cache, options.steps)
        timed = [r for r in fits if r.measured_s is not None]
        if not timed:
            raise TuneError(f"every measured candidate failed; the first: {chosen[0].rejected}")
        winner = min(timed, key=lambda r: r.measured_s)
        correlation = spearman([r.predicted_s for r in timed], [r.measured_s for r in timed])
    else:
        winner, correlation = fits[0], None
    t = base.train
    # With compile-only GPUs (--target) their hosts are in the devices; else the processes, or --devices-per-host.
    hosts = len({d.process_index for d in options.devices}) if device else \
        devices // (options.devices_per_host or jax.local_device_count())
    device = device or jax.local_devices()[0]
    return Report(results=results, default=default_result, winner=winner, model=model, budget=budget,
                  measured=measuring, correlation=correlation, tokens=t.batch_size * t.seq_len,
                  model_flops=model_flops_per_token(base, device.platform) * t.batch_size * t.seq_len,
                  devices=devices, hosts=hosts, device_kind=device.device_kind, fp8=base.model.fp8)


def step_time(result: Result) -> float | None:
    return result.measured_s if result.measured_s is not None else result.predicted_s


def format_report(report: Report, rows: int = 20) -> str:
    """The ranked table (by measured step time where measured, then by predicted), and a summary."""
    results = report.results
    fits = [r for r in results if r.predicted_s is not None and r.rejected is None]
    ranked = sorted(fits, key=lambda r: (r.measured_s is None, step_time(r)))
    shown = ranked[:rows] + ([report.default] if report.default in ranked[rows:] else [])
    width = max(len(r.candidate.label) for r in shown) + 2
    peaks = MfuPeaks.with_fp8(report.model.peak_flops, "the cost model's", report.fp8, report.device_kind)
    lines = [(f"{'#':>3}  {'candidate':<{width}}{'memory':>10}{'predicted':>11}{'measured':>10}{'tokens/s':>11}"
              f"{'MFU':>7}" + (f"{'of fp8':>8}" if peaks.fp8 else ""))]
    for r in shown:
        seconds = step_time(r)
        mfu = peaks.fractions(report.model_flops / seconds, report.devices)
        mark = " <- default" if r is report.default else ""
        measured = f"{r.measured_s * 1e3:8.1f}ms" if r.measured_s is not None else f"{'-':>10}"
        lines.append(f"{ranked.index(r) + 1:>3}  {r.candidate.label:<{width}}{r.memory_bytes / 2**20:8.0f}MiB"
                     f"{r.predicted_s * 1e3:9.1f}ms{measured}{report.tokens / seconds:11,.0f}{mfu['mfu']:7.1%}"
                     + (f"{mfu['mfu_fp8']:8.1%}" if peaks.fp8 else "") + mark)
    invalid = [r for r in results if r.config is None]
    over = [r for r in results if r.config is not None and (r.rejected or "").startswith("needs")]
    failed = [r for r in results if r.config is not None and r.rejected and r not in over]
    unscored = [r for r in results if r.config is not None and r.rejected is None and r.predicted_s is None]
    reasons: dict[str, int] = {}
    for r in invalid:  # counted by kind: the figures in parentheses differ from candidate to candidate
        kind = re.sub(r"\([^)]*\)", "(..)", r.rejected.split(";")[0])
        reasons[kind] = reasons.get(kind, 0) + 1
    lines += [("candidate: pP(xR)(-1f1b) pipeline stages (x repeats; the 1F1B schedule, else GPipe), d/f/t/s mesh "
               "sizes (data, fsdp, tensor, sequence; +sp: sequence parallelism), mb micro-batches (/k: k per pass "
               "through the pipeline), remat policy (/n: on every n-th layer); tokens/s and MFU from the measured step "
               "time where there is one, else the predicted"), "",
              f"{len(results)} candidates: {len(invalid)} invalid, {len(over)} over the memory budget of "
              f"{format_bytes(report.budget)}, {len(failed)} failed to compile or run, {len(unscored)} not compiled "
              f"(staged search or time budget), {len(fits)} ranked"
              + (f", {sum(r.measured_s is not None for r in fits)} measured" if report.measured else "")]
    lines += [f"  {n:>4} x {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    m = report.model
    fp8_rate = f" + fp8 FLOPs / ({m.fp8_peak_flops / 1e12:.4g} TFLOP/s x {m.efficiency:g})" \
        if m.fp8_peak_flops and report.fp8 != "none" else ""
    lines.append(f"cost model, per device: sum over operations of max({'other ' if fp8_rate else ''}FLOPs / "
                 f"({m.peak_flops / 1e12:.3g} TFLOP/s x {m.efficiency:g}){fp8_rate}, bytes / "
                 f"{m.memory_bandwidth / 1e9:.3g} GB/s) + {1 - m.overlap:g} x (collective bytes within a host / "
                 f"{m.bandwidth(INTRA_HOST) / 1e9:.3g} GB/s + between hosts / {m.bandwidth(INTER_HOST) / 1e9:.3g} "
                 f"GB/s); {report.devices} devices on {report.hosts} host(s)")
    if report.correlation is not None:
        lines.append(f"Spearman correlation of predicted and measured step times: {report.correlation:+.2f}")
    if report.default.rejected:
        lines.append(f"the default configuration cannot run: {report.default.rejected}")
    elif step_time(report.default):
        basis = "measured" if report.winner.measured_s is not None and report.default.measured_s is not None \
            else "predicted"
        speedup = (getattr(report.default, f"{basis}_s") or 0) / getattr(report.winner, f"{basis}_s")
        lines.append(f"winner {report.winner.candidate.label}: {speedup:.2f}x the default "
                     f"({report.default.candidate.label}), {basis}")
    return "\n".join(lines)


def write_winner(report: Report, out: Path) -> None:
    r = report.winner
    timing = f"measured {r.measured_s * 1e3:.1f} ms" if r.measured_s is not None else \
        f"predicted {r.predicted_s * 1e3:.1f} ms"
    header = (f"# Written by llama-jax tune for {report.devices} {report.device_kind} device(s): {r.candidate.label},\n"
              f"# {timing} per step, {r.memory_bytes / 2**20:.0f} MiB per device. Train with: llama-jax train {out}\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.write_text(header + config_lib.to_yaml(r.config))


def report_json(report: Report) -> str:
    rows = [{"candidate": dataclasses.asdict(r.candidate), "label": r.candidate.label, "rejected": r.rejected,
             "memory_bytes": r.memory_bytes, "hlo_flops": r.hlo_flops, "collective_bytes": r.collective_bytes,
             "collective_tiers": r.tier_bytes,
             "predicted_s": r.predicted_s, "measured_s": r.measured_s} for r in report.results]
    return json.dumps({"devices": report.devices, "hosts": report.hosts, "budget_bytes": report.budget,
                       "measured": report.measured, "cost_model": dataclasses.asdict(report.model),
                       "spearman": report.correlation, "default": report.default.candidate.label,
                       "winner": report.winner.candidate.label, "candidates": rows}, indent=1)
