"""One run.dir, one trainer: the lease a training run holds on its run.dir, in ``<run.dir>/holder.json``.

Two runs writing one run.dir would each save, and each delete the other's checkpoints by its keep policy. So
process 0 of a run takes the run.dir's lease before it writes anything there, renews it while it trains, and
gives it back when it ends; a multi-process run holds it once, as one run. The file says who holds it: host,
node, pid, since when, and a beat counter the holder raises every lease_s / 6.

A second run is refused (one line naming the holder, exit 2, nothing written) while the holder lives. A holder
that is gone is taken over at once or within one lease, so a restart after a crash or a requeue never waits for
a person:
- on this host (the same host name), the holder is gone when its pid is, or when that pid is another process
  (its start time, from /proc, is not the holder's);
- on another host, the holder lives while its beat moves: the run watches the file for up to run.lease_s
  (measured on its own clock, so skewed clocks between hosts do not matter) and takes it over when it did not.
A holder that finds the file naming someone else (it was stopped for longer than the lease and was taken over)
stops at once, writing nothing more.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from llama_jax.distributed.processes import node_name
from llama_jax.errors import EXIT_HANG, ConfigError
from llama_jax.files import atomic_path

HOLDER_FILE = "holder.json"
BEATS_PER_LEASE = 6  # the holder renews 6 times per lease: a live one is seen to beat well within it
_POLL_S = 0.5


def _started(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks after boot (/proc/PID/stat's field 22): a pid and this
    name one process, where a pid alone may have been reused. None where /proc does not say (not Linux, gone)."""
    fields = _stat(pid)
    return fields[19] if fields else None


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command's name (state first), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (a zombie, killed and not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    fields = _stat(pid)
    return not (fields and fields[0] in ("Z", "X"))


def _read(path: Path) -> dict | None:
    """The holder's record, or None where there is none (or it is being replaced: read again)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # a torn or foreign file: nobody valid holds it
        return {}


def describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("since", 0)))
    node = f" (node {holder['node']})" if holder.get("node") and holder.get("node") != holder.get("host") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{node} since {since}"


class RunDirLease:
    """The lease of `run_dir` for this process. `problem()` says whether a live run holds it and writes nothing;
    `take()` takes it (making run_dir), `release()` gives it back; in between a daemon thread renews it."""

    def __init__(self, run_dir: Path, lease_s: float):
        self.path = Path(run_dir) / HOLDER_FILE
        self.lease_s = lease_s
        self.host = socket.gethostname()
        self.record = {
            "host": self.host,
            "node": node_name(),
            "pid": os.getpid(),
            "started": _started(os.getpid()),
            "token": uuid.uuid4().hex,
            "since": time.time(),
            "beat": 0,
            "lease_s": lease_s,
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Holders on another host (token, beat) already watched for a whole lease without a beat: a check then a
        # take (train's, then execute's) waits once, not twice.
        self._still: set[tuple] = set()

    @classmethod
    def of(cls, config) -> RunDirLease:
        """The lease of a run's run.dir, on its config's terms (run.lease_s)."""
        return cls(Path(config.run.dir), config.run.lease_s)

    def taken_for(self, peers) -> RunDirLease:
        """This lease, taken by process 0 for every process of the run; ConfigError (on all) if a live run holds
        it."""
        if held := peers.broadcast("run.dir lease", self.take() if peers.index == 0 else ""):
            raise ConfigError(held)
        return self

    # Who holds it.

    def _alive(self, holder: dict) -> bool:
        """Whether the holder in the file lives (on another host: waits until its beat moves or a lease passes)."""
        if not holder or holder.get("token") == self.record["token"]:
            return False
        if holder.get("host") == self.host:
            pid = holder.get("pid")
            if not isinstance(pid, int) or not _pid_alive(pid):
                return False
            started = _started(pid)
            return started is None or holder.get("started") in (None, started)
        if (holder.get("token"), holder.get("beat")) in self._still:
            return False
        lease = float(holder.get("lease_s") or self.lease_s)
        deadline = time.monotonic() + max(lease, self.lease_s)
        while time.monotonic() < deadline:
            time.sleep(_POLL_S)
            now = _read(self.path)
            if now is None or now.get("token") != holder.get("token"):
                return False  # given back, or taken by another: look again (acquire's loop)
            if now.get("beat") != holder.get("beat"):
                return True
        self._still.add((holder.get("token"), holder.get("beat")))
        return False

    def problem(self) -> str:
        """The one line refusing this run while a live run holds run.dir ("" when none does); reads only."""
        holder = _read(self.path)
        return self._held(holder) if holder is not None and self._alive(holder) else ""

    def _held(self, holder: dict) -> str:
        return (
            f"run.dir {self.path.parent} is held by a live training run: {describe(holder)} ({self.path}); "
            "stop that run first (or wait for it to end), or choose another run.dir"
        )

    # Holding it.

    def take(self) -> str:
        """Take the lease: create the file if there is none, else take it over from a holder that is gone.
        "" when taken, else the line refusing this run (a live run holds it)."""
        body = json.dumps(self.record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = _read(self.path)
                if holder is None:
                    continue  # given back meanwhile
                if self._alive(holder):
                    return self._held(holder)
                self._take_over(holder)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(body)
            break
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew, name="run-dir-lease", daemon=True)
        self._thread.start()
        return ""

    def _take_over(self, stale: dict) -> None:
        """Move the gone holder's file aside (one rename: of two runs taking over, one moves it); should the file
        moved be another's fresh one (taken over between our read and the rename), put it back."""
        aside = self.path.with_name(f".{HOLDER_FILE}.{self.record['token']}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = _read(aside) or {}
        if stale and moved.get("token") != stale.get("token"):
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        aside.unlink(missing_ok=True)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / BEATS_PER_LEASE):
            holder = _read(self.path)
            if holder is None or holder.get("token") != self.record["token"]:
                print(
                    f"llama-jax: error: this run lost run.dir {self.path.parent} to {describe(holder or {})} after "
                    f"not renewing its lease for run.lease_s={self.lease_s:g}s (was the process stopped?); "
                    "stopping without writing more",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_HANG)
            self.record["beat"] += 1
            try:
                with atomic_path(self.path) as tmp:
                    tmp.write_text(json.dumps(self.record))
            except OSError:  # a storage hiccup: the next beat tries again (the lease allows for 5 missed)
                pass

    def release(self) -> None:
        """Give the lease back (the file goes, if it still names this run)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        holder = _read(self.path)
        if holder and holder.get("token") == self.record["token"]:
            self.path.unlink(missing_ok=True)
