"""The durable tier on disk: Orbax checkpoints under ``<run.dir>/checkpoints/<step>/``, one atomic
directory per step holding

    state   params, optimizer state and the step counter (sharded arrays; any mesh can restore them)
    data    the loader's position (next batch index) and the fingerprint of the batch stream
    meta    the resolved config, code and JAX versions, mesh, process count and save time (JSON)

Orbax writes into a temporary directory and renames it when complete, so a step directory that exists is
a finished checkpoint and an interrupted save is ignored. Here: listing the finished steps, reading a
step's meta, checking that a step holds this run's model, reading a step (onto any mesh, the layers put in
the run's pipeline order), and parameters-only checkpoints (conversions from Hugging Face). Saving, the
cadence and falling back from damaged steps are the Checkpointer's (checkpointer.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from llama_jax.config.choices import ARCHITECTURE_FIELDS, FUNCTION_FIELDS
from llama_jax.errors import ConfigError
from llama_jax.model.stages import NATURAL, LayerOrder, in_order, relayout

ITEMS = ("state", "data", "meta")


def step_directories(directory: Path) -> list[int]:
    """Finished step numbers in a checkpoints directory, read without creating anything.

    Orbax writes into `<step>.orbax-checkpoint-tmp*` and renames to `<step>` when complete, so
    only all-digit directory names are finished checkpoints.
    """
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


def latest_checkpoint_step(run_dir: Path) -> int:
    """Newest finished checkpoint step in run_dir (0 if none)."""
    return max(step_directories(Path(run_dir) / "checkpoints"), default=0)


def read_meta(step_dir: Path) -> dict | None:
    """The meta item of a step directory, or None if it is missing or unreadable."""
    try:
        return json.loads((step_dir / "meta" / "metadata").read_text())
    except (OSError, ValueError):
        return None


def saved_layer_order(meta: dict | None) -> LayerOrder:
    """The pipeline layout a step was saved with: the order of its layers (model/stages.py)."""
    meta = meta or {}
    mesh = meta.get("config", {}).get("mesh", {})
    return LayerOrder(
        int(meta.get("mesh", {}).get("pipeline", 1)),
        int(mesh.get("pipeline_repeats", 1)),
        tuple(mesh.get("pipeline_stage_layers", ())),
    )


def model_differences(saved: dict, model: dict) -> list[str]:
    """The architecture fields (choices.ARCHITECTURE_FIELDS) in which two model configs differ. The
    llama3 RoPE scaling's shape parameters count only where its factor is not 1 (a factor of 1 leaves
    the frequencies untouched whatever they say)."""
    scaled = saved.get("rope_scaling_factor", 1.0) != 1.0 or model.get("rope_scaling_factor", 1.0) != 1.0
    ignored = set() if scaled else {"rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len"}
    return [k for k in ARCHITECTURE_FIELDS if k not in ignored and k in saved and saved[k] != model[k]]


def check_model(saved: dict, model: dict, where: Path | str, allowed: tuple[str, ...] | list[str] = ()) -> None:
    """A checkpoint must hold this model: the same shapes and the same function. Names every field that
    differs (exit 2, nothing touched); `allowed` (checkpoint.allow_model_changes) lets function fields differ."""
    differ = [k for k in model_differences(saved, model) if k not in allowed]
    if differ:
        hint = (
            ""
            if set(differ) - set(FUNCTION_FIELDS)
            else (
                f"; to change it on purpose (e.g. new RoPE scaling for a longer context) add "
                f"checkpoint.allow_model_changes=[{','.join(differ)}]"
            )
        )
        fields = "; ".join(f"model.{k} {saved[k]} (saved) vs {model[k]}" for k in differ)
        raise ConfigError(
            f"{where} holds checkpoints of a different model ({fields}); "
            f"use another run.dir or the saved model settings{hint}"
        )


def resolve_step_dir(path: str) -> Path:
    """`checkpoint.resume_from` / `init_from`: a step directory, or a run dir / checkpoints dir (its newest
    step), as an absolute path (Orbax requires one)."""
    p = Path(path).expanduser().absolute()
    for candidate in (p, p / "checkpoints"):
        steps = step_directories(candidate)
        if steps:
            return candidate / str(steps[-1])
    if p.name.isdigit() and p.is_dir():
        return p
    if (p / "config.yaml").is_file() or (p / "metrics.jsonl").is_file():  # a run that has not saved yet
        raise ConfigError(
            f"{path} is a run directory without a finished checkpoint yet (none in "
            f"{p / 'checkpoints'}); a run saves one every checkpoint.every_steps steps and at its end"
        )
    raise ConfigError(f"{path} holds no finished checkpoint; give a run dir, its checkpoints/ or a step directory")


def _is_abandoned_read_callback(unraisable) -> bool:
    """Whether an unraisable exception is a TensorStore read landing on Orbax's closed event loop: when one array
    of a damaged step fails to read, Orbax stops waiting and closes its loop while TensorStore's threads still
    finish the step's other reads; each completion then calls call_soon_threadsafe on the closed loop, which
    raises 'Event loop is closed' in that thread. The failed read itself is reported (the Checkpointer sets the
    step aside in one line; resume_from / init_from stop in one line), so the tracebacks are noise."""
    error, frames = unraisable.exc_value, unraisable.exc_traceback
    while frames is not None and frames.tb_next is not None:
        frames = frames.tb_next
    return (
        isinstance(error, RuntimeError)
        and str(error) == "Event loop is closed"
        and frames is not None
        and frames.tb_frame.f_code.co_name == "_check_closed"
    )


def _drop_abandoned_read_callbacks() -> None:
    """Put a filter of _is_abandoned_read_callback in front of sys.unraisablehook (once): every other unraisable
    exception still reaches the hook that was there."""
    if getattr(sys.unraisablehook, "drops_abandoned_reads", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _is_abandoned_read_callback(unraisable):
            previous(unraisable)

    hook.drops_abandoned_reads = True
    sys.unraisablehook = hook


def read_step(step_dir: Path, abstract_state: Any, layout: LayerOrder) -> tuple[Any, dict]:
    """(state, loader state) of a step directory, in the shardings of abstract_state and the layer order
    `layout` (read in the order it was saved in, then moved)."""
    _drop_abandoned_read_callbacks()
    saved = saved_layer_order(read_meta(step_dir))
    handler = ocp.CompositeCheckpointHandler()
    try:
        restored = handler.restore(
            step_dir,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(in_order(abstract_state, layout, saved)), data=ocp.args.JsonRestore()
            ),
        )
    finally:
        handler.close()
    return relayout(restored["state"], saved, layout, abstract_state), dict(restored["data"])


def restore_step(step_dir: Path, abstract_state: Any, layout: LayerOrder = NATURAL) -> tuple[Any, dict]:
    """(train state, loader state) of a step directory of another run (resume_from / init_from),
    read without opening a manager on that run, so nothing there can be touched. `layout`: the pipeline
    layout whose layer order the state is wanted in."""
    return read_step(Path(step_dir).absolute(), abstract_state, layout)


def restore_params(step_dir: Path, abstract_params: Any, layout: LayerOrder = NATURAL) -> Any:
    """The parameters of a step directory: a converted checkpoint's `params` item, or the `params`
    of a training checkpoint's state (only they are read, not the optimizer moments), with the layers
    in the order of pipeline `layout` (default: the natural order)."""
    has_params_item = (Path(step_dir) / "params").is_dir()
    item = "params" if has_params_item else "state"
    saved = saved_layer_order(read_meta(step_dir))
    stored = in_order({"params": abstract_params}, layout, saved)
    target = stored["params"] if has_params_item else stored
    restore_args = jax.tree.map(
        lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype), target
    )
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        restored = checkpointer.restore(
            step_dir,
            args=ocp.args.Composite(
                **{
                    item: ocp.args.PyTreeRestore(
                        item=target, restore_args=restore_args, partial_restore=not has_params_item
                    )
                }
            ),
        )
    finally:
        checkpointer.close()
    params = restored[item] if has_params_item else restored[item]["params"]
    return relayout({"params": params}, saved, layout, {"params": abstract_params})["params"]


def save_params(directory: Path, params: Any, meta: dict) -> Path:
    """A parameters-only checkpoint (e.g. converted from Hugging Face): <directory>/checkpoints/0/ with
    items `params` and `meta`. `checkpoint.init_from`, `llama-jax generate` and `eval` read it."""
    manager = ocp.CheckpointManager(
        Path(directory).absolute() / "checkpoints",
        item_names=("params", "meta"),
        options=ocp.CheckpointManagerOptions(create=True),
    )
    try:
        manager.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave(meta)))
        manager.wait_until_finished()
    finally:
        manager.close()
    return Path(directory) / "checkpoints" / "0"
