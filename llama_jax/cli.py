"""`llama-jax` command line: train, prepare, plan, tune, doctor, report, profile, convert, average, generate, eval,
supervise, goodput.

Every error a user can act on (errors.py) is reported as one line on stderr with its exit status: 2
for bad input (config, mesh, data, checkpoint). `train` checks its input before anything in run.dir is
created or overwritten.
The commands import their modules when they run, so `llama-jax --help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from llama_jax.errors import EXIT_PEER_TIMEOUT, InputError, LlamaJaxError
from llama_jax.files import unreadable, unwritable

DEVICES_PER_HOST_HELP = ("devices per host, to tell which collectives cross the network between hosts; must divide "
                         "the device count (default: the processes the devices belong to, one per host as launch/ "
                         "starts them; e.g. 8 plans a cluster of 8-GPU hosts on simulated devices)")


def _error(message: str) -> None:
    # One write: the lines of several processes sharing a terminal must not interleave mid-line.
    sys.stderr.write(f"llama-jax: error: {message}\n")
    sys.stderr.flush()


def _split_source(args: list[str]) -> tuple[str | None, list[str]]:
    """`[PRESET|CONFIG.yaml] [key=value ...]` -> (source, overrides)."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def cmd_train(ns: argparse.Namespace) -> int:
    from llama_jax.config import load_config, to_yaml

    config = load_config(*_split_source(ns.args))
    if ns.print_config:
        print(to_yaml(config), end="")
        return 0
    import jax

    from llama_jax.training.loop import train

    result = train(config, print_fn=print, started_at=ns.started_at)
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

def _add_train(commands) -> None:
    parser = commands.add_parser(
        "train", help="train a model (no arguments: the tiny preset on the bundled Shakespeare corpus)",
        description="llama-jax train [PRESET|CONFIG.yaml] [key=value ...]. Dotted keys override the preset, "
                    "e.g. train.steps=100 model.n_layers=2 run.dir=runs/mine.")
    parser.add_argument("args", nargs="*", metavar="PRESET|CONFIG|key=value")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    parser.set_defaults(func=cmd_train)


def _target_gpus(ns: argparse.Namespace) -> tuple:
    """--target GPU --gpus N [--gpus-per-host G]: compile-only GPUs of that cluster (perf/gpu_target.py), or ()."""
    if not ns.target:
        if ns.gpus or ns.gpus_per_host:
            raise InputError("--gpus and --gpus-per-host plan a cluster of --target GPUs, e.g. --target h100 --gpus 32")
        return ()
    if ns.devices_per_host:
        raise InputError("--devices-per-host is for simulated devices; with --target the hosts are --gpus-per-host")
    if not ns.gpus:
        raise InputError(f"--target {ns.target} needs --gpus N: how many GPUs the run has")
    # The compile needs no local GPU, and without a driver the CUDA plugin registers only on a CPU-only jax.
    if not os.environ.get("JAX_PLATFORMS"):
        os.environ["JAX_PLATFORMS"] = "cpu"
    from llama_jax.perf import gpu_target

    return tuple(gpu_target.devices(ns.target, ns.gpus, ns.gpus_per_host))

def _add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="h100, h200, a100 or b200: compile with XLA:GPU for a cluster of these "
                        "GPUs, on any machine (needs the gpu extra: Python >= 3.12)")
    parser.add_argument("--gpus", type=int, default=0, help="with --target: the GPUs of the run")
    parser.add_argument("--gpus-per-host", type=int, default=0, help="with --target: GPUs per host (default 8)")


def cmd_plan(ns: argparse.Namespace) -> int:
    gpus = _target_gpus(ns)
    from llama_jax.config import load_config
    from llama_jax.distributed import sharding
    from llama_jax.training import plan as planning

    config = load_config(*_split_source(ns.args))
    mesh = sharding.make_mesh(config, list(gpus) or None)
    if ns.compare_remat:
        plans = planning.compare_remat(config, mesh, print_fn=None if ns.json else print,
                                       devices_per_host=ns.devices_per_host)
        print(json.dumps({k: planning.plan_dict(p) for k, p in plans.items()}, indent=2) if ns.json
              else planning.format_remat_comparison(plans))
        return 0
    plan = planning.make_plan(config, mesh, ns.devices_per_host)
    print(planning.plan_json(plan) if ns.json else planning.format_plan(plan))
    return 0

