"""The commands that plan a run before it runs: `plan` (its compiled step), `tune` (the fastest layout that fits)
and `goodput` (its effective training time under failures).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from llama_jax.cli.arguments import DEVICES_PER_HOST_HELP, add_target, int_list, split_source, target_gpus
from llama_jax.errors import InputError
from llama_jax.files import unreadable, unwritable


def cmd_plan(ns: argparse.Namespace) -> int:
    gpus = target_gpus(ns)
    from llama_jax.config import load_config
    from llama_jax.config.stages import resolve
    from llama_jax.distributed import sharding
    from llama_jax.planning import plan as planning
    from llama_jax.planning import plan_report

    config = load_config(*split_source(ns.args))
    mesh = sharding.make_mesh(config, list(gpus) or None)
    if ns.compare_remat:
        plans = planning.compare_remat(
            config, mesh, print_fn=None if ns.json else print, devices_per_host=ns.devices_per_host
        )
        print(
            json.dumps({k: plan_report.plan_dict(p) for k, p in plans.items()}, indent=2)
            if ns.json
            else plan_report.format_remat_comparison(plans)
        )
        return 0
    stages = resolve(config)
    if len(stages) > 1:  # a staged run: every stage on its own mesh, and what they add up to
        plans = planning.stage_plans(stages, lambda c: sharding.make_mesh(c, list(gpus) or None), ns.devices_per_host)
        print(plan_report.stage_plans_json(stages, plans) if ns.json else plan_report.format_stage_plans(stages, plans))
        return 0
    plan = planning.make_plan(config, mesh, ns.devices_per_host)
    print(plan_report.plan_json(plan) if ns.json else plan_report.format_plan(plan))
    return 0


def add_plan(commands) -> None:
    parser = commands.add_parser(
        "plan",
        help="compile the train step ahead of time and report memory, FLOPs and communication",
        description="llama-jax plan [PRESET|CONFIG.yaml] [key=value ...] [--json]. Runs nothing and allocates "
        "nothing; simulate devices with XLA_FLAGS=--xla_force_host_platform_device_count=N.",
    )
    parser.add_argument("args", nargs="*", metavar="PRESET|CONFIG|key=value")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--compare-remat",
        action="store_true",
        help="plan every remat policy side by side (memory and HLO FLOPs relative to none)",
    )
    parser.add_argument("--devices-per-host", type=int, default=0, help=DEVICES_PER_HOST_HELP)
    add_target(parser)
    parser.set_defaults(func=cmd_plan)


def cmd_tune(ns: argparse.Namespace) -> int:
    source, overrides = split_source(ns.args)
    policies, schedules = _searched_choices(ns)
    _check_tune_figures(ns)
    out = Path(ns.out)
    if problem := unwritable(out, "file"):
        raise InputError(f"--out {out} cannot be written: {problem}; name the YAML file to write, e.g. tune.yaml")
    gpus = target_gpus(ns)
    options = _tune_options(ns, policies, schedules, gpus)
    if ns.dry_run:
        _print_candidates(source, overrides, options)
        return 0
    _tune_and_write(ns, source, overrides, options, out)
    if not ns.json:
        print(f"wrote {out}: llama-jax train {out}")
    return 0


def _searched_choices(ns: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """--policies and --pipeline-schedules as tuples, each name checked."""
    from llama_jax.config.choices import PIPELINE_SCHEDULES, REMAT_POLICIES

    policies = tuple(ns.policies.split(","))
    unknown = [p for p in policies if p not in REMAT_POLICIES]
    if unknown:
        raise InputError(f"--policies: unknown remat policy '{unknown[0]}'; valid: {', '.join(REMAT_POLICIES)}")
    schedules = tuple(ns.pipeline_schedules.split(","))
    if any(s not in PIPELINE_SCHEDULES for s in schedules):
        raise InputError(
            f"--pipeline-schedules: choose from {', '.join(PIPELINE_SCHEDULES)}, got '{ns.pipeline_schedules}'"
        )
    return policies, schedules


def _check_tune_figures(ns: argparse.Namespace) -> None:
    """The budgets, counts and cost-model figures in their ranges."""
    if ns.memory_gb < 0 or ns.budget_min <= 0 or ns.top_k < 1 or ns.steps < 1 or ns.meshes < 1:
        raise InputError("tune: --memory-gb must be >= 0, and --budget-min, --top-k, --steps, --meshes positive")
    if (
        not 0 <= ns.efficiency <= 1
        or min(ns.bandwidth_gbs, ns.nic_gbs) < 0
        or not (ns.overlap == -1 or 0 <= ns.overlap <= 1)
    ):
        raise InputError("tune: --efficiency and --overlap must be in [0, 1], --bandwidth-gbs and --nic-gbs >= 0")


def _tune_options(ns: argparse.Namespace, policies: tuple[str, ...], schedules: tuple[str, ...], gpus: tuple):
    """tune.Options from the command line."""
    from llama_jax.planning import tune

    return tune.Options(
        memory_gb=ns.memory_gb,
        budget_min=ns.budget_min,
        top_k=ns.top_k,
        measure=ns.measure,
        steps=ns.steps,
        meshes=ns.meshes,
        policies=policies,
        microbatches=ns.microbatches,
        every_n_layers=ns.every_n_layers,
        pipeline_repeats=ns.pipeline_repeats,
        pipeline_schedules=schedules,
        pass_microbatches=ns.pass_microbatches,
        efficiency=ns.efficiency,
        bandwidth_gbs=ns.bandwidth_gbs,
        overlap=ns.overlap,
        nic_gbs=ns.nic_gbs,
        devices_per_host=ns.devices_per_host,
        devices=gpus,
        progress=not ns.json,
    )


def _print_candidates(source: str | None, overrides: list[str], options) -> None:
    """--dry-run: every stage's candidates, and why the invalid ones are refused."""
    from llama_jax.planning import tune, tune_space

    searches = tune.stage_searches(source, overrides, options)  # one for a run without train.stages
    for stage, base, pins in searches:
        if len(searches) > 1:
            print(stage.describe())
        print(tune_space.format_candidates(tune.enumerate_candidates(base, pins, options)[2]))


