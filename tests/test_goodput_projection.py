"""`llama-jax goodput` (planning/goodput_projection.py): the projection's formulas on hand-made inputs, and the
command on presets and on a run's goodput.json. No step is compiled."""

import dataclasses
import importlib.util
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme import ROOT, llama_jax_args, readme_commands

from llama_jax import cli
from llama_jax.planning.goodput_model import (
    LLAMA3_HOST_LOSS_SHARE,
    best_intervals,
    best_spares,
    mean_age_steps,
    project,
    sensitivity,
)
from llama_jax.planning.goodput_projection import LLAMA3_FAILURES_PER_GPU_HOUR, Inputs, measured


def inputs(**changes) -> Inputs:
    """A durable-only run of 10,000 one-second steps on 64 GPUs, one-second saves, no failures."""
    base = Inputs(
        gpus=64,
        gpus_per_host=8,
        steps=10_000,
        step_s=1.0,
        durable_every=100,
        local_every=0,
        local_replicas=1,
        save_durable_s=1.0,
        save_local_s=0.1,
        write_durable_s=0.0,
        write_local_s=0.0,
        restore_durable_s=30.0,
        restore_local_s=3.0,
        restart_s=60.0,
        first_start_s=0.0,
        detect_s=20.0,
        hang_detect_s=300.0,
        replacement_s=600.0,
        steady_overhead=0.0,
        failures_per_gpu_hour=0.0,
        planned_per_gpu_hour=0.0,
    )
    return dataclasses.replace(base, **changes)


def test_without_failures_goodput_is_one_less_the_checkpoint_overhead():
    x = inputs()
    p = project(x)
    productive = 10_000.0
    saves = productive / 100 * 1.0 + 1.0  # one blocked second per 100 steps, and the final save
    assert p.goodput == pytest.approx(productive / (productive + saves), rel=1e-12)
    assert sum(p.breakdown.values()) == pytest.approx(1.0, abs=1e-12)
    assert p.breakdown["lost"] == p.breakdown["restart"] == 0.0


def test_goodput_falls_as_the_failure_rate_rises_and_the_breakdown_sums_to_one():
    goodputs = []
    for rate in (0.0, 1e-5, 1e-4, 1e-3, 3e-3):
        p = project(inputs(failures_per_gpu_hour=rate))
        assert sum(p.breakdown.values()) == pytest.approx(1.0, abs=1e-9)
        goodputs.append(p.goodput)
    assert goodputs == sorted(goodputs, reverse=True) and len(set(goodputs)) == len(goodputs)
    assert project(inputs(failures_per_gpu_hour=1.0)).goodput == 0.0  # failures faster than recovery


def test_the_best_durable_interval_is_young_dalys():
    """sqrt(2 x save cost x MTBF): with a 10 s save and a 20,000 s MTBF, 632 steps of 1 s."""
    rate = 3600 / 20_000 / 64  # per GPU-hour
    x = inputs(failures_per_gpu_hour=rate, save_durable_s=10.0, steps=2_000_000)
    assert x.mtbf_s == pytest.approx(20_000)
    best = best_intervals(x, local=False)
    young_daly = math.sqrt(2 * 10.0 * 20_000)
    assert abs(best.durable_every - young_daly) <= 0.25 * young_daly, best.durable_every
    assert best.goodput >= project(x, durable_every=round(young_daly)).goodput - 1e-4


def test_a_lost_host_restores_from_its_partners_copy_only_when_one_exists():
    x = inputs(failures_per_gpu_hour=1e-4, local_every=10, mix={"host_lost": 1.0})
    with_partner = project(x).per_failure_s["host_lost"]
    # The local tier, unless the partner host is lost too before the restore (detect + replacement + restart).
    survives = math.exp(-1e-4 * 8 / 3600 * (20 + 600 + 60))
    assert with_partner["restore"] == pytest.approx(survives * 3.0 + (1 - survives) * 30.0, rel=1e-12)
    assert with_partner["lost"] == pytest.approx(survives * 5.0 + (1 - survives) * 50.0, rel=1e-12)  # half an interval
    for alone in (dataclasses.replace(x, local_replicas=0), dataclasses.replace(x, gpus=8)):  # no copy; one host
        lost_host = project(alone).per_failure_s["host_lost"]
        assert lost_host["restore"] == 30.0 and lost_host["lost"] == 50.0  # durable: half of 100 steps
    crash = project(dataclasses.replace(x, local_replicas=0, mix={"crash": 1.0})).per_failure_s["crash"]
    assert crash["restore"] == 3.0 and crash["replacement"] == 0.0  # the host stayed: its own local copy
    assert project(x).goodput > project(dataclasses.replace(x, local_replicas=0)).goodput


