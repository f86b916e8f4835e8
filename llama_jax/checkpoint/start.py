"""Where a run starts, decided in one place: before anything in run.dir is written (`decide`), and carried out
once the train step is compiled (`restore`).

    the run's own steps      run.dir holds steps, in checkpoints/ or the node-local tier (which may be newer):
                             the newest step some tier holds whole (Checkpointer.restore_newest: the local tier,
                             then checkpoints/; a damaged copy is set aside and the next one tried). A local step
                             counts when the hosts of this run hold every saving process's shards between them
                             (own copies and partners', on whatever process count or mesh saved it: a run that
                             continues on fewer hosts, or grows back, resumes from it); else the next older one
    checkpoint.resume_from   a new run.dir continues another run's step: params, optimizer state, data position
    checkpoint.init_from     a new run.dir starts from another model's params (a run, a step, hf:DIR)
    peft.method              the base model of checkpoint.init_from, frozen, with adapters: new ones, or the run's
                             own saved ones (checkpoints hold the adapters only, so the base is read on every start);
                             init_from naming adapters of the same method (a peft run, a PEFT adapter directory)
                             continues them: their base is the run's, and they are its adapters at step 0
    none of these            a new model from config.seed

`decide` reads what each source says about its model (a checkpoint's meta, a Hugging Face config) and refuses
one of another model in one line (ConfigError, exit 2), naming the fields; a peft run's checkpoints must hold
the same adapters. `load_base` reads a peft run's base into its shards and checks it against what the run's
checkpoints recorded of it. `restore` returns the state and data position to continue from, or the params to
initialise with; the training side turns that into a train state (TrainProgram.start_state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_jax.checkpoint.checkpointer import Checkpointer, Restored
from llama_jax.checkpoint.durable import check_model, latest_checkpoint_step, read_meta, restore_step
from llama_jax.checkpoint.local_files import host_directory, host_pieces, read_manifest
from llama_jax.checkpoint.relayout import covered_steps
from llama_jax.checkpoint.specs import ModelSpec, load_params, read_adapters, resolve
from llama_jax.config import Config
from llama_jax.distributed.peers import Peers
from llama_jax.errors import ConfigError
from llama_jax.model import peft


@dataclass(frozen=True)
class Start:
    """The decision: run.dir's newest step (0: none) and its meta, and the model a new run starts from."""

    step: int  # the newest step some tier of run.dir holds (each process its own directory; agreed by all)
    meta: dict | None  # that step's meta (the config it was saved with, a peft run's base reference)
    source: ModelSpec | None = None  # checkpoint.resume_from or init_from for a new run.dir; a peft run's base
    resume: bool = False  # source is a step to continue (resume_from), not params to start from
    adapting: str = ""  # a peft run's method: source is its frozen base, on every start
    adapters: ModelSpec | None = None  # a peft run continuing trained adapters (init_from): their spec


def decide(config: Config, peers: Peers) -> Start:
    """Where `config`'s run starts. Raises ConfigError (one line) for a source of another model, other
    adapters, or a source that cannot be resumed; reads, never writes."""
    run_dir, model = Path(config.run.dir), dataclasses.asdict(config.model)
    allowed = config.checkpoint.allow_model_changes
    step = latest_checkpoint_step(run_dir)
    meta = read_meta(run_dir / "checkpoints" / str(step)) if step else None
    if config.checkpoint.local_dir:  # the local tier may hold newer steps: the newest the hosts hold whole
        host = host_directory(config.checkpoint.local_dir, run_dir)
        covered = covered_steps(host, peers)  # saved on any process count or mesh (partners' copies included)
        if covered and covered[0][0] > step:
            step = covered[0][0]
            mine = next((Path(where) for saved, _, _, where, _ in host_pieces(host) if saved == step), None)
            meta = peers.reduce(
                f"meta of local step {step}",
                (read_manifest(mine) or {}).get("meta") if mine else None,
                lambda all_: next((m for m in all_ if m), None),
            )
    if meta is not None:  # an unreadable one is set aside at restore time
        check_model(meta["config"]["model"], model, run_dir, allowed)
        check_optimizer(meta["config"], config, run_dir)
        peft.check_adapters(meta["config"].get("peft", {}), config.peft, run_dir)
    if config.peft.method != "none":  # the base model, also when resuming: checkpoints hold adapters only
        source = resolve(config.checkpoint.init_from)
        check_model(dataclasses.asdict(source.model), model, source.text, allowed)
        if source.adapters is not None and source.adapters.method == config.peft.method:
            return Start(step, meta, _base_of(source, config), adapting=config.peft.method, adapters=source)
        if source.adapters is not None and source.adapters.virtual_tokens:
            raise ConfigError(
                f"{source.text} is a prompt-tuned run, not a model to adapt; set "
                f"checkpoint.init_from to its base, {source.base['spec']}"
            )
        return Start(step, meta, source, adapting=config.peft.method)
    if step or not (config.checkpoint.resume_from or config.checkpoint.init_from):
        return Start(step, meta)
    source = resolve(config.checkpoint.resume_from or config.checkpoint.init_from)
    if config.checkpoint.resume_from and source.params_only:
        raise ConfigError(
            f"{source.text} holds parameters only (no optimizer state or data position) and "
            "cannot be resumed; start from it with checkpoint.init_from"
        )
    check_model(dataclasses.asdict(source.model), model, source.text, allowed)
    if config.checkpoint.resume_from and (saved := read_meta(source.step_dir)) is not None:
        check_optimizer(saved.get("config", {}), config, source.text)
    return Start(step, meta, source, resume=bool(config.checkpoint.resume_from))