def _add_plan(commands) -> None:
    parser = commands.add_parser(
        "plan", help="compile the train step ahead of time and report memory, FLOPs and communication",
        description="llama-jax plan [PRESET|CONFIG.yaml] [key=value ...] [--json]. Runs nothing and allocates "
                    "nothing; simulate devices with XLA_FLAGS=--xla_force_host_platform_device_count=N.")
    parser.add_argument("args", nargs="*", metavar="PRESET|CONFIG|key=value")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--compare-remat", action="store_true",
                        help="plan every remat policy side by side (memory and HLO FLOPs relative to none)")
    parser.add_argument("--devices-per-host", type=int, default=0, help=DEVICES_PER_HOST_HELP)
    _add_target(parser)
    parser.set_defaults(func=cmd_plan)


def cmd_doctor(ns: argparse.Namespace) -> int:
    import jax

    from llama_jax.config import load_config
    from llama_jax.distributed import processes, sharding
    from llama_jax.distributed.peers import Peers
    from llama_jax.resilience import preflight

    config = load_config(*_split_source(ns.args))
    processes.initialize(config.run)
    mesh = sharding.make_mesh(config)
    peers = Peers(config.fault.barrier_timeout_s)
    primary = jax.process_index() == 0

    def note(line: str) -> None:  # that suspects are measured again: before the table (--json: in the document)
        if primary and not ns.json:
            print(line, flush=True)

    report = preflight.check(config, mesh, peers, say=note)
    if primary:
        print(preflight.report_json(report) if ns.json else preflight.format_report(report))
    # Unhealthy: exit 71, and the verdict goes into run.dir only if that exists (doctor starts no run).
    preflight.enforce(report, Path(config.run.dir), create=False, peers=peers)
    return 0

def _add_doctor(commands) -> None:
    parser = commands.add_parser(
        "doctor", help="check every device (matmul rate, memory bandwidth, a known product) and the mesh's collectives",
        description="llama-jax doctor [PRESET|CONFIG.yaml] [key=value ...] [--json]. The pre-flight check that "
                    "fault.preflight=true runs before training, on the config's mesh, run by every process of a "
                    "multi-process run: a device below fault.preflight_min_ratio (default 0.8) x the fleet median in "
                    "most of the rounds that measure it again, or with a wrong product, is named; exit 0 when "
                    "healthy, 71 when not, 2 on bad input.")
    parser.add_argument("args", nargs="*", metavar="PRESET|CONFIG|key=value")
    parser.add_argument("--json", action="store_true", help="print every figure and the verdict as JSON")
    parser.set_defaults(func=cmd_doctor)


def _int_list(text: str, least: int = 1) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if min(values) < least:
        raise argparse.ArgumentTypeError(f"expected integers >= {least}, got '{text}'")
    return values


