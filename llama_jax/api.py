"""The Python API for notebooks and scripts: load a model, score tokens, generate text, evaluate, train.

    from llama_jax import api

    cfg, params = api.load("hf:/models/Llama-3.2-1B")    # a Hugging Face directory, or one of our runs:
    cfg, params = api.load("runs/tiny")                  # a run dir, its checkpoints/, or a step dir
    cfg, params = api.load("hf:/models/Llama-3.1-70B", overrides=["mesh.tensor=8"])   # sharded over 8 devices
    logits = api.logits(cfg, params, [[128000, 791, 6864, 315]])     # [batch, seq, vocab] numpy
    tokenizer = api.load_tokenizer("runs/tiny")
    print(api.generate_text(cfg, params, tokenizer, ["To be, or not"], max_new_tokens=40)[0])
    summary = api.train("tiny", ["train.steps=100", "run.dir=runs/notebook"])

A model is named by a spec string (checkpoint/specs.py) or by the ModelSpec `api.resolve` makes of one, which
saves reading it again. Without mesh.* keys `load` puts a model on one device; with them it is sharded
over that mesh, and `logits`, `generate_text` (KV cache included) run on the mesh the params are on.
A run with adapters (peft.method=lora, prompt, ptuning) loads like any run: `load` returns its base with
LoRA folded into the weights, or, for a learned prompt, the prompt's embeddings in params["prompt"], which
`logits` and `generate_text` put in front of the tokens (its logits are not returned).
Every function raises ConfigError or DataError (one line) on bad input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from llama_jax.checkpoint import convert as conversion
from llama_jax.checkpoint import specs
from llama_jax.checkpoint.specs import ModelSpec, resolve
from llama_jax.config import ModelConfig, PeftConfig, load_config
from llama_jax.data.corpus import ReadOptions
from llama_jax.data.streams import evaluation_batches
from llama_jax.data.tokenizer import Tokenizer
from llama_jax.distributed import processes
from llama_jax.errors import ConfigError
from llama_jax.evaluation import tasks as lm_eval_tasks
from llama_jax.files import unwritable
from llama_jax.inference.generate import Sampling, generate, inference_adapters
from llama_jax.model import peft
from llama_jax.model.llama import abstract_model
from llama_jax.planning.plan_report import describe_program
from llama_jax.training import batches
from llama_jax.training.loop import train as train_config
from llama_jax.training.program import TrainProgram

__all__ = [
    "ModelSpec",
    "convert",
    "evaluate",
    "evaluate_tasks",
    "generate_text",
    "load",
    "load_tokenizer",
    "logits",
    "resolve",
    "train",
]


def load(
    model: str | ModelSpec, compute_dtype: str | None = "float32", target=None, overrides: list[str] = (), devices=None
) -> tuple[ModelConfig, dict]:
    """(config, params) of a Hugging Face directory or a llama-jax checkpoint. The params take the
    shapes, dtypes and shardings of `target` (a ShapeDtypeStruct tree, e.g. the params of
    TrainProgram.abstract_state()); without one they are sharded over the mesh of the mesh.* keys in
    `overrides` over `devices` (default: all) when either is given, else put on the default device.
    compute_dtype (None: the model's own) is the dtype the forward pass computes in, unless `overrides`
    set model.compute_dtype; model.attention can change too."""
    return specs.load_model(model, compute_dtype, target, overrides, devices)


def load_tokenizer(model: str | ModelSpec) -> Tokenizer:
    """The tokenizer that belongs to a model: the Hugging Face directory's, or the one a llama-jax run
    keeps in its run directory."""
    return specs.load_tokenizer(resolve(model))


def logits(cfg: ModelConfig, params, tokens) -> np.ndarray:
    """tokens [batch, seq] -> logits [batch, seq, vocab] (numpy, in the compute dtype)."""
    adapters = inference_adapters(params)
    tokens = np.asarray(peft.with_prompt_slots(np.asarray(tokens).tolist(), adapters.virtual_tokens), np.int32)
    return np.asarray(_forward(cfg, adapters)(params, jnp.asarray(tokens)))[:, adapters.virtual_tokens :]


_forwards: dict[tuple[ModelConfig, int], Callable] = {}  # by model and prompt length


def _forward(cfg: ModelConfig, adapters: PeftConfig) -> Callable:
    key = (cfg, adapters.virtual_tokens)
    if key not in _forwards:
        graph = nnx.graphdef(abstract_model(cfg, adapters))
        _forwards[key] = jax.jit(lambda params, tokens: nnx.merge(graph, params)(tokens))
    return _forwards[key]


def generate_text(
    cfg: ModelConfig,
    params,
    tokenizer: Tokenizer,
    prompts: list[str],
    max_new_tokens: int = 64,
    sampling: Sampling = Sampling(),
    seed: int = 0,
) -> list[str]:
    """Continue each prompt (BOS added when the tokenizer has one); stops at EOS or max_new_tokens. On the
    mesh the params are sharded over, if any (the key/value cache is sharded alike)."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    encoded = [[*bos, *tokenizer.encode(p)] for p in prompts]
    new = generate(cfg, params, encoded, max_new_tokens, jax.random.key(seed), sampling, tokenizer.eos_id)
    return [tokenizer.decode(tokens) for tokens in new]


def train(source: str | None = None, overrides: list[str] = (), print_fn: Callable[[str], None] = print) -> dict:
    """Train like `llama-jax train SOURCE KEY=VALUE ...`, printing what it prints through print_fn (also
    as one process of a multi-process run, joined from run.* keys or the environment); returns the summary
    (eval losses, tokens/s, MFU, goodput, sample)."""
    return train_config(load_config(source, list(overrides)), print_fn=print_fn, describe_program=describe_program)


def convert(
    source: str,
    out: str,
    overrides: list[str] = (),
    dtype: str = "float32",
    rotary: str = "half",
    print_fn: Callable[[str], None] = print,
    devices=None,
    merge: bool = False,
) -> Path:
    """Hugging Face directory <-> llama-jax checkpoint, sharded over the mesh of `overrides`; a run with
    adapters -> a PEFT adapter directory, or with `merge` (LoRA) a Hugging Face model; see checkpoint/convert.py."""
    return conversion.convert(source, out, overrides, dtype, rotary, print_fn, devices, merge)


def evaluate(
    model: str | ModelSpec,
    data: str,
    overrides: list[str] = (),
    max_batches: int = 0,
    split: str = "val",
    print_fn: Callable[[str], None] = print,
    devices=None,
) -> dict:
    """Mean next-token loss and perplexity of `model` on `data`: a token store's `split` (made with the
    model's tokenizer), or text files (.txt/.md/.jsonl, scored whole). train.batch_size, train.seq_len
    and mesh.* come from `overrides`, over `devices` (default: all); max_batches 0 = one pass."""
    spec = resolve(model)
    config = specs.inference_config(spec.model, overrides)
    if spec.adapters is not None:  # a learned prompt is part of the model (peft.inference_peft)
        config = dataclasses.replace(config, peft=peft.inference_peft(spec.adapters))
    processes.initialize(config.run)
    t = config.train
    read = ReadOptions(config.data.text_field, config.data.text_unit, config.data.on_bad_record)
    stream = evaluation_batches(
        data, specs.load_tokenizer(spec), t.batch_size, t.seq_len, split, spec.text, config.peft.virtual_tokens, read
    )
    program = TrainProgram.for_config(config, devices)
    params = specs.load_params(spec, target=program.abstract_params())
    with program.activate():
        n = min(max_batches or stream.batches_per_epoch(), stream.batches_per_epoch())
        loss = batches.evaluate(program, params, stream, n)
    result = {"loss": loss, "perplexity": float(np.exp(loss)), "batches": n, "tokens": n * t.batch_size * t.seq_len}
    print_fn(
        f"{spec.text} on {data}: loss {loss:.4f}, perplexity {result['perplexity']:.2f} "
        f"({n} batch(es) of {t.batch_size} x {t.seq_len} tokens)"
    )
    return result


def evaluate_tasks(
    model: str | ModelSpec,
    tasks: list[str],
    overrides: list[str] = (),
    limit: int | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 16,
    output: str | None = None,
) -> dict:
    """lm-eval's results (simple_evaluate's dict) of `model` on `tasks` (lm-eval task names or task YAML files),
    offline, through the llama-jax backend (evaluation/harness.py; the [eval] extra), sharded over the mesh of
    the mesh.* keys in `overrides`; `output` (a file) gets them as JSON, from process 0."""
    harness = _harness()
    target = None if output is None else Path(output).expanduser()
    if target is not None and (problem := unwritable(target, "file")):
        raise ConfigError(f"--output: {problem}")
    names, manager = lm_eval_tasks.prepare(list(tasks))  # unknown tasks, missing data: before the model is read
    lm = harness.LlamaJaxLM(model, overrides=list(overrides), batch_size=batch_size)
    results = lm_eval_tasks.run(lm, names, manager, limit, num_fewshot)
    if target is not None and jax.process_index() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(lm_eval_tasks.as_json(results) + "\n")
    return results


def _harness():
    """evaluation/harness.py, which needs lm-eval (the [eval] extra), or a one-line ConfigError."""
    import importlib

    try:
        importlib.import_module("lm_eval")
    except ImportError:
        raise ConfigError("lm-eval tasks need the [eval] extra: pip install -e '.[eval]'") from None
    return importlib.import_module("llama_jax.evaluation.harness")
