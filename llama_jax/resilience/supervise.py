"""Keep a training command running through failures: `llama-jax supervise [options] -- COMMAND ...`.

Large runs are interrupted often (Llama 3 405B saw an interruption every ~3 hours), and re-running the
same `llama-jax train ...` command on the same run.dir resumes from its newest checkpoint. So recovery
needs nothing but restarting the command, which is all this does, deciding by the child's exit status:

    EXIT_OK (0)          finished                      -> exit 0
    EXIT_BAD_INPUT (2)   bad config or data            -> exit 2, never restarted (it will not fix itself)
    EXIT_UNHEALTHY (71)  a device failed pre-flight    -> exit 71, never restarted (the same hosts meet the
                                                          same device: exclude its host first)
    EXIT_STORAGE (74)    checkpoints cannot be written -> exit 74, never restarted (full, read-only or failing
                                                          storage: a person frees space or fixes it first)
    EXIT_PREEMPTED (75)  saved after SIGTERM/SIGINT    -> restarted (exit 75 if *we* were told to stop)
    EXIT_PEER_TIMEOUT (76) a peer missed a barrier     -> restarted (every process rejoins)
    EXIT_HANG (124)      the hang watchdog fired       -> restarted
    anything else, or killed by a signal              -> restarted

Restarts back off exponentially (--backoff doubling up to --max-backoff) and give up after
--max-restarts in a row, exiting with the child's last status (1 if a signal killed it). A child that ran
longer than --reset-after before failing starts a new streak: an hour of training followed by a crash
is not a crash loop. SIGTERM/SIGINT to the supervisor are forwarded as SIGTERM to the child's process
group (so the trainer saves a checkpoint), the child gets --grace seconds before SIGKILL, and the
supervisor exits with the child's status without restarting.

Multi-host: each host runs its own supervisor around its own process. When one process dies, the others
fail their collectives or lose the JAX coordination service and exit non-zero too, so every supervisor
restarts its process and they rendezvous again, resuming from the same newest checkpoint.

A pre-flight verdict counts even when the status does not show it: `srun --kill-on-bad-exit` may report a
task it killed (128 + 9) rather than the 71 of the task that failed first, so an attempt that wrote
<run.dir>/unhealthy.json (preflight.py) after it started is treated as exit 71.

Events go to stderr as `llama-jax supervise: ...` lines; if the command has a `run.dir=DIR` argument and
DIR exists (the trainer creates it), each attempt is also appended as one JSON line to
DIR/supervisor.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from llama_jax.errors import (
    EXIT_BAD_INPUT,
    EXIT_HANG,
    EXIT_OK,
    EXIT_PEER_TIMEOUT,
    EXIT_PREEMPTED,
    EXIT_STORAGE,
    EXIT_UNHEALTHY,
    LAUNCHED_BY,
    UNHEALTHY_FILE,
)
from llama_jax.resilience.cluster import LABEL_ENV, label_nodes, unhealthy_hosts

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_POLL_S = 0.05  # how quickly a received signal is forwarded to the child
_LOG_PREFIX = "llama-jax supervise:"


@dataclasses.dataclass(frozen=True)
class Policy:
    """When to restart; the defaults live in the CLI (`llama-jax supervise --help`)."""

    max_restarts: int  # consecutive restarts before giving up
    backoff: float  # seconds before the first restart of a streak, doubled for each further one
    max_backoff: float
    reset_after: float  # a child that ran longer than this starts a new streak when it fails
    grace: float  # seconds the child has to exit after a forwarded SIGTERM before SIGKILL


def meaning(returncode: int) -> str:
    """What a child's returncode means (negative: killed by that signal, as subprocess reports it)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return {
        EXIT_OK: "finished",
        EXIT_BAD_INPUT: "bad input",
        EXIT_PREEMPTED: "preempted, checkpoint saved",
        EXIT_HANG: "hang watchdog fired",
        EXIT_PEER_TIMEOUT: "a peer missed a barrier",
        EXIT_UNHEALTHY: "unhealthy device",
        EXIT_STORAGE: "checkpoint storage failing",
    }.get(returncode, "failed")


def exit_status(returncode: int) -> int:
    """The status to exit with for a child's returncode: its own, or 1 ("failed") if a signal killed it."""
    return returncode if returncode >= 0 else 1


