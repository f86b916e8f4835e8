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
A staged run (train.stages) is searched stage by stage, for what a stage entry sets: its micro-batches and remat
policy on the mesh the stage runs (stage_searches, tune_stages).
Results are cached per candidate (`<data.cache_dir>/tune/`), so a re-run is instant.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import jax
from tqdm import tqdm

from llama_jax import __version__
from llama_jax import config as config_lib
from llama_jax.config import Config
from llama_jax.config.stages import Stage, resolve
from llama_jax.distributed import sharding
from llama_jax.errors import ConfigError
from llama_jax.files import atomic_path, cache_root, format_bytes
from llama_jax.perf.costmodel import CostModel, check_devices_per_host, default_cost_model, spearman
from llama_jax.perf.hardware import compile_only, memory_budget, simulated_devices
from llama_jax.planning import plan
from llama_jax.planning.tune_report import Report
from llama_jax.planning.tune_space import (
    DEFAULT_POLICIES,
    SEARCHED_KEYS,
    Candidate,
    Result,
    candidate_space,
    default_candidate,
    validate_candidates,
)
from llama_jax.training.batches import put_batch
from llama_jax.training.program import TrainProgram
from llama_jax.training.step import model_flops_per_token
from llama_jax.training.timing import random_batch, time_train_steps

PACKAGE = Path(__file__).parents[1]  # llama_jax/, not training/: the model and kernels decide the step too


def source_files() -> list[Path]:
    """Every module of llama_jax, whose code a cached candidate was compiled and measured with."""
    return sorted(PACKAGE.rglob("*.py"))


