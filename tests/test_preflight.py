"""The pre-flight health check (preflight.py): `llama-jax doctor`, `train fault.preflight=true`, in one process on
the 8 simulated devices and in 2 real processes x 2 devices.

The simulated devices share this machine's cores with whatever else runs, so the tests judge with
fault.preflight_min_ratio=0.5 (0.35 across processes, which contend for the cores too) instead of the default 0.8
meant for real accelerators: a healthy device is never named for noise, and an injected slow one (SLOW_FACTOR = 10
times the work, about 0.1x the median) always is. A device that looks slow is measured again in rounds
(fleet_rounds.py): tested on a simulated fleet, and on 2 real processes with one's core loaded for part of the
check. Nothing here asserts a time.
"""

import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import jax
import pytest
from conftest import tiny_config, write_tiny_yaml

from llama_jax import cli
from llama_jax.config import load_config
from llama_jax.distributed import sharding
from llama_jax.distributed.peers import Peers
from llama_jax.errors import EXIT_BAD_INPUT, EXIT_UNHEALTHY, ConfigError, UnhealthyDevice
from llama_jax.resilience import fleet_rounds, preflight
from llama_jax.training.loop import train

ROOT = Path(__file__).resolve().parents[1]
RATIO = "fault.preflight_min_ratio=0.5"


def named(stderr: str) -> list[int]:
    """The device ids an UnhealthyDevice line names."""
    return [int(d) for d in re.findall(r"device (\d+) \(process \d+ on ", stderr)]


def test_a_healthy_check_of_the_tiny_preset_names_nobody(tmp_path):
    config = load_config("tiny", [RATIO, f"run.dir={tmp_path / 'run'}"])
    mesh = sharding.make_mesh(config)
    peers = Peers(config.fault.barrier_timeout_s)
    report = preflight.check(config, mesh, peers)
    assert report.healthy and report.unhealthy == [] and report.hosts == []
    assert [d["device"] for d in report.devices] == [d.id for d in jax.devices()]
    assert all(d["matmul_flops"] > 0 and d["memory_bytes_s"] > 0 and d["arithmetic_ok"] for d in report.devices)
    assert set(report.collectives) == {a for a, n in mesh.shape.items() if n > 1} == {"fsdp"}
    assert report.collectives["fsdp"] > 0
    preflight.enforce(report, Path(config.run.dir), create=True, peers=peers)  # healthy: no error, nothing written
    assert not (tmp_path / "run").exists()
    print(f"\nhealthy pre-flight check of the tiny preset on 8 simulated devices: {report.seconds:.2f} s")


def test_doctor_names_an_injected_slow_device_and_exits_71(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["doctor", "tiny", RATIO, "inject.slow_device=3", f"run.dir={run_dir}"]) == EXIT_UNHEALTHY
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert line.startswith("llama-jax: error: pre-flight check: device 3 (process 0 on ") and named(line) == [3]
    assert re.search(r"matmul [\d.]+ [GMT]?FLOP/s, 0\.\d\dx the median", line) and "exclude host" in line
    assert re.search(r"^\S+ +0 +3 .*<- unhealthy$", out, flags=re.MULTILINE)  # the table marks it
    assert not run_dir.exists()  # doctor starts no run: it writes the verdict only into a run.dir that exists


