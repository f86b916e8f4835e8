"""`llama-jax average`: the elementwise mean of a run's checkpoints' parameters (Polyak averaging, as Llama 3 averages
the checkpoints of its annealing phase), written as a parameters-only checkpoint: what `convert hf:DIR` writes, so
`generate`, `eval`, `convert` and `checkpoint.init_from` read it.

Streamed a parameter (one leaf of the tree: a stacked layer kernel, the embedding, ...) at a time: Orbax reads that
leaf alone from each checkpoint in turn (a partial restore), sharded over the mesh as training shards it, and adds
it to a float32 sum on the same devices. Besides the mean being built (one copy of the parameters, sharded), the
devices hold the sum of the leaf in progress and the leaf being read (at its end, the sum and its quotient): memory
does not grow with the number of checkpoints, and no parameter passes whole through one host.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from llama_jax import __version__
from llama_jax.checkpoint.durable import model_differences, read_meta, restore_params, save_params, step_directories
from llama_jax.checkpoint.specs import copy_tokenizer, inference_config, inference_mesh, param_target
from llama_jax.config import Config, ModelConfig
from llama_jax.config.stages import decay_saves
from llama_jax.distributed import processes
from llama_jax.distributed.peers import Peers
from llama_jax.errors import ConfigError
from llama_jax.files import unreadable, unwritable


def chosen_steps(run_dir: Path, steps: tuple[int, ...] = (), last: int = 0) -> list[int]:
    """The steps to average: `steps` as named (each must be a finished checkpoint of the run), or the newest `last`."""
    saved = step_directories(run_dir / "checkpoints")
    if not saved:
        kind = (
            "a run directory without a finished checkpoint"
            if (run_dir / "config.yaml").is_file()
            else "not a run directory (no checkpoints/<step>/ in it)"
        )
        raise ConfigError(f"average: {run_dir} is {kind}; name the run.dir of a run that has saved checkpoints")
    listed = ", ".join(map(str, saved))
    if bool(steps) == (last != 0) or last < 0:
        raise ConfigError(
            f"average: name the checkpoints to average, either --steps A,B,... or --last N with N >= 1 "
            f"(the run has {listed})"
        )
    if last:
        if last > len(saved):
            raise ConfigError(
                f"average: --last {last}, and {run_dir} has {len(saved)} checkpoint(s) ({listed}); "
                f"ask for at most {len(saved)}"
            )
        return saved[-last:]
    missing = [s for s in steps if s not in saved]
    if missing:
        raise ConfigError(
            f"average: --steps names step {missing[0]}, and {run_dir} has no checkpoint there; its "
            f"checkpoints: {listed}"
        )
    if len(set(steps)) < len(steps):
        raise ConfigError(f"average: --steps names a step twice ({','.join(map(str, steps))}); name each once")
    return sorted(steps)


def checked_model(run_dir: Path, steps: list[int]) -> ModelConfig:
    """The model the chosen checkpoints hold: the same one in every one of them, and without adapters. A peft run
    is refused: the mean of LoRA adapters is not the mean of the adapted models (B·A is not linear in B and A)."""
    models = []
    for step in steps:
        meta = read_meta(run_dir / "checkpoints" / str(step))
        if meta is None:
            raise ConfigError(
                f"average: {run_dir / 'checkpoints' / str(step)} has no readable meta item: it is not a "
                "llama-jax checkpoint or it is damaged; leave that step out"
            )
        method = meta["config"].get("peft", {}).get("method", "none")
        if method != "none":
            raise ConfigError(
                f"average: {run_dir} trains adapters (peft.method={method}), whose mean is not the mean "
                "of the adapted models; average the runs that train whole models"
            )
        models.append(meta["config"]["model"])
    for step, model in zip(steps[1:], models[1:]):
        if differ := model_differences(models[0], model):
            raise ConfigError(
                f"average: checkpoints {steps[0]} and {step} of {run_dir} hold different models ("
                f"{'; '.join(f'model.{k} {models[0][k]} vs {model[k]}' for k in differ)}); average "
                "checkpoints of one model"
            )
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in models[0].items() if k in names})


def _only(path: tuple, leaf: Any) -> dict:
    """The tree that holds `leaf` at `path` and nothing else: what a partial restore reads."""
    for key in reversed(path):
        leaf = {key.key: leaf}
    return leaf


def mean_params(step_dirs: list[Path], target: Any) -> Any:
    """The elementwise mean of the parameters of `step_dirs`, in the shapes, dtypes and shardings of `target`,
    summed in float32 a leaf at a time (module docstring)."""
    add = jax.jit(lambda total, x: total + x.astype(jnp.float32), donate_argnums=0)
    count = jnp.float32(len(step_dirs))

    @functools.partial(jax.jit, static_argnums=2)
    def divide(total: jax.Array, n: jax.Array, dtype) -> jax.Array:
        # XLA rewrites a division by a broadcast scalar as a multiplication by its reciprocal, 1 ulp off the
        # quotient for a third of the values (1.2e-7 near 1, in the norm scales); behind the barrier it divides.
        return (total / jax.lax.optimization_barrier(jnp.broadcast_to(n, total.shape))).astype(dtype)

    def mean(path: tuple, like: jax.ShapeDtypeStruct) -> jax.Array:
        total = jax.jit(lambda: jnp.zeros(like.shape, jnp.float32), out_shardings=like.sharding)()
        for step_dir in step_dirs:
            part = restore_params(step_dir, _only(path, like))
            total = add(total, jax.tree.leaves(part)[0])
        return divide(total, count, like.dtype)

    return jax.tree_util.tree_map_with_path(mean, target)


def average(
    run_dir: str,
    out: str,
    overrides: list[str] = (),
    steps: tuple[int, ...] = (),
    last: int = 0,
    print_fn: Callable[[str], None] = print,
    devices=None,
) -> Path:
    """Average the checkpoints `steps` (or the newest `last`) of `run_dir` into a parameters-only checkpoint in
    `out` (new or empty), sharded over the mesh of `overrides` (mesh.* keys; default all devices on fsdp) while it
    is computed. The run's tokenizer goes along. Every process of a multi-process run runs it."""
    run, target = Path(run_dir).expanduser(), Path(out).expanduser()
    if problem := unreadable(run, "directory"):
        raise ConfigError(f"average: {problem}; name the run.dir of a run")
    if problem := unwritable(target):
        raise ConfigError(f"average: --out {out} cannot be written: {problem}; choose a new output directory")
    if target.exists() and any(target.iterdir()):
        raise ConfigError(f"average: --out {target} exists and is not empty; choose a new output directory")
    chosen = chosen_steps(run, tuple(steps), last)
    model = checked_model(run, chosen)
    config = inference_config(model, overrides, batches=False)
    processes.initialize(config.run)
    Peers(config.fault.barrier_timeout_s).barrier("llama-jax average")  # every process has checked `out`
    return write_average(run, chosen, target, config, inference_mesh(config, devices), print_fn)