def test_a_lost_host_waits_for_the_scheduler_only_when_every_hot_spare_is_taken():
    """Erlang's loss system: with an offered load of 2 (two hosts lost per repair time) and 2 spares, a loss finds
    none free with Erlang B's (2^2 / 2!) / (1 + 2 + 2^2 / 2!) = 0.4."""
    x = inputs(failures_per_gpu_hour=1e-4, mix={"host_lost": 1.0}, local_every=10)
    per_gpu_rate = 1e-4 / 3600
    repair_s = 2 / (per_gpu_rate * x.gpus)
    spared = dataclasses.replace(x, spare_hosts=2, repair_s=repair_s)
    assert x.no_spare_chance == 1.0 and project(x).per_failure_s["host_lost"]["replacement"] == 600.0
    assert spared.no_spare_chance == pytest.approx(0.4, rel=1e-12)
    assert project(spared).per_failure_s["host_lost"]["replacement"] == pytest.approx(600 * 0.4, rel=1e-12)
    assert dataclasses.replace(spared, spare_hosts=1000).no_spare_chance < 1e-300  # no factorial overflows
    more = [dataclasses.replace(spared, spare_hosts=n).no_spare_chance for n in (2, 4, 8)]
    assert more == sorted(more, reverse=True) and more[-1] < 0.002
    assert project(dataclasses.replace(spared, spare_hosts=8)).goodput > project(spared).goodput > project(x).goodput
    crash = project(dataclasses.replace(spared, mix={"crash": 1.0})).per_failure_s["crash"]
    assert crash["replacement"] == 0.0  # a crash keeps its host


