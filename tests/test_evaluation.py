"""lm-eval tasks on our backend (evaluation/): the command and lm-eval's own simple_evaluate give one table; a
sharded model answers as one device does; every request agrees with lm-eval's `hf` backend on the exported
weights (where torch and transformers are installed); bad tasks, missing data and missing models are one line,
exit 2, nothing written. The tasks are lm-eval YAML files on local files, made here."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml
from conftest import write_tiny_yaml

from llama_jax import cli
from llama_jax.config import load_config
from llama_jax.training.loop import train

lm_eval = pytest.importorskip("lm_eval", reason="the [eval] extra (lm-eval) is not installed")

from llama_jax.evaluation import tasks as lm_eval_tasks  # noqa: E402
from llama_jax.evaluation.harness import LlamaJaxLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler"]
LIMIT = 1e-5  # float32 on one device and on a mesh: the same sums, in another order


def write_task(folder: Path, name: str, rows: list[dict], **fields) -> Path:
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(folder / f"{name}.jsonl")}},
        "test_split": "test",
        **fields,
    }
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(task))
    return folder / f"{name}.yaml"


@pytest.fixture(scope="module")
def setting(tmp_path_factory, corpus):
    """A tiny run trained 8 steps on the corpus's words, and three tasks on those words: multiple choice,
    generation to the end of a line, and rolling perplexity."""
    root = tmp_path_factory.mktemp("evaluation")
    config_file = write_tiny_yaml(root, train={"steps": 8}, data={"sources": [str(corpus)]})
    train(load_config(str(config_file), [f"run.dir={root / 'run'}"]), print_fn=lambda _: None)
    folder = root / "tasks"
    folder.mkdir()
    questions = [" ".join(WORDS[i : i + 4]) for i in range(6)]
    choice = write_task(
        folder,
        "words_choice",
        [
            {"q": q, "choices": [WORDS[(i + 4) % 11], WORDS[(i + 7) % 11], "question"], "a": 0}
            for i, q in enumerate(questions)
        ],
        output_type="multiple_choice",
        doc_to_text="{{q}}",
        doc_to_choice="{{choices}}",
        doc_to_target="{{a}}",
        metric_list=[{"metric": "acc"}, {"metric": "acc_norm"}],
    )
    continuation = write_task(
        folder,
        "words_continue",
        [{"start": q, "rest": " " + WORDS[(i + 4) % 11]} for i, q in enumerate(questions)],
        output_type="generate_until",
        doc_to_text="{{start}}",
        doc_to_target="{{rest}}",
        target_delimiter="",
        generation_kwargs={"until": ["\n", "."], "max_gen_toks": 12, "do_sample": False},
        metric_list=[{"metric": "exact_match"}],
    )
    rolling = write_task(
        folder,
        "words_lines",
        [{"text": " ".join(WORDS * (1 + i))} for i in range(3)],  # the longest spans two windows of the model's 128
        output_type="loglikelihood_rolling",
        doc_to_text="",
        doc_to_target="{{text}}",
        metric_list=[{"metric": "word_perplexity"}, {"metric": "bits_per_byte"}],
    )
    return root / "run", [str(choice), str(continuation), str(rolling)]


def test_the_command_and_simple_evaluate_give_the_same_results(setting, tmp_path, capsys):
    run, task_files = setting
    out = tmp_path / "results.json"
    assert cli.main(["eval", str(run), "--tasks", ",".join(task_files), "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "words_choice" in table and "acc_norm" in table and "exact_match" in table and "bits_per_byte" in table
    from_command = json.loads(out.read_text())["results"]
    # lm-eval's way: the backend by its registered name, lm-eval's model_args string
    names, manager = lm_eval_tasks.resolve(task_files)
    embedded = lm_eval.simple_evaluate(model="llama-jax", model_args=f"model={run}", tasks=names, task_manager=manager)
    assert embedded["results"] == from_command
    assert set(lm_eval_tasks.scores(embedded)) >= {"words_choice/acc", "words_continue/exact_match"}


def answers(results: dict) -> list:
    return [s["resps"] for task in sorted(results["samples"]) for s in results["samples"][task]]


def test_a_sharded_model_answers_as_one_device_does(setting):
    run, task_files = setting
    names, manager = lm_eval_tasks.resolve(task_files)

    def evaluate(lm):
        return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, log_samples=True)

    one = evaluate(LlamaJaxLM(str(run), batch_size=4))
    sharded = evaluate(LlamaJaxLM(str(run), overrides="mesh.data=2 mesh.fsdp=2 mesh.tensor=2", batch_size=4))
    for mine, theirs in zip(answers(sharded), answers(one), strict=True):
        for a, b in zip(mine, theirs, strict=True):
            a, b = a[0], b[0]
            if isinstance(a, str):
                assert a == b
            elif isinstance(a, (list, tuple)):
                assert abs(a[0] - b[0]) <= LIMIT and a[1] == b[1]
            else:
                assert abs(a - b) <= LIMIT


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
    reason="lm-eval's hf backend needs torch and transformers (pip install torch==2.13.0 transformers accelerate)",
)
def test_every_request_agrees_with_lm_evals_hf_backend_on_the_exported_weights(setting):
    sys.path.insert(0, str(ROOT / "bench"))
    import eval_harness
    from lm_eval.models.huggingface import HFLM

    from llama_jax.checkpoint.convert import convert

    run, task_files = setting
    exported = run.parent / "exported"
    if not exported.exists():
        convert(str(run), str(exported), print_fn=lambda _: None)
    ours, _, _ = eval_harness.timed(LlamaJaxLM(str(run), batch_size=4), task_files, None)
    hf = HFLM(pretrained=str(exported), dtype="float32", batch_size=4, device="cpu")
    theirs, _, _ = eval_harness.timed(hf, task_files, None)
    figures = eval_harness.compare(ours, theirs)
    assert figures["requests"] == 6 * 3 + 6 + 3  # choices, generations, rolling texts
    assert figures["max_loglikelihood_diff"] <= 1e-4
    assert figures["is_greedy_identical"] and figures["generations_identical"] and figures["metrics_identical"]


def test_the_evaluation_guide_commands(setting, tmp_path, monkeypatch, capsys):
    """docs/evaluation.md's `llama-jax eval ... --tasks` commands, from the repository root (the example tasks
    name their files from there), on the tiny run in place of runs/tiny."""
    run, _ = setting
    commands = [
        line.strip()
        for line in (ROOT / "docs" / "evaluation.md").read_text().splitlines()
        if line.strip().startswith("llama-jax eval ") and "--tasks" in line
    ]
    assert commands
    monkeypatch.chdir(ROOT)
    for command in commands:
        argv = command.replace("runs/tiny", str(run)).replace("results.json", str(tmp_path / "r.json")).split()[1:]
        assert cli.main(argv) == 0, command
        assert "shakespeare_" in capsys.readouterr().out


def one_line_exit_2(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_tasks_missing_data_and_missing_models_are_one_line_exit_2_and_write_nothing(setting, tmp_path, capsys):
    run, task_files = setting
    out = tmp_path / "out" / "results.json"
    before = sorted(p.name for p in run.rglob("*"))
    err = one_line_exit_2(["eval", str(run), "--tasks", "no_such_task_here", "--output", str(out)], capsys)
    assert "unknown task 'no_such_task_here'" in err
    missing = write_task(tmp_path, "gone", [{"t": "x"}], output_type="loglikelihood_rolling", doc_to_target="{{t}}")
    (tmp_path / "gone.jsonl").unlink()
    err = one_line_exit_2(["eval", str(run), "--tasks", str(missing), "--output", str(out)], capsys)
    assert "task gone: its data is not on this machine" in err and "data_files" in err
    # a built-in task whose data is not in the datasets cache: nothing is downloaded
    err = one_line_exit_2(["eval", str(run), "--tasks", "arc_easy", "--output", str(out)], capsys)
    assert "task arc_easy: its data is not on this machine" in err
    err = one_line_exit_2(["eval", str(tmp_path / "no_run"), "--tasks", task_files[0]], capsys)
    assert "does not exist" in err
    err = one_line_exit_2(["eval", str(run), "--tasks", str(tmp_path / "nothing.yaml")], capsys)
    assert "task file" in err and "does not exist" in err
    assert not out.exists() and not out.parent.exists()
    assert sorted(p.name for p in run.rglob("*")) == before