def _source_digest() -> str:
    """Of llama_jax's own code: a changed model or step must not be answered from an old compilation."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(str(path.relative_to(PACKAGE)).encode() + path.read_bytes())
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
        identity["platform"] = [
            devices[0].device_kind,
            compile_only(devices[0]),
            len(devices),
            len({d.process_index for d in devices}),
            devices_per_host,
            jax.__version__,
            __version__,
            os.environ.get("XLA_FLAGS", ""),
            _source_digest(),
        ]
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


def score(
    result: Result, cache: Cache, model: CostModel, budget: float, devices_per_host: int = 0, devices: tuple = ()
) -> None:
    """Compile the candidate (or read the cache) and fill in memory, FLOPs, traffic and the prediction."""
    entry = cache.get(result.candidate)
    if "tier_bytes" not in entry:
        try:
            mesh = sharding.make_mesh(result.config, devices or None)
            planned = plan.make_plan(result.config, mesh, devices_per_host)
        except Exception as err:  # noqa: BLE001 - a candidate the compiler refuses is a rejection, not a crash
            result.rejected = f"does not compile: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            return
        entry = {
            "memory_bytes": planned.total_bytes,
            "hlo_flops": planned.hlo_flops,
            "collective_bytes": planned.collective_total,
            "tier_bytes": planned.collective_tiers,
            "devices": planned.devices,
            "operations": [[round(x) for x in operation] for operation in planned.operations],
        }
        cache.put(result.candidate, **entry)
    result.memory_bytes, result.hlo_flops = entry["memory_bytes"], entry["hlo_flops"]
    result.collective_bytes, result.tier_bytes = entry["collective_bytes"], entry["tier_bytes"]
    result.predicted_s = model.predict(entry["operations"], result.tier_bytes)
    if result.memory_bytes > budget:
        result.rejected = (
            f"needs {format_bytes(result.memory_bytes)} per device, over the budget of {format_bytes(budget)}"
        )


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
            times, _ = time_train_steps(
                program, state, put_batch(program, random_batch(result.config)), steps, warmup=1
            )
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


class TuneError(ConfigError):
    """No candidate can run (all invalid, or none fits the memory budget): a bad input, exit 2."""


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
        model,
        efficiency=options.efficiency or model.efficiency,
        link_bandwidth=options.bandwidth_gbs * 1e9 if options.bandwidth_gbs else model.link_bandwidth,
        nic_bandwidth=options.nic_gbs * 1e9 if options.nic_gbs else model.nic_bandwidth,
        overlap=options.overlap if options.overlap >= 0 else model.overlap,
    )


def enumerate_candidates(
    base: Config, overrides: list[str], options: Options
) -> tuple[Config, Candidate, list[Result]]:
    """The config, its own (default) candidate, and every candidate validated (step 1; compiles nothing);
    `overrides` pin the searched keys they set."""
    if options.memory_gb:  # the budget a candidate's train.microbatches=auto resolves against, and the winner runs at
        base = dataclasses.replace(base, run=dataclasses.replace(base.run, device_memory_gb=options.memory_gb))
    devices = len(options.devices) or jax.device_count()
    check_devices_per_host(options.devices_per_host, devices)
    default = default_candidate(base, devices)
    space = candidate_space(
        devices,
        overrides,
        options.policies,
        options.microbatches,
        options.every_n_layers,
        options.pipeline_repeats,
        options.pipeline_schedules,
        options.pass_microbatches,
    )
    if default not in space:
        space.insert(0, default)  # the baseline every speed-up is measured against
    results = validate_candidates(base, space)
    if not any(r.config is not None for r in results):
        raise TuneError(
            f"none of the {len(results)} candidates is valid on {devices} devices; e.g. "
            f"{results[0].candidate.label}: {results[0].rejected}"
        )
    return base, default, results


def tune(source: str | None, overrides: list[str], options: Options = Options()) -> Report:
    """The config's own search (a staged run's first stage only: tune_stages searches every stage)."""
    return tune_config(config_lib.load_config(source, overrides), overrides, options)


@dataclass(frozen=True)
class StageTuning:
    stage: Stage
    report: Report


def stage_searches(source: str | None, overrides: list[str], options: Options) -> list[tuple[Stage, Config, list[str]]]:
    """Each stage the run reaches, its config as a one-stage run and the overrides that pin its search: for a
    staged run (train.stages) what a stage entry can set, its micro-batches and remat policy, on the mesh the
    stage runs. The mesh stays the config's: a stage changes no more of it than mesh.sequence, so no stage's
    best mesh would carry over to the others (to search meshes, tune the stage alone: 'train.stages=[]' and its
    batch, sequence length and mesh.sequence). The user's own train.microbatches and remat.policy pin the first
    stage's, as they set them; a later stage's own settings are the defaults its search starts from."""
    config = config_lib.load_config(source, overrides)
    stages = resolve(config)
    if len(stages) == 1:
        return [(stages[0], config, overrides)]
    devices = len(options.devices) or jax.device_count()
    searches = []
    for stage in stages:
        base = dataclasses.replace(stage.config, train=dataclasses.replace(stage.config.train, stages=()))
        m, stage_keys = base.mesh, ("train.microbatches=", "remat.policy=")
        kept = overrides if stage.index == 0 else [o for o in overrides if not o.strip().startswith(stage_keys)]
        try:
            sizes = sharding.mesh_shape(m, devices)
        except ConfigError as err:
            raise ConfigError(f"{stage.name} (from step {stage.first_step + 1}): {err}") from None
        pins = [f"mesh.{axis}={size}" for axis, size in sizes.items()] + [
            f"mesh.sequence_parallel={m.sequence_parallel}",
            f"mesh.pipeline_repeats={m.pipeline_repeats}",
            f"mesh.pipeline_schedule={m.pipeline_schedule}",
            f"mesh.pipeline_microbatches={m.pipeline_microbatches}",
            f"remat.every_n_layers={base.remat.every_n_layers}",
        ]
        searches.append((stage, base, [*kept, *pins]))
    return searches


def tune_stages(source: str | None, overrides: list[str], options: Options = Options()) -> list[StageTuning]:
    """Every stage's search (stage_searches), in order; one for a run without stages."""
    return [
        StageTuning(stage, tune_config(base, pins, options))
        for stage, base, pins in stage_searches(source, overrides, options)
    ]


def tune_config(base: Config, overrides: list[str], options: Options = Options()) -> Report:
    base, default, results = enumerate_candidates(base, overrides, options)
    devices = len(options.devices) or jax.device_count()
    device = options.devices[0] if options.devices else None
    budget = memory_budget(options.memory_gb or base.run.device_memory_gb, device)
    root = cache_root(base.data.cache_dir)
    cache = Cache(root / "tune", base, options.devices_per_host, options.devices)
    model = _cost_model(options, cache, base.model.compute_dtype, root)
    scoring = _Scoring(cache, model, budget, options, deadline=time.monotonic() + 60 * options.budget_min)
    default_result = _score_in_stages(results, default, scoring)
    fits = _ranked(results, budget, options)
    # Compile-only GPUs cannot run; simulated CPU devices' timings say little about real ones.
    measuring = not options.devices and (options.measure if options.measure is not None else not simulated_devices())
    if measuring:
        winner, correlation = _measure_best(fits, default_result, cache, options)
    else:
        winner, correlation = fits[0], None
    t = base.train
    # With compile-only GPUs (--target) their hosts are in the devices; else the processes, or --devices-per-host.
    hosts = (
        len({d.process_index for d in options.devices})
        if device
        else devices // (options.devices_per_host or jax.local_device_count())
    )
    device = device or jax.local_devices()[0]
    return Report(
        results=results,
        default=default_result,
        winner=winner,
        model=model,
        budget=budget,
        measured=measuring,
        correlation=correlation,
        tokens=t.batch_size * t.seq_len,
        model_flops=model_flops_per_token(base, device.platform) * t.batch_size * t.seq_len,
        devices=devices,
        hosts=hosts,
        device_kind=device.device_kind,
        fp8=base.model.fp8,
    )