def test_a_lost_first_host_is_detected_as_slurm_sees_it_once_in_hosts(capsys):
    """Under slurm.sbatch the first host runs the batch script and the supervisor: losing it (1 / hosts of the hosts
    lost) is detected when Slurm marks it DOWN and the successor job starts, not by the heartbeat. Other kinds keep
    their detection; a run started by hand has no batch script."""
    x = inputs(gpus=16, failures_per_gpu_hour=1e-4, first_host_detect_s=320.0)  # 2 hosts of 8
    per_failure = project(x).per_failure_s
    assert per_failure["host_lost"]["detect"] == pytest.approx((20.0 + 320.0) / 2, rel=1e-12)
    assert per_failure["crash"]["detect"] == per_failure["slow_device"]["detect"] == 20.0
    assert project(dataclasses.replace(x, first_host_detect_s=0.0)).per_failure_s["host_lost"]["detect"] == 20.0
    assert project(x).goodput < project(dataclasses.replace(x, first_host_detect_s=0.0)).goodput
    args = ["goodput", "llama3_8b", "--gpus", "16", "--json"]
    assert cli.main(args) == 0
    launched = json.loads(capsys.readouterr().out)["inputs"]["first_host_detect_s"]
    assert launched["value"] == pytest.approx(300.0 + 12.1 + 30.0)  # + run.lease_s: the holder was on that host
    assert "bench/slurm_restart.py --first-node" in launched["source"]
    assert cli.main([*args, "--without-launcher"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["first_host_detect_s"]["value"] == 0.0
    assert cli.main(args[:-1] + ["--without-launcher"]) == 0  # as text: the header names the preset
    text = capsys.readouterr().out
    assert text.startswith("goodput projection: llama3_8b on 16 GPUs") and "first_host_detect_s    0 " in text


def test_auto_spares_are_the_count_that_trains_the_most_per_gpu_allocated():
    """Each spare is a host held idle (1/hosts of the allocation) against the wait it saves: the auto count is the
    best of every count up to far past it, and none where a lost host costs no wait."""
    x = inputs(gpus=4096, failures_per_gpu_hour=LLAMA3_FAILURES_PER_GPU_HOUR, local_every=10, repair_s=24 * 3600.0)

    def per_gpu_allocated(spares: int) -> float:
        return project(dataclasses.replace(x, spare_hosts=spares)).goodput * x.hosts / (x.hosts + spares)

    best = best_spares(x)
    assert best > 0 and per_gpu_allocated(best) == max(per_gpu_allocated(s) for s in range(60))
    assert best_spares(dataclasses.replace(x, replacement_s=0.0)) == 0


def test_the_plain_command_projects_the_launched_run_with_its_spares(capsys):
    """`llama-jax goodput llama3_405b --gpus 16384` projects the run as slurm.sbatch starts it: launch/defaults.sh's
    keys (the local tier every auto steps, pre-flight) and the spares that train the most per GPU allocated; it
    reaches the >= 95% goal with every input's source. The user's keys come after the launcher's and win;
    --without-launcher drops both the keys and the spares."""
    args = ["goodput", "llama3_405b", "--gpus", "16384", "--json"]
    assert cli.main(args) == 0
    launched = json.loads(capsys.readouterr().out)
    assert launched["goodput"] >= 0.95 and all(entry["source"] for entry in launched["inputs"].values())
    spares = launched["inputs"]["spare_hosts"]
    assert spares["value"] > 0 and spares["source"].startswith("auto: the most training per GPU allocated")
    assert launched["inputs"]["local_every"]["source"].startswith("auto:") and "preflight" in launched["restart_parts"]
    assert launched["per_gpu_allocated"] == pytest.approx(launched["goodput"] * 2048 / (2048 + spares["value"]))
    for other in (spares["value"] - 1, spares["value"] + 1):
        assert cli.main([*args, "--spares", str(other)]) == 0
        assert json.loads(capsys.readouterr().out)["per_gpu_allocated"] < launched["per_gpu_allocated"]
    assert cli.main([*args, "--without-launcher"]) == 0
    bare = json.loads(capsys.readouterr().out)
    assert bare["inputs"]["spare_hosts"] == {"value": 0, "source": "none: a run started by hand (--without-launcher)"}
    assert bare["inputs"]["local_every"]["value"] == 0
    assert "preflight" not in bare["restart_parts"] and bare["goodput"] < 0.9
    assert cli.main([*args[:2], "checkpoint.local_dir=", "checkpoint.local_every_steps=0", *args[2:]]) == 0
    durable = json.loads(capsys.readouterr().out)
    assert durable["inputs"]["local_every"]["value"] == 0 and "preflight" in durable["restart_parts"]


def test_a_restart_is_the_sum_of_its_parts_and_only_the_distributed_init_grows_with_the_hosts(capsys):
    """Where no run measured it, restart_s adds up the parts a run's goodput.json keeps (each with its source):
    on 16 times the hosts only distributed_init and the step (its share of the batch) change; pre-flight counts
    where the config turns it on."""
    assert cli.main(["goodput", "llama3_405b", "--gpus", "1024", "--without-launcher", "--json"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert cli.main(["goodput", "llama3_405b", "fault.preflight=true", "--gpus", "16384", "--json"]) == 0
    large = json.loads(capsys.readouterr().out)
    for out in (small, large):
        parts = out["restart_parts"]
        assert out["inputs"]["restart_s"]["value"] == pytest.approx(sum(p["value"] for p in parts.values()))
        assert out["inputs"]["restart_s"]["source"] == "the sum of its parts (below)"
        assert all(p["source"] for p in parts.values())
        assert parts["first_step"]["value"] == out["inputs"]["step_s"]["value"]
    assert "preflight" not in small["restart_parts"] and large["restart_parts"]["preflight"]["value"] > 0
    grown = {
        k for k in small["restart_parts"] if large["restart_parts"][k]["value"] != small["restart_parts"][k]["value"]
    }
    assert grown == {"distributed_init", "first_step"}
    assert large["restart_parts"]["distributed_init"]["value"] > small["restart_parts"]["distributed_init"]["value"]
    assert cli.main(["goodput", "llama3_405b", "--gpus", "1024", "--restart-s", "99", "--json"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert given["inputs"]["restart_s"] == {"value": 99.0, "source": "given"} and given["restart_parts"] == {}


def test_mean_age_of_the_newest_checkpoint_over_both_tiers():
    assert mean_age_steps(10, 0) == 5.0 and mean_age_steps(0, 10) == 5.0
    assert mean_age_steps(10, 20) == 5.0  # durable saves on local steps: the local sequence
    assert mean_age_steps(4, 6) == pytest.approx((16 + 4 + 4 + 16) / 24)  # 0 4 6 8 12
    assert mean_age_steps(0, 0) == math.inf


def test_sensitivity_names_the_failure_rate_at_llama3_scale():
    x = inputs(gpus=16_384, failures_per_gpu_hour=LLAMA3_FAILURES_PER_GPU_HOUR)
    swings = sensitivity(x)
    lo, hi = swings["failures_per_gpu_hour"]
    assert lo > project(x).goodput > hi
    assert swings["restore_local_s"][0] == swings["restore_local_s"][1]  # no local tier: no effect


def test_goodput_command_json_at_llama3_scale(capsys):
    assert (
        cli.main(
            [
                "goodput",
                "llama3_405b",
                "checkpoint.local_dir=/dev/shm/llama-jax",
                "checkpoint.local_every_steps=auto",
                "--gpus",
                "16384",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["goodput"] < 1 and sum(out["breakdown"].values()) == pytest.approx(1.0, abs=1e-9)
    assert out["intervals"]["configured"]["local_every"] > 0 and out["intervals"]["best"]["goodput"] >= out["goodput"]
    assert out["durable_only"]["goodput"] < out["goodput"]  # the local tier and its partner copies pay
    assert out["failures"]["mtbf_h"] == pytest.approx(3600 / (16_384 * (419 + 47) / (16_384 * 54 * 24)) / 3600)
    assert out["inputs"]["failures_per_gpu_hour"]["source"].startswith("Llama 3: 419")
    assert out["inputs"]["durable_every"]["source"].startswith("auto")
    assert all(entry["source"] for entry in out["inputs"].values())
    assert out["most_sensitive"] in out["sensitivity"]
    shares = out["failures"]["shares"]
    assert (shares["host_lost"] + shares["slow_device"]) / (1 - shares["preemption"]) == pytest.approx(
        LLAMA3_HOST_LOSS_SHARE
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (["--gpus", "0"], "--gpus 0 must be positive"),
        (["--gpus", "12"], "whole number of hosts"),
        (["--gpus", "16", "--host-loss-share", "1.5"], "--host-loss-share in [0, 1]"),
        (["--gpus", "16", "--spares", "-1"], "--spares must be >= 0"),
        (["--gpus", "16", "--repair-hours", "0"], "--repair-hours > 0"),
        (["--gpus", "16", "--from", "/nonexistent/run"], "--from /nonexistent/run does not exist"),
    ],
)
def test_goodput_command_refuses_bad_input_in_one_line(args, says, capsys):
    assert cli.main(["goodput", "tiny", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_goodput_from_a_run_without_goodput_json_exits_2(tmp_path, capsys):
    assert cli.main(["goodput", "tiny", "--gpus", "8", "--from", str(tmp_path)]) == 2
    assert "no goodput.json" in capsys.readouterr().err


def test_costs_measured_from_a_runs_goodput_json(tmp_path, capsys):
    """Two attempts: the first killed at 100 s (last sign of life), the second started 8 s later, 12 s of start-up
    before its first step (its restart bucket holds the 8 s gap too) and 3 s compile."""
    buckets = dict.fromkeys(
        (
            "productive",
            "compile",
            "checkpoint_save",
            "checkpoint_restore",
            "data_wait",
            "eval",
            "lost",
            "straggler",
            "restart",
            "other",
        ),
        0.0,
    )
    first = {
        "started_at": 0.0,
        "last_alive": 100.0,
        "outcome": "died",
        "highest_step": 80,
        "timed_steps": 80,
        "step_seconds": 80.0,
        "buckets": {**buckets, "productive": 80.0, "compile": 10.0, "restart": 5.0, "data_wait": 2.0},
        "tiers": {
            "save_durable": {"count": 4, "seconds": 2.0, "bytes": 0},
            "save_local": {"count": 8, "seconds": 0.8, "bytes": 0},
        },
    }
    second = {
        "started_at": 108.0,
        "last_alive": 200.0,
        "outcome": "finished",
        "highest_step": 160,
        "timed_steps": 90,
        "step_seconds": 90.0,
        "buckets": {
            **buckets,
            "productive": 90.0,
            "compile": 3.0,
            "restart": 20.0,
            "checkpoint_restore": 1.5,
            "lost": 10.0,
        },
        "tiers": {"restore_local": {"count": 1, "seconds": 1.5, "bytes": 0}},
    }
    (tmp_path / "goodput.json").write_text(json.dumps({"attempts": [first, second]}))
    found = {k: v for k, (v, _) in measured(tmp_path).items()}
    assert found["step_s"] == 1.0 and found["save_durable_s"] == 0.5 and found["save_local_s"] == 0.1
    assert found["restore_local_s"] == 1.5 and found["detect_s"] == 8.0
    assert found["restart_s"] == 20.0 - 8.0 + 3.0 and found["first_start_s"] == 15.0
    assert cli.main(["goodput", "tiny", "--gpus", "8", "--from", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["step_s"] == {"value": 1.0, "source": f"measured ({tmp_path / 'goodput.json'})"}


@pytest.mark.slow
def test_readme_rehearsal_commands_parse_and_a_short_rehearsal_survives_a_lost_host(tmp_path):
    """Every documented bench/rehearsal.py command parses; a real one, shortened (60 steps, one fault, due a tenth
    of a second into training on average: a host lost, its local directory deleted), runs the llama3_8b recipe on
    2 processes under the supervisor and ends with the uninterrupted run's parameters, its last line the JSON the
    issue asks for."""
    spec = importlib.util.spec_from_file_location("rehearsal", ROOT / "bench" / "rehearsal.py")
    rehearsal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rehearsal)
    commands = readme_commands(".venv/bin/python bench/rehearsal.py")
    assert {rehearsal.arguments(shlex.split(c)[2:]).processes for c in commands} >= {2, 4}
    out = tmp_path / "rehearsal.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "rehearsal.py"),
            "--preset",
            "llama3_8b",
            "--processes",
            "2",
            "--devices",
            "1",
            "--steps",
            "60",
            "--failures-per-hour",
            "36000",
            "--max-faults",
            "1",
            "--seed",
            "7",
            "--work",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["params_bitwise_equal"] is True
    assert 0 < last["goodput_measured"] < 1 and 0 < last["goodput_projected"] < 1
    result = json.loads(Path(out).read_text())
    assert [f["kind"] for f in result["faults"]] == ["host_lost"]
    assert result["lost_per_kind"]["host_lost"]["count"] == 1
    assert sum(result["breakdown_projected"].values()) == pytest.approx(1.0, abs=1e-9)


def test_readme_goodput_commands_run(capsys):
    """Every documented `llama-jax goodput` command runs (a --from run directory is made first from a real
    goodput.json shape), the llama3_405b projection with the launchers' local tier beats durable only, and each
    command's goodput is the figure docs/fault-tolerance.md gives for it."""
    guide = (ROOT / "docs" / "fault-tolerance.md").read_text()
    commands = readme_commands("llama-jax goodput")
    assert any("llama3_405b" in c and "16384" in c for c in commands)
    for command in commands:
        args = llama_jax_args(command)
        if "--from" in args:
            continue  # a run directory of the reader's: --from is tested on a goodput.json above
        assert cli.main([*args, "--json"] if "--json" not in args else args) == 0, command
        out = json.loads(capsys.readouterr().out)
        assert 0 < out["goodput"] < 1
        if "llama3_405b" in command and "16384" in command:
            assert f"{100 * out['goodput']:.1f}%" in guide, command
        if "checkpoint.local_dir=/dev/shm/llama-jax" in command:
            assert out["goodput"] > out["durable_only"]["goodput"]


@pytest.mark.slow
def test_the_distributed_init_benchmark_times_real_processes_and_fits_its_line(tmp_path):
    """bench/distributed_init.py on 2 and 3 real processes: a time for each count, and the line through them."""
    out = tmp_path / "init.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "distributed_init.py"), "--processes", "2", "3", "--repeats", "1"]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    seconds = {int(k): v for k, v in result["seconds"].items()}
    assert sorted(seconds) == [2, 3] and all(0 < v < 60 for v in seconds.values())
    for count, value in seconds.items():  # two points: the line passes through both
        assert result["a"] + result["b"] * count == pytest.approx(value, abs=1e-9)
    assert "fit: seconds = " in proc.stdout