def check_optimizer(saved: dict, config: Config, where) -> None:
    """A step to continue must hold the state of this run's optimizer (checkpoints before train.optimizer
    existed hold AdamW's); init_from takes the parameters alone and starts any optimizer afresh."""
    saved_optimizer = saved.get("train", {}).get("optimizer", "adamw")
    if saved_optimizer != config.train.optimizer:
        raise ConfigError(
            f"{where} holds the state of train.optimizer={saved_optimizer}, not {config.train.optimizer}; continue "
            f"it with train.optimizer={saved_optimizer}, or start a new run.dir from its parameters with "
            "checkpoint.init_from"
        )


def _base_of(adapted: ModelSpec, config: Config) -> ModelSpec:
    """The base model of adapters a peft run continues to train; their settings must be the run's peft.*."""
    saved = dataclasses.asdict(adapted.adapters)
    if differ := peft.differing_fields(saved, config.peft):
        settings = " ".join(f"peft.{k}={_override(saved[k])}" for k in differ)
        raise ConfigError(
            f"{adapted.text} holds adapters with other settings than peft.*; to continue training them set {settings}"
        )
    return resolve(adapted.base["path"])


def _override(value: Any) -> str:
    """A setting as the command line writes it: [q,v] for a list, repr(float) for a float (exact)."""
    return f"[{','.join(value)}]" if isinstance(value, list) else repr(value)


def load_base(start: Start, target: Any) -> tuple[Any, dict]:
    """A peft run's base params in the shapes and shardings of `target`, and the reference its checkpoints
    keep of it (path and digest: peft.base_reference); adapters it continues must have been trained on it."""
    base = load_params(start.source, target=target)
    reference = peft.base_reference(start.source.text, start.source.location, base)
    if start.adapters is not None:  # adapters continued: the base they were trained on (a run's records its digest)
        peft.check_base(start.adapters.base, reference, start.adapters.text)
    return base, reference


def meta_check(config: Config, base_reference: dict | None) -> Callable[[dict | None], None]:
    """What a step's meta must say beyond its model (which the Checkpointer checks): a peft run's adapters and
    the base they were trained on. Raises ConfigError, one line."""
    where = Path(config.run.dir)

    def check(meta: dict | None) -> None:
        if meta is None:
            return
        peft.check_adapters(meta.get("config", {}).get("peft", {}), config.peft, where)
        if base_reference is not None:
            peft.check_base(meta.get("base"), base_reference, where)

    return check


def restore(start: Start, checkpointer: Checkpointer, abstract: Any, print_fn: Callable[[str], None]) -> Restored:
    """Carry the decision out, in `abstract`'s shapes and shardings (a checkpointed train state; a peft run's
    without the base). Every process calls it (the Checkpointer agrees with the others on each step). The result
    (checkpointer.Restored) keeps what trying run.dir's own steps cost, also when none restored."""
    if not start.step:
        return _from_source(start, checkpointer, abstract, print_fn)
    found = checkpointer.restore_newest(abstract, print_fn)
    if found.state is not None:
        print_fn(f"resumed from {found.path}")
        return found
    print_fn("warning: no checkpoint in run.dir restores; starting from scratch")
    return dataclasses.replace(_from_source(start, checkpointer, abstract, print_fn), seconds=found.seconds)


def _from_source(start: Start, checkpointer: Checkpointer, abstract: Any, print_fn: Callable[[str], None]) -> Restored:
    """A run without a step of its own that restores: checkpoint.resume_from, init_from, a peft base, or none."""
    if start.source is None:
        return Restored()
    if start.adapting:
        print_fn(f"adapting {start.source.text} (peft.method={start.adapting}); its params stay frozen")
        if start.adapters is None:
            return Restored()
        print_fn(f"continuing the adapters of {start.adapters.text}")
        return Restored(params=read_adapters(start.adapters, abstract.params))
    if start.resume:
        state, data = restore_step(start.source.step_dir, abstract, checkpointer.layout)
        print_fn(f"resumed from {start.source.text}")
        return Restored(state=state, data=data)
    params = load_params(start.source, target=abstract.params, layout=checkpointer.layout)
    print_fn(f"initialised the params from {start.source.text}")
    return Restored(params=params)