def _tune_and_write(ns: argparse.Namespace, source: str | None, overrides: list[str], options, out: Path) -> None:
    """Tune every stage, write the winner's config (a staged run's: every stage's) and print the report."""
    from llama_jax.config import load_config
    from llama_jax.planning import tune, tune_report

    tunings = tune.tune_stages(source, overrides, options)
    if len(tunings) > 1:
        tune_report.write_stage_winners(tunings, load_config(source, overrides), out)
        print(
            tune_report.stage_reports_json(tunings) if ns.json else tune_report.format_stage_reports(tunings, ns.rows)
        )
    else:
        tune_report.write_winner(tunings[0].report, out)
        report = tunings[0].report
        print(tune_report.report_json(report) if ns.json else tune_report.format_report(report, rows=ns.rows))


def add_tune(commands) -> None:
    parser = commands.add_parser(
        "tune",
        help="search mesh x micro-batches x remat for the fastest configuration that fits in memory",
        description="llama-jax tune [PRESET|CONFIG.yaml] [key=value ...]. Compiles candidates ahead of time, ranks "
        "them with a cost model, measures the best few on real devices and writes the winner's "
        "config. A key=value on a searched key (mesh.*, train.microbatches, remat.policy, "
        "remat.every_n_layers) pins it. Cached: a re-run is instant.",
    )
    parser.add_argument("args", nargs="*", metavar="PRESET|CONFIG|key=value")
    parser.add_argument(
        "--memory-gb",
        type=float,
        default=0.0,
        help="per-device memory budget in GiB (default: run.device_memory_gb, else the device's memory minus 10%%)",
    )
    parser.add_argument("--budget-min", type=float, default=10.0, help="minutes of compiling, at most (default 10)")
    parser.add_argument("--top-k", type=int, default=3, help="candidates to measure (default 3)")
    parser.add_argument(
        "--measure",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the top-k for a few steps (default: on, except on simulated CPU devices)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measured candidate (default 3)")
    parser.add_argument(
        "--meshes",
        type=int,
        default=3,
        help="the best N meshes of stage 1 get every micro-batch count and policy (default 3)",
    )
    _add_search_space(parser)
    _add_cost_model(parser)
    parser.add_argument("--rows", type=int, default=20, help="table rows to print (default 20)")
    parser.add_argument("--out", default="tune.yaml", help="the winner's config file (default tune.yaml)")
    parser.add_argument("--json", action="store_true", help="print every candidate as JSON")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="list the candidates and why the invalid ones are refused; compile nothing",
    )
    add_target(parser)
    parser.set_defaults(func=cmd_tune)