def test_doctor_names_an_injected_wrong_device_and_writes_the_verdict_into_an_existing_run_dir(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = ["doctor", "tiny", RATIO, "inject.wrong_device=5", f"run.dir={run_dir}", "--json"]
    assert cli.main(args) == EXIT_UNHEALTHY
    out, err = capsys.readouterr()
    assert named(err) == [5] and "wrong matmul result (1 of 65536 elements differ" in err
    report = json.loads(out)
    assert [d["device"] for d in report["devices"] if not d["arithmetic_ok"]] == [5]
    verdict = json.loads((run_dir / "unhealthy.json").read_text())
    assert verdict["exit_code"] == EXIT_UNHEALTHY and verdict["hosts"] == [preflight.node_name()]
    assert [d["device"] for d in verdict["devices"]] == [5]


def test_train_with_preflight_stops_before_writing_anything_but_the_verdict(tmp_path, corpus):
    config = tiny_config(
        tmp_path,
        data=dict(sources=[str(corpus)], cache_dir=str(tmp_path / "cache")),
        fault=dict(preflight=True, preflight_min_ratio=0.5),
        inject=dict(wrong_device=2),
    )
    with pytest.raises(UnhealthyDevice, match=r"device 2 \(process 0 on .*wrong matmul result") as caught:
        train(config, print_fn=lambda line: None)
    assert caught.value.exit_code == EXIT_UNHEALTHY
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["unhealthy.json"]  # no config, no checkpoint


@pytest.mark.parametrize(
    "override, message",
    [
        ("fault.preflight_min_ratio=1.5", "fault.preflight_min_ratio must be in (0, 1]"),
        ("fault.preflight_min_ratio=0", "fault.preflight_min_ratio must be in (0, 1]"),
        ("inject.slow_device=-2", "inject.slow_device must be >= -1 (-1: none), got -2"),  # the config's range
        ("inject.slow_device=9", "inject.slow_device=9 is not a device of this run's mesh (ids 0-7)"),
        ("inject.wrong_device=8", "inject.wrong_device=8 is not a device of this run's mesh (ids 0-7)"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2(tmp_path, capsys, override, message):
    run_dir = tmp_path / "run"
    assert cli.main(["doctor", "tiny", override, f"run.dir={run_dir}"]) == EXIT_BAD_INPUT
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("llama-jax: error: ") and message in line
    assert not run_dir.exists()


def test_load_config_refuses_a_ratio_above_one():
    with pytest.raises(ConfigError, match=r"fault.preflight_min_ratio must be in \(0, 1\]"):
        load_config("tiny", ["fault.preflight_min_ratio=1.01"])


class LoadedHost:
    """A fake clock for preflight.best_times: 8 equal devices (1 s per call) and one 10x slow device, on a host
    whose load from elsewhere makes calls `load(call number)` times slower."""

    def __init__(self, load, slow=None):
        self.load, self.slow, self.calls = load, slow, 0

    def time_once(self, device):
        self.calls += 1
        seconds = (10.0 if device == self.slow else 1.0) * self.load(self.calls)
        return seconds, seconds


def test_a_burst_of_load_on_one_device_is_cleared_by_the_second_look():
    """The load hits device 6's three timed calls (calls 7, 15 and 23) and lasts through the second look: every
    call from 23 on is 2.2x slower. Timed next to a reference device in the same load, device 6 is as fast as it."""
    host = LoadedHost(lambda call: 2.2 if call == 7 or call == 15 or call >= 23 else 1.0)
    best = preflight.best_times(list(range(8)), host.time_once, min_ratio=0.5)
    assert all(best[d] == [1.0, 1.0] for d in range(8))
    assert host.calls == 24 + 2 * preflight.SECOND_LOOK_ROUNDS  # bounded: three rounds, then the pairs


def test_a_slow_device_stays_slow_through_the_second_look_under_changing_load():
    """Load that changes from call to call (1x, 1.5x, 2x): a 10x slow device comes out at least 10 / 2 = 5x slow."""
    host = LoadedHost(lambda call: 1.0 + (call % 3) / 2, slow=3)
    best = preflight.best_times(list(range(8)), host.time_once, min_ratio=0.5)
    for k in (0, 1):
        assert best[3][k] >= 5 * statistics.median(b[k] for b in best.values())
    assert host.calls == 24 + 2 * preflight.SECOND_LOOK_ROUNDS


@pytest.mark.slow
def test_two_processes_name_a_slow_device_on_every_process(tmp_path, corpus):
    """2 processes x 2 devices: a healthy `doctor` first (which gives the devices' ids), then `train
    fault.preflight=true` with process 1's first device slowed: both processes name it and exit 71, and the
    verdict is in run.dir."""
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", LLAMA_JAX=str(Path(sys.executable).parent / "llama-jax"))
    config = write_tiny_yaml(tmp_path, data={"sources": [str(corpus)]})

    def launch(*args):
        return subprocess.run(
            [
                sys.executable,
                str(ROOT / "launch" / "multiprocess.py"),
                "--processes",
                "2",
                "--devices",
                "2",
                "--grace",
                "30",
                "--",
                *map(str, args),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )

    healthy = launch("doctor", config, "fault.preflight_min_ratio=0.35", "--json")
    assert healthy.returncode == 0, healthy.stderr
    report = json.loads(healthy.stdout[healthy.stdout.index('{\n  "devices"') :])  # after gloo's notes on stdout
    assert report["healthy"] and len(report["devices"]) == 4 and set(report["collectives"]) == {"fsdp"}
    slow = min(d["device"] for d in report["devices"] if d["process"] == 1)

    run_dir = tmp_path / "run"
    result = launch(
        "train",
        config,
        f"run.dir={run_dir}",
        "fault.preflight=true",
        "fault.preflight_min_ratio=0.35",
        f"inject.slow_device={slow}",
    )
    assert result.returncode == EXIT_UNHEALTHY, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("llama-jax: error: pre-flight check")]
    assert len(errors) == 2 and all(named(line) == [slow] and "(process 1 on " in line for line in errors)
    assert re.findall(r"process \d exited with status (\d+)", result.stderr) == ["71", "71"]
    verdict = json.loads((run_dir / "unhealthy.json").read_text())
    assert [d["device"] for d in verdict["devices"]] == [slow]
    assert not (run_dir / "checkpoints").exists()
    # Named after the rounds measured it again, every ratio of which the verdict keeps (the first look's too).
    (suspect,) = [s for s in verdict["suspects"] if s["device"] == slow]
    assert suspect["named"] and len(suspect["slow_rounds"]) > fleet_rounds.ROUNDS // 2
    assert all(len(ratios) == suspect["rounds"] + 1 for ratios in suspect["ratios"].values())
    assert "rounds measured again" in verdict["devices"][0]["reasons"][-1]


def figures(rate: float) -> dict:
    return {"matmul_flops": rate, "memory_bytes_s": rate}


class Fleet:
    """Peers for fleet_rounds.recheck as process 0 of a simulated fleet: rate(device, round) is any device's
    figures in a round (1-based), and a round's reduce adds what the other processes measured (`theirs`, their
    reference devices) to what this one did."""

    index = 0

    def __init__(self, rate, theirs: list[int]):
        self.rate, self.theirs, self.round = rate, theirs, 0

    def barrier(self, name: str) -> None:
        self.round += 1

    def reduce(self, name: str, value, combine):
        return combine([value, {str(d): self.rate(d, self.round) for d in self.theirs}])


def first_look(rates: dict[int, float]) -> list[dict]:
    """2 hosts: node-a is process 0 (devices 0 and 1), node-b is process 1 (devices 2 and 3)."""
    return [
        {"host": f"node-{'ab'[d // 2]}", "process": d // 2, "device": d, "arithmetic_ok": True} | figures(rates[d])
        for d in range(4)
    ]


@pytest.mark.parametrize("busy_rounds, rounds", [((), 2), ((1,), 3)])
def test_a_host_busy_for_part_of_the_check_is_reported_loaded_not_named(monkeypatch, busy_rounds, rounds):
    """node-a's host was busy in the first look (both its devices at 0.2 of node-b's rate: 0.33x the median), and in
    round 1 too in the second case: normal in most rounds, so named nowhere and reported as loaded during the check,
    with its ratios."""
    monkeypatch.setattr(fleet_rounds, "ROUND_GAP_S", 0.0)
    devices = first_look({0: 0.2, 1: 0.2, 2: 1.0, 3: 1.0})
    medians, flagged = preflight.judge(devices, 0.35)
    assert [d["device"] for d in flagged] == [0, 1]
    assert fleet_rounds.references(devices, {0, 1}) == {1: 2}  # process 1's median device; process 0 has none
    fleet = Fleet(lambda d, r: figures(0.25 if d < 2 and r in busy_rounds else 1.0), theirs=[2])
    result = fleet_rounds.recheck(devices, {0, 1}, lambda d: fleet.rate(d, fleet.round), fleet, 0.35, medians)
    assert result.named == set() and result.rounds == fleet.round == rounds  # stopped once most rounds were normal
    assert [s["ratios"]["matmul"] for s in result.suspects] == [
        [0.333] + [0.25 if r in busy_rounds else 1.0 for r in range(1, rounds + 1)]
    ] * 2
    assert result.loaded == [
        {"host": "node-a", "processes": [0], "devices": [0, 1], "loaded_rounds": [0, *busy_rounds], "rounds": rounds}
    ]


def test_a_slow_device_is_named_while_the_whole_fleet_slows_down_and_its_host_is_busy(monkeypatch):
    """Device 3 is 10x slow. In round 1 every device is 2x slower (load the fleet shares), in round 2 node-b is 3x
    slower: each round's median is of the references measured with it, so device 3 stays at 0.1x and is named
    after two rounds; node-b, a host with a device named, is not reported as merely loaded."""
    monkeypatch.setattr(fleet_rounds, "ROUND_GAP_S", 0.0)
    devices = first_look({0: 1.0, 1: 1.0, 2: 1.0, 3: 0.1})
    medians, flagged = preflight.judge(devices, 0.35)
    assert [d["device"] for d in flagged] == [3]
    assert fleet_rounds.references(devices, {3}) == {0: 0, 1: 2}

    def rate(device: int, round: int) -> dict:
        load = 2.0 if round == 1 else 3.0 if round == 2 and device >= 2 else 1.0
        return figures((0.1 if device == 3 else 1.0) / load)

    fleet = Fleet(rate, theirs=[2, 3])  # process 1 measures its reference and its suspect
    result = fleet_rounds.recheck(devices, {3}, lambda d: rate(d, fleet.round), fleet, 0.35, medians)
    assert result.named == {3} and result.rounds == 2 and result.loaded == []
    (suspect,) = result.suspects
    assert suspect["slow_rounds"] == [1, 2] and all(r <= 0.1 for r in suspect["ratios"]["memory"])


def launcher():
    """launch/multiprocess.py as a module: the environment it gives each process."""
    spec = importlib.util.spec_from_file_location("multiprocess", ROOT / "launch" / "multiprocess.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BURNERS = 12  # busy processes on node-a's core: its devices at about 0.2x of node-b's while they run


@pytest.mark.slow
def test_two_processes_name_nobody_when_one_host_is_busy_for_part_of_the_check(tmp_path):
    """A healthy `doctor` of 2 processes x 2 devices, each process pinned to a core of its own and named as a host
    of its own (node-a, node-b). BURNERS CPU-burning processes pinned to node-a's core run from the moment it joins
    the run until the check says it measures its suspects again: the first look finds node-a's devices far below the
    median, and alone would name them. Both processes exit 0 and name nobody; every suspect is cleared by the rounds,
    and when the suspects are node-a's devices, the report says node-a was loaded during the check."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or not shutil.which("taskset"):
        pytest.skip("needs 2 cores (one process's core busy, the other's not) and taskset")
    multiprocess = launcher()
    port = multiprocess.free_port()
    base = dict(os.environ, XLA_FLAGS="")
    processes, burners, log = [], [], tmp_path / "process1.log"
    for i, output in enumerate((subprocess.PIPE, log.open("w"))):
        env = multiprocess.process_environment(base, i, 2, 2, port) | {"LLAMA_JAX_NODE_NAME": f"node-{'ab'[i]}"}
        processes.append(
            subprocess.Popen(
                [
                    "taskset",
                    "-c",
                    str(cores[i]),
                    sys.executable,
                    "-m",
                    "llama_jax",
                    "doctor",
                    "tiny",
                    "fault.preflight_min_ratio=0.35",
                ],
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    output.close()  # process 1's copy stays open
    watchdog = threading.Timer(240, lambda: [p.kill() for p in processes + burners])
    watchdog.start()
    lines = []
    try:
        for line in processes[0].stdout:
            lines.append(line)
            if line.startswith("joining the run") and not burners:
                burners = [
                    subprocess.Popen(["taskset", "-c", str(cores[0]), sys.executable, "-c", "while True: pass"])
                    for _ in range(BURNERS)
                ]
            if "measuring again" in line:  # the first look is over: the burst ends
                for burner in burners:
                    burner.kill()
        statuses = [p.wait() for p in processes]
    finally:
        watchdog.cancel()
        for burner in burners:
            burner.kill()
            burner.wait()
    out = "".join(lines)
    assert statuses == [0, 0], out + log.read_text()
    assert "<- unhealthy" not in out and "4 devices healthy" in out
    # The suspects, if the burst made any (on a machine otherwise idle: node-a's two devices, every time).
    note = next((line for line in lines if "measuring again" in line), "")
    suspects = re.findall(r"device (\d+) \(process (\d) on (node-\w)\)", note)
    for device, process, host in suspects:
        assert re.search(
            rf"^{host} +{process} +{device} .*<- slow at first; slow in [01] of \d rounds measured again: "
            "cleared$",
            out,
            flags=re.MULTILINE,
        ), out
    if [(p, h) for _, p, h in suspects] == [("0", "node-a")] * 2:
        assert "host node-a (process 0) was loaded during the check: every device slow in the first look" in out
    print(f"\nsuspects measured again and cleared: {suspects}")
