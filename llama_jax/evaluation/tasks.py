"""lm-eval tasks, offline: found by name or by task YAML file, their data only from this machine.

A task is one of lm-eval's names (hellaswag, arc_easy, ...) or a task YAML file in lm-eval's format, whose
`dataset_path`/`dataset_kwargs.data_files` may name local files (`dataset_path: json`). Nothing is downloaded:
Hugging Face's offline switches are set before the datasets library is imported, so a task's data comes from
the Hugging Face datasets cache or the files its YAML names. A task that does not exist, or whose data is not on
this machine, is a one-line ConfigError/DataError (exit 2) before any request is scored.

lm-eval indexes its ~15,000 built-in task YAMLs in ~12 s; that index is built only when a task is not among the
YAML files given, and once per process.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import yaml

from llama_jax.errors import ConfigError, DataError

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def go_offline() -> None:
    """Hugging Face's libraries read their offline switches when imported: set them first (here, before lm-eval
    and datasets are), and on the modules where another import came first."""
    os.environ.update(OFFLINE)
    import datasets
    import huggingface_hub

    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True


@functools.cache
def _manager(include: tuple[str, ...], with_builtin: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include) or None, include_defaults=with_builtin)


def resolve(tasks: list[str]) -> tuple[list[str], object]:
    """(task names, the lm-eval TaskManager that knows them) for task names and YAML files; ConfigError for a
    task that is neither."""
    names, folders = [], []
    for task in tasks:
        path = Path(task).expanduser()
        if path.suffix in (".yaml", ".yml"):
            if not path.is_file():
                raise ConfigError(f"task file {task} does not exist; pass an lm-eval task YAML or a task name")
            try:
                name = (yaml.safe_load(path.read_text()) or {}).get("task")
            except (yaml.YAMLError, AttributeError, OSError) as err:
                reason = str(err).splitlines()[0]
                raise ConfigError(f"task file {task} is not an lm-eval task YAML ({reason})") from None
            if not isinstance(name, str):
                raise ConfigError(f"task file {task} has no `task:` name; lm-eval task YAMLs start with `task: NAME`")
            names.append(name)
            folders.append(str(path.resolve().parent))
        else:
            names.append(task)
    go_offline()
    include = tuple(dict.fromkeys(folders))
    manager = _manager(include, False)
    if any(name not in manager.all_tasks for name in names):
        manager = _manager(include, True)
    for name in names:
        if name not in manager.all_tasks:
            raise ConfigError(
                f"unknown task {name!r}; use one of lm-eval's task names (`lm_eval ls tasks`) or a task YAML file"
            )
    return names, manager


def check_data(names: list[str], manager) -> None:
    """Each task's data, loaded once from this machine (after which it is in the datasets cache); DataError
    naming what to put where for a task whose data is not here."""
    from lm_eval.tasks import get_task_dict

    for name in names:
        try:
            get_task_dict([name], manager)
        except (OSError, ValueError) as err:  # datasets: ConnectionError (offline), FileNotFoundError, ...
            cache = os.environ.get("HF_DATASETS_CACHE", "~/.cache/huggingface/datasets")
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise DataError(
                f"task {name}: its data is not on this machine ({reason}); put the dataset in the Hugging Face "
                f"datasets cache ({cache}), or give a task YAML whose dataset_kwargs.data_files name local files"
            ) from None


def prepare(tasks: list[str]) -> tuple[list[str], object]:
    """(task names, their TaskManager) once every task is known and its data is on this machine: what `run`
    takes, decided before a model is read."""
    names, manager = resolve(tasks)
    check_data(names, manager)
    return names, manager


def run(lm, names: list[str], manager, limit: int | None = None, num_fewshot: int | None = None, log_samples=False):
    """lm-eval's results (simple_evaluate's dict; per-sample logs with `log_samples`) of `lm` on the tasks
    `prepare` gave, offline."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm, tasks=names, task_manager=manager, limit=limit, num_fewshot=num_fewshot, log_samples=log_samples
    )


def scores(results: dict) -> dict[str, float]:
    """{"task/metric": value} of every task's metrics (lm-eval's "acc,none" is "acc"; stderrs left out): the
    numbers a run logs."""
    flat = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if isinstance(value, (int, float)) and not metric.endswith("_stderr") and metric != "sample_len":
                suffix = "" if filter_name in ("", "none") else f"[{filter_name}]"
                flat[f"{task}/{metric}{suffix}"] = float(value)
    return flat


def table(results: dict) -> str:
    """lm-eval's own table of the results."""
    from lm_eval.utils import make_table

    return make_table(results) + (("\n" + make_table(results, "groups")) if results.get("groups") else "")


def as_json(results: dict) -> str:
    """The results as lm-eval's CLI writes them (what is not JSON, e.g. a task's functions, as text)."""
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