def _add_search_space(parser: argparse.ArgumentParser) -> None:
    """tune's searched values: remat policies, micro-batch counts, pipeline repeats, schedules and passes."""
    parser.add_argument(
        "--policies",
        default="none,save_dot_except_mlp,selective,full",
        help="remat policies to try, comma-separated (default none,save_dot_except_mlp,selective,full)",
    )
    parser.add_argument(
        "--microbatches",
        type=int_list,
        default=(1, 2, 4),
        help="micro-batch counts (default 1,2,4; with P pipeline stages, these times P)",
    )
    parser.add_argument(
        "--pipeline-repeats",
        type=int_list,
        default=(1, 2),
        help="mesh.pipeline_repeats tried with a pipeline (default 1,2)",
    )
    parser.add_argument(
        "--pipeline-schedules",
        default="gpipe,1f1b",
        help="mesh.pipeline_schedule values tried with a pipeline, comma-separated (default gpipe,1f1b)",
    )
    parser.add_argument(
        "--pass-microbatches",
        type=lambda text: int_list(text, least=0),
        default=(0,),
        help="micro-batches per pass through a pipeline of P stages, these times P (0: one pass of all; default 0)",
    )
    parser.add_argument(
        "--every-n-layers",
        type=int_list,
        default=(1, 2),
        help="remat.every_n_layers values for recomputing policies (default 1,2)",
    )


def _add_cost_model(parser: argparse.ArgumentParser) -> None:
    """The cost model's figures tune ranks candidates with, where the defaults do not fit."""
    parser.add_argument(
        "--efficiency",
        type=float,
        default=0.0,
        help="cost model: fraction of peak FLOP/s reached (default 0.7 on GPUs, 0.8 on CPUs)",
    )
    parser.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=0.0,
        help="cost model: collective GB/s per device within a host (default: the data sheet's NVLink "
        "or PCIe figure on known GPUs, e.g. 450 on an H100 SXM; measured on CPUs)",
    )
    parser.add_argument(
        "--nic-gbs",
        type=float,
        default=0.0,
        help="cost model: collective GB/s per device between hosts (default 50: one 400 Gb/s NIC per "
        "GPU; at most the link within a host)",
    )
    parser.add_argument("--devices-per-host", type=int, default=0, help=DEVICES_PER_HOST_HELP)
    parser.add_argument(
        "--overlap",
        type=float,
        default=-1.0,
        help="cost model: fraction of communication hidden by compute (default 0.5 GPU, 0 CPU)",
    )


def cmd_goodput(ns: argparse.Namespace) -> int:
    # --spares: a count; auto (None here); not given, auto for a launched run and none for one started by hand
    by_hand = ns.spares is None and ns.without_launcher
    spares = 0 if by_hand else None if ns.spares == "auto" else ns.spares
    rates = (ns.failures_per_gpu_hour, ns.planned_per_gpu_hour, ns.replacement_s, ns.restart_s, spares)
    if (
        any(v is not None and v < 0 for v in rates)
        or not (ns.host_loss_share is None or 0 <= ns.host_loss_share <= 1)
        or (ns.repair_hours is not None and ns.repair_hours <= 0)
    ):
        raise InputError(
            "goodput: --failures-per-gpu-hour, --planned-per-gpu-hour, --replacement-s, --restart-s and --spares "
            "must be >= 0, --host-loss-share in [0, 1], --repair-hours > 0"
        )
    if ns.run_dir and (problem := unreadable(Path(ns.run_dir), "directory")):
        raise InputError(f"goodput: --from {problem}; name the run.dir of a run")
    from llama_jax.config import load_config
    from llama_jax.planning import goodput_projection as projection
    from llama_jax.planning import goodput_report

    source, overrides = split_source(ns.args)
    launcher = [] if ns.without_launcher else list(projection.LAUNCHER_KEYS)  # before the user's, as they add them
    config = load_config(source, [*launcher, *overrides])
    given = {k: v for k, v in (("replacement_s", ns.replacement_s), ("restart_s", ns.restart_s)) if v is not None}
    inputs = projection.inputs_for(
        config,
        ns.gpus,
        ns.gpus_per_host,
        projection.measured(Path(ns.run_dir)) if ns.run_dir else None,
        failures_per_gpu_hour=ns.failures_per_gpu_hour,
        planned_per_gpu_hour=ns.planned_per_gpu_hour,
        host_loss_share=ns.host_loss_share,
        spare_hosts=spares,
        repair_hours=ns.repair_hours,
        **given,
    )
    if by_hand:
        none = "none: a run started by hand (--without-launcher)"
        inputs = dataclasses.replace(inputs, sources={**inputs.sources, "spare_hosts": none})
    if ns.without_launcher:  # no batch script on the first host: its loss is detected as any host's
        as_any = "as any host's: a run started by hand (--without-launcher)"
        sources = {**inputs.sources, "first_host_detect_s": as_any}
        inputs = dataclasses.replace(inputs, first_host_detect_s=0.0, sources=sources)
    report = goodput_report.report(inputs)
    parts = projection.start_parts(Path(ns.run_dir)) if ns.run_dir else {}
    if ns.json:
        print(goodput_report.report_json(report | ({"start_parts": parts} if parts else {})))
    else:
        print(goodput_report.format_report(report, source or "tiny", inputs))
        if parts:
            print(projection.format_start_parts(parts))
    return 0