def cmd_tune(ns: argparse.Namespace) -> int:
    from llama_jax.config.choices import PIPELINE_SCHEDULES, REMAT_POLICIES

    source, overrides = _split_source(ns.args)
    policies = tuple(ns.policies.split(","))
    unknown = [p for p in policies if p not in REMAT_POLICIES]
    if unknown:
        raise InputError(f"--policies: unknown remat policy '{unknown[0]}'; valid: {', '.join(REMAT_POLICIES)}")
    schedules = tuple(ns.pipeline_schedules.split(","))
    if any(s not in PIPELINE_SCHEDULES for s in schedules):
        raise InputError(f"--pipeline-schedules: choose from {', '.join(PIPELINE_SCHEDULES)}, got "
                         f"'{ns.pipeline_schedules}'")
    if ns.memory_gb < 0 or ns.budget_min <= 0 or ns.top_k < 1 or ns.steps < 1 or ns.meshes < 1:
        raise InputError("tune: --memory-gb must be >= 0, and --budget-min, --top-k, --steps, --meshes positive")
    if not 0 <= ns.efficiency <= 1 or min(ns.bandwidth_gbs, ns.nic_gbs) < 0 or \
            not (ns.overlap == -1 or 0 <= ns.overlap <= 1):
        raise InputError("tune: --efficiency and --overlap must be in [0, 1], --bandwidth-gbs and --nic-gbs >= 0")
    out = Path(ns.out)
    if problem := unwritable(out, "file"):
        raise InputError(f"--out {out} cannot be written: {problem}; name the YAML file to write, e.g. tune.yaml")
    gpus = _target_gpus(ns)
    from llama_jax.training import tune

    options = tune.Options(
        memory_gb=ns.memory_gb, budget_min=ns.budget_min, top_k=ns.top_k, measure=ns.measure, steps=ns.steps,
        meshes=ns.meshes, policies=policies, microbatches=ns.microbatches, every_n_layers=ns.every_n_layers,
        pipeline_repeats=ns.pipeline_repeats, pipeline_schedules=schedules, pass_microbatches=ns.pass_microbatches,
        efficiency=ns.efficiency, bandwidth_gbs=ns.bandwidth_gbs, overlap=ns.overlap, nic_gbs=ns.nic_gbs,
        devices_per_host=ns.devices_per_host, devices=gpus, progress=not ns.json)
    if ns.dry_run:
        print(tune.format_candidates(tune.enumerate_candidates(source, overrides, options)[2]))
        return 0
    report = tune.tune(source, overrides, options)
    tune.write_winner(report, out)
    print(tune.report_json(report) if ns.json else tune.format_report(report, rows=ns.rows))
    if not ns.json:
        print(f"wrote {out}: llama-jax train {out}")
    return 0

def _add_tune(commands) -> None:
    parser = commands.add_parser(
        "tune", help="search mesh x micro-batches x remat for the fastest configuration that fits in memory",
        description="llama-jax tune [PRESET|CONFIG.yaml] [key=value ...]. Compiles candidates ahead of time, ranks "
                    "them with a cost model, measures the best few on real devices and writes the winner's "
                    "config. A key=value on a searched key (mesh.*, train.microbatches, remat.policy, "
                    "remat.every_n_layers) pins it. Cached: a re-run is instant.")
    parser.add_argument("args", nargs="*", metavar="PRESET|CONFIG|key=value")
    parser.add_argument("--memory-gb", type=float, default=0.0, help="per-device memory budget in GiB (default: "
                        "run.device_memory_gb, else the device's memory minus 10%%)")
    parser.add_argument("--budget-min", type=float, default=10.0, help="minutes of compiling, at most (default 10)")
    parser.add_argument("--top-k", type=int, default=3, help="candidates to measure (default 3)")
    parser.add_argument("--measure", action=argparse.BooleanOptionalAction, default=None,
                        help="time the top-k for a few steps (default: on, except on simulated CPU devices)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measured candidate (default 3)")
    parser.add_argument("--meshes", type=int, default=3,
                        help="the best N meshes of stage 1 get every micro-batch count and policy (default 3)")
    parser.add_argument("--policies", default="none,save_dot_except_mlp,selective,full",
                        help="remat policies to try, comma-separated (default none,save_dot_except_mlp,selective,full)")
    parser.add_argument("--microbatches", type=_int_list, default=(1, 2, 4),
                        help="micro-batch counts (default 1,2,4; with P pipeline stages, these times P)")
    parser.add_argument("--pipeline-repeats", type=_int_list, default=(1, 2),
                        help="mesh.pipeline_repeats tried with a pipeline (default 1,2)")
    parser.add_argument("--pipeline-schedules", default="gpipe,1f1b", help="mesh.pipeline_schedule values tried "
                        "with a pipeline, comma-separated (default gpipe,1f1b)")
    parser.add_argument("--pass-microbatches", type=lambda text: _int_list(text, least=0), default=(0,),
                        help="micro-batches per pass through a pipeline of P stages, these times P (0: one pass of "
                             "all; default 0)")
    parser.add_argument("--every-n-layers", type=_int_list, default=(1, 2),
                        help="remat.every_n_layers values for recomputing policies (default 1,2)")
    parser.add_argument("--efficiency", type=float, default=0.0, help="cost model: fraction of peak FLOP/s reached "
                        "(default 0.7 on GPUs, 0.8 on CPUs)")
    parser.add_argument("--bandwidth-gbs", type=float, default=0.0,
                        help="cost model: collective GB/s per device within a host (default: the data sheet's NVLink "
                             "or PCIe figure on known GPUs, e.g. 450 on an H100 SXM; measured on CPUs)")
    parser.add_argument("--nic-gbs", type=float, default=0.0,
                        help="cost model: collective GB/s per device between hosts (default 50: one 400 Gb/s NIC per "
                             "GPU; at most the link within a host)")
    parser.add_argument("--devices-per-host", type=int, default=0, help=DEVICES_PER_HOST_HELP)
    parser.add_argument("--overlap", type=float, default=-1.0,
                        help="cost model: fraction of communication hidden by compute (default 0.5 GPU, 0 CPU)")
    parser.add_argument("--rows", type=int, default=20, help="table rows to print (default 20)")
    parser.add_argument("--out", default="tune.yaml", help="the winner's config file (default tune.yaml)")
    parser.add_argument("--json", action="store_true", help="print every candidate as JSON")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the candidates and why the invalid ones are refused; compile nothing")
    _add_target(parser)
    parser.set_defaults(func=cmd_tune)