@dataclass(frozen=True)
class _Scoring:
    """What scoring a candidate needs: the cache, the cost model, the memory budget, the options, the deadline."""

    cache: Cache
    model: CostModel
    budget: float
    options: Options
    deadline: float  # time.monotonic(): no new compilation after it (a cached candidate is still read)

    def one(self, result: Result) -> None:
        score(result, self.cache, self.model, self.budget, self.options.devices_per_host, self.options.devices)

    def all(self, batch: list[Result], stage: str) -> None:
        todo = [r for r in batch if r.predicted_s is None and r.rejected is None]
        quiet = None if self.options.progress else True  # None: a bar on terminals only
        with tqdm(total=len(todo), desc=stage, unit="candidate", disable=quiet, leave=False) as bar:
            for result in todo:
                if "tier_bytes" in self.cache.get(result.candidate) or time.monotonic() < self.deadline:
                    self.one(result)
                bar.update()


def _score_in_stages(results: list[Result], default: Candidate, scoring: _Scoring) -> Result:
    """Stage 1: every mesh once; stage 2: every micro-batch count and policy on the best meshes; and the default
    candidate, whatever its stage left of it. Returns the default's result."""
    valid = [r for r in results if r.config is not None]
    # Stage 1: every mesh once, with the default's micro-batching and recomputation where searched.
    one_per_mesh: dict[tuple, Result] = {}
    for r in valid:
        c = r.candidate
        like_default = (c.microbatches, c.policy, c.every_n_layers, c.schedule, c.per_pass) == (
            default.microbatches,
            default.policy,
            default.every_n_layers,
            default.schedule,
            default.per_pass,
        )
        if c.mesh_key not in one_per_mesh or like_default:
            one_per_mesh[c.mesh_key] = r
    stage1 = list(one_per_mesh.values())
    scoring.all(stage1, "stage 1: meshes")
    # Stage 2: every micro-batch count and policy on the best meshes (the leanest, if none fits).
    scored = [r for r in stage1 if r.predicted_s is not None]
    by_mesh = sorted(
        scored, key=lambda r: (r.rejected is not None, r.predicted_s if r.rejected is None else r.memory_bytes)
    )
    best_meshes = list(dict.fromkeys(r.candidate.mesh_key for r in by_mesh))[: scoring.options.meshes]
    best_meshes.append(default.mesh_key)  # the default mesh with other settings: the plainest alternative
    scoring.all([r for r in valid if r.candidate.mesh_key in best_meshes], "stage 2: micro-batches x remat")
    default_result = next(r for r in results if r.candidate == default)
    if default_result.config is not None and default_result.predicted_s is None and default_result.rejected is None:
        scoring.one(default_result)
    return default_result


def _ranked(results: list[Result], budget: float, options: Options) -> list[Result]:
    """The candidates that fit, fastest predicted first; TuneError when none does (none compiled, or all over)."""
    fits = sorted((r for r in results if r.predicted_s is not None and r.rejected is None), key=lambda r: r.predicted_s)
    if not fits:
        over = [r for r in results if r.memory_bytes is not None]
        if not over:
            raise TuneError(f"no candidate was compiled within --budget-min {options.budget_min:g}; raise it")
        leanest = min(over, key=lambda r: r.memory_bytes)
        raise TuneError(
            f"no candidate fits the memory budget of {format_bytes(budget)} per device: the leanest, "
            f"{leanest.candidate.label}, needs {format_bytes(leanest.memory_bytes)}, "
            f"{format_bytes(leanest.memory_bytes - budget)} more; raise --memory-gb, lower "
            f"train.batch_size or train.seq_len, or use more devices"
        )
    return fits


def _measure_best(
    fits: list[Result], default_result: Result, cache: Cache, options: Options
) -> tuple[Result, float | None]:
    """Time the top-k (and the default, when it fits) on the devices: (the fastest measured, the Spearman
    correlation of predicted and measured step times)."""
    quiet = None if options.progress else True
    chosen = fits[: options.top_k] + ([default_result] if default_result in fits[options.top_k :] else [])
    for result in tqdm(chosen, desc="measuring", unit="candidate", disable=quiet, leave=False):
        measure(result, cache, options.steps)
    timed = [r for r in fits if r.measured_s is not None]
    if not timed:
        raise TuneError(f"every measured candidate failed; the first: {chosen[0].rejected}")
    winner = min(timed, key=lambda r: r.measured_s)
    return winner, spearman([r.predicted_s for r in timed], [r.measured_s for r in timed])
