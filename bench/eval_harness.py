"""lm-eval on our backend against lm-eval's own `hf` backend (transformers + PyTorch), on the same weights and
requests, side by side in this one run: requests per second, and how far apart the answers are.

    .venv/bin/python bench/eval_harness.py [--model RUN] [--tasks A,B] [--limit N] [--batch-size 16] [--json out]

MODEL is a llama-jax run or checkpoint (default: the tiny preset trained for 60 steps into a temporary
directory); it is exported with `llama-jax convert` and lm-eval's `hf` backend loads the export (float32, CPU).
Tasks default to the three of examples/tasks (multiple choice, generation, rolling perplexity), read from the
repository root. Each backend runs every task twice: the first run includes our compiles (and transformers'
start), the second is what a run that evaluates often pays; requests/s counts the requests lm-eval made.
The comparison is per request: the largest |difference| of the log-likelihoods (loglikelihood and
loglikelihood_rolling), whether every is_greedy and every generation is identical, and whether every metric is.
The last line is JSON. Needs the [eval] extra, and torch + transformers for the `hf` backend
(`pip install torch==2.13.0 transformers accelerate`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERPLEXITIES = ("word_perplexity", "byte_perplexity", "bits_per_byte")
REQUEST_METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")
EXAMPLE_TASKS = [str(ROOT / "examples" / "tasks" / f"shakespeare_{n}.yaml") for n in ("choice", "continue", "lines")]


def answers(results: dict) -> dict[tuple[str, int, int], object]:
    """{(task, doc, request): what the backend answered}, from simple_evaluate's per-sample logs."""
    found = {}
    for task, samples in results["samples"].items():
        for sample in samples:
            for index, response in enumerate(sample["resps"]):
                found[task, sample["doc_id"], index] = response[0]
    return found


def compare(ours: dict, theirs: dict) -> dict:
    """How far apart two backends' answers and metrics are."""
    mine, other = answers(ours), answers(theirs)
    assert mine.keys() == other.keys(), "the backends were asked different requests"
    largest, greedy_same, text_same = 0.0, True, True
    for key, answer in mine.items():
        if isinstance(answer, str):
            text_same &= answer == other[key]
            continue
        if isinstance(answer, (list, tuple)):  # loglikelihood: (log-likelihood, is_greedy)
            greedy_same &= bool(answer[1]) == bool(other[key][1])
            answer, reference = answer[0], other[key][0]
        else:  # loglikelihood_rolling: one float
            reference = other[key]
        largest = max(largest, abs(float(answer) - float(reference)))
    # Counts (acc, exact_match, ...) must be identical; a perplexity is a float computed from the log-likelihoods,
    # so it can differ in its last bits: its largest relative difference is reported.
    counted_same, relative = True, 0.0
    for task, metrics in ours["results"].items():
        for key, value in metrics.items():
            other_value = theirs["results"][task][key]
            if key.split(",")[0] in PERPLEXITIES and isinstance(value, float):
                relative = max(relative, abs(value - other_value) / abs(other_value))
            elif key != "alias":
                counted_same &= bool(value == other_value)
    return {
        "requests": len(mine),
        "max_loglikelihood_diff": largest,
        "is_greedy_identical": greedy_same,
        "generations_identical": text_same,
        "metrics_identical": counted_same,
        "perplexity_max_relative_diff": relative,
    }


def timed(lm, tasks: list[str], limit: int | None) -> tuple[dict, float, float]:
    """(results of the second run, the backend's seconds in the first run, in the second). A backend's seconds
    are those spent in its request methods: what lm-eval does around them (building the tasks and their
    prompts, the metrics) is the same for both backends and is left out."""
    from llama_jax.evaluation import tasks as lm_eval_tasks

    names, manager = lm_eval_tasks.prepare(tasks)
    spent = [0.0]

    def clocked(method):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return call

    for name in REQUEST_METHODS:
        setattr(lm, name, clocked(getattr(lm, name)))
    seconds = []
    for _ in range(2):
        spent[0] = 0.0
        results = lm_eval_tasks.run(lm, names, manager, limit, log_samples=True)
        seconds.append(spent[0])
    return results, seconds[0], seconds[1]


def trained_tiny(directory: Path) -> str:
    run = directory / "run"
    command = [sys.executable, "-m", "llama_jax", "train", "tiny", "train.steps=60", f"run.dir={run}"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return str(run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a llama-jax run or checkpoint (default: tiny, trained here)")
    parser.add_argument("--tasks", default=",".join(EXAMPLE_TASKS))
    parser.add_argument("--limit", type=int)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--json", help="also write the figures to this file")
    ns = parser.parse_args()

    from lm_eval.models.huggingface import HFLM

    from llama_jax.checkpoint.convert import convert
    from llama_jax.evaluation.harness import LlamaJaxLM

    tasks = [t for t in ns.tasks.split(",") if t]
    with tempfile.TemporaryDirectory() as scratch:
        model = ns.model or trained_tiny(Path(scratch))
        exported = Path(scratch) / "hf"
        convert(model, str(exported), print_fn=lambda _: None)
        ours, ours_first, ours_warm = timed(LlamaJaxLM(model, batch_size=ns.batch_size), tasks, ns.limit)
        hf_lm = HFLM(pretrained=str(exported), dtype="float32", batch_size=ns.batch_size, device="cpu")
        theirs, hf_first, hf_warm = timed(hf_lm, tasks, ns.limit)
    figures = compare(ours, theirs)
    n = figures["requests"]
    figures.update(
        ours_requests_per_s=n / ours_warm,
        hf_requests_per_s=n / hf_warm,
        speedup=hf_warm / ours_warm,
        ours_first_run_s=ours_first,
        hf_first_run_s=hf_first,
        batch_size=ns.batch_size,
        tasks=[Path(t).stem for t in tasks],
    )
    print(f"{n} requests ({', '.join(figures['tasks'])}), batch {ns.batch_size}, on this CPU:")
    print(
        f"  llama-jax backend   {figures['ours_requests_per_s']:9.1f} requests/s "
        f"(first run {ours_first:.2f} s, compiles included)"
    )
    print(f"  lm-eval hf backend  {figures['hf_requests_per_s']:9.1f} requests/s (first run {hf_first:.2f} s)")
    print(
        f"  speed-up {figures['speedup']:.2f}x; largest log-likelihood difference "
        f"{figures['max_loglikelihood_diff']:.2e}"
    )
    print(
        f"  is_greedy identical: {figures['is_greedy_identical']}, generations identical: "
        f"{figures['generations_identical']}, metrics identical: {figures['metrics_identical']}"
    )
    if ns.json:
        Path(ns.json).write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