def run_dir_of(command: list[str]) -> Path | None:
    """The last `run.dir=` argument of the command (later overrides win, as in the trainer)."""
    dirs = [arg.split("=", 1)[1] for arg in command if arg.startswith("run.dir=")]
    return Path(dirs[-1]) if dirs else None


def log(message: str) -> None:
    print(f"{_LOG_PREFIX} {message}", file=sys.stderr, flush=True)


class Supervisor:
    """Runs one command until it succeeds, fails for good, or the supervisor is told to stop."""

    def __init__(self, command: list[str], policy: Policy) -> None:
        self.command = command
        self.policy = policy
        self.run_dir = run_dir_of(command)
        self.failures = 0  # restarts in the current streak
        self.stop_signal: int | None = None  # set by the signal handler, acted on by the main loop

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in _STOP_SIGNALS}
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Only record it: forwarding happens in the wait loop, which also covers a signal that arrives
        # between two children or before the first one has started.
        self.stop_signal = self.stop_signal or signum

    def _loop(self) -> int:
        attempt = 0
        while True:
            attempt += 1
            if self.stop_signal is not None:
                return self._stopped_between_children()
            log(f"start #{attempt}: {shlex.join(self.command)}")
            started, t0, verdict_before = time.time(), time.monotonic(), self._verdict_identity()
            try:
                returncode = self._run_child()
            except OSError as err:  # no such executable, not executable: retrying will not help
                log(f"cannot start the command: {err}")
                return EXIT_BAD_INPUT
            ran = time.monotonic() - t0
            returncode = self._unhealthy_verdict(returncode, verdict_before)
            log(f"#{attempt} {meaning(returncode)} (exit {returncode}) after {ran:.1f}s")
            action, wait = self._decide(returncode, ran)
            self._record(
                attempt=attempt,
                start=started,
                end=time.time(),
                exit_code=returncode,
                meaning=meaning(returncode),
                action=action,
                wait_s=wait,
            )
            if action != "restart":
                return exit_status(returncode)
            if self._sleep(wait):
                return self._stopped_between_children()

    def _decide(self, returncode: int, ran: float) -> tuple[str, float | None]:
        """("done" | "stop" | "give up" | "restart", seconds to wait before the restart); logs why."""
        if returncode == EXIT_OK:
            return "done", None
        if returncode == EXIT_BAD_INPUT:
            log(f"exit {EXIT_BAD_INPUT} means bad config or data, which a restart will not fix: not restarting")
            return "stop", None
        if returncode == EXIT_UNHEALTHY:
            log(
                f"exit {EXIT_UNHEALTHY} means the pre-flight check named an unhealthy device, which a restart on the "
                "same hosts meets again: not restarting; exclude its host (named above and in run.dir/unhealthy.json)"
            )
            self._keep_off_unhealthy_nodes()
            return "stop", None
        if returncode == EXIT_STORAGE:
            log(
                f"exit {EXIT_STORAGE} means checkpoints could not be written (full, read-only or failing storage), "
                "which a restart meets again: not restarting; free space or fix the filesystem (named above)"
            )
            return "stop", None
        if self.stop_signal is not None:
            log(f"stopping as asked by {signal.Signals(self.stop_signal).name}: not restarting")
            return "stop", None
        if ran > self.policy.reset_after:
            self.failures = 0
        self.failures += 1
        if self.failures > self.policy.max_restarts:
            log(
                f"giving up after {self.policy.max_restarts} restarts in a row; "
                f"last status {exit_status(returncode)} ({meaning(returncode)})"
            )
            return "give up", None
        # The exponent is capped so a huge --max-restarts cannot overflow the float.
        wait = min(self.policy.backoff * 2.0 ** min(self.failures - 1, 64), self.policy.max_backoff)
        log(f"restart {self.failures} of {self.policy.max_restarts} in {wait:g}s")
        return "restart", wait

    def _keep_off_unhealthy_nodes(self) -> None:
        """Where the launcher asks for it (launch/k8s.sh), label the nodes the verdict names, so that the
        scheduler keeps the job's replacement pods off them (cluster.py)."""
        label = os.environ.get(LABEL_ENV)
        hosts = unhealthy_hosts(self.run_dir / UNHEALTHY_FILE) if self.run_dir is not None else []
        if label and hosts:
            for line in label_nodes(hosts, label):
                log(line)

    def _verdict_identity(self) -> tuple[int, int, int] | None:
        """Which run.dir/unhealthy.json is there now (inode, size, mtime), if any."""
        try:
            found = (self.run_dir / UNHEALTHY_FILE).stat() if self.run_dir is not None else None
        except OSError:
            return None
        return None if found is None else (found.st_ino, found.st_size, found.st_mtime_ns)

    def _unhealthy_verdict(self, returncode: int, before: tuple[int, int, int] | None) -> int:
        """EXIT_UNHEALTHY for a failed attempt that wrote run.dir/unhealthy.json, else returncode. The file is
        this attempt's if it was not there, or was another file, when the attempt started (times alone took an
        earlier attempt's verdict written within a second of this start for this one's)."""
        now = self._verdict_identity()
        if returncode in (EXIT_OK, EXIT_UNHEALTHY) or now is None or now == before:
            return returncode
        log(
            f"exit {returncode}, but this attempt's pre-flight check wrote {self.run_dir / UNHEALTHY_FILE}: taken as "
            f"exit {EXIT_UNHEALTHY}"
        )
        return EXIT_UNHEALTHY

    def _run_child(self) -> int:
        # Own process group: the trainer's helper processes get our forwarded SIGTERM too, and a Ctrl-C
        # in the terminal reaches only us, so the child sees exactly one SIGTERM (from us).
        # The child knows it runs under a supervisor: a run that saves no checkpoint periodically warns.
        env = {**os.environ, LAUNCHED_BY: os.environ.get(LAUNCHED_BY, "llama-jax supervise")}
        child = subprocess.Popen(self.command, process_group=0, env=env)
        deadline: float | None = None
        while True:
            if self.stop_signal is not None and deadline is None:
                log(
                    f"received {signal.Signals(self.stop_signal).name}: sending SIGTERM to the command, "
                    f"waiting up to {self.policy.grace:g}s"
                )
                _signal_group(child.pid, signal.SIGTERM)
                deadline = time.monotonic() + self.policy.grace
            if deadline is not None and time.monotonic() > deadline:
                log(f"still running {self.policy.grace:g}s after SIGTERM: sending SIGKILL")
                _signal_group(child.pid, signal.SIGKILL)
                deadline = float("inf")
            try:
                returncode = child.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                continue
        # Helpers the child left behind (data workers, a killed trainer's subprocesses) could hold
        # accelerator memory or ports the next attempt needs. The group id stays reserved while any
        # member lives, so this cannot hit an unrelated process.
        if _signal_group(child.pid, signal.SIGKILL):
            log("killed processes the command left behind")
        return returncode

    def _sleep(self, seconds: float) -> bool:
        """Sleep, but wake up for a stop signal; True if one arrived."""
        end = time.monotonic() + seconds
        while self.stop_signal is None and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, _POLL_S))
        return self.stop_signal is not None

    def _stopped_between_children(self) -> int:
        # Nothing is running, and the newest checkpoint is where the next run resumes: to whoever sent
        # the signal (a scheduler) this is a preemption, to be requeued.
        log(
            f"stopping as asked by {signal.Signals(self.stop_signal or signal.SIGTERM).name} "
            f"(no command running): exit {EXIT_PREEMPTED}"
        )
        return EXIT_PREEMPTED

    def _record(self, **fields: object) -> None:
        # Only into a directory the trainer has created: the supervisor must not make a run.dir
        # that a bad-input run would have refused to create.
        if self.run_dir is not None and self.run_dir.is_dir():
            try:
                with open(self.run_dir / "supervisor.jsonl", "a") as f:
                    f.write(json.dumps(fields) + "\n")
            except OSError as err:  # a full or read-only run.dir: the log line above says it all
                log(f"could not append to {self.run_dir / 'supervisor.jsonl'}: {err.strerror or err}")


def _signal_group(pgid: int, sig: int) -> bool:
    """Send sig to a process group; False if the group has no processes left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def supervise(command: list[str], policy: Policy) -> int:
    """Run command under policy; returns the status the supervisor should exit with."""
    return Supervisor(command, policy).run()
