"""bench/gpu_check.py (`make gpu-check`) on the CPU: the one-line answer without a GPU, the make target, and the
whole table and its JSON with --cpu-smoke (the same code as on a GPU, small shapes, cuDNN rows skipped)."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402
from gpu_checks.attention import PARITY_CASES, SMOKE_SHAPE, packed_segments  # noqa: E402
from gpu_checks.body import marginal_layer, marginal_row  # noqa: E402
from gpu_checks.environment import gpu_env_applied, recommended_settings  # noqa: E402
from gpu_checks.fp8 import FP8_LOSS_TOLERANCE, loss_gap  # noqa: E402
from gpu_checks.step import PROFILED_STEPS, prediction_row  # noqa: E402

NO_GPU_LINE = re.compile(
    r"gpu-check: no NVIDIA GPU here \((jax has no CUDA plugin installed: "
    r"pip install -e '\.\[gpu\]'|jax backend: \w+)\); nothing to check"
)
TRAIN_CHECKS = [
    "model",
    "loss",
    "tokens/s",
    "predicted step",
    "MFU",
    "achieved FLOP/s",
    "HLO / model FLOPs",
    "peak device memory",
]
FP8_CHECKS = ["model", "loss", "tokens/s", "predicted step", "MFU", "peak device memory", "loss vs bf16"]
BODY_CHECKS = ["layers", "marginal-layer MFU (fp32)", "marginal-layer MFU (fp8)"]  # then the fp8 speed-up, if any
ENVIRONMENT_CHECKS = ["XLA_FLAGS", "launch/gpu_env.sh", "versions", "device", "CUDA / cuDNN"]


def one_cpu_device_env() -> dict[str, str]:
    """This environment on the CPU with one device: the check plans and times the step on one device."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One --cpu-smoke run: (its stdout, the JSON it wrote)."""
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--cpu-smoke",
            "--json",
            str(out / "figures.json"),
            f"data.cache_dir={out / 'cache'}",
            f"run.compilation_cache={out / 'jax_cache'}",
        ],
        env=one_cpu_device_env(),
        cwd=out,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads((out / "figures.json").read_text())


