"""The Python API for notebooks and scripts: load a model, score tokens, generate text, train.

    from llama_jax import api

    cfg, params = api.load("hf:/models/Llama-3.2-1B")    # a Hugging Face directory, or one of our runs:
    cfg, params = api.load("runs/tiny")                  # a run dir, its checkpoints/, or a step dir
    logits = api.logits(cfg, params, [[128000, 791, 6864, 315]])     # [batch, seq, vocab] numpy
    tokenizer = api.load_tokenizer("runs/tiny")
    print(api.generate_text(cfg, params, tokenizer, ["To be, or not"], max_new_tokens=40)[0])
    summary = api.train("tiny", ["train.steps=100", "run.dir=runs/notebook"])

Every function raises ConfigError or DataError (one line) on bad input.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from llama_jax import hf
from llama_jax.checkpoint import read_meta, resolve_step_dir, restore_params
from llama_jax.config import Config, ConfigError, ModelConfig
from llama_jax.data import tokenizer as tokenizers
from llama_jax.data.tokenizer import Tokenizer
from llama_jax.generate import Sampling, generate
from llama_jax.model import Llama, abstract_params


def hf_directory(path: str) -> Path | None:
    """The directory of a Hugging Face model spec ("hf:DIR", or a directory holding config.json)."""
    directory = Path(path.removeprefix("hf:")).expanduser()
    if path.startswith("hf:") or (directory / "config.json").is_file():
        return directory
    return None


def model_config(path: str) -> ModelConfig:
    """The architecture of a model spec, read without loading any weights."""
    directory = hf_directory(path)
    if directory is not None:
        return hf.read_config(directory)
    step_dir = resolve_step_dir(path)
    meta = read_meta(step_dir)
    if meta is None:
        raise ConfigError(f"{step_dir} has no readable meta item: it is not a llama-jax checkpoint or it is damaged")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in meta["config"]["model"].items() if k in names})


def load(path: str, compute_dtype: str | None = "float32", target=None) -> tuple[ModelConfig, dict]:
    """(config, params) of a Hugging Face directory or a llama-jax checkpoint. The params take the
    shapes, dtypes and shardings of `target` (a ShapeDtypeStruct tree, e.g. the params of
    Trainer.abstract_state()) or, without one, the model's param_dtype on the default device.
    compute_dtype (None: the model's own) is the dtype the forward pass computes in."""
    cfg = model_config(path)
    if compute_dtype:
        cfg = dataclasses.replace(cfg, compute_dtype=compute_dtype)
    if target is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device),
                              nn.meta.unbox(abstract_params(cfg)))
    directory = hf_directory(path)
    if directory is not None:
        shardings = jax.tree.map(lambda t: t.sharding, target)
        return cfg, hf.read_params(directory, cfg, shardings, dtype=np.dtype(cfg.param_dtype))
    return cfg, restore_params(resolve_step_dir(path), target)


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer that belongs to a model spec: the Hugging Face directory's, or the one a llama-jax
    run keeps in its run directory."""
    directory = hf_directory(path)
    if directory is None:
        step_dir = resolve_step_dir(path)
        directory = step_dir.parent.parent  # <run.dir>/checkpoints/<step>
    return tokenizers.load_tokenizer(directory)


def logits(cfg: ModelConfig, params, tokens) -> np.ndarray:
    """tokens [batch, seq] -> logits [batch, seq, vocab] (numpy, in the compute dtype)."""
    return np.asarray(_forward(cfg)(params, jnp.asarray(tokens, jnp.int32)))


_forwards: dict[ModelConfig, Callable] = {}


def _forward(cfg: ModelConfig) -> Callable:
    if cfg not in _forwards:
        model = Llama(cfg)
        _forwards[cfg] = jax.jit(lambda params, tokens: model.apply({"params": params}, tokens))
    return _forwards[cfg]


def generate_text(cfg: ModelConfig, params, tokenizer: Tokenizer, prompts: list[str], max_new_tokens: int = 64,
                  sampling: Sampling = Sampling(), seed: int = 0) -> list[str]:
    """Continue each prompt (BOS added when the tokenizer has one); stops at EOS or max_new_tokens."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    encoded = [[*bos, *tokenizer.encode(p)] for p in prompts]
    new = generate(cfg, params, encoded, max_new_tokens, jax.random.key(seed), sampling, tokenizer.eos_id)
    return [tokenizer.decode(tokens) for tokens in new]


def train(source: str | None = None, overrides: list[str] = (), print_fn: Callable[[str], None] = print) -> dict:
    """Train like `llama-jax train SOURCE KEY=VALUE ...` on this process's devices; returns the summary
    (eval losses, tokens/s, MFU, goodput, sample)."""
    from llama_jax import sharding
    from llama_jax.config import load_config
    from llama_jax.data.pipeline import open_data
    from llama_jax.train import Run, execute

    config: Config = load_config(source, list(overrides))
    mesh = sharding.make_mesh(config)
    run = Run.setup(config, mesh, open_data(config, log=print_fn))
    return execute(run, print_fn=print_fn)


