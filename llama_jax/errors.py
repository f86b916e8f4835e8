"""The failures a user can act on, and the exit status each one ends a command with.

Every command exits with one of these statuses, and `llama-jax supervise` (and a cluster's requeue
logic) decides from it whether a restart can help:

    EXIT_OK           0    finished
    EXIT_BAD_INPUT    2    bad config, mesh, data, tokenizer or checkpoint: a restart cannot fix it
    EXIT_UNAVAILABLE  69   the coordinator of a multi-process run did not answer (EX_UNAVAILABLE)
    EXIT_UNHEALTHY    71   the pre-flight check found a slow or wrong device (EX_OSERR): exclude its host, then
                           restart; a restart on the same hosts cannot fix it
    EXIT_STORAGE      74   checkpoints could not be written (full, read-only or failing storage; EX_IOERR): free
                           space or fix the filesystem, then restart; a restart alone would fail the same way
    EXIT_PREEMPTED    75   saved the current step after SIGTERM/SIGINT: restart to continue (EX_TEMPFAIL)
    EXIT_PEER_TIMEOUT 76   a process of a multi-process run did not reach a barrier in time (EX_PROTOCOL)
    EXIT_HANG         124  the hang watchdog fired (what coreutils `timeout` returns)

An error's message is one line that says what is wrong and how to fix it; the CLI prints it as
`llama-jax: error: ...` and exits with the error's `exit_code`.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_UNAVAILABLE = 69
EXIT_UNHEALTHY = 71
UNHEALTHY_FILE = "unhealthy.json"  # in run.dir: exit 71's verdict (preflight.py), for supervise and launch/
# Set by `llama-jax supervise` and the launchers for the commands they start: a run that restarts by itself
# and saves no checkpoint periodically would redo everything after each failure, so it warns.
LAUNCHED_BY = "LLAMA_JAX_LAUNCHED_BY"
EXIT_STORAGE = 74
EXIT_PREEMPTED = 75
EXIT_PEER_TIMEOUT = 76
EXIT_HANG = 124


class LlamaJaxError(Exception):
    """An expected failure with a one-line message; the CLI catches this one type."""

    exit_code = 1


class InputError(LlamaJaxError, ValueError):
    """Bad input, found before anything in run.dir is created or overwritten."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(InputError):
    """A bad configuration value, mesh, model spec or checkpoint."""


class DataError(InputError):
    """Bad data: a missing or unreadable input, a bad record, a mismatched tokenizer or token store."""


class CoordinatorUnavailable(LlamaJaxError, RuntimeError):
    """The coordination service of a multi-process run did not answer in time: not bad input, a restart may help."""

    exit_code = EXIT_UNAVAILABLE


class PeerTimeout(LlamaJaxError, RuntimeError):
    """Some processes of a multi-process run did not reach a barrier or an agreement in time; the message
    names them. Not bad input: a restart of every process (the supervisor's) may help."""

    exit_code = EXIT_PEER_TIMEOUT

    def __init__(self, message: str, missing: list[int] | tuple[int, ...] = ()):
        super().__init__(message)
        self.missing = list(missing)  # the absent processes, when known: the ones a hang report names


class UnhealthyDevice(LlamaJaxError, RuntimeError):
    """The pre-flight check (preflight.py) found a device far slower than the fleet, or one that computes wrong
    results; the message names each one (host, process, device id). Not bad input: the run can go on without
    that host, but restarting it on the same hosts cannot help."""

    exit_code = EXIT_UNHEALTHY


class StorageFailure(LlamaJaxError, OSError):
    """Durable checkpoints could not be written (no space, read-only, an I/O error, no permission, the directory
    gone) for checkpoint.max_failed_saves saves in a row, or the last save of a run failed. The message names the
    step, the reason, the directory and its free space. Not bad input, but a restart cannot help until the storage
    is fixed: the supervisor and the launchers stop (exit 74)."""

    exit_code = EXIT_STORAGE