def average_decay_phase(run_dir: Path, steps: list[int], devices, print_fn: Callable[[str], None]) -> Path:
    """checkpoint.average_decay at the end of a run: its decay phase's checkpoints `steps` averaged into
    run_dir/averaged (every process of the run calls it, after the last save)."""
    config = inference_config(checked_model(run_dir, steps), batches=False)
    return write_average(run_dir, steps, run_dir / "averaged", config, inference_mesh(config, devices), print_fn)


def write_average(
    run: Path, chosen: list[int], target: Path, config: Any, mesh: Any, print_fn: Callable[[str], None]
) -> Path:
    """The mean of checkpoints `chosen` of `run` on `mesh`, written to `target` with the run's tokenizer."""
    model = config.model
    step_dirs = [(run / "checkpoints" / str(step)).absolute() for step in chosen]
    params = mean_params(step_dirs, param_target(config, mesh))
    meta = {
        "config": {"model": dataclasses.asdict(model)},
        "source": str(run.absolute()),
        "averaged_steps": chosen,
        "llama_jax": __version__,
        "jax": jax.__version__,
    }
    done = save_params(target, params, meta)
    if jax.process_index() == 0:
        copy_tokenizer(run, target)
        print_fn(f"averaged {len(chosen)} checkpoint(s) of {run} (steps {', '.join(map(str, chosen))}) -> {done}")
    return done


def average_decay(config: Config, peers: Peers, devices: list, print_fn: Callable[[str], None]) -> None:
    """checkpoint.average_decay, once a run has trained to its end and saved: the decay phase's checkpoints that
    exist averaged into run.dir/averaged, unless an average of those very steps is there. A planned checkpoint may
    be missing (a save the guard held for a bad step went to the next good one): the others are averaged, with a
    warning; with fewer than 2, none is, and the run still ends well. Every process of the run calls it."""
    run_dir = Path(config.run.dir)
    if not config.checkpoint.average_decay:
        return
    out = run_dir / "averaged"
    # Process 0's reading of the directories, for every process: on a shared filesystem two processes may see
    # them at different moments, and one deciding alone to skip would leave the others waiting in the average.
    steps = peers.broadcast("average decay: steps", _decay_steps_to_average(config, run_dir, out, print_fn))
    if not steps:
        return
    if jax.process_index() == 0 and out.exists():  # an earlier average: unfinished, or of other steps
        shutil.rmtree(out)
    peers.barrier("average decay")
    average_decay_phase(run_dir, steps, devices, print_fn)


def _decay_steps_to_average(config: Config, run_dir: Path, out: Path, print_fn: Callable[[str], None]) -> list[int]:
    """The decay phase's checkpoints to average into `out`, or [] where there are fewer than 2 or `out` already
    holds their average."""
    planned = decay_saves(config)
    begin = config.train.steps - config.train.resolved_decay_steps
    steps = [s for s in step_directories(run_dir / "checkpoints") if begin < s <= config.train.steps]
    if steps != planned:
        print_fn(
            f"warning: checkpoint.average_decay planned steps {planned}; the decay phase's checkpoints are {steps}"
            + ("" if len(steps) >= 2 else ": fewer than 2, nothing averaged")
        )
    done = read_meta(out / "checkpoints" / "0")
    if len(steps) < 2 or (done is not None and done.get("averaged_steps") == steps):
        return []
    return steps
