"""A program's memory: what its compiled step needs per device, the budget it must fit, and the micro-batch count
train.microbatches=auto picks by them (program.py's TrainProgram.build asks for it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import Mesh

from llama_jax.config import Config
from llama_jax.errors import ConfigError
from llama_jax.files import format_bytes
from llama_jax.model.context import mesh_device
from llama_jax.model.pipeline import fewest_microbatches
from llama_jax.perf.hardware import memory_budget as device_budget


def step_memory_bytes(compiled) -> int:
    """Per device: arguments + temporaries + outputs that do not reuse (alias) donated arguments."""
    memory = compiled.memory_analysis()
    return (
        memory.argument_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
    )


def memory_bytes(program) -> int:
    """Per device, what a TrainProgram's compiled step needs: step_memory_bytes, plus cuDNN attention's workspace on
    compile-only GPUs, whose compile does not size it (gpu_target.cudnn_workspace_bytes)."""
    return step_memory_bytes(program.compile_step()) + cudnn_workspace_bytes(program)


def cudnn_workspace_bytes(program) -> int:
    """The part of memory_bytes() that is estimated, not compiled: 0 where the compile sizes it."""
    program.compile_step()
    return program.compiled.workspace_bytes


def memory_budget(program) -> float:
    """Bytes per device a TrainProgram's step may use on its mesh's devices."""
    return budget_on(program.config, program.mesh)


def budget_on(config: Config, mesh: Mesh) -> float:
    """Bytes per device a step of `config` may use on `mesh`'s devices: run.device_memory_gb, or this process's
    device's default (hardware.memory_budget)."""
    return device_budget(config.run.device_memory_gb, own_device(mesh))


def check_fits(program) -> None:
    """Raise ConfigError (one line: what the step needs, the budget, the keys to change) when the compiled
    step needs more memory per device than run.device_memory_gb allows."""
    need, budget = memory_bytes(program), memory_budget(program)
    if need > budget:
        t, remat_policy = program.config.train, program.config.remat.policy
        raise ConfigError(
            f"the train step ({t.microbatches} micro-batch(es), remat.policy={remat_policy}) needs "
            f"{format_bytes(need)} per device, over the budget of {format_bytes(budget)} (run.device_memory_gb); "
            "use train.microbatches=auto (or more), recompute more (remat.policy=full), shard over more devices "
            "(mesh.fsdp, mesh.tensor), or let `llama-jax tune` choose"
        )


def fewest_microbatches_that_fit(config: Config, mesh: Mesh, build: Callable[[Config], object]):
    """The program (build(config with a count)) with the fewest micro-batches whose compiled step fits the budget;
    else the most (one sequence per device at a time), which check_fits then refuses."""
    rows = config.train.batch_size // (mesh.shape["data"] * mesh.shape["fsdp"])  # per batch shard
    budget = budget_on(config, mesh)
    # pipelining needs a multiple of the stages, and of the micro-batches of one pass
    step = fewest_microbatches(config.mesh, mesh.shape["pipeline"])
    counts = [n for n in range(step, rows + 1) if rows % n == 0 and n % step == 0]
    if not counts:
        raise ConfigError(
            f"train.microbatches=auto: no micro-batch count is a multiple of {step} (the pipeline "
            f"stages and mesh.pipeline_microbatches) and divides the {rows} rows of each batch "
            "shard; raise train.batch_size or lower mesh.pipeline_microbatches"
        )
    failure = None
    for count in counts:
        program = build(dataclasses.replace(config, train=dataclasses.replace(config.train, microbatches=count)))
        try:
            needs = memory_bytes(program)
        except jax.errors.JaxRuntimeError as err:
            # XLA:GPU's HLO verifier rejects some counts of some layouts (jax 0.12.0.1, llama3_405b's long-context
            # stages at 1 micro-batch: an async custom call's shape); another count compiles, so try it.
            failure = err
            continue
        failure = None
        if needs <= budget:
            break
    if failure is not None:
        raise failure
    return program


def own_device(mesh: Mesh):
    """This process's first device of the mesh (another process's cannot be asked for its memory), or the first
    of a mesh of compile-only devices (`--target`), which no process owns."""
    return next((d for d in mesh.devices.flat if d.process_index == jax.process_index()), mesh_device(mesh))
