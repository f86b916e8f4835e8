"""A training run before its first step: everything the loop needs, built and checked before anything in run.dir
is written (`Run.setup`), and what its checkpoints record of it.

Setup decides where the run starts (checkpoint/start.py: its own newest step, resume_from, init_from, a peft
run's base, or nothing), refusing a source of another model; compiles the train step (train.microbatches=auto:
the fewest that fit) and checks its memory against run.device_memory_gb. A peft run's base is loaded into its
shards and checked against the run's checkpoints before the step compiles. Every failure is one line, exit 2.

A staged run (train.stages, config/stages.py) compiles every stage's step at setup, so a stage that does not fit
is refused before the first step, not days in; `Run.enter` makes a stage's program and data the current ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from llama_jax import __version__
from llama_jax.checkpoint import start as run_start
from llama_jax.checkpoint.checkpointer import Checkpointer, Identity, Tiers
from llama_jax.checkpoint.local import LocalTier
from llama_jax.checkpoint.storage_failures import quiet_storage_noise
from llama_jax.config import Config, to_dict
from llama_jax.config.stages import Stage, decay_saves, stage_at
from llama_jax.data.streams import TrainData
from llama_jax.distributed.peers import Peers
from llama_jax.errors import ConfigError
from llama_jax.files import cache_root
from llama_jax.model.stages import LayerOrder
from llama_jax.resilience.inject import Injector
from llama_jax.training.memory import check_fits
from llama_jax.training.metrics import check_wandb
from llama_jax.training.program import TrainProgram, layer_order
from llama_jax.training.step import TrainState


@dataclass(frozen=True)
class RunStage:
    """A stage of a staged run: where it trains, on what mesh, from what data (train() opens it), and its program
    (compiled by Run.setup)."""

    stage: Stage
    mesh: Mesh
    data: TrainData
    program: TrainProgram | None = None


@dataclass
class Run:
    """Everything a training run needs, built and checked before anything in run.dir is written."""

    config: Config
    program: TrainProgram  # the current stage's (the only stage's, in a run without train.stages)
    data: TrainData  # the current stage's
    start: run_start.Start  # where the run starts: run.dir's newest step, or the model a new run starts from
    peers: Peers  # the other processes, for every decision outside the jitted step
    compile_seconds: float = 0.0  # compiling the train step ahead of time, to check its memory
    base: Any = None  # a peft run: the base model's params, loaded and checked by setup (frozen in the state)
    base_reference: dict | None = None  # ... and what checkpoints record of it (peft.base_reference)
    stages: list[RunStage] = dataclasses.field(default_factory=list)  # a staged run's, first to last
    stage: int = 0  # the current one

    @classmethod
    def setup(
        cls, config: Config, mesh: Mesh, data: TrainData, peers: Peers | None = None, staged: list[RunStage] = ()
    ) -> Run:
        """Raises ConfigError or DataError (one line each) on bad input; writes nothing. `peers` defaults to
        every process, with config's barrier timeout; `staged`: a staged run's stages, the first being config's."""
        peers = peers or Peers(config.fault.barrier_timeout_s)
        check_wandb(config.run)
        start = run_start.decide(config, peers)
        compiling = time.perf_counter()
        program = TrainProgram.build(config, mesh)  # train.microbatches=auto: the fewest that fit
        run = cls(program.config, program, data, start, peers)
        if start.adapting:  # the base, loaded into its shards and checked before compiling
            run.base, run.base_reference = run_start.load_base(start, program.abstract_state().frozen)
            run.check_meta(start.meta)
        check_fits(program)  # the step compiled now, its memory against run.device_memory_gb
        if staged:
            first = dataclasses.replace(staged[0].stage, config=program.config)
            run.stages = [dataclasses.replace(staged[0], stage=first, program=program)]
            for part in staged[1:]:
                try:
                    stage_program = TrainProgram.build(part.stage.config, part.mesh)
                    check_fits(stage_program)
                except ConfigError as err:
                    raise ConfigError(f"{part.stage.name} (train.stages[{part.stage.listed - 1}]): {err}") from None
                run.stages.append(dataclasses.replace(part, program=stage_program))
        run.compile_seconds = time.perf_counter() - compiling
        return run

    def stage_of(self, step: int) -> int:
        """The index of the stage that trains step `step` (0 in a run without stages)."""
        return stage_at([s.stage for s in self.stages], step).index if self.stages else 0

    def enter(self, index: int) -> RunStage:
        """Make stage `index`'s program and data the current ones."""
        self.stage, current = index, self.stages[index]
        self.program, self.data = current.program, current.data
        return current

    @property
    def data_fingerprint(self) -> str:
        """Names the run's batch stream, saved with every checkpoint: a staged run's names every stage's stream and
        where it begins, so crossing a boundary is not a change of the data settings."""
        if not self.stages:
            return self.data.fingerprint
        parts = [[s.stage.first_step, s.data.fingerprint] for s in self.stages]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    def check_meta(self, meta: dict | None) -> None:
        """A checkpoint's meta must say this run's adapters and base, beyond its model (ConfigError, one line)."""
        run_start.meta_check(self.config, self.base_reference)(meta)

    @property
    def layer_order(self) -> LayerOrder:
        return layer_order(self.config, self.program.mesh)

    def metadata(self) -> dict:
        """What every checkpoint of this run records besides its arrays."""
        return run_metadata(self.config, self.program.mesh) | (
            {"base": self.base_reference} if self.base_reference else {}
        )


