"""`llama-jax` command line: train, prepare, plan, tune, doctor, report, profile, convert, average, generate, eval,
supervise, goodput.

Every error a user can act on (errors.py) is reported as one line on stderr with its exit status: 2
for bad input (config, mesh, data, checkpoint). `train` checks its input before anything in run.dir is
created or overwritten.
The commands import their modules when they run, so `llama-jax --help` answers at once.

    __init__.py   the parser of every command, and main: run one, its errors as one line and an exit status
    arguments.py  what several commands parse alike: PRESET|CONFIG key=value, integer lists, --target GPUs
    train.py      train, prepare, doctor, supervise: the commands around a training run
    planning.py   plan, tune, goodput: the commands that plan a run before it runs
    models.py     convert, average, generate, eval: the commands on a trained or converted model
    records.py    report, profile: the commands that read what a run wrote
    __main__.py   `python -m llama_jax.cli`
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from llama_jax.cli import models, planning, records, train
from llama_jax.errors import EXIT_PEER_TIMEOUT, LlamaJaxError


def _error(message: str) -> None:
    # One write: the lines of several processes sharing a terminal must not interleave mid-line.
    sys.stderr.write(f"llama-jax: error: {message}\n")
    sys.stderr.flush()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llama-jax", description="Pre-train Llama 3 models with JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (
        train.add_train,
        train.add_prepare,
        planning.add_plan,
        train.add_doctor,
        planning.add_tune,
        records.add_report,
        models.add_convert,
        models.add_average,
        models.add_generate,
        models.add_eval,
        train.add_supervise,
        planning.add_goodput,
    ):
        add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    started_at = time.time()  # goodput counts the start-up (imports, compilation) as restart overhead
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra and hasattr(ns, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        # key=value after an option: `convert A B --dtype bfloat16 mesh.tensor=8`
        ns.overrides = [*ns.overrides, *extra]
    elif extra:
        parser.parse_args(argv)  # argparse's own error for what it does not know
    ns.started_at = started_at
    from llama_jax.perf.xla_flags import check_xla_flags  # here, not at the top: `--help` answers without jaxlib

    try:
        check_xla_flags()
        return ns.func(ns)
    except LlamaJaxError as err:
        _error(str(err))
        if err.exit_code == EXIT_PEER_TIMEOUT:
            _leave_now(err.exit_code)
        return err.exit_code
    except Exception:
        if not _joined_a_multiprocess_run():
            raise
        # Most often a process of the run is gone and this one's collectives failed: the same wait as above.
        traceback.print_exc()
        _leave_now(1)


def _joined_a_multiprocess_run() -> bool:
    jax = sys.modules.get("jax")  # never imported for `--help`
    return jax is not None and jax.distributed.is_initialized()


def _leave_now(status: int) -> None:
    """Exit without JAX's exit handler, which waits at a shutdown barrier for every process of the run: one that is
    gone never reaches it, and this process would wait until the scheduler kills it (Slurm's KillWait) instead of
    letting the supervisor restart the run now."""
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(status)