def table_rows(stdout: str) -> list[dict[str, str]]:
    """The table's rows as {column: cell}, cut at the header's column starts (the last column runs to the end)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("area "))
    header = lines[start]
    names = header.split()
    starts = [header.index(name) for name in names]
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("figures: ") or not line.strip():  # the profiles' tables follow a blank line
            break
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]
        rows.append(dict(zip(names, cells)))
    return rows


def test_without_a_gpu_it_prints_one_line_and_succeeds(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)],
        env=one_cpu_device_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert NO_GPU_LINE.fullmatch(line)
    assert not (tmp_path / "runs").exists()  # nothing measured, nothing written


def test_readme_make_gpu_check_sources_the_gpu_settings_and_answers_in_one_line():
    """The GPU guide's command as shown, under make with this interpreter's environment (never reinstalled)."""
    from test_readme import readme_commands

    (command,) = readme_commands("make gpu-check")  # docs/gpus.md
    venv = Path(sys.prefix)
    make = ["make", "--no-print-directory", "-o", f"{venv}/.installed", f"VENV={venv}"]
    proc = subprocess.run(
        [*make, *command.split()[1:]], cwd=ROOT, env=one_cpu_device_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # make echoes the recipe (the CUDA install only where nvidia-smi finds a GPU), then the check's one line.
    install, run, answer = proc.stdout.splitlines()
    assert install.startswith("if nvidia-smi -L") and "'.[gpu]'" in install
    assert "source launch/gpu_env.sh" in run and "bench/gpu_check.py" in run
    assert NO_GPU_LINE.fullmatch(answer)
    dry_run = subprocess.run(
        [*make, "-n", "gpu-check", "ARGS=--json out.json model.n_layers=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "bench/gpu_check.py --json out.json model.n_layers=2" in dry_run


def test_cpu_smoke_prints_one_table_of_every_check(smoke):
    stdout, _ = smoke
    summary = stdout.splitlines()[0]
    assert re.fullmatch(r"gpu-check --cpu-smoke on cpu: \d+ passed, 0 failed, \d+ skipped", summary)
    rows = table_rows(stdout)
    assert all(list(row) == ["area", "check", "status", "value", "detail"] for row in rows)
    attention = {row["check"]: row for row in rows if row["area"] == "attention"}
    assert list(attention) == [case.label for case in PARITY_CASES]
    for case in PARITY_CASES:
        row = attention[case.label]
        if case.implementation == "cudnn":  # never a pass for a path that did not run
            assert row["status"] == "skipped: needs cuDNN" and row["value"] == ""
        else:
            assert row["status"] == "pass"
            assert re.fullmatch(r"out \d\.\d{4}, grad \d\.\d{4}", row["value"])
    assert [row["check"] for row in rows if row["area"] == "train step"] == TRAIN_CHECKS
    assert [row["check"] for row in rows if row["area"] == "fp8 step"] == FP8_CHECKS
    assert [row["check"] for row in rows if row["area"] == "environment"] == ENVIRONMENT_CHECKS
    train = {row["check"]: row for row in rows if row["area"] == "train step"}
    assert train["loss"]["status"] == "pass"
    assert train["MFU"]["value"].endswith("%") and "measured" in train["MFU"]["detail"]  # no data sheet for a CPU
    assert train["peak device memory"]["status"].startswith("skipped")  # the CPU reports no device memory
    fp8 = {row["check"]: row for row in rows if row["area"] == "fp8 step"}
    assert fp8["model"]["value"] == "model.fp8=tensorwise" and fp8["loss"]["status"] == "pass"
    assert train["predicted step"]["value"] == fp8["predicted step"]["value"] == "none"  # no data sheet: no prediction
    assert re.search(r"\d\.\d\dx the fp32 step's [\d,]+; goal on one H100: >= 1\.3x", fp8["tokens/s"]["detail"])
    # MFU against the bf16 peak; a CPU has no fp8 peak, and the row says so rather than inventing one
    assert fp8["MFU"]["value"].endswith("%") and "fp8: no fp8 peak for cpu" in fp8["MFU"]["detail"]
    assert fp8["loss vs bf16"]["status"] == "pass" and fp8["loss vs bf16"]["value"].endswith("%")
    body = [row for row in rows if row["area"] == "body"]
    assert [row["check"] for row in body][:3] == BODY_CHECKS and body[0]["value"] == "2 -> 4"
    assert all(re.fullmatch(r"\d+\.\d%|n/a", row["value"]) for row in body[1:3])
    # each timed step's profile, as `llama-jax profile` prints it, after the table
    for label in ("fp32", "fp8"):
        assert re.search(rf"where the {label} step's time went \(llama-jax profile \S+\):\nprofile ", stdout)
    assert stdout.count("where a step went") == 2 and stdout.splitlines()[-1].startswith("figures: ")


def test_cpu_smoke_json_holds_the_table_and_its_figures(smoke):
    stdout, report = smoke
    assert report["mode"] == "cpu-smoke" and report["failed"] == 0
    assert [(r["area"], r["check"], r["status"]) for r in report["rows"]] == [
        (r["area"], r["check"], r["status"]) for r in table_rows(stdout)
    ]
    for entry in report["attention"]:
        if entry["status"] == "pass":
            assert 0 <= entry["output_error"] < entry["tolerance"] and 0 <= entry["gradient_error"] < entry["tolerance"]
        else:
            assert entry["implementation"] == "cudnn" and "output_error" not in entry
    step = report["train_step"]
    assert step["preset"] == "tiny" and step["fits"]
    assert len(step["step_s"]) == step["steps"] == 3
    for key in (
        "tokens_per_s",
        "achieved_flops_per_s",
        "hlo_flops_per_s",
        "peak_flops_per_device",
        "mfu",
        "model_flops",
        "hlo_flops",
        "planned_total_bytes",
        "budget_bytes",
    ):
        assert step[key] > 0, key
    assert step["achieved_flops_per_s"] == pytest.approx(step["model_flops"] / step["step_s_median"])
    assert step["mfu"] == pytest.approx(step["achieved_flops_per_s"] / step["peak_flops_per_device"])
    assert math.isfinite(step["loss"]) and step["finite"] and step["peak_bytes_in_use"] is None
    fp8 = report["fp8_step"]
    assert fp8["fp8"] == "tensorwise" and fp8["fits"] and len(fp8["step_s"]) == 3
    assert fp8["tokens_per_s_ratio"] == pytest.approx(fp8["tokens_per_s"] / step["tokens_per_s"])
    assert fp8["peak_flops_per_device"] == step["peak_flops_per_device"]  # MFU against the same peak
    assert fp8["mfu"] == pytest.approx(fp8["achieved_flops_per_s"] / fp8["peak_flops_per_device"])
    assert fp8["mfu_fp8"] is None and fp8["fp8_peak_flops_per_device"] is None and step["mfu_fp8"] is None
    # 5 steps of each from the same weights on the plays' first 5 batches: both learn, and differ by fp8's rounding
    bf16_losses, fp8_losses = fp8["loss_bf16"], fp8["loss_fp8"]
    assert len(bf16_losses) == len(fp8_losses) == fp8["loss_steps"] == 5
    assert bf16_losses[-1] < bf16_losses[0] and fp8_losses[-1] < fp8_losses[0]
    assert fp8["loss_max_relative_difference"] == pytest.approx(
        max(abs(b - f) / b for b, f in zip(bf16_losses, fp8_losses))
    )
    assert fp8["loss_tail_steps"] == 5 and fp8["loss_tail_relative_difference"] == pytest.approx(
        abs(sum(fp8_losses) - sum(bf16_losses)) / sum(bf16_losses)
    )
    assert 0 < fp8["loss_tail_relative_difference"] <= FP8_LOSS_TOLERANCE
    # the marginal layer: the 4-layer steps less the 2-layer ones, over the same peak
    for name in ("step", "fp8_step"):
        marginal = report["body"][name]
        assert marginal["fits"] and marginal["layer_model_flops"] > 0
        if marginal["layer_s"] > 0:
            assert marginal["mfu"] == pytest.approx(
                marginal["layer_model_flops"] / marginal["layer_s"] / step["peak_flops_per_device"]
            )
    # PROFILED_STEPS steps traced after the timed ones, its matmuls seen
    for figures in (step, fp8):
        assert len(figures["profile"]["steps"]) == PROFILED_STEPS
        assert figures["profile"]["classes"]["matmul fp32"]["ms"] > 0
    environment = report["environment"]
    assert environment["jax"] == jax.__version__ and environment["device_kind"] == "cpu"
    assert isinstance(environment["xla_flags"], list) and isinstance(environment["gpu_env_applied"], bool)


def test_the_fp8_loss_row_bounds_the_end_of_the_curve_not_its_steepest_step():
    """The criterion reads the last LOSS_TAIL steps' mean: an early step that falls later (fp8 a step behind where
    the loss drops fastest) is reported, and a curve that ends 3% high fails."""
    bf16 = [12.0, 8.0, *[5.0] * 18]
    behind = [12.0, 10.0, *[5.0] * 18]  # 25% off at step 2, the same from step 3 on
    assert loss_gap(bf16, behind) == (0.0, 0.25)
    tail, _ = loss_gap(bf16, [12.0, 8.0, *[5.0] * 8, *[5.15] * 10])
    assert tail == pytest.approx(0.03) and tail > FP8_LOSS_TOLERANCE


def test_gpu_env_counts_as_applied_only_with_all_its_settings(monkeypatch):
    settings = recommended_settings()
    assert settings["XLA_FLAGS"] and "XLA_PYTHON_CLIENT_MEM_FRACTION" in settings
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    assert gpu_env_applied(settings)[0]
    first, *rest = settings["XLA_FLAGS"].split()
    monkeypatch.setenv("XLA_FLAGS", " ".join(rest))
    applied, detail = gpu_env_applied(settings)
    assert not applied and detail.startswith("missing 1 of its flags")


def test_packed_segments_give_each_row_its_documents_and_the_last_row_padding():
    shape = SMOKE_SHAPE
    segments = packed_segments(6, shape)
    assert segments.shape == (shape.batch, shape.seq)
    assert sorted(set(segments[0])) == [1, 2, 3, 4, 5, 6]
    assert (segments[-1, -shape.padding :] == 0).all() and sorted(set(segments[-1])) == [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("args", [["--steps", "0"], ["--warmup", "-1"]])
def test_bad_step_counts_are_one_line_and_exit_2(args, capsys):
    assert gpu_check.main(["--cpu-smoke", *args]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_the_predicted_step_row_puts_plans_prediction_beside_the_measured_step():
    """On a GPU with a data sheet each timed step's row shows plan's predicted step and whether it is within
    PREDICTION_TOLERANCE of the measured median (the CPU smoke run above has no prediction to show)."""
    near = prediction_row("train step", {"predicted_step_s": 0.5, "step_s_median": 0.55})
    assert (near.check, near.value) == ("predicted step", "0.500 s")
    assert near.detail == "measured / predicted 1.100; goal: within 15% (met)"
    far = prediction_row("fp8 step", {"predicted_step_s": 1.5, "step_s_median": 0.5})
    assert far.detail.endswith("(not met)") and far.status == "info"


def test_the_marginal_layer_is_the_difference_of_the_two_steps_and_its_prediction_beside_it():
    """What a GPU's body rows compute: per added layer, the extra time and model FLOPs, their MFU against the
    shallower step's peak, plan's predicted extra time; a deeper step over its budget is a skipped row."""
    shallow = {"layers": 4, "step_s_median": 0.6, "model_flops": 3e14, "peak_flops_per_device": 989e12}
    deep = {"layers": 8, "step_s_median": 0.9, "model_flops": 5e14, "fits": True, "microbatches": 2}
    marginal = marginal_layer({**shallow, "predicted_step_s": 0.58}, {**deep, "predicted_step_s": 0.9, "profile": None})
    assert marginal["layer_s"] == pytest.approx(0.075) and marginal["layer_model_flops"] == pytest.approx(5e13)
    assert marginal["mfu"] == pytest.approx(5e13 / 0.075 / 989e12)
    assert marginal["predicted_layer_s"] == pytest.approx(0.08)
    row = marginal_row("bf16", marginal, deep)
    assert row.value == "67.4%" and "75.00 ms per layer" in row.detail and "predicted 80.00 ms" in row.detail
    over = {**deep, "fits": False, "planned_total_bytes": 90 * 2**30, "budget_bytes": 72 * 2**30}
    skipped = marginal_row("bf16", marginal_layer(shallow, over), over)
    assert skipped.status == "skipped: does not fit" and skipped.detail.startswith("8 layers: 90")
