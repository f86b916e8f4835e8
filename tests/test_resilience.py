"""llama_jax.resilience with real threads, real signals and one real subprocess; no JAX involved."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from llama_jax.checkpoint.durable import check_model, model_differences
from llama_jax.checkpoint.interval import STEADY_STEPS, Figures, Interval, auto_checkpoint_steps, young_daly_interval_s
from llama_jax.errors import EXIT_HANG, EXIT_PREEMPTED, ConfigError
from llama_jax.files import format_ranges
from llama_jax.resilience import lease as lease_module
from llama_jax.resilience.goodput import Goodput, StartClock, format_goodput, observed_mtbf_s, process_started_at
from llama_jax.resilience.guards import SpikeGuard
from llama_jax.resilience.lease import HOLDER_FILE, RunDirLease
from llama_jax.resilience.preemption import PreemptionGuard
from llama_jax.resilience.stragglers import HostScores, HostWindow, StragglerDetector
from llama_jax.resilience.watchdog import HangWatchdog
from llama_jax.training.parts import StepResult, Stragglers

# ---------------------------------------------------------------------------------------------
# HangWatchdog


class FakeExit:
    """exit_fn that records the code instead of ending the test process."""

    def __init__(self):
        self.codes: list[int] = []
        self.event = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.event.set()


def fast_watchdog(tmp_path, exit_fn, **kwargs):
    options = dict(
        factor=2.0, min_timeout_s=0.2, startup_timeout_s=0.5, poll_s=0.01, describe=lambda: "all-reduce x 4 over fsdp"
    )
    return HangWatchdog(tmp_path, "node-7", exit_fn=exit_fn, **{**options, **kwargs})


def stuck_in_collective(fired: threading.Event, limit_s: float) -> None:
    """Stands in for a collective whose peer died: blocks until the watchdog fires."""
    deadline = time.monotonic() + limit_s
    while not fired.is_set() and time.monotonic() < deadline:
        time.sleep(0.005)


def test_watchdog_fires_after_steps_stop_and_dumps_stacks_and_describe(tmp_path):
    fake = FakeExit()
    with fast_watchdog(tmp_path, fake) as watchdog:
        watchdog.step_done(1, None)
        for step in range(2, 12):
            time.sleep(0.01)
            watchdog.step_done(step, 0.01)
        assert watchdog.timeout_s == 0.2  # max(0.2, 2 x ~0.01)
        stopped = time.monotonic()
        stuck_in_collective(fake.event, limit_s=5)
        fired_after = time.monotonic() - stopped
    assert fake.codes == [EXIT_HANG]
    assert 0.2 <= fired_after < 2.0
    text = (tmp_path / "hang-node-7.txt").read_text()
    assert "stuck_in_collective" in text  # the main thread's stack shows where it is blocked
    assert "Thread 'MainThread'" in text and "Thread 'hang-watchdog'" in text
    assert "all-reduce x 4 over fsdp" in text
    assert "last completed step: 11 (0.01 s)" in text and "last progress: step 11 done" in text
    assert f"pid: {os.getpid()}" in text and "host: node-7" in text and "median step time 0.01 s" in text


def test_watchdog_quiet_while_steps_come_and_inside_paused(tmp_path):
    fake = FakeExit()
    with fast_watchdog(tmp_path, fake) as watchdog:
        watchdog.step_done(1, None)
        for step in range(2, 60):  # ~0.6 s of steps, three times the 0.2 s timeout
            time.sleep(0.01)
            watchdog.step_done(step, 0.01)
        with watchdog.paused("checkpoint"):
            time.sleep(0.8)
        watchdog.progress("eval batch 1")
        time.sleep(0.1)
        assert not fake.codes
        fake.event.wait(2.0)  # after the pause the clock runs again
    assert fake.codes == [EXIT_HANG]
    assert "last progress: eval batch 1" in (tmp_path / "hang-node-7.txt").read_text()


def test_watchdog_bounds_a_checkpoint_phase_and_names_it(tmp_path):
    """A save or restore is not timed against steps, but it has its own bound (checkpoint.timeout_s)."""
    fake = FakeExit()
    with fast_watchdog(tmp_path, fake) as watchdog:
        watchdog.step_done(1, 0.01)
        start = time.monotonic()
        with watchdog.paused("checkpoint save of step 12", timeout_s=0.5):
            fake.event.wait(3.0)  # the save "hangs"
        fired_after = time.monotonic() - start
    assert fake.codes == [EXIT_HANG] and 0.5 <= fired_after < 2.5
    text = (tmp_path / "hang-node-7.txt").read_text()
    assert text.startswith("hang watchdog: checkpoint save of step 12 did not finish within its bound of 0.5 s")


def test_watchdog_describe_failure_is_a_note_not_a_crash(tmp_path):
    fake = FakeExit()

    def broken() -> str:
        raise RuntimeError("no compiled step")

    with fast_watchdog(tmp_path, fake, describe=broken, startup_timeout_s=0.05):
        fake.event.wait(2.0)
    assert fake.codes == [EXIT_HANG]
    text = (tmp_path / "hang-node-7.txt").read_text()
    assert "describe() failed: RuntimeError: no compiled step" in text
    assert "startup timeout 0.05 s (no timed step yet)" in text


def test_watchdog_timeout_derivation():
    watchdog = HangWatchdog(Path("unused"), "h", factor=10.0, min_timeout_s=5.0, startup_timeout_s=900.0, window=3)
    assert watchdog.timeout_s == 900.0
    watchdog.step_done(1, None)  # compilation: no step time yet
    assert watchdog.timeout_s == 900.0
    watchdog.step_done(2, 0.1)
    assert watchdog.timeout_s == 5.0  # 10 x 0.1 < the minimum
    for step, seconds in [(3, 2.0), (4, 3.0), (5, 100.0)]:
        watchdog.step_done(step, seconds)
    assert watchdog.timeout_s == 30.0  # 10 x median(2, 3, 100) of the last 3


def test_a_stuck_process_exits_124_and_leaves_the_dump(tmp_path):
    child = textwrap.dedent(f"""
        import threading
        from pathlib import Path
        from llama_jax.resilience.watchdog import HangWatchdog

        def blocked_forever():
            threading.Event().wait()

        with HangWatchdog(Path({str(tmp_path)!r}), "child", startup_timeout_s=0.3, poll_s=0.05):
            blocked_forever()
    """)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=30)
    assert proc.returncode == EXIT_HANG, proc.stderr
    assert time.monotonic() - started < 20
    assert "blocked_forever" in (tmp_path / "hang-child.txt").read_text()
    assert f"exiting {EXIT_HANG}" in proc.stderr


# ---------------------------------------------------------------------------------------------
# PreemptionGuard


def deliver(sig: signal.Signals) -> None:
    """Send a signal to ourselves and give the main thread the moment it needs to run the handler."""
    os.kill(os.getpid(), sig)
    for _ in range(100):
        time.sleep(0.001)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sets_the_flag_and_handlers_are_restored(sig):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with PreemptionGuard() as guard:
        assert not guard.should_stop(1) and guard.signal_name is None
        deliver(sig)
        assert guard.should_stop(2)
        assert guard.signal_name == sig.name
    assert {s: signal.getsignal(s) for s in before} == before
    assert EXIT_PREEMPTED == 75


def test_a_second_sigint_raises_keyboard_interrupt():
    with PreemptionGuard() as guard:
        deliver(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            deliver(signal.SIGINT)
        assert guard.signal_name == "SIGTERM"


def test_multi_process_sync_decides_and_sigterm_stays_with_jax():
    notified: list[int] = []
    jax_like = lambda signum, frame: notified.append(signum)  # noqa: E731 - stands in for JAX's notifier
    previous = signal.signal(signal.SIGTERM, jax_like)
    try:
        with PreemptionGuard(sync=lambda step: step >= 3 and bool(notified)) as guard:
            assert signal.getsignal(signal.SIGTERM) is jax_like  # not replaced
            deliver(signal.SIGINT)
            assert notified == [signal.SIGTERM]  # SIGINT was forwarded as SIGTERM to JAX
            assert guard.signal_name == "SIGINT"
            assert not guard.should_stop(2)  # only the agreed sync point stops a multi-process run
            assert guard.should_stop(3)
        assert signal.getsignal(signal.SIGTERM) is jax_like
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------
# Goodput


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def first_attempt(run_dir, clock, flush_after=7):
    """Started at 1000, loop at 1010, compile 5 s, steps 2..7 of 2 s each; last flush at 1040 after step flush_after."""
    clock.t = 1010.0
    goodput = Goodput(run_dir, started_at=1000.0, now=clock)
    goodput.begin(0)
    goodput.add("compile", 5.0)
    for step in range(2, 8):
        goodput.step_done(step, 2.0)
        if step == flush_after:
            clock.t = 1040.0
            goodput.flush()
    return goodput  # and "dies": no final record


def test_goodput_across_a_death_and_a_resume(tmp_path):
    clock = Clock(0.0)
    first_attempt(tmp_path, clock)
    clock.t = 1103.0
    second = Goodput(tmp_path, started_at=1100.0, now=clock)
    second.add("checkpoint_restore", 2.0)
    second.begin(resumed_step=5)
    for step in range(6, 10):
        second.step_done(step, 1.0)
    clock.t = 1120.0
    s = second.summary()
    assert s["lost"] == 4.0  # steps 6 and 7 again, at attempt 1's mean of 2 s
    assert s["restart"] == 10.0 + 60.0 + 1.0  # start-up 1, gap 1040 -> 1100, start-up 2 less the restore
    assert s["productive"] == 12.0 + 4.0 - 4.0
    assert s["wall_s"] == 120.0 and s["attempts"] == 2 and s["redone_steps"] == 2
    assert s["goodput"] == 12.0 / 120.0
    assert sum(s[b] for b in ("productive", "compile", "checkpoint_restore", "lost", "restart", "other")) == 120.0
    assert format_goodput(second.summary()).startswith(
        "goodput 10.0% of 120 s over 2 attempts: productive 12 s, compile 5.0 s"
    )
    second.finish()
    record = json.loads((tmp_path / "goodput.json").read_text())
    assert [a["outcome"] for a in record["attempts"]] == ["died", "finished"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_goodput_of_a_kill_9_counts_from_its_last_flush(tmp_path):
    clock = Clock(0.0)
    first_attempt(tmp_path, clock, flush_after=5)  # steps 6 and 7 ran but were never recorded
    clock.t = 1100.0
    second = Goodput(tmp_path, started_at=1100.0, now=clock)
    second.begin(resumed_step=5)
    s = second.summary()
    assert s["lost"] == 0.0 and s["redone_steps"] == 0  # as far as anyone knows, nothing beyond step 5 was done...
    assert s["restart"] == 10.0 + 60.0  # ...the unrecorded work is inside the gap
    assert s["productive"] == 8.0 and s["wall_s"] == 100.0 and s["goodput"] == 0.08


def test_goodput_rollback_and_idle_time_after_a_finished_run(tmp_path):
    clock = Clock(10.0)
    goodput = Goodput(tmp_path, started_at=0.0, now=clock)
    goodput.begin(0)
    for step in range(1, 7):
        goodput.step_done(step, 1.0)
    goodput.discard(3, 6)  # rolled back from step 6 to 3
    clock.t = 20.0
    goodput.finish()
    assert goodput.summary()["lost"] == 3.0 and goodput.summary()["productive"] == 3.0
    clock.t = 1000.0  # a week later (say) the user raises train.steps: the wait is no one's fault
    later = Goodput(tmp_path, started_at=995.0, now=clock)
    later.begin(6)
    s = later.summary()
    assert s["wall_s"] == 20.0 + 5.0 and s["restart"] == 10.0 + 5.0 and s["lost"] == 3.0


def test_goodput_only_process_0_writes_and_a_broken_file_is_not_fatal(tmp_path):
    Goodput(tmp_path, started_at=time.time(), write=False).begin(0)
    assert not (tmp_path / "goodput.json").exists()
    (tmp_path / "goodput.json").write_text("{not json")
    goodput = Goodput(tmp_path, started_at=time.time())
    goodput.begin(0)
    assert goodput.summary()["attempts"] == 1
    with pytest.raises(ValueError, match="unknown goodput bucket"):
        goodput.add("coffee", 1.0)


def test_the_step_clock_leaves_pauses_out_of_step_times_and_charges_them(tmp_path):
    clock = Clock(100.0)
    goodput = Goodput(tmp_path, started_at=0.0, now=Clock(50.0), clock=clock)
    goodput.begin(0)
    clock.t = 130.0
    assert goodput.time_step(1, data_wait=0.5, compiled=True) == 30.0  # compiled: charged to compile
    with goodput.pause(None):  # e.g. the preemption check: excluded, charged to no bucket
        with goodput.pause("eval"):
            clock.t = 134.0
        with goodput.pause("checkpoint_save"):
            clock.t = 137.0
    clock.t = 139.0
    assert goodput.time_step(2, data_wait=0.25) == 2.0  # 9 s since step 1, of which 7 s paused
    clock.t = 141.0
    assert goodput.time_step(3, data_wait=0.0) == 2.0
    buckets = goodput.current["buckets"]
    assert buckets["compile"] == 29.5 and buckets["data_wait"] == 0.75
    assert buckets["eval"] == 4.0 and buckets["checkpoint_save"] == 3.0
    assert buckets["productive"] == 1.75 + 2.0 and goodput.current["timed_steps"] == 2


def test_a_start_is_kept_part_by_part_and_a_launch_only_for_a_launched_process():
    """Each mark is the time since the previous one; a process launched for the run (the command line) also
    counts from its start by the OS, one called from a longer-lived process (the API) does not."""
    times = iter([101.0, 101.5, 103.0, 104.5])
    clock = StartClock(100.0, now=lambda: next(times))
    clock.mark("imports")
    clock.mark("compile")
    clock.mark("restore")
    clock.mark("restore")  # a part marked twice adds up
    assert clock.parts == {"imports": 1.0, "compile": 0.5, "restore": 3.0}
    with pytest.raises(ValueError, match="unknown start part 'warmup'"):
        clock.mark("warmup")
    assert 0 <= time.time() - process_started_at() < 3600  # this test process, started by the OS a moment ago
    launched = StartClock(time.time(), launched=True).parts["launch"]
    assert 0 <= launched == pytest.approx(time.time() - process_started_at(), abs=0.05)


def test_observed_mtbf(tmp_path):
    assert observed_mtbf_s(tmp_path) is None
    clock = Clock(0.0)
    first_attempt(tmp_path, clock)  # died; last alive at 1040
    clock.t = 1100.0
    second = Goodput(tmp_path, started_at=1100.0, now=clock)
    second.begin(5)
    clock.t = 1500.0
    second.finish()
    assert observed_mtbf_s(tmp_path) == 500.0  # 500 s of wall, one failure
    clock.t = 1600.0
    third = Goodput(tmp_path, started_at=1600.0, now=clock)
    third.begin(9)
    clock.t = 1700.0
    third.finish(preempted=True)  # stopped on a signal: an interruption, not a clean finish
    assert observed_mtbf_s(tmp_path) == (1700.0 - 1000.0 - 100.0) / 2  # the idle 1500 -> 1600 excluded


# ---------------------------------------------------------------------------------------------
# Checkpoint interval, stragglers, bad steps


def test_young_daly_interval_and_steps():
    assert young_daly_interval_s(2.0, 3600.0) == 120.0
    assert young_daly_interval_s(8.0, 10800.0) == pytest.approx(415.692, abs=1e-3)
    assert auto_checkpoint_steps(2.0, 3600.0, 0.5) == 240
    assert auto_checkpoint_steps(2.0, 3600.0, 7.0) == 17  # 120 / 7 = 17.1
    assert auto_checkpoint_steps(0.001, 1.0, 60.0) == 1  # at least one
    with pytest.raises(ValueError):
        auto_checkpoint_steps(2.0, 3600.0, 0.0)


def test_an_automatic_interval_is_worked_out_from_measured_figures_and_again_when_they_move():
    """auto: the first save waits for STEADY_STEPS timed steps; the interval is Young/Daly on the agreed figures,
    at least one write long, and is worked out again only when the step time or save cost moved more than 2x."""
    interval = Interval.of("checkpoint.every_steps", "auto", mtbf_s=3600.0)
    assert interval.measuring and not interval.due(3, STEADY_STEPS - 1) and interval.due(4, STEADY_STEPS)
    line = interval.settle(Figures(step_s=0.5, save_s=2.0, write_s=1.0))
    assert interval.every == auto_checkpoint_steps(2.0, 3600.0, 0.5) == 240 and "saving every 240 steps" in line
    assert not interval.measuring and interval.due(480, 0) and not interval.due(481, 99)
    assert interval.settle(Figures(0.9, 3.5, 1.0)) is None and interval.every == 240  # within 2x: as it was
    line = interval.settle(Figures(1.2, 2.0, 1.0))  # the step time more than doubled
    assert interval.every == 100 and "worked out again: step 0.5s -> 1.2s" in line
    assert auto_checkpoint_steps(0.01, 1.0, 0.1, write_s=5.0) == 50  # never shorter than one write
    fixed = Interval.of("checkpoint.every_steps", 10, 3600.0)
    assert fixed.due(20, 0) and not fixed.due(15, 99) and fixed.settle(Figures(1.0, 1.0)) is None
    interval.costs.extend([2.0, 4.0, 3.0])  # the advice prices a save as auto does: its blocked time (median 3 s)
    assert interval.advice(1.5).startswith("checkpoint interval advice (Young/Daly): sqrt(2 x save 3.00s x MTBF 1 h)")


def test_straggler_warns_only_above_factor_times_median_and_names_the_process():
    detector = StragglerDetector(factor=3.0, window=50, min_steps=10)
    assert detector.observe(1, 50.0) is None  # not before min_steps
    for step in range(2, 12):
        assert detector.observe(step, 1.0) is None
    assert detector.observe(12, 2.9) is None  # median is 1.0: 2.9 is below 3x
    warning = detector.observe(13, 4.0, process=0)
    assert warning is not None and "step 13" in warning and "took 4 s, 4.0x the median 1 s" in warning
    assert "seen on process 5" in detector.observe(14, 9.0, process=5)


def test_a_run_of_one_process_names_no_straggler_and_one_of_two_does():
    """A laptop's busy moment (one step 10x the others) is not a straggler where no one waits for the process; in a
    run of two processes the same step is named, on the process that saw it."""

    def warnings_of(processes: int) -> list[str]:
        messages = []
        peers = SimpleNamespace(count=processes, index=processes - 1)
        hosts = HostWindow(peers, HostScores(0.1), every=1000, host="laptop", devices=[0])
        part = Stragglers(3.0, hosts, SimpleNamespace(message=messages.append), goodput=None)
        for step in range(1, 31):
            part.observe(
                StepResult(step, {}, compiled=False, waited=0.0, blocked=0.1, seconds=1.5 if step == 20 else 0.15)
            )
        return messages

    assert warnings_of(1) == []
    assert warnings_of(2) == ["warning: straggler: step 20 took 1.5 s, 10.0x the median 0.15 s; seen on process 1"]


def test_spike_guard_skips_spikes_and_rollback():
    guard = SpikeGuard(max_bad_steps=3, zscore=3.0, window=20)
    for step in range(1, 21):
        assert guard.observe(step, 2.0 + 0.01 * (step % 2), True) == "ok"
    assert guard.observe(21, float("nan"), False) == "skipped"
    assert guard.observe(22, 2.0, True) == "ok"  # a good step ends the run of bad ones
    assert guard.consecutive == 0 and guard.bad_steps_total == 1
    assert guard.observe(23, 9.0, True) == "spike"
    assert guard.observe(24, 9.0, True) == "spike"  # the first spike did not raise the bar
    assert guard.observe(25, 2.0, False) == "rollback"  # three bad in a row
    assert guard.bad_steps_total == 4 and guard.consecutive == 3
    guard.reset()
    assert guard.consecutive == 0 and guard.observe(26, 2.01, True) == "ok"


def test_spike_rule_off_by_default_and_needs_history():
    assert SpikeGuard().observe(1, 1e9, True) == "ok"
    guard = SpikeGuard(max_bad_steps=0, zscore=1.0)
    assert guard.observe(1, 2.0, True) == "ok" and guard.observe(2, 50.0, True) == "ok"  # no history yet
    for step in range(3, 10):
        assert guard.observe(step, float("inf"), True) == "skipped"  # max_bad_steps 0: never rolls back


def report(host_s, step_s=1.0, steps=5, process=0):
    return {
        "host_s": host_s,
        "step_s": step_s,
        "steps": steps,
        "host": f"node-{process}",
        "devices": list(range(8 * process, 8 * process + 8)),
    }


def test_host_scores_name_a_host_slow_two_windows_running_with_its_devices():
    scores = HostScores(threshold=0.1)
    fleet = {p: report(0.02, process=p) for p in range(16)}
    assert scores.observe((1, 5), fleet)[2] == []
    fleet[3] = report(0.32, process=3)  # 0.3 s of each 1 s step more than the others' median
    ranked, waited, warnings = scores.observe((6, 10), fleet)
    assert ranked[0]["process"] == 3 and ranked[0]["score"] == pytest.approx(0.3) and not ranked[0]["straggler"]
    assert waited == pytest.approx(0.3 * 5) and warnings == []  # one window is not yet persistent
    ranked, _, warnings = scores.observe((11, 15), fleet)
    assert ranked[0]["straggler"] and ranked[0]["vs_own_best"] == pytest.approx(16.0)
    assert warnings == [
        "warning: straggler host: process 3 on node-3 (devices 24-31) costs the fleet 0.3 s of each "
        "1 s step over steps 11-15 (score 0.30 > fault.straggler_host_threshold 0.1, 2 windows "
        "running; 16.00x its own best)"
    ]
    fleet[3] = report(0.02, process=3)  # recovered: no longer named
    assert scores.observe((16, 20), fleet)[2] == []
    assert HostScores(0.1).observe((1, 5), {0: report(9.0)}) == ([], 0.0, [])  # one process: nothing to compare


def test_ranges_keep_a_list_of_processes_or_devices_short():
    assert (
        format_ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3, 7, 9-10"
        and format_ranges([5]) == "5"
        and format_ranges([]) == ""
    )


def test_a_checkpoint_of_another_function_is_refused_unless_allowed():
    saved = {
        "d_model": 64,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "rope_scaling_factor": 1.0,
        "rope_low_freq_factor": 1.0,
        "rope_high_freq_factor": 4.0,
        "rope_original_max_len": 8192,
    }
    assert model_differences(saved, dict(saved, rope_original_max_len=2048)) == []  # no scaling: unused
    assert model_differences(saved, dict(saved, rope_scaling_factor=8.0, rope_original_max_len=2048)) == [
        "rope_scaling_factor",
        "rope_original_max_len",
    ]
    with pytest.raises(
        ConfigError,
        match=r"model.rope_theta 10000.0 \(saved\) vs 20000.0.*"
        r"checkpoint.allow_model_changes=\[rope_theta\]",
    ):
        check_model(saved, dict(saved, rope_theta=20000.0), "runs/x")
    check_model(saved, dict(saved, rope_theta=20000.0), "runs/x", allowed=["rope_theta"])
    with pytest.raises(
        ConfigError,
        match=r"model.d_model 64 \(saved\) vs 128\); use another run.dir or the saved "
        r"model settings$",
    ):  # shapes cannot be allowed
        check_model(saved, dict(saved, d_model=128), "runs/x", allowed=["rope_theta"])


def test_a_time_based_save_is_announced_two_steps_ahead(tmp_path):
    """checkpoint.every_minutes: process 0's clock decides after step n that step n + 2 is saved, so in a
    multi-process run every process reads the decision without waiting (Peers.announce), while
    the host runs one step ahead of the devices."""
    from llama_jax.checkpoint.checkpointer import Checkpointer, Tiers
    from llama_jax.config import CheckpointConfig

    checkpointer = Checkpointer(Tiers(tmp_path), CheckpointConfig(every_minutes=1.0))
    try:
        assert not checkpointer.due(5, read=4)
        checkpointer.last_save_time -= 61  # a minute has passed since the last save
        assert not checkpointer.due(6, read=5) and not checkpointer.due(7, read=6)  # decided after step 6
        assert checkpointer.due(8, read=7)  # saved at step 8
        checkpointer.last_save_time = time.monotonic()  # the save at step 8
        assert not checkpointer.due(9, read=8)
    finally:
        checkpointer.close()


# ---------------------------------------------------------------------------------------------
# RunDirLease: a holder on another host


def foreign_holder(run_dir: Path, beat: int = 0) -> dict:
    """A holder.json as a run on another host writes it (lease_s 1 s)."""
    holder = {"host": "elsewhere-7", "node": "n7", "pid": 1, "started": None, "token": "theirs", "since": 0.0}
    holder |= {"beat": beat, "lease_s": 1.0}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / HOLDER_FILE).write_text(json.dumps(holder))
    return holder


def test_a_holder_on_another_host_that_beats_is_refused_and_one_that_stopped_is_waited_for_once(tmp_path, monkeypatch):
    """Across hosts only the beat tells: one that moves within a lease is a live run (named, refused); one that
    stays still for a lease is gone. A check (train) then a take (execute) watch it once: the take sleeps no more."""
    live = tmp_path / "live"
    holder = foreign_holder(live)
    stop = threading.Event()

    def beating():  # as a holder renews: a whole new file in one rename, never a torn one
        while not stop.wait(0.2):
            holder["beat"] += 1
            (live / "next.json").write_text(json.dumps(holder))
            os.replace(live / "next.json", live / HOLDER_FILE)

    thread = threading.Thread(target=beating, daemon=True)
    thread.start()
    try:
        lease = RunDirLease(live, lease_s=1.0)
        assert lease.problem().startswith(
            f"run.dir {live} is held by a live training run: pid 1 on elsewhere-7 (node n7)"
        )
        assert lease.take().startswith(f"run.dir {live} is held by a live training run")
    finally:
        stop.set()
        thread.join()
    assert json.loads((live / HOLDER_FILE).read_text())["token"] == "theirs"

    gone = tmp_path / "gone"
    foreign_holder(gone, beat=3)
    lease = RunDirLease(gone, lease_s=1.0)
    assert lease.problem() == ""  # watched for a lease: no beat
    naps = []
    monkeypatch.setattr(lease_module.time, "sleep", naps.append)
    try:
        assert lease.take() == ""
        assert naps == []  # taken over at once: the same holder, the same beat, already watched
        assert json.loads((gone / HOLDER_FILE).read_text())["token"] == lease.record["token"]
    finally:
        lease.release()
    assert not (gone / HOLDER_FILE).exists()
