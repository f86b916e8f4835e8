"""The commands that read what a run wrote: `report` (report.png from metrics.jsonl) and `profile` (where its traced
steps spent their time).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llama_jax.errors import InputError
from llama_jax.files import unreadable


def cmd_report(ns: argparse.Namespace) -> int:
    from llama_jax.training.report import write_report

    if problem := unreadable(Path(ns.run_dir), "directory"):  # missing, a file or unreadable: before any read
        raise InputError(f"report: {problem}; name the run.dir of a run")
    try:
        print(write_report(Path(ns.run_dir)))
    except (OSError, ValueError) as err:  # no metrics yet or unreadable, a corrupt line, report.png not writable
        raise InputError(str(err)) from None
    return 0


def cmd_profile(ns: argparse.Namespace) -> int:
    from llama_jax.perf.profile import report

    print(report(Path(ns.run_dir), top=ns.top, as_json=ns.json))
    return 0


def add_report(commands) -> None:  # and profile: both read what a run wrote
    parser = commands.add_parser("report", help="plot loss, eval loss and throughput of a run to RUN_DIR/report.png")
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.set_defaults(func=cmd_report)
    parser = commands.add_parser("profile", help="where the steps run.profile_steps traced spent their time")
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    parser.add_argument("--top", type=int, default=10, help="ops to list, the longest first (default 10)")
    parser.set_defaults(func=cmd_profile)
