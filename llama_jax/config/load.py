"""Building a Config: a preset (presets/*.yaml, package data) or a YAML file, then `key=value` overrides.

OmegaConf merges them onto the schema (schema.py), checking key names and types; checks.py then checks
the values that depend on each other. Every failure becomes one ConfigError line, which the CLI prints and
turns into exit status 2 before anything is written.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from llama_jax.config.checks import check_rule, validate
from llama_jax.config.schema import Config
from llama_jax.errors import ConfigError
from llama_jax.files import unreadable


def preset_dir() -> Path:
    return Path(str(resources.files("llama_jax.config") / "presets"))


def preset_names() -> list[str]:
    return sorted(p.stem for p in preset_dir().glob("*.yaml"))

def all_keys() -> list[str]:
    """Every dotted key of the schema, e.g. ``train.lr``."""
    return list(_leaf_types())

def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read config file {path}: {str(err).splitlines()[0]}") from None
    if data is None:  # an empty file, or only comments: most likely not the file meant (a preset is never empty)
        raise ConfigError(f"config file {path} holds no keys (it is empty or all comments); put the keys to set in "
                          "it, e.g. `train: {steps: 100}`, or name a preset")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(data).__name__}")
    return data

def _resolve_source(source: str | None) -> tuple[str, dict]:
    """A preset name or a YAML path -> (its name, its contents)."""
    if source is None:
        source = "tiny"
    path = Path(source)
    # A preset's name has no slash: anything with one, a .yaml name or an existing file is a config file.
    if source.endswith((".yaml", ".yml")) or "/" in source or os.path.isfile(path):
        if problem := unreadable(path, "file"):
            raise ConfigError(f"config file {problem}; name a preset ({', '.join(preset_names())}) or a YAML file")
        return str(path), _read_yaml(path)
    if source not in preset_names():
        near = difflib.get_close_matches(source, preset_names(), n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ConfigError(f"unknown preset '{source}'; {hint}presets: {', '.join(preset_names())}")
    return source, _read_yaml(preset_dir() / f"{source}.yaml")

@functools.cache
def _leaf_types(node: Any = Config, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> its Python type, for every leaf of the schema."""
    types: dict[str, Any] = {}
    for name, kind in typing.get_type_hints(node).items():
        if dataclasses.is_dataclass(kind):
            types.update(_leaf_types(kind, f"{prefix}{name}."))
        else:
            types[prefix + name] = kind
    return types

def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat

_BOOL_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0"}

def _check_key(key: str, value: Any, origin: str) -> None:
    """Unknown keys (with the nearest valid one), whole sections and non-boolean booleans.

    OmegaConf checks the remaining types, but it names only the unknown *part* of a dotted key
    and turns any number into a bool, so these two checks come first.
    """
    if key.startswith("remat.custom."):
        return  # tag and action are checked with the rest of the remat config in validate()
    if key.startswith("mesh.rules."):
        check_rule(key.removeprefix("mesh.rules."), str(value))
        return
    types = _leaf_types()
    if key in {k.rsplit(".", 1)[0] for k in types if "." in k}:
        raise ConfigError(f"{origin}'{key}' is a section, not a value; set its fields, e.g. "
                          f"{next(k for k in types if k.startswith(key + '.'))}=...")
    if key not in types:
        near = difflib.get_close_matches(key, list(types), n=1, cutoff=0.5)
        hint = f"did you mean '{near[0]}'?" if near else "`llama-jax train --print-config` lists every key"
        raise ConfigError(f"unknown config key '{key}'{origin and ' in ' + origin.rstrip(': ')}; {hint}")
    if types[key] is bool and str(value).lower() not in _BOOL_WORDS:
        raise ConfigError(f"{origin}'{key}' must be true or false, got '{value}'")

def _as_list_if_needed(item: str) -> str:
    """`data.sources=a.jsonl` means a list of one: OmegaConf itself wants `[a.jsonl]`."""
    key, _, value = item.partition("=")
    kind = _leaf_types().get(key.strip())
    if typing.get_origin(kind) is list and not value.strip().startswith("["):
        return f"{key}=[{value}]"
    return item

def load_config(source: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a validated Config from a preset name or YAML path plus ``key=value`` overrides."""
    name, preset = _resolve_source(source)
    for key, value in _flatten(preset).items():
        _check_key(key, value, f"{name}: ")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. train.steps=100)")
        _check_key(key.strip(), value.strip(), "")
    overrides = [_as_list_if_needed(item) for item in overrides]
    try:
        merged = OmegaConf.merge(
            OmegaConf.structured(Config), OmegaConf.create(preset), OmegaConf.from_dotlist(list(overrides))
        )
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        message = str(err).splitlines()[0]
        raise ConfigError(f"bad value for '{key}': {message}" if key else message) from None
    validate(config)
    return config

def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)

def to_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)

def summary(config: Config) -> str:
    """A one-screen description of what will run."""
    m, t = config.model, config.train
    return (
        f"model: {m.n_layers} layers, d_model {m.d_model}, heads {m.n_heads}/{m.n_kv_heads} kv, "
        f"head_dim {m.resolved_head_dim}, ffn {m.ffn_dim}, vocab {m.vocab_size}, "
        f"{'tied' if m.tie_embeddings else 'untied'} embeddings, compute {m.compute_dtype}\n"
        f"train: {t.steps} steps x {t.batch_size} seqs x {t.seq_len} tokens "
        f"({t.microbatches} microbatch{'es' if t.microbatches != 1 else ''}), lr {t.lr:g}, "
        f"remat {config.remat.policy}, data {', '.join(config.data.sources)}, run.dir {config.run.dir}"
    )