def cmd_prepare(ns: argparse.Namespace) -> int:
    from llama_jax.data.corpus import ReadOptions
    from llama_jax.data.prepare import PrepareOptions, prepare

    prepare(PrepareOptions(
        inputs=tuple(ns.inputs), out=ns.out, tokenizer=ns.tokenizer or "", train_vocab=ns.train_tokenizer or 0,
        read=ReadOptions(ns.text_field, ns.text_unit, ns.on_bad_record), val_every_nth_doc=ns.val_every,
        workers=ns.workers, tokenizer_sample_mb=ns.tokenizer_sample_mb))
    return 0

def _add_prepare(commands) -> None:
    parser = commands.add_parser(
        "prepare", help="tokenize text/jsonl/parquet/HF-dataset inputs into a token store for data.sources",
        description="llama-jax prepare INPUT [INPUT ...] --out DIR (--tokenizer PATH | --train-tokenizer VOCAB). "
                    "An INPUT is a file, a directory, a glob, hf:DIR or shakespeare, optionally with a mixture "
                    "weight: web/*.jsonl@0.7. Re-running is a no-op; an interrupted run resumes.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT")
    parser.add_argument("--out", required=True, help="the token store directory to create")
    parser.add_argument("--tokenizer", help="tokenizer.json, a Llama 3 tokenizer.model, a sentencepiece .model, "
                        "or a directory holding one")
    parser.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                        help="train a byte-level BPE with VOCAB tokens on the training documents")
    parser.add_argument("--text-field", default="text", help="jsonl field / parquet or dataset column (default text)")
    parser.add_argument("--text-unit", default="file", choices=("file", "paragraph", "line"),
                        help=".txt/.md inputs: one document per file (default), paragraph or line")
    parser.add_argument("--val-every", type=int, default=20, metavar="N",
                        help="hold out every N-th document for validation (default 20)")
    parser.add_argument("--on-bad-record", default="fail", choices=("fail", "skip"),
                        help="a jsonl line that is not JSON or lacks the field: fail (default) or skip and count")
    parser.add_argument("--workers", type=int, default=0, help="tokenizing processes (default: one per core)")
    parser.add_argument("--tokenizer-sample-mb", type=int, default=256,
                        help="text the BPE is trained on, at most (default 256)")
    parser.set_defaults(func=cmd_prepare)


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