def inference_config(cfg: ModelConfig, overrides: list[str] = ()) -> Config:
    """A full Config around a loaded model (the mesh, batch and sequence settings of `overrides`)."""
    from llama_jax.checkpoint import SHAPE_FIELDS
    from llama_jax.config import load_config, validate

    base = load_config(None, list(overrides))
    changed = {o.split("=", 1)[0].removeprefix("model.") for o in overrides if o.startswith("model.")}
    if changed & set(SHAPE_FIELDS):
        raise ConfigError(f"model.{sorted(changed & set(SHAPE_FIELDS))[0]} is fixed by the loaded weights; "
                          "only settings such as model.compute_dtype or model.attention can change")
    config = dataclasses.replace(base, model=dataclasses.replace(cfg, **{k: getattr(base.model, k) for k in changed}))
    validate(config)
    return config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spm.model")


def convert(source: str, out: str, overrides: list[str] = (), dtype: str = "float32", rotary: str = "half",
            print_fn: Callable[[str], None] = print) -> Path:
    """Hugging Face directory -> llama-jax checkpoint (params only, sharded for the mesh of `overrides`),
    or a llama-jax checkpoint -> Hugging Face directory (safetensors in `dtype`). The tokenizer files
    go along. `out` must not exist yet (or be empty): nothing is overwritten."""
    import shutil

    from llama_jax import __version__, sharding
    from llama_jax.checkpoint import save_params
    from llama_jax.train import Trainer

    target = Path(out).expanduser()
    if target.exists() and any(target.iterdir()):
        raise ConfigError(f"{target} exists and is not empty; choose a new output directory")
    if rotary not in hf.ROTARY_LAYOUTS:
        raise ConfigError(f"--rotary must be one of {', '.join(hf.ROTARY_LAYOUTS)}, got '{rotary}'")
    directory = hf_directory(source)
    if directory is not None:  # Hugging Face -> llama-jax
        cfg = hf.read_config(directory)
        config = inference_config(cfg, overrides)
        trainer = Trainer.build(config, sharding.make_mesh(config))
        params = hf.read_params(directory, cfg, trainer.state_shardings.params, np.dtype(cfg.param_dtype), rotary)
        meta = {"config": {"model": dataclasses.asdict(cfg)}, "source": str(directory), "llama_jax": __version__,
                "jax": jax.__version__}
        step_dir = save_params(target, params, meta)
        from_dir = directory
        print_fn(f"converted {directory} -> {step_dir}")
    else:  # llama-jax -> Hugging Face
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be float32, bfloat16 or float16, got '{dtype}'")
        cfg, params = load(source, compute_dtype=None)
        hf.write_hf(target, params, cfg, dtype, rotary)
        from_dir = resolve_step_dir(source).parent.parent
        print_fn(f"converted {source} -> {target} ({dtype})")
    for name in TOKENIZER_FILES:
        if (from_dir / name).is_file():
            shutil.copy2(from_dir / name, target / name)
    return target


def evaluate(model: str, data: str, overrides: list[str] = (), max_batches: int = 0, split: str = "val",
             print_fn: Callable[[str], None] = print, devices=None) -> dict:
    """Mean next-token loss and perplexity of `model` on `data`: a token store's `split` (made with the
    model's tokenizer), or text files (.txt/.md/.jsonl, scored whole). train.batch_size, train.seq_len
    and mesh.* come from `overrides`, over `devices` (default: all); max_batches 0 = one pass."""
    from llama_jax import sharding
    from llama_jax.data.corpus import DataError, ReadOptions, plan_units, read_unit, BadRecords
    from llama_jax.data.loader import TokenStore, batches, components, document_batches
    from llama_jax.data.pipeline import is_store
    from llama_jax.train import Trainer

    tokenizer = load_tokenizer(model)
    config = inference_config(model_config(model), overrides)
    t = config.train
    if is_store(data):
        store = TokenStore(Path(data).expanduser())
        if store.meta["tokenizer"]["sha256"] != tokenizer.fingerprint()["sha256"]:
            raise DataError(f"{data} was prepared with another tokenizer than {model}'s; prepare it with "
                            f"`llama-jax prepare ... --tokenizer` and that model's tokenizer")
        stream = batches(components([store], []), split, t.batch_size, t.seq_len, 0, "concat", 1)
    else:
        options, bad = ReadOptions(), BadRecords()
        documents = [np.asarray(tokenizer.encode_document(text), np.int32)
                     for unit in plan_units(data, options) for text in read_unit(unit, options, bad)]
        stream = document_batches(documents, t.batch_size, t.seq_len)
    trainer = Trainer.build(config, sharding.make_mesh(config, devices=devices))
    _, params = load(model, compute_dtype=None, target=trainer.abstract_state().params)
    with trainer.activate():
        n = min(max_batches or stream.batches_per_epoch(), stream.batches_per_epoch())
        loss = trainer.evaluate(params, stream, n)
    result = {"loss": loss, "perplexity": float(np.exp(loss)), "batches": n,
              "tokens": n * t.batch_size * t.seq_len}
    print_fn(f"{model} on {data}: loss {loss:.4f}, perplexity {result['perplexity']:.2f} "
             f"({n} batch(es) of {t.batch_size} x {t.seq_len} tokens)")
    return result