def spares_count(text: str) -> int | str:
    """--spares: a whole number, or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--spares takes a whole number or auto, not {text!r}") from None


def add_goodput(commands) -> None:
    parser = commands.add_parser(
        "goodput",
        help="project the effective training time of a run under failures, and the best checkpoint intervals",
        description="llama-jax goodput [PRESET|CONFIG.yaml] [key=value ...] --gpus N [--gpus-per-host 8] "
        "[--from RUN_DIR] [--json]. The run as the cluster launchers start it (launch/defaults.sh's keys before "
        "yours; hot spares: auto) unless --without-launcher. Failures as Poisson at Llama 3's rate and mix by "
        "default; costs measured by the run in --from (its goodput.json), else stated defaults, each printed "
        "with its source (docs/fault-tolerance.md).",
    )
    parser.add_argument("args", nargs="*", metavar="PRESET|CONFIG|key=value")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the run")
    parser.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per host (default 8)")
    parser.add_argument(
        "--from",
        dest="run_dir",
        metavar="RUN_DIR",
        help="a run.dir whose goodput.json gives the measured costs (step, saves, restores, restarts)",
    )
    _add_failures(parser)
    _add_recovery(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help="print an object with goodput, breakdown, intervals, and the inputs with sources",
    )
    parser.set_defaults(func=cmd_goodput)


def _add_failures(parser: argparse.ArgumentParser) -> None:
    """goodput's failures: how often the run is interrupted, and how often that loses a host."""
    parser.add_argument(
        "--failures-per-gpu-hour",
        type=float,
        help="unexpected interruptions per GPU-hour (default Llama 3's: 419 / (16,384 x 54 x 24 h))",
    )
    parser.add_argument(
        "--planned-per-gpu-hour",
        type=float,
        help="planned interruptions (preemptions) per GPU-hour (default Llama 3's 47 / the same)",
    )
    parser.add_argument(
        "--host-loss-share",
        type=float,
        help="share of the unexpected interruptions that lose a host (default Llama 3's, 0.84)",
    )


def _add_recovery(parser: argparse.ArgumentParser) -> None:
    """goodput's recovery: a replacement host, the restart, the hot spares, the launcher and a lost host's repair."""
    parser.add_argument(
        "--replacement-s",
        type=float,
        help="seconds to get a host from the scheduler where no spare is free (default 600)",
    )
    parser.add_argument(
        "--restart-s",
        type=float,
        help="seconds from a failure noticed to the first step (default: the sum of a restart's parts, printed)",
    )
    parser.add_argument(
        "--spares",
        type=spares_count,
        help="hot spare hosts, as slurm.sbatch --spares and k8s.sh --spares keep them (default auto: the count that "
        "trains the most per GPU allocated; 0 with --without-launcher)",
    )
    parser.add_argument(
        "--without-launcher",
        action="store_true",
        help="project `llama-jax train` started by hand: without the keys the cluster launchers add "
        "(launch/defaults.sh: the node-local tier, pre-flight) and without spares",
    )
    parser.add_argument(
        "--repair-hours",
        type=float,
        help="hours until a lost host is a spare again (default: the stated assumption, printed with the inputs)",
    )