def _add_report(commands) -> None:  # and profile: both read what a run wrote
    parser = commands.add_parser("report", help="plot loss, eval loss and throughput of a run to RUN_DIR/report.png")
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.set_defaults(func=cmd_report)
    parser = commands.add_parser("profile", help="where the steps run.profile_steps traced spent their time")
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--json", action="store_true", help="print the breakdown as JSON")
    parser.add_argument("--top", type=int, default=10, help="ops to list, the longest first (default 10)")
    parser.set_defaults(func=cmd_profile)


def cmd_supervise(ns: argparse.Namespace) -> int:
    from llama_jax.resilience.supervise import Policy, supervise

    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        raise InputError("supervise needs a command: llama-jax supervise [options] -- llama-jax train ... run.dir=DIR")
    if min(ns.max_restarts, ns.backoff, ns.max_backoff, ns.reset_after, ns.grace) < 0:
        raise InputError("supervise: --max-restarts, --backoff, --max-backoff, --reset-after and --grace must be >= 0")
    return supervise(command, Policy(max_restarts=ns.max_restarts, backoff=ns.backoff, max_backoff=ns.max_backoff,
                                     reset_after=ns.reset_after, grace=ns.grace))

def _add_supervise(commands) -> None:
    parser = commands.add_parser(
        "supervise", help="run a command, restarting it after failures (a train command resumes its run.dir)",
        description="llama-jax supervise [options] -- COMMAND ... Restarts COMMAND unless it exits 0, 2 (bad "
                    "input) or 71 (an unhealthy device), with exponential backoff; SIGTERM/SIGINT are forwarded "
                    "as SIGTERM and stop it.")
    parser.add_argument("--max-restarts", type=int, default=10, metavar="N",
                        help="give up after N restarts in a row (default 10)")
    parser.add_argument("--backoff", type=float, default=10.0, metavar="S",
                        help="seconds before the first restart, doubled for each further one (default 10)")
    parser.add_argument("--max-backoff", type=float, default=300.0, metavar="S",
                        help="longest wait between restarts (default 300)")
    parser.add_argument("--reset-after", type=float, default=600.0, metavar="S",
                        help="a command that ran longer than S seconds before failing starts a new streak: "
                             "the restart count and backoff reset (default 600)")
    parser.add_argument("--grace", type=float, default=120.0, metavar="S",
                        help="seconds the command has to exit after a forwarded SIGTERM before SIGKILL (default 120)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    parser.set_defaults(func=cmd_supervise)


def cmd_convert(ns: argparse.Namespace) -> int:
    from llama_jax import api

    api.convert(ns.source, ns.out, ns.overrides, ns.dtype, ns.rotary, merge=ns.merge)
    return 0

def _add_convert(commands) -> None:
    parser = commands.add_parser(
        "convert", help="Hugging Face Llama directory <-> llama-jax checkpoint",
        description="llama-jax convert SOURCE OUT [key=value ...] [--merge]. SOURCE is a Hugging Face directory "
                    "(config.json + safetensors; written as a parameters-only checkpoint in OUT) or a llama-jax run / "
                    "checkpoint (written as a Hugging Face directory, in safetensors files of at most 5 GiB; a run "
                    "with adapters as a PEFT adapter directory, or with --merge its base with the LoRA adapters folded "
                    "in). Either way the model is loaded sharded over the mesh of the mesh.* keys (default: all "
                    "devices on fsdp) and streamed through the host a block at a time. Tokenizer files go along.")
    parser.add_argument("source", metavar="SOURCE")
    parser.add_argument("out", metavar="OUT")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--dtype", default="float32", help="safetensors dtype when writing Hugging Face: "
                        "float32 (default), bfloat16 or float16")
    parser.add_argument("--rotary", default="half", help="q/k layout of the Hugging Face side: half (transformers' "
                        "rotate_half, default) or interleaved (Meta's original)")
    parser.add_argument("--merge", action="store_true", help="a run with LoRA adapters: write its base with the "
                        "adapters folded into the weights, as a Hugging Face model (default: a PEFT adapter directory)")
    parser.set_defaults(func=cmd_convert)


