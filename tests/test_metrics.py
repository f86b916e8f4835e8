"""Tests for llama_jax.training.metrics and llama_jax.training.report (CPU, fast, no timing assertions)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from llama_jax.config import Config, RunConfig
from llama_jax.errors import ConfigError
from llama_jax.perf import hardware
from llama_jax.perf.hardware import MfuPeaks, device_peak_flops, mfu_peaks, table_fp8_peak_flops, table_peak_flops
from llama_jax.training.metrics import (
    MetricsLog,
    ThroughputMeter,
    WandbSettings,
    check_wandb,
    read_metrics,
    wandb_run_id,
)
from llama_jax.training.report import write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _log_steps(run_dir: pathlib.Path, steps: range, lines: list[str], **kwargs) -> None:
    with MetricsLog(
        run_dir, total_steps=600, start_step=steps.start, interactive=False, print_fn=lines.append, **kwargs
    ) as log:
        for step in steps:
            # numpy scalars, as a train loop would produce them, must come out as plain JSON.
            log.log(
                {
                    "step": np.int32(step),
                    "loss": np.float32(4.0 - 0.01 * step),
                    "tokens_per_s": 12345.6,
                    "mfu": np.float64(0.412),
                    "lr": 3e-4,
                    "step_time_s": 0.5,
                }
            )


def test_jsonl_lines_are_valid_and_appended_across_runs(tmp_path):
    lines: list[str] = []
    _log_steps(tmp_path, range(0, 3), lines, tensorboard=False)
    _log_steps(tmp_path, range(3, 5), lines, tensorboard=False)  # a resumed run
    raw = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(raw) == 5
    records = [json.loads(line) for line in raw]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert all(type(r["step"]) is int and type(r["loss"]) is float for r in records)
    assert records == read_metrics(tmp_path / "metrics.jsonl")


def test_plain_output_shows_step_loss_throughput_mfu(tmp_path):
    lines: list[str] = []
    _log_steps(tmp_path, range(118, 121), lines, tensorboard=False)
    last = lines[-1]
    assert "step 120/600" in last and "loss 2.8" in last
    assert "12,346 tok/s" in last and "MFU 41.2%" in last
    assert "ETA 4m00s" in last  # 480 steps left x the measured 0.5 s per step


def test_eval_only_record_is_logged_and_shown(tmp_path):
    lines: list[str] = []
    with MetricsLog(tmp_path, total_steps=10, interactive=False, print_fn=lines.append, tensorboard=False) as log:
        log.log({"step": 5, "eval_loss": 4.25})
        log.log({"step": 6, "loss": float("nan")})  # a NaN loss must still be strict JSON
        log.message("hello")
    assert "eval_loss 4.2500" in lines[0] and lines[-1] == "hello"
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 5, "eval_loss": 4.25}, {"step": 6, "loss": None}]


def test_interactive_bar_does_not_crash(tmp_path, capsys):
    with MetricsLog(tmp_path, total_steps=10, start_step=2, interactive=True, tensorboard=False) as log:
        log.log({"step": 3, "loss": 3.0, "tokens_per_s": 100.0, "mfu": 0.5})
        log.log({"step": 4, "eval_loss": 3.5})
        log.message("checkpoint saved")
    out = capsys.readouterr().out
    assert "checkpoint saved" in out and "MFU 50.0%" in out and "eval_loss 3.5000" in out


def test_tensorboard_event_file_appears(tmp_path):
    _log_steps(tmp_path, range(0, 2), [], tensorboard=True)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_read_metrics_skips_truncated_last_line_and_log_repairs_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.9}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    # A run resumed after the kill appends on a fresh line instead of gluing onto the fragment.
    with MetricsLog(tmp_path, total_steps=5, interactive=False, print_fn=lambda s: None, tensorboard=False) as log:
        log.log({"step": 3, "loss": 2.8})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match="corrupt"):
        read_metrics(path)


# W&B in offline mode: no network, no account, files only under the test's directories.
WANDB_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_CONSOLE": "off",
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
    "WANDB__DISABLE_STATS": "true",
    "WANDB__DISABLE_META": "true",
    "WANDB__SAVE_REQUIREMENTS": "false",
}


def _wandb_records(offline_run: pathlib.Path) -> list[dict]:
    """The records of an offline run's .wandb file, read by wandb's own reader (`wandb leet inspect`)."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(offline_run)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory):
    """A run directory logged to W&B by a MetricsLog and then by a second one, as a restarted run
    (resumed from step 1's checkpoint) logs it: one W&B service for the module's tests.
    Returns (run_dir, config, [the records of each offline run, in order])."""
    wandb = pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("wandb")
    run_dir = root / "run"
    config = Config(run=RunConfig(dir=str(run_dir), wandb=True, wandb_project="llama-jax-test"))
    with pytest.MonkeyPatch.context() as env:
        for key, value in WANDB_ENV.items():
            env.setenv(key, value)
        for key in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            env.setenv(key, str(root / key.lower()))  # WANDB_DIR: dir=run_dir must win over it
        _log_steps(run_dir, range(0, 3), [], tensorboard=False, wandb=WandbSettings.from_config(config))
        with MetricsLog(
            run_dir,
            total_steps=600,
            start_step=1,
            interactive=False,
            print_fn=lambda s: None,
            tensorboard=False,
            wandb=WandbSettings.from_config(config),
        ) as log:
            log.log({"step": 2, "loss": 3.5, "grad_norm": np.float32(0.25), "finite": True})
            log.log({"step": 2, "eval_loss": 3.75})
            log.log({"step": 3, "eval_loss": None})  # nothing to plot: no W&B row
        offline = sorted((run_dir / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)
        runs = [_wandb_records(path) for path in offline]
    wandb.teardown()  # stop the W&B service this process started
    return run_dir, config, runs


def _of_type(records: list[dict], kind: str) -> list[dict]:
    return [r[kind] for r in records if r["type"] == kind]


def _history(records: list[dict]) -> list[dict]:
    """Logged rows without W&B's own fields (_step, _runtime, _timestamp)."""
    return [{k: v for k, v in h["item"].items() if not k.startswith("_")} for h in _of_type(records, "history")]


def test_wandb_logs_the_scalars_tensorboard_gets_with_the_config(wandb_run):
    run_dir, config, runs = wandb_run
    assert len(runs) == 2  # the run and its restart, each an offline run under run.dir/wandb
    history = _history(runs[0])
    assert [h["step"] for h in history] == [0, 1, 2]
    for h in history:
        assert h == pytest.approx(
            {
                "step": h["step"],
                "loss": 4.0 - 0.01 * h["step"],
                "tokens_per_s": 12345.6,
                "mfu": 0.412,
                "lr": 3e-4,
                "step_time_s": 0.5,
            }
        )
    (started,) = _of_type(runs[0], "run")
    assert started["project"] == "llama-jax-test" and started["display_name"] == "run"  # wandb_name "": run.dir's name
    assert started["config"]["update"]["model"]["n_layers"] == config.model.n_layers
    assert started["config"]["update"]["run"]["wandb"] is True
    step_axis = [m for m in _of_type(runs[0], "metric") if m.get("glob_name") == "*"]
    assert step_axis and step_axis[0]["step_metric"] == "step"  # charts plot against our step
    assert [e["exit_code"] for e in _of_type(runs[0], "exit")] == [0]


def test_a_restarted_run_continues_the_same_wandb_run(wandb_run):
    run_dir, _, runs = wandb_run
    run_id = (run_dir / "wandb" / "run_id").read_text().strip()
    assert [_of_type(records, "run")[0]["run_id"] for records in runs] == [run_id, run_id]
    assert _of_type(runs[1], "run")[0]["resume"] is True
    # Step 2 again (resumed from step 1), then its evaluation: kept, not dropped as an "old" step.
    assert _history(runs[1]) == [{"step": 2, "loss": 3.5, "grad_norm": 0.25}, {"step": 2, "eval_loss": 3.75}]


def test_wandb_run_id_is_kept_per_run_dir(tmp_path):
    first = wandb_run_id(tmp_path / "a")
    assert wandb_run_id(tmp_path / "a") == first == (tmp_path / "a" / "wandb" / "run_id").read_text().strip()
    assert wandb_run_id(tmp_path / "b") != first


def test_check_wandb_is_one_line_config_error_when_wandb_is_missing(tmp_path, monkeypatch):
    check_wandb(RunConfig(wandb=False))  # off: wandb is never imported
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees when it is not installed
    check_wandb(RunConfig(wandb=False))
    with pytest.raises(ConfigError, match=r"pip install 'llama-jax\[wandb\]'") as err:
        check_wandb(RunConfig(dir=str(tmp_path / "run"), wandb=True))
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


def test_wandb_settings_only_when_enabled_and_disabled_log_starts_no_wandb_run(tmp_path):
    assert WandbSettings.from_config(Config()) is None
    settings = WandbSettings.from_config(Config(run=RunConfig(wandb=True, wandb_name="n", wandb_entity="e")))
    assert (settings.project, settings.name, settings.entity) == ("llama-jax", "n", "e")
    assert settings.config["run"]["wandb_name"] == "n"
    with MetricsLog(tmp_path / "run", total_steps=5, interactive=False, enabled=False, wandb=settings) as log:
        log.log({"step": 1, "loss": 3.0})  # process 1 of a multi-process run: nothing written, no W&B run
    assert not (tmp_path / "run").exists()


def _records(with_eval: bool) -> list[dict]:
    out = [{"step": s, "loss": 5.0 / (s + 1), "tokens_per_s": 1000.0 + s, "mfu": 0.3} for s in range(1, 21)]
    if with_eval:
        out += [{"step": s, "eval_loss": 5.5 / (s + 1)} for s in (10, 20)]
    return out


@pytest.mark.parametrize(
    "records", [_records(True), _records(False), [{"step": 1, "loss": 4.0}], [{"step": 3, "eval_loss": None}]]
)
def test_write_report_writes_png(tmp_path, records):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = write_report(tmp_path)
    assert out == tmp_path / "report.png"
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert not list(tmp_path.glob(".report.*"))  # no temp file left behind


def test_write_report_raises_without_records(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="no complete records"):
        write_report(tmp_path)


def test_a_measured_peak_is_the_best_seen_so_a_busy_moment_cannot_lower_it(tmp_path, monkeypatch):
    """CPU peaks are measured on every call and combined with the cache as the maximum: a measurement taken
    while the machine was busy neither lowers the denominator of MFU later nor now."""
    measurements, calls = iter([1.5e11, 0.5e11, 2e11, 1e11]), []

    def fake_measure(dtype: str = "float32", size: int = 1024, repeats: int = 5) -> float:
        calls.append((dtype, size))
        return next(measurements)

    monkeypatch.setattr(hardware, "measure_matmul_peak", fake_measure)
    peak, source = device_peak_flops("float32", tmp_path)
    # The 8 simulated CPU devices share the measured machine: each is credited with 1/8 of it.
    assert jax.local_device_count() == 8 and "split over 8 simulated devices" in source
    assert peak == 1.5e11 / 8 and "measured fp32 1024^3 matmul" in source and "best seen" in source
    assert device_peak_flops("float32", tmp_path)[0] == 1.5e11 / 8  # a busy moment (0.5e11) changes nothing
    assert device_peak_flops("float32", tmp_path)[0] == 2e11 / 8  # an idle one raises it
    assert list(json.loads((tmp_path / "peak_flops.json").read_text()).values()) == [2e11]
    device_peak_flops("bfloat16", tmp_path)  # another dtype is another cache entry
    assert calls == [("float32", 1024)] * 3 + [("bfloat16", 1024)]
    assert sorted(json.loads((tmp_path / "peak_flops.json").read_text()).values()) == [1e11, 2e11]


def test_an_unknown_gpu_is_measured_with_a_large_matmul(tmp_path, monkeypatch):
    """A GPU missing from the data-sheet table gets an 8192^3 matmul, labelled measured: a small one is
    bound by kernel launches and would inflate MFU."""

    class FutureGpu:
        platform, device_kind = "gpu", "NVIDIA Z999"

    sizes = []
    monkeypatch.setattr(hardware.jax, "local_devices", lambda: [FutureGpu()])
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda dtype, size, repeats: sizes.append(size) or 7e14)
    peak, source = device_peak_flops("bfloat16", tmp_path)
    assert (peak, sizes) == (7e14, [8192]) and source.startswith("measured bf16 8192^3 matmul on NVIDIA Z999")
    monkeypatch.setattr(
        hardware.jax,
        "local_devices",
        lambda: [type("H100", (), {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"})()],
    )
    assert device_peak_flops("bfloat16", tmp_path) == (989e12, "H100 table, bfloat16 dense") and sizes == [8192]


def test_corrupt_cache_is_ignored_and_rewritten(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda dtype="float32", **kw: 2e11)
    (tmp_path / "peak_flops.json").write_text('{"cpu|cpu|2|0.1')
    assert device_peak_flops("float32", tmp_path)[0] == 2e11 / jax.local_device_count()
    assert list(json.loads((tmp_path / "peak_flops.json").read_text()).values()) == [2e11]


def test_real_measurement_is_positive():
    assert hardware.measure_matmul_peak("float32", size=128, repeats=2) > 0


def test_table_lookup():
    assert table_peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(989e12)
    assert table_peak_flops("NVIDIA H100 80GB HBM3", "float32") == pytest.approx(67e12)
    assert table_peak_flops("NVIDIA A100-SXM4-80GB", "float32") == pytest.approx(19.5e12)
    assert table_peak_flops("NVIDIA H100 PCIe", "bfloat16") == pytest.approx(756e12)
    assert table_peak_flops("NVIDIA L40S", "bfloat16") == pytest.approx(362e12)  # not "L4"
    assert table_peak_flops("TPU v5 lite", "bfloat16") == pytest.approx(197e12)  # not "TPU v5"
    assert table_peak_flops("NVIDIA A10G", "bfloat16") is None  # not "A10": measured instead
    assert table_peak_flops("cpu", "float32") is None
    with pytest.raises(ValueError):
        table_peak_flops("cpu", "int8")


def test_fp8_peaks_are_the_data_sheets_dense_figures_and_none_without_fp8_tensor_cores():
    assert table_fp8_peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(1979e12)
    assert table_fp8_peak_flops("NVIDIA H200") == pytest.approx(1979e12)
    assert table_fp8_peak_flops("NVIDIA H100 PCIe") == pytest.approx(1513e12)
    assert table_fp8_peak_flops("NVIDIA H100 NVL") == pytest.approx(1671e12)
    assert table_fp8_peak_flops("NVIDIA L40S") == pytest.approx(733e12)  # not "L4"
    assert table_fp8_peak_flops("NVIDIA L4") == pytest.approx(242.5e12)
    assert table_fp8_peak_flops("NVIDIA A100-SXM4-80GB") is None  # Ampere has no fp8 tensor cores
    assert table_fp8_peak_flops("cpu") is None and table_fp8_peak_flops("TPU v5 lite") is None


def test_mfu_is_against_the_compute_peak_and_under_fp8_also_the_fp8_peak(tmp_path):
    assert MfuPeaks(1e15, "x").fractions(4e14, 2) == pytest.approx({"mfu": 0.2, "mfu_fp8": None})
    with pytest.raises(ValueError):
        MfuPeaks(0.0, "x").fractions(1.0, 1)
    h100 = MfuPeaks.with_fp8(989e12, "H100 table", "tensorwise", "NVIDIA H100 80GB HBM3")
    assert h100.fractions(989e12, 1) == pytest.approx({"mfu": 1.0, "mfu_fp8": 989 / 1979})
    assert h100.describe() == "peak 989 TFLOP/s per device (H100 table), fp8 1979 TFLOP/s (H100 table, fp8 dense)"
    assert MfuPeaks.with_fp8(989e12, "H100 table", "none", "NVIDIA H100 80GB HBM3").fp8 is None
    # A CPU has no fp8 peak: MFU against it is not reported, and the description says why.
    cpu = mfu_peaks("float32", "tensorwise", tmp_path)
    assert cpu.fp8 is None and cpu.fractions(1e9, 1)["mfu_fp8"] is None
    assert cpu.describe().endswith(
        f"no fp8 peak for {jax.local_devices()[0].device_kind}: MFU against fp8 not reported"
    )


def test_throughput_meter_reports_its_window_and_the_run_medians():
    meter = ThroughputMeter(tokens_per_step=1000, flops_per_token=6e6, peaks=MfuPeaks(1e12, "x"), n_devices=2)
    assert meter.record() == {"tokens_per_s": None, "mfu": None}  # nothing timed yet (the compiling step)
    assert meter.median_step_s is None
    meter.add(0.5, data_wait=0.1)
    meter.add(1.5, data_wait=0.3)
    first = meter.record()  # 2 steps in 2 s
    assert first == pytest.approx(
        {"tokens_per_s": 1000.0, "step_time_s": 1.0, "mfu": 1000 * 6e6 / 2e12, "data_wait_s": 0.2}
    )
    meter.add(0.25, data_wait=0.0)  # a new window: the first one's steps are gone
    assert meter.record()["tokens_per_s"] == 4000.0
    meter.add(0.5, data_wait=0.0)
    assert meter.record()["tokens_per_s"] == 2000.0
    assert meter.median_tokens_per_s == 2000.0 and meter.median_step_s == 0.5
    fp8 = ThroughputMeter(tokens_per_step=1000, flops_per_token=6e6, peaks=MfuPeaks(1e12, "x", 2e12, "y"), n_devices=2)
    fp8.add(1.0, data_wait=0.0)
    assert fp8.record()["mfu_fp8"] == pytest.approx(1000 * 6e6 / 4e12)
