"""The commands on a trained or converted model: `convert` (Hugging Face <-> llama-jax), `average` (a run's
checkpoints), `generate` and `eval`.
"""

from __future__ import annotations

import argparse

from llama_jax.cli.arguments import int_list
from llama_jax.errors import ConfigError


def cmd_convert(ns: argparse.Namespace) -> int:
    from llama_jax import api

    api.convert(ns.source, ns.out, ns.overrides, ns.dtype, ns.rotary, merge=ns.merge)
    return 0


def add_convert(commands) -> None:
    parser = commands.add_parser(
        "convert",
        help="Hugging Face Llama directory <-> llama-jax checkpoint",
        description="llama-jax convert SOURCE OUT [key=value ...] [--merge]. SOURCE is a Hugging Face directory "
        "(config.json + safetensors; written as a parameters-only checkpoint in OUT) or a llama-jax run / "
        "checkpoint (written as a Hugging Face directory, in safetensors files of at most 5 GiB; a run "
        "with adapters as a PEFT adapter directory, or with --merge its base with the LoRA adapters folded "
        "in). Either way the model is loaded sharded over the mesh of the mesh.* keys (default: all "
        "devices on fsdp) and streamed through the host a block at a time. Tokenizer files go along.",
    )
    parser.add_argument("source", metavar="SOURCE")
    parser.add_argument("out", metavar="OUT")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="safetensors dtype when writing Hugging Face: float32 (default), bfloat16 or float16",
    )
    parser.add_argument(
        "--rotary",
        default="half",
        help="q/k layout of the Hugging Face side: half (transformers' "
        "rotate_half, default) or interleaved (Meta's original)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a run with LoRA adapters: write its base with the "
        "adapters folded into the weights, as a Hugging Face model (default: a PEFT adapter directory)",
    )
    parser.set_defaults(func=cmd_convert)


def cmd_average(ns: argparse.Namespace) -> int:
    from llama_jax.checkpoint.average import average

    average(ns.run_dir, ns.out, ns.overrides, ns.steps or (), ns.last or 0)
    return 0


def add_average(commands) -> None:
    parser = commands.add_parser(
        "average",
        help="average a run's checkpoints into a parameters-only checkpoint",
        description="llama-jax average RUN_DIR (--steps A,B,... | --last N) --out DIR "
        "[mesh.* keys]: the mean of the parameters, a tensor at a time.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="mesh.* keys: where the mean is computed")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--steps", type=int_list, help="the checkpoint steps to average, e.g. 800,900,1000")
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


def add_generate(commands) -> None:
    parser = commands.add_parser(
        "generate",
        help="continue prompts with a trained or converted model (KV cache)",
        description="llama-jax generate MODEL [key=value ...] --prompt TEXT [--prompt TEXT ...]. MODEL is a run "
        "dir, a checkpoint, or a Hugging Face directory (hf:DIR). Without mesh.* keys the model goes "
        "on one device; with them (e.g. mesh.tensor=8) it is sharded over that mesh of all devices, "
        "and so is the key/value cache.",
    )
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="mesh.* keys; model.compute_dtype, model.attention"
    )
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

    if ns.tasks is None:
        if ns.data is None:
            raise ConfigError("llama-jax eval MODEL needs DATA (a token store or text files) or --tasks A,B")
        api.evaluate(ns.model, ns.data, ns.overrides, ns.batches, ns.split)
        return 0
    if ns.data is not None:  # with --tasks there is no DATA: what stands there is an override
        if "=" not in ns.data:
            raise ConfigError(f"llama-jax eval MODEL --tasks ... takes no DATA ({ns.data}); drop it or drop --tasks")
        ns.overrides = [ns.data, *ns.overrides]
    import jax

    results = api.evaluate_tasks(
        ns.model, ns.tasks, ns.overrides, ns.limit, ns.num_fewshot, ns.batch_size, output=ns.output
    )
    if jax.process_index() == 0:
        from llama_jax.evaluation import tasks

        print(tasks.as_json(results) if ns.json else tasks.table(results))
    return 0


def add_eval(commands) -> None:
    parser = commands.add_parser(
        "eval",
        help="perplexity on a token store or text files, or lm-eval benchmark tasks (--tasks)",
        description="llama-jax eval MODEL DATA [key=value ...]: perplexity; DATA is a token store made with the "
        "model's tokenizer (its validation split is scored) or text/jsonl files (scored whole); "
        "train.batch_size, train.seq_len and mesh.* keys apply. "
        "llama-jax eval MODEL --tasks A,B [--limit N] [--num-fewshot K] [key=value ...]: lm-evaluation-harness "
        "tasks (the [eval] extra), by name or task YAML file, offline (data from the Hugging Face datasets cache "
        "or the files a task YAML names); prints lm-eval's table (--json: its results); mesh.* keys shard the "
        "model, and the requests go over the data axes.",
    )
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("data", metavar="DATA", nargs="?")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--batches", type=int, default=0, help="at most this many batches (0: one pass)")
    parser.add_argument("--split", default="val", choices=("val", "train"), help="token store split (default val)")
    parser.add_argument("--tasks", type=task_list, help="lm-eval tasks: names or task YAML files, comma-separated")
    parser.add_argument("--limit", type=int, help="at most N documents of each task")
    parser.add_argument("--num-fewshot", type=int, help="K examples in front of each question (default: the task's)")
    parser.add_argument("--batch-size", type=int, default=16, help="requests scored at once (default 16)")
    parser.add_argument("--json", action="store_true", help="print lm-eval's results as JSON instead of its table")
    parser.add_argument("--output", help="also write lm-eval's results as JSON to this file")
    parser.set_defaults(func=cmd_eval)


def task_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("name at least one task, e.g. --tasks hellaswag,arc_easy")
    return names