def cmd_average(ns: argparse.Namespace) -> int:
    from llama_jax.checkpoint.average import average

    average(ns.run_dir, ns.out, ns.overrides, ns.steps or (), ns.last or 0)
    return 0

def _add_average(commands) -> None:
    parser = commands.add_parser("average", help="average a run's checkpoints into a parameters-only checkpoint",
                                 description="llama-jax average RUN_DIR (--steps A,B,... | --last N) --out DIR "
                                             "[mesh.* keys]: the mean of the parameters, a tensor at a time.")
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="mesh.* keys: where the mean is computed")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--steps", type=_int_list, help="the checkpoint steps to average, e.g. 800,900,1000")
    which.add_argument("--last", type=int, metavar="N", help="the newest N checkpoints")
    parser.add_argument("--out", required=True, help="the checkpoint directory to write (new or empty)")
    parser.set_defaults(func=cmd_average)


def cmd_generate(ns: argparse.Namespace) -> int:
    import jax

    from llama_jax import api
    from llama_jax.data.tokenizer import load_tokenizer
    from llama_jax.inference.generate import Sampling

    sampling = Sampling(ns.temperature, ns.top_k, ns.top_p)
    sampling.check()
    model = api.resolve(ns.model)
    tokenizer = load_tokenizer(ns.tokenizer) if ns.tokenizer else api.load_tokenizer(model)
    cfg, params = api.load(model, compute_dtype=ns.dtype or "float32", overrides=ns.overrides)
    texts = api.generate_text(cfg, params, tokenizer, ns.prompt, ns.max_new_tokens, sampling, ns.seed)
    if jax.process_index() == 0:
        for prompt, text in zip(ns.prompt, texts):
            print(prompt + text)
            print()
    return 0

def _add_generate(commands) -> None:
    parser = commands.add_parser(
        "generate", help="continue prompts with a trained or converted model (KV cache)",
        description="llama-jax generate MODEL [key=value ...] --prompt TEXT [--prompt TEXT ...]. MODEL is a run "
                    "dir, a checkpoint, or a Hugging Face directory (hf:DIR). Without mesh.* keys the model goes "
                    "on one device; with them (e.g. mesh.tensor=8) it is sharded over that mesh of all devices, "
                    "and so is the key/value cache.")
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="mesh.* keys; model.compute_dtype, model.attention")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="tokenizer file (default: the model's)")
    parser.add_argument("--dtype", help="compute dtype: float32 (default) or bfloat16; model.compute_dtype=... too")
    parser.set_defaults(func=cmd_generate)


def cmd_eval(ns: argparse.Namespace) -> int:
    from llama_jax import api

    api.evaluate(ns.model, ns.data, ns.overrides, ns.batches, ns.split)
    return 0

def _add_eval(commands) -> None:
    parser = commands.add_parser(
        "eval", help="perplexity of a model on a token store or text files",
        description="llama-jax eval MODEL DATA [key=value ...]. DATA is a token store made with the model's "
                    "tokenizer (its validation split is scored) or text/jsonl files (scored whole); "
                    "train.batch_size, train.seq_len and mesh.* keys apply.")
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("data", metavar="DATA")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--batches", type=int, default=0, help="at most this many batches (0: one pass)")
    parser.add_argument("--split", default="val", choices=("val", "train"), help="token store split (default val)")
    parser.set_defaults(func=cmd_eval)


