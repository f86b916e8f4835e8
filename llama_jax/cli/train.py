"""The commands around a training run: `train`, `prepare` (its data), `doctor` (its devices, before it starts) and
`supervise` (restarting it after failures).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llama_jax.cli.arguments import split_source
from llama_jax.errors import InputError


def cmd_train(ns: argparse.Namespace) -> int:
    from llama_jax.config import load_config, to_yaml

    config = load_config(*split_source(ns.args))
    if ns.print_config:
        print(to_yaml(config), end="")
        return 0
    import jax

    from llama_jax.planning.plan_report import describe_program
    from llama_jax.training.loop import train

    result = train(config, print_fn=print, started_at=ns.started_at, describe_program=describe_program)
    if jax.process_index() != 0:
        return result["exit_code"]
    if "final_eval_loss" in result:
        initial = result.get("initial_eval_loss")
        ratio = f" ({result['final_eval_loss'] / initial:.0%} of the initial {initial:.3f})" if initial else ""
        print(f"eval loss {result['final_eval_loss']:.3f}{ratio}")
    if "tokens_per_s" in result:
        fp8 = f" ({result['mfu_fp8']:.1%} of the fp8 peak)" if "mfu_fp8" in result else ""
        print(f"throughput {result['tokens_per_s']:,.0f} tokens/s, MFU {result['mfu']:.1%}{fp8}")
    if "report" in result:
        print(f"wall time {result['wall_time_s']:.0f}s; report: {result['report']}")
    return result["exit_code"]  # 0, or EXIT_PREEMPTED after a signal made the run save and stop


def add_train(commands) -> None:
    parser = commands.add_parser(
        "train",
        help="train a model (no arguments: the tiny preset on the bundled Shakespeare corpus)",
        description="llama-jax train [PRESET|CONFIG.yaml] [key=value ...]. Dotted keys override the preset, "
        "e.g. train.steps=100 model.n_layers=2 run.dir=runs/mine.",
    )
    parser.add_argument("args", nargs="*", metavar="PRESET|CONFIG|key=value")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.set_defaults(func=cmd_train)


def cmd_prepare(ns: argparse.Namespace) -> int:
    from llama_jax.data.corpus import ReadOptions
    from llama_jax.data.prepare import PrepareOptions, prepare

    prepare(
        PrepareOptions(
            inputs=tuple(ns.inputs),
            out=ns.out,
            tokenizer=ns.tokenizer or "",
            train_vocab=ns.train_tokenizer or 0,
            read=ReadOptions(ns.text_field, ns.text_unit, ns.on_bad_record),
            val_every_nth_doc=ns.val_every,
            workers=ns.workers,
            tokenizer_sample_mb=ns.tokenizer_sample_mb,
        )
    )
    return 0


def add_prepare(commands) -> None:
    parser = commands.add_parser(
        "prepare",
        help="tokenize text/jsonl/parquet/HF-dataset inputs into a token store for data.sources",
        description="llama-jax prepare INPUT [INPUT ...] --out DIR (--tokenizer PATH | --train-tokenizer VOCAB). "
        "An INPUT is a file, a directory, a glob, hf:DIR or shakespeare, optionally with a mixture "
        "weight: web/*.jsonl@0.7. Re-running is a no-op; an interrupted run resumes.",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT")
    parser.add_argument("--out", required=True, help="the token store directory to create")
    parser.add_argument(
        "--tokenizer",
        help="tokenizer.json, a Llama 3 tokenizer.model, a sentencepiece .model, or a directory holding one",
    )
    parser.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB",
        help="train a byte-level BPE with VOCAB tokens on the training documents",
    )
    parser.add_argument("--text-field", default="text", help="jsonl field / parquet or dataset column (default text)")
    parser.add_argument(
        "--text-unit",
        default="file",
        choices=("file", "paragraph", "line"),
        help=".txt/.md inputs: one document per file (default), paragraph or line",
    )
    parser.add_argument(
        "--val-every",
        type=int,
        default=20,
        metavar="N",
        help="hold out every N-th document for validation (default 20)",
    )
    parser.add_argument(
        "--on-bad-record",
        default="fail",
        choices=("fail", "skip"),
        help="a jsonl line that is not JSON or lacks the field: fail (default) or skip and count",
    )
    parser.add_argument("--workers", type=int, default=0, help="tokenizing processes (default: one per core)")
    parser.add_argument(
        "--tokenizer-sample-mb", type=int, default=256, help="text the BPE is trained on, at most (default 256)"
    )
    parser.set_defaults(func=cmd_prepare)


def cmd_doctor(ns: argparse.Namespace) -> int:
    import jax

    from llama_jax.config import load_config
    from llama_jax.distributed import processes, sharding
    from llama_jax.distributed.peers import Peers
    from llama_jax.resilience import preflight

    config = load_config(*split_source(ns.args))
    processes.initialize(config.run)
    mesh = sharding.make_mesh(config)
    peers = Peers(config.fault.barrier_timeout_s)
    primary = jax.process_index() == 0

    def note(line: str) -> None:  # that suspects are measured again: before the table (--json: in the document)
        if primary and not ns.json:
            print(line, flush=True)

    report = preflight.check(config, mesh, peers, print_fn=note)
    if primary:
        print(preflight.report_json(report) if ns.json else preflight.format_report(report))
    # Unhealthy: exit 71, and the verdict goes into run.dir only if that exists (doctor starts no run).
    preflight.enforce(report, Path(config.run.dir), create=False, peers=peers)
    return 0


def add_doctor(commands) -> None:
    parser = commands.add_parser(
        "doctor",
        help="check every device (matmul rate, memory bandwidth, a known product) and the mesh's collectives",
        description="llama-jax doctor [PRESET|CONFIG.yaml] [key=value ...] [--json]. The pre-flight check that "
        "fault.preflight=true runs before training, on the config's mesh, run by every process of a "
        "multi-process run: a device below fault.preflight_min_ratio (default 0.8) x the fleet median in "
        "most of the rounds that measure it again, or with a wrong product, is named; exit 0 when "
        "healthy, 71 when not, 2 on bad input.",
    )
    parser.add_argument("args", nargs="*", metavar="PRESET|CONFIG|key=value")
    parser.add_argument("--json", action="store_true", help="print every figure and the verdict as JSON")
    parser.set_defaults(func=cmd_doctor)


def cmd_supervise(ns: argparse.Namespace) -> int:
    from llama_jax.resilience.supervise import Policy, supervise

    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        raise InputError("supervise needs a command: llama-jax supervise [options] -- llama-jax train ... run.dir=DIR")
    if min(ns.max_restarts, ns.backoff, ns.max_backoff, ns.reset_after, ns.grace) < 0:
        raise InputError("supervise: --max-restarts, --backoff, --max-backoff, --reset-after and --grace must be >= 0")
    return supervise(
        command,
        Policy(
            max_restarts=ns.max_restarts,
            backoff=ns.backoff,
            max_backoff=ns.max_backoff,
            reset_after=ns.reset_after,
            grace=ns.grace,
        ),
    )


def add_supervise(commands) -> None:
    parser = commands.add_parser(
        "supervise",
        help="run a command, restarting it after failures (a train command resumes its run.dir)",
        description="llama-jax supervise [options] -- COMMAND ... Restarts COMMAND unless it exits 0, 2 (bad "
        "input) or 71 (an unhealthy device), with exponential backoff; SIGTERM/SIGINT are forwarded "
        "as SIGTERM and stop it.",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=10, metavar="N", help="give up after N restarts in a row (default 10)"
    )
    parser.add_argument(
        "--backoff",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds before the first restart, doubled for each further one (default 10)",
    )
    parser.add_argument(
        "--max-backoff", type=float, default=300.0, metavar="S", help="longest wait between restarts (default 300)"
    )
    parser.add_argument(
        "--reset-after",
        type=float,
        default=600.0,
        metavar="S",
        help="a command that ran longer than S seconds before failing starts a new streak: "
        "the restart count and backoff reset (default 600)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds the command has to exit after a forwarded SIGTERM before SIGKILL (default 120)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    parser.set_defaults(func=cmd_supervise)