def open_checkpointer(run: Run, print_fn: Callable[[str], None], injector: Injector) -> Checkpointer:
    """The run's Checkpointer: the durable tier in run.dir, the node-local one where checkpoint.local_dir is set."""
    c, run_dir, mesh = run.config.checkpoint, Path(run.config.run.dir), run.program.mesh
    local = (
        LocalTier(c.local_dir, run_dir, mesh, run.peers, c.local_keep, c.local_replicas, print_fn=print_fn)
        if c.local_dir
        else None
    )
    identity = Identity(
        meta=run.metadata(), model=run.metadata()["config"]["model"], check=run.check_meta, layout=run.layer_order
    )
    return Checkpointer(
        Tiers(run_dir, local=local),
        c,
        identity,
        peers=run.peers,
        print_fn=print_fn,
        injector=injector,
        keep_steps=tuple(decay_saves(run.config)),
    )


def configure_process(config: Config) -> None:
    """What a run sets for its whole process, in this one place, when it starts (train()): JAX's persistent
    compilation cache, and Orbax's log records of the storage failures the Checkpointer reports in one line itself
    dropped (checkpoint/storage_failures.py)."""
    enable_compilation_cache(config)
    quiet_storage_noise()


def enable_compilation_cache(config: Config) -> None:
    """JAX's persistent compilation cache: a restarted run loads its compiled steps instead of compiling. The
    default keeps a directory already given to JAX (JAX_COMPILATION_CACHE_DIR, or the caller's jax.config), so
    the processes of one job, or of a test session, share it."""
    setting = config.run.compilation_cache
    if setting == "off" or (not setting and jax.config.jax_compilation_cache_dir):
        return
    directory = Path(setting).expanduser() if setting else cache_root(config.data.cache_dir) / "jax_compilation_cache"
    jax.config.update("jax_compilation_cache_dir", str(directory))


def run_metadata(config: Config, mesh: Mesh) -> dict:
    return {
        "config": to_dict(config),
        "llama_jax": __version__,
        "jax": jax.__version__,
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        "devices": mesh.devices.size,
    }


def load_checkpoint(config: Config, step: int, devices=None) -> tuple[TrainState, dict]:
    """(train state, loader state) saved at `step` in config.run.dir, restored onto `devices` (default:
    all) in config's mesh: to inspect a run's parameters or compare two runs (a peft run's: its adapters)."""
    program = TrainProgram.for_config(config, devices)
    checkpointer = Checkpointer(
        Tiers(Path(config.run.dir)), config.checkpoint, Identity(layout=layer_order(config, program.mesh))
    )
    try:
        with program.activate():
            return checkpointer.restore(step, program.abstract_checkpoint())
    finally:
        checkpointer.close()