def cmd_goodput(ns: argparse.Namespace) -> int:
    rates = (ns.failures_per_gpu_hour, ns.planned_per_gpu_hour, ns.replacement_s, ns.restart_s)
    if any(v is not None and v < 0 for v in rates) or not (ns.host_loss_share is None or 0 <= ns.host_loss_share <= 1):
        raise InputError("goodput: --failures-per-gpu-hour, --planned-per-gpu-hour, --replacement-s and --restart-s "
                         "must be >= 0, --host-loss-share in [0, 1]")
    if ns.run_dir and (problem := unreadable(Path(ns.run_dir), "directory")):
        raise InputError(f"goodput: --from {problem}; name the run.dir of a run")
    from llama_jax.config import load_config
    from llama_jax.training import goodput_projection as projection

    source, overrides = _split_source(ns.args)
    config = load_config(source, overrides)
    given = {k: v for k, v in (("replacement_s", ns.replacement_s), ("restart_s", ns.restart_s)) if v is not None}
    inputs = projection.inputs_for(
        config, ns.gpus, ns.gpus_per_host, projection.measured(Path(ns.run_dir)) if ns.run_dir else None,
        failures_per_gpu_hour=ns.failures_per_gpu_hour, planned_per_gpu_hour=ns.planned_per_gpu_hour,
        host_loss_share=ns.host_loss_share, **given)
    report = projection.report(inputs)
    print(projection.report_json(report) if ns.json else projection.format_report(report, source or "tiny", inputs))
    return 0

def _add_goodput(commands) -> None:
    parser = commands.add_parser(
        "goodput", help="project the effective training time of a run under failures, and the best checkpoint "
                        "intervals",
        description="llama-jax goodput [PRESET|CONFIG.yaml] [key=value ...] --gpus N [--gpus-per-host 8] "
                    "[--from RUN_DIR] [--json]. Failures as Poisson at Llama 3's rate and mix by default; costs "
                    "measured by the run in --from (its goodput.json), else stated defaults, each printed with "
                    "its source (docs/fault-tolerance.md).")
    parser.add_argument("args", nargs="*", metavar="PRESET|CONFIG|key=value")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the run")
    parser.add_argument("--gpus-per-host", type=int, default=8, help="GPUs per host (default 8)")
    parser.add_argument("--from", dest="run_dir", metavar="RUN_DIR",
                        help="a run.dir whose goodput.json gives the measured costs (step, saves, restores, restarts)")
    parser.add_argument("--failures-per-gpu-hour", type=float,
                        help="unexpected interruptions per GPU-hour (default Llama 3's: 419 / (16,384 x 54 x 24 h))")
    parser.add_argument("--planned-per-gpu-hour", type=float,
                        help="planned interruptions (preemptions) per GPU-hour (default Llama 3's 47 / the same)")
    parser.add_argument("--host-loss-share", type=float,
                        help="share of the unexpected interruptions that lose a host (default Llama 3's, 0.84)")
    parser.add_argument("--replacement-s", type=float, help="seconds to get a replacement host (default 600)")
    parser.add_argument("--restart-s", type=float, help="seconds from a process start to its first step")
    parser.add_argument("--json", action="store_true",
                        help="print an object with goodput, breakdown, intervals, and the inputs with sources")
    parser.set_defaults(func=cmd_goodput)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llama-jax", description="Pre-train Llama 3 models with JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_prepare, _add_plan, _add_doctor, _add_tune, _add_report, _add_convert, _add_average,
                _add_generate, _add_eval, _add_supervise, _add_goodput):
        add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    started_at = time.time()  # goodput counts the start-up (imports, compilation) as restart overhead
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra and hasattr(ns, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        # key=value after an option: `convert A B --dtype bfloat16 mesh.tensor=8`
        ns.overrides = [*ns.overrides, *extra]
    elif extra:
        parser.parse_args(argv)  # argparse's own error for what it does not know
    ns.started_at = started_at
    from llama_jax.perf.xla_flags import check_xla_flags  # here, not at the top: `--help` answers without jaxlib
    try:
        check_xla_flags()
        return ns.func(ns)
    except LlamaJaxError as err:
        _error(str(err))
        if err.exit_code == EXIT_PEER_TIMEOUT:
            # JAX's exit handler waits for every process at a shutdown barrier, which the absent one will
            # never reach: leave without it, so the supervisor can restart this process now.
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(err.exit_code)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
