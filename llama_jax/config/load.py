"""Building a Config: a preset (presets/*.yaml, package data) or a YAML file, then `key=value` overrides.

Every value is read as the text the user wrote and parsed here against its key's type in the schema
(schema.py), one rule per type: a string keeps its text exactly, a bool is true or false, an int is decimal
digits, a float what Python's float() reads, a list `[a, b]` or a single value. YAML's own typing is not
used: YAML 1.1 reads `off` as false, `0123` as octal 83 and `12:30` as 750, so `run.compilation_cache=off`
became the directory 'False'. checks.py then checks the values that depend on each other. Every failure is
one ConfigError line, which the CLI prints and turns into exit status 2 before anything is written.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

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


def _load_text(text: str) -> Any:
    """YAML's structure (mappings, lists) with every scalar left as the text written: BaseLoader resolves no
    type and builds no object, so a string key can get back exactly what was typed (quotes removed)."""
    return yaml.load(text, Loader=yaml.BaseLoader)


def _read_yaml(path: Path) -> dict:
    try:
        data = _load_text(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read config file {path}: {str(err).splitlines()[0]}") from None
    if data is None:  # an empty file, or only comments: most likely not the file meant (a preset is never empty)
        raise ConfigError(
            f"config file {path} holds no keys (it is empty or all comments); put the keys to set in "
            "it, e.g. `train: {steps: 100}`, or name a preset"
        )
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


# Decimal only: YAML 1.1 read 0123 as octal 83, 0x10 as 16 and 1:30 as 90.
_INT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*")
# How yaml.safe_dump (to_yaml) writes the floats float() cannot read, so a run's config.yaml loads back.
_YAML_FLOATS = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}
_TYPE_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "one value (not a list)"}


def _is_union(kind: Any) -> bool:
    """`int | str` (types.UnionType) or `Union[int, str]` (typing.Union): the schema may spell it either way."""
    return typing.get_origin(kind) in (typing.Union, types.UnionType)


def _parse(key: str, kind: Any, value: Any, origin: str) -> Any:
    """One value as written (text; a list of texts from YAML) -> the schema type `kind` of `key`."""
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        if dataclasses.is_dataclass(item):  # train.stages: a list of mappings
            return [_parse_entry(f"{key}[{i}]", item, v, origin) for i, v in enumerate(_as_list(key, value, origin))]
        return [_parse(key, item, v, origin) for v in _as_list(key, value, origin)]
    if kind is str and isinstance(value, str):
        return value  # exactly as written: `off`, `null`, `0123` and `1e3` are names and paths too
    text = value.strip() if isinstance(value, str) else None
    if kind is bool and text is not None and text.lower() in ("true", "false"):  # as documented; not YAML 1.1's on, no
        return text.lower() == "true"
    if kind is int and text is not None and _INT.fullmatch(text):
        return int(text)
    if kind is float and text is not None:
        if text.lower() in _YAML_FLOATS:
            return _YAML_FLOATS[text.lower()]
        try:
            return float(text)
        except ValueError:
            pass
    if _is_union(kind) and text is not None:  # train.microbatches and the like: a word (auto) or a number
        if int in typing.get_args(kind) and _INT.fullmatch(text):
            return int(text)
        if float in typing.get_args(kind):
            try:
                return _parse(key, float, text, origin)
            except ConfigError:
                return value  # a word: bounds.BOUNDS says which one the key takes
        return value
    names = [_TYPE_NAMES[k] for k in typing.get_args(kind) or (kind,)]
    raise ConfigError(f"{origin}'{key}' must be {' or '.join(names)}, got '{value}'")


def _parse_entry(key: str, kind: Any, value: Any, origin: str) -> Any:
    """One mapping of a list of sections (a stage of train.stages) -> its frozen dataclass, each field parsed."""
    if not isinstance(value, dict):
        raise ConfigError(f"{origin}'{key}' must be a mapping of {kind.__name__} fields, e.g. {{start_step: 100}}")
    types = typing.get_type_hints(kind)
    fields = {}
    for name, text in value.items():
        if name not in types:
            near = difflib.get_close_matches(name, list(types), n=1, cutoff=0.5)
            hint = f"did you mean '{near[0]}'?" if near else f"its fields: {', '.join(types)}"
            raise ConfigError(f"{origin}'{key}' has no field '{name}'; {hint}")
        fields[name] = _parse(f"{key}.{name}", types[name], text, origin)
    return kind(**fields)


def _as_list(key: str, value: Any, origin: str) -> list:
    """A list key's items: a YAML list, `[a, b]` (YAML's flow syntax, quotes allowed), or one value, a list of
    one (`data.sources=notes/`); nothing (`data.sources=`) is the empty list."""
    if isinstance(value, list):
        return value
    if not value.strip():
        return []
    if not value.strip().startswith("["):
        return [value]
    try:
        return _load_text(value)
    except yaml.YAMLError as err:
        raise ConfigError(f"{origin}'{key}': cannot read the list {value}: {str(err).splitlines()[0]}") from None


# Keys that moved: the old name is refused in one line naming the new one. The fault.inject_* keys became the
# testing section inject.* (schema.InjectConfig), so a production section holds no test hooks.
MOVED_KEYS = {
    f"fault.inject_{name}": f"inject.{name}"
    for name in (
        "nan_steps",
        "save_failure_steps",
        "spike_steps",
        "hang_step",
        "process",
        "step_delay_s",
        "save_delay_s",
        "stall_at",
        "slow_device",
        "wrong_device",
    )
}


def _set(values: dict[str, Any], key: str, value: Any, origin: str) -> None:
    """Check `key`, parse `value` as its type and record it in `values` (dotted key -> typed value); an entry
    of a table (mesh.rules.embed, remat.custom.mlp_hidden) goes into its table."""
    types = _leaf_types()
    table = next((t for t, kind in types.items() if typing.get_origin(kind) is dict and key.startswith(t + ".")), None)
    if table:
        entry, text = key.removeprefix(table + "."), _parse(key, str, value, origin)
        if table == "mesh.rules":
            check_rule(entry, text)
        # remat.custom's tags and actions are checked with the rest of the remat config in validate()
        values.setdefault(table, dict(_default(table)))[entry] = text
        return
    if key in {k.rsplit(".", 1)[0] for k in types if "." in k}:
        raise ConfigError(
            f"{origin}'{key}' is a section, not a value; set its fields, e.g. "
            f"{next(k for k in types if k.startswith(key + '.'))}=..."
        )
    if key in MOVED_KEYS:
        raise ConfigError(f"{origin}{key} moved to {MOVED_KEYS[key]} (the testing section)")
    if key not in types:
        near = difflib.get_close_matches(key, list(types), n=1, cutoff=0.5)
        hint = f"did you mean '{near[0]}'?" if near else "`llama-jax train --print-config` lists every key"
        raise ConfigError(f"unknown config key '{key}'{origin and ' in ' + origin.rstrip(': ')}; {hint}")
    if typing.get_origin(types[key]) is dict:  # a whole table, `mesh.rules={embed: none}`: it replaces the one before
        try:
            entries = (_load_text(value) or {}) if isinstance(value, str) else value
        except yaml.YAMLError:
            entries = None
        if not isinstance(entries, dict):
            raise ConfigError(f"{origin}'{key}' is a table: set its entries, e.g. {key}.NAME=VALUE, got '{value}'")
        values[key] = {}
        for entry, text in entries.items():
            _set(values, f"{key}.{entry}", text, origin)
        return
    values[key] = _parse(key, types[key], value, origin)


def _default(key: str) -> Any:
    return functools.reduce(getattr, key.split("."), Config())


def _build(node: Any, values: dict[str, Any], prefix: str = "") -> Any:
    """The frozen dataclasses, with `values` (dotted key -> typed value) in place of the schema's defaults."""
    fields = {}
    for name, kind in typing.get_type_hints(node).items():
        if dataclasses.is_dataclass(kind):
            fields[name] = _build(kind, values, f"{prefix}{name}.")
        elif prefix + name in values:
            fields[name] = values[prefix + name]
    return node(**fields)


def load_config(source: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a validated Config from a preset name or YAML path plus ``key=value`` overrides."""
    name, preset = _resolve_source(source)
    values: dict[str, Any] = {}
    for key, value in _flatten(preset).items():
        _set(values, key, value, f"{name}: ")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. train.steps=100)")
        _set(values, key.strip(), value, "")
    config = _build(Config, values)
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
