"""Config loading, overrides and validation; bad command lines exit 2 with one line, touching nothing."""

import dataclasses
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from conftest import subprocess_environment

import llama_jax.training.loop
from llama_jax import cli
from llama_jax.config import Config, all_keys, checks, load_config, preset_names, to_yaml
from llama_jax.config.bounds import BOUNDS, METHOD_BOUNDS, UNBOUNDED
from llama_jax.config.load import _is_union, _leaf_types
from llama_jax.config.stages import resolve
from llama_jax.distributed import sharding
from llama_jax.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
PRESET_FILES = sorted((REPO / "configs").glob("*.yaml"))

# The dotted keys DESIGN.md section 3 promises, each with a valid value that differs from the tiny
# preset, and the value it must load as.
INTERFACE_KEYS = {
    "seed": ("7", 7),
    "run.dir": ("runs/elsewhere", "runs/elsewhere"),
    "train.steps": ("77", 77),
    "train.batch_size": ("32", 32),
    "train.seq_len": ("64", 64),
    "train.microbatches": ("2", 2),
    "train.lr": ("1e-3", 1e-3),
    "mesh.data": ("2", 2),
    "mesh.fsdp": ("2", 2),
    "mesh.tensor": ("2", 2),
    "mesh.sequence": ("2", 2),
    "mesh.sequence_parallel": ("false", False),
    "remat.policy": ("full", "full"),
    "checkpoint.every_steps": ("5", 5),
    "checkpoint.keep": ("2", 2),
    "model.compute_dtype": ("bfloat16", "bfloat16"),
    "model.n_layers": ("3", 3),
    "model.d_model": ("128", 128),
    "model.n_heads": ("8", 8),
    "model.n_kv_heads": ("4", 4),
    "model.ffn_dim": ("512", 512),
    "model.vocab_size": ("1024", 1024),
}


def get(config, key):
    for part in key.split("."):
        config = getattr(config, part)
    return config


# --------------------------------------------------------------------------------------------
# Loading and overrides


def test_preset_files_are_the_presets():
    """configs/ holds exactly the presets load_config knows, including the default tiny and bench."""
    assert [p.stem for p in PRESET_FILES] == preset_names()
    assert {"tiny", "bench", "llama3_1b", "llama3_8b", "llama3_405b"} <= set(preset_names())


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.stem)
def test_each_preset_loads_by_name_and_by_path(path):
    """Every preset validates, and loading it by name or by YAML path gives the same config."""
    by_name = load_config(path.stem)
    assert isinstance(by_name, Config)
    assert load_config(str(path)) == by_name


def test_no_source_is_the_tiny_preset():
    """`load_config(None)` (i.e. `llama-jax train` with no arguments) is the tiny preset on Shakespeare."""
    default = load_config(None)
    assert default == load_config("tiny")
    assert default.data.sources == ["shakespeare"]
    assert (default.model.d_model, default.model.n_layers) == (192, 2)  # as written in configs/tiny.yaml


def test_overrides_are_typed():
    """Override strings become the schema's types: float, bool, int, str."""
    config = load_config(
        "tiny",
        [
            "train.lr=1e-3",
            "model.tie_embeddings=true",
            "train.steps=12",
            "train.warmup_steps=2",
            "remat.policy=full",
            "mesh.sequence_parallel=false",
        ],
    )
    assert isinstance(config.train.lr, float) and config.train.lr == 1e-3
    assert config.model.tie_embeddings is True
    assert isinstance(config.train.steps, int) and config.train.steps == 12
    assert config.remat.policy == "full"
    assert config.mesh.sequence_parallel is False


def test_later_override_wins_and_others_keep_preset_values():
    """Overrides replace only their key; the last one for a key wins."""
    config = load_config("tiny", ["train.warmup_steps=1", "train.steps=3", "train.steps=5"])
    assert config.train.steps == 5
    assert config.train.batch_size == load_config("tiny").train.batch_size


def test_config_is_frozen():
    """The dataclasses are immutable: a loaded config cannot be changed by accident."""
    config = load_config("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train.steps = 1


def test_saved_yaml_loads_back(tmp_path):
    """The resolved config written to run.dir loads back to the same config."""
    config = load_config("tiny", ["train.steps=9", "train.warmup_steps=1", "model.n_layers=2", f"run.dir={tmp_path}"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(config))
    assert load_config(str(path)) == config


def test_all_interface_keys_exist():
    """Every key listed in DESIGN.md section 3 is in the schema."""
    missing = set(INTERFACE_KEYS) - set(all_keys())
    assert not missing


@pytest.mark.parametrize("key", INTERFACE_KEYS)
def test_each_interface_key_can_be_overridden(key):
    """Each DESIGN.md section 3 key accepts a `key=value` override and takes that value."""
    text, expected = INTERFACE_KEYS[key]
    config = load_config("tiny", [f"{key}={text}"])
    assert get(config, key) == expected
    assert get(config, key) != get(load_config("tiny"), key)


def test_mesh_shape_fills_one_axis():
    """mesh.*=-1 takes the devices the other axes leave; the product must equal the device count."""
    config = load_config("tiny", ["mesh.data=2", "mesh.tensor=2"])
    assert sharding.mesh_shape(config.mesh, 8) == {"pipeline": 1, "data": 2, "fsdp": 2, "sequence": 1, "tensor": 2}
    with pytest.raises(ConfigError, match="mesh.fsdp=-1"):
        sharding.mesh_shape(load_config("tiny", ["mesh.data=3"]).mesh, 8)


# --------------------------------------------------------------------------------------------
# Bad input through the CLI: exit 2, one line on stderr, run.dir untouched


def case(name, args, fragments, marks=()):
    """A bad command line: the arguments after `train`, and fragments its error line must contain."""
    return pytest.param(args, fragments, id=name, marks=marks)


BAD_INPUTS = [
    case("unknown-key", ["train.step=5"], ["'train.step'", "did you mean 'train.steps'"]),
    case("unknown-section", ["modle.n_layers=2"], ["modle", "did you mean 'model.n_layers'"]),
    case("bare-section", ["train=5"], ["'train' is a section", "train.steps"]),
    case("number-as-bool", ["mesh.sequence_parallel=2"], ["mesh.sequence_parallel", "true or false", "'2'"]),
    case("wrong-type-int", ["train.steps=abc"], ["train.steps", "abc"]),
    case("wrong-type-bool", ["model.tie_embeddings=maybe"], ["model.tie_embeddings", "maybe"]),
    case("yaml-1.1-bool", ["model.tie_embeddings=on"], ["model.tie_embeddings", "true or false", "'on'"]),
    case("hex-int", ["train.steps=0x10"], ["train.steps", "a whole number", "'0x10'"]),
    case("word-as-choice", ["model.attention=off"], ["model.attention must be one of", "got 'off'"]),
    case("negative-steps", ["train.steps=-1"], ["train.steps", "-1"]),
    case("kv-heads", ["model.n_kv_heads=3"], ["model.n_heads (4)", "model.n_kv_heads (3)"]),
    case("seq-len-above-max", ["train.seq_len=2048"], ["train.seq_len (2048)", "model.max_seq_len (1024)"]),
    case("microbatches", ["train.microbatches=3"], ["train.batch_size (16)", "train.microbatches (3)"]),
    case(
        "local-dir-without-interval",
        ["checkpoint.local_dir=/dev/shm/x"],
        ["checkpoint.local_dir and checkpoint.local_every_steps go together"],
    ),
    case(
        "local-replicas",
        ["checkpoint.local_dir=/dev/shm/x", "checkpoint.local_every_steps=5", "checkpoint.local_replicas=2"],
        ["checkpoint.local_replicas must be in [0, 1]", "got 2"],
    ),
    case(
        "negative-mtbf",
        ["checkpoint.mtbf_hours=-1", "checkpoint.every_steps=auto"],
        ["checkpoint.mtbf_hours must be positive or observed, got -1.0"],
    ),
    case(
        "zero-mtbf",
        ["checkpoint.mtbf_hours=0", "checkpoint.every_steps=auto"],
        ["checkpoint.mtbf_hours must be positive or observed, got 0.0"],
    ),
    case(
        "word-mtbf", ["checkpoint.mtbf_hours=seen"], ["checkpoint.mtbf_hours must be positive or observed, got 'seen'"]
    ),
    case("zero-checkpoint-timeout", ["checkpoint.timeout_s=0"], ["checkpoint.timeout_s must be at least 1, got 0"]),
    case("unknown-preset", ["llama3_8"], ["unknown preset 'llama3_8'", "did you mean 'llama3_8b'"]),
    case("missing-yaml", ["{tmp}/missing.yaml"], ["missing.yaml", "does not exist"]),
    case("bad-dtype", ["model.compute_dtype=float8"], ["model.compute_dtype", "float8", "bfloat16"]),
    case("remat-policy", ["remat.policy=everything"], ["remat.policy", "everything", "none", "full", "selective"]),
    case("no-equals", ["train.steps=3", "model.n_layers"], ["'model.n_layers'", "key=value"]),
    case("two-fill-axes", ["mesh.data=-1", "mesh.fsdp=-1"], ["at most one mesh axis may be -1"]),
    case(
        "mesh-product",
        ["mesh.fsdp=3", "mesh.data=1", "mesh.tensor=1", "mesh.sequence=1"],
        ["fsdp=3", "needs 3 devices", "8 are available"],
    ),
    case("mesh-no-fill", ["mesh.data=3"], ["data=3", "does not divide the 8"]),
    case("batch-vs-mesh", ["mesh.fsdp=8", "train.batch_size=12"], ["train.batch_size (12)", "data×fsdp"]),
    case("heads-vs-tensor", ["mesh.tensor=8"], ["model.n_heads (4)", "mesh.tensor (8)"]),
    case("cudnn-on-cpu", ["model.attention=cudnn"], ["model.attention=cudnn needs a GPU", "model.attention=auto"]),
    case("float16", ["model.compute_dtype=float16"], ["model.compute_dtype", "float16"]),
    case("negative-rope-context", ["model.rope_original_max_len=-5"], ["model.rope_original_max_len", "-5"]),
    case(
        "vocab-vs-tensor",
        ["model.vocab_size=4097", "mesh.tensor=2", "mesh.fsdp=4"],
        ["model.vocab_size (4097)", "tensor (2)", "pad it to 4098"],
    ),
    case(
        "embed-vs-fsdp",
        ["model.d_model=250", "model.n_heads=5", "model.n_kv_heads=5", "train.batch_size=16"],
        ["model.d_model (250)", "fsdp (8)"],
    ),
    case(
        "batch-longer-than-corpus",
        ["train.batch_size=2048", "train.seq_len=1024", "model.max_seq_len=1024"],
        ["training split", "fewer than one batch"],
    ),
    case("missing-corpus", ["data.sources={tmp}/no_such_corpus"], ["{tmp}/no_such_corpus", "does not exist"]),
    case("unknown-packing", ["data.packing=zigzag"], ["data.packing", "concat, first_fit", "zigzag"]),
    case("weights-vs-sources", ["data.weights=[1,2]"], ["data.weights has 2 value(s) for 1 source(s)"]),
    case("missing-tokenizer", ["data.tokenizer={tmp}/no_tokenizer.json"], ["no_tokenizer.json"]),
    case("unknown-optimizer", ["train.optimizer=sgd"], ["train.optimizer must be one of adamw, muon, got 'sgd'"]),
    case(
        "muon-coefficients",
        ["train.optimizer=muon", "train.muon.ns_coefficients=[3.4,-4.7]"],
        ["train.muon.ns_coefficients must be three finite numbers", "[3.4, -4.7]", "[3.4445, -4.7750, 2.0315]"],
    ),
    case("muon-momentum", ["train.optimizer=muon", "train.muon.momentum=1"], ["train.muon.momentum must be in [0, 1)"]),
]


@pytest.fixture
def no_training(monkeypatch):
    """Fail fast instead of training for minutes if a bad input slips through validation."""

    def refuse(*args, **kwargs):
        raise AssertionError("bad input was accepted: training started")

    monkeypatch.setattr(llama_jax.training.loop, "execute", refuse)


def snapshot(directory: Path):
    if not directory.exists():
        return None
    return {
        str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None for p in sorted(directory.rglob("*"))
    }


@pytest.mark.parametrize("run_dir_exists", [False, True], ids=["new-run-dir", "existing-run-dir"])
@pytest.mark.parametrize("args, fragments", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line(args, fragments, run_dir_exists, tmp_path, capsys, no_training):
    """A bad input returns 2, prints one 'llama-jax: error:' line naming the problem, writes nothing to run.dir."""
    run_dir = tmp_path / "run"
    if run_dir_exists:
        run_dir.mkdir()
        (run_dir / "keep.txt").write_text("precious\n")
        (run_dir / "config.yaml").write_text("seed: 123\n")
    before = snapshot(run_dir)
    args = [a.format(tmp=tmp_path) for a in args]

    status = cli.main(["train", *args, f"run.dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"])

    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2
    assert len(lines) == 1 and len(err.splitlines()) == 1, err
    assert lines[0].startswith("llama-jax: error: ")
    for fragment in fragments:
        assert fragment.format(tmp=tmp_path) in lines[0]
    assert snapshot(run_dir) == before
    if run_dir_exists:
        assert (run_dir / "keep.txt").read_text() == "precious\n"
    else:
        assert not run_dir.exists()


# The ten fault.inject_* keys moved to the testing section inject.* (schema.InjectConfig, resilience/inject.py).
OLD_INJECT_KEYS = {
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


@pytest.mark.parametrize("old, new", sorted(OLD_INJECT_KEYS.items()))
def test_an_old_fault_inject_key_is_refused_in_one_line_naming_its_new_key(old, new, tmp_path, capsys):
    """fault.inject_X, on the command line or in a YAML file: ConfigError (exit 2), one line naming inject.X; the new
    key takes the value."""
    assert new in all_keys() and old not in all_keys()
    value = "[1]" if new.endswith("_steps") else "restore" if new.endswith("stall_at") else "1"
    message = f"{old} moved to {new} (the testing section)"
    with pytest.raises(ConfigError) as refused:
        load_config("tiny", [f"{old}={value}"])
    assert refused.value.exit_code == 2 and str(refused.value) == message
    section, field = old.split(".")
    from_file = tmp_path / "old.yaml"
    from_file.write_text(f"{section}:\n  {field}: {value}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(str(from_file))
    assert refused.value.exit_code == 2 and str(refused.value) == f"{from_file}: {message}"
    assert cli.main(["train", "tiny", f"{old}={value}", f"run.dir={tmp_path / 'run'}", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err == f"llama-jax: error: {message}\n"
    assert get(load_config("tiny", [f"{new}={value}"]), new) != get(Config(), new)


def test_bad_input_in_a_subprocess(tmp_path):
    """`python -m llama_jax train train.steps=-1` exits with status 2 and one stderr line."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "llama_jax",
            "train",
            "train.steps=-1",
            f"run.dir={run_dir}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("llama-jax: error: ") and "train.steps" in proc.stderr
    assert not run_dir.exists()


LLAMA3_PRESETS = [name for name in preset_names() if name.startswith("llama3_")]


@pytest.mark.parametrize("name", LLAMA3_PRESETS)
def test_llama3_presets_are_recipes(name):
    """Each Llama 3 preset states its token budget and trains to it (steps x batch x sequence), warms up for a small
    fraction of the run (Llama 3's recipe: 8,000 of its steps), saves at the automatic interval, and names no
    data: the user's must be named (the bundled plays are for the tiny and bench presets)."""
    import math
    import re

    text = (REPO / "configs" / f"{name}.yaml").read_text()
    number, unit = re.search(r"# (?:Recipe|Budget): ([\d.]+)([BT]) tokens", text).groups()
    budget = float(number) * (1e9 if unit == "B" else 1e12)
    config = load_config(name)
    t, stages = config.train, resolve(config)
    if len(stages) == 1:
        assert t.steps == math.ceil(budget / (t.batch_size * t.seq_len))
    tokens = sum(s.steps * s.tokens_per_step for s in stages)  # a staged recipe: each stage's batch
    assert tokens >= budget > tokens - stages[-1].tokens_per_step  # to the budget, not a step further
    assert 0 < t.resolved_warmup_steps <= min(8000, t.steps // 50)
    assert config.checkpoint.every_steps == "auto" and config.data.sources == [] and config.data.tokenizer == ""


def test_a_warmup_as_long_as_the_run_is_refused():
    with pytest.raises(ConfigError, match=r"train.warmup_steps \(360\) is not below train.steps \(360\)"):
        load_config("tiny", ["train.steps=360", "train.warmup_steps=360"])
    assert load_config("tiny", ["train.steps=0", "train.warmup_steps=40"]).train.steps == 0  # steps 0: nothing to warm


def test_max_bad_steps_0_means_never_roll_back():
    assert load_config("tiny", ["fault.max_bad_steps=0"]).fault.max_bad_steps == 0
    with pytest.raises(ConfigError, match="fault.max_bad_steps must be >= 0"):
        load_config("tiny", ["fault.max_bad_steps=-1"])


def test_pipeline_microbatches_without_a_pipeline_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"mesh.pipeline_microbatches=4 sends a pipeline's micro-batches through in "
        r"passes, and there is no pipeline \(mesh.pipeline=1\)",
    ):
        load_config("tiny", ["mesh.pipeline_microbatches=4"])


@pytest.mark.parametrize(
    "overrides, named",
    [
        ([], "data.sources is empty: name the data to train on"),
        (["data.sources=[shakespeare]"], "shakespeare is not a token store and data.tokenizer is not set"),
    ],
)
def test_a_llama3_preset_without_its_data_is_refused_in_one_line(tmp_path, overrides, named):
    """`llama-jax train llama3_8b` (shrunk) without data.sources, or with raw text and no tokenizer, stops in one
    line saying which keys to set, exit 2, before anything is written."""
    run_dir = tmp_path / "run"
    small = [
        "model.n_layers=2",
        "model.d_model=64",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.head_dim=16",
        "model.ffn_dim=128",
        "train.batch_size=8",
        "train.seq_len=32",
        f"run.dir={run_dir}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "llama_jax", "train", "llama3_8b", *small, *overrides],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("llama-jax: error:")]
    assert len(errors) == 1 and named in errors[0] and "llama-jax prepare" in errors[0], proc.stderr
    assert not run_dir.exists()


# --------------------------------------------------------------------------------------------
# Numeric ranges: bounds.BOUNDS, one row per key


def numeric_keys() -> set[str]:
    """The schema's keys that hold one number (or a count or auto)."""
    return {
        key
        for key, kind in _leaf_types().items()
        if kind in (int, float) or set(getattr(kind, "__args__", ())) in ({int, str}, {float, str})
    }


def test_every_numeric_key_has_a_bound_or_a_reason_for_none():
    """A new numeric key must say which values it takes (bounds.BOUNDS) or why it takes any (UNBOUNDED)."""
    bounded = set(BOUNDS) | {key for keys in METHOD_BOUNDS.values() for key in keys}
    assert numeric_keys() == bounded | set(UNBOUNDED)
    assert not bounded & set(UNBOUNDED)


def outside(bound) -> list[float]:
    """Values just outside a bound: under its low end (at it when `above`), under its special value (-1: fill),
    and over its high end."""
    values = [bound.low - 1] + ([bound.low] if bound.above else [])
    if bound.special is not None:
        values.append(bound.special - 1)
    if bound.high is not None:
        values += [bound.high + 1] + ([bound.high] if bound.below else [])
    return [v for v in values if v != bound.special]


BOUNDED = [
    (key, bound, method) for method, keys in [("none", BOUNDS), *METHOD_BOUNDS.items()] for key, bound in keys.items()
]


@pytest.mark.parametrize("key, bound, method", BOUNDED, ids=[f"{k}-{m}" if m != "none" else k for k, _, m in BOUNDED])
def test_a_value_outside_its_bound_is_refused_and_its_lowest_allowed_one_accepted(key, bound, method):
    """0 and below are refused where only a positive value makes sense, in one line that names the key and its
    range (and what the lowest allowed value means, where it means something); that lowest value loads."""
    peft = [] if method == "none" else [f"peft.method={method}", "checkpoint.init_from=runs/base"]
    for value in outside(bound):
        with pytest.raises(ConfigError) as refused:
            load_config("tiny", [*peft, f"{key}={value:g}"])
        assert str(refused.value) == f"{key} must be {bound.describe()}, got {get_typed(key, value)!r}"
    if not bound.above and bound.special is None:
        assert get(load_config("tiny", [*peft, f"{key}={bound.low:g}"]), key) == bound.low


def get_typed(key: str, value: float):
    """`value` as the schema's type of `key` holds it (an int key's -1 is -1, a float key's is -1.0)."""
    kind = _leaf_types()[key]
    return float(value) if kind is float or float in getattr(kind, "__args__", ()) else int(value)


def test_mtbf_hours_observed_is_the_named_default_and_0_is_refused():
    """checkpoint.mtbf_hours is "observed" by default: the MTBF this run observes, else 3 h (schema.py,
    docs/fault-tolerance.md). An MTBF of 0 (or below) has no meaning for the Young/Daly interval: refused."""
    assert load_config("tiny", ["checkpoint.every_steps=auto"]).checkpoint.mtbf_hours == "observed"
    assert load_config("tiny", ["checkpoint.mtbf_hours=observed"]).checkpoint.mtbf_setting_s == 0
    assert load_config("tiny", ["checkpoint.mtbf_hours=2.5"]).checkpoint.mtbf_setting_s == 9000
    for value in ("0", "-0.5"):
        with pytest.raises(ConfigError, match=r"^checkpoint.mtbf_hours must be positive or observed, got -?0\.?5?"):
            load_config("tiny", [f"checkpoint.mtbf_hours={value}", "checkpoint.every_steps=auto"])


def test_a_zero_divisor_is_refused_before_any_division():
    """remat.every_n_layers=0 with explicit pipeline stages divided by zero (a traceback) before the table."""
    with pytest.raises(ConfigError, match="remat.every_n_layers must be positive, got 0"):
        load_config("tiny", ["remat.every_n_layers=0", "mesh.pipeline=2", "mesh.pipeline_stage_layers=[1,1]"])


# --------------------------------------------------------------------------------------------
# Values are parsed against the schema's types, not by YAML 1.1's rules (which read `off` as false, `0123` as
# octal 83, `1e3` as a float and `null` as nothing, and the string keys got 'False', '83', '1000.0')

WORDS = ["off", "no", "on", "yes", "true", "null", "1e3", "0123"]


def schema_keys(node=Config, prefix=""):
    """Dotted key -> type, from the dataclasses' annotations (what load.py parses against)."""
    found = {}
    for name, kind in typing.get_type_hints(node).items():
        found.update(schema_keys(kind, f"{prefix}{name}.") if dataclasses.is_dataclass(kind) else {prefix + name: kind})
    return found


# Every key that holds text: str, and the lists of str (their items). The tables of str (mesh.rules, remat.custom)
# are left out: their entries are axis names and remat actions, whose checks (test_sharding, test_remat) own them.
STRING_KEYS = sorted(k for k, kind in schema_keys().items() if kind is str or kind == list[str])
# Settings a key can only be given with (the node-local tier is a directory and an interval, or neither).
COMPANIONS = {
    "checkpoint.local_dir": ["checkpoint.local_every_steps=5"],
    "checkpoint.local_every_steps": ["checkpoint.local_dir=/dev/shm/llama-jax"],
}


def as_override(key, text):
    return f"{key}=[{text}]" if schema_keys()[key] == list[str] else f"{key}={text}"


def as_yaml_file(directory, key, text):
    """`key: text` nested into its sections, the text unquoted (a plain YAML scalar, as a user writes it)."""
    *sections, field = key.split(".")
    lines = [f"{'  ' * depth}{section}:" for depth, section in enumerate(sections)]
    lines.append(f"{'  ' * len(sections)}{field}: {'[' + text + ']' if schema_keys()[key] == list[str] else text}")
    path = directory / f"{key}-{text}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def has_choices(key):
    """Whether the key takes only some words (model.attention, peft.method, ...): a made-up one is refused."""
    try:
        load_config("tiny", [*COMPANIONS.get(key, []), as_override(key, "no-such-choice")])
    except ConfigError:
        return True
    return False


def names_exactly(message, text):
    """The message quotes the text as typed, not a conversion of it ('False', '83', '1000.0')."""
    return re.search(rf"(?<![\w.]){re.escape(text)}(?![\w.])", message) is not None


@pytest.mark.parametrize("source", ["key=value", "yaml"])
@pytest.mark.parametrize("key", STRING_KEYS)
def test_every_string_key_keeps_the_text_as_written(key, source, tmp_path):
    """Each string key, given each of WORDS on the command line or unquoted in a YAML file, holds that exact text;
    a key with a fixed set of choices refuses each in one ConfigError line that names the key and the text."""
    choices = has_choices(key)
    for text in WORDS:
        try:
            if source == "yaml":
                config = load_config(str(as_yaml_file(tmp_path, key, text)), COMPANIONS.get(key, []))
            else:
                config = load_config("tiny", [*COMPANIONS.get(key, []), as_override(key, text)])
        except ConfigError as err:
            message = str(err)
            assert choices, f"{key}={text} refused: {message}"
            assert len(message.splitlines()) == 1 and key in message and names_exactly(message, text), message
            continue
        assert not choices, f"{key} took '{text}', a made-up word is refused"
        expected = [text] if schema_keys()[key] == list[str] else text
        assert get(config, key) == expected, (key, text)


def test_the_keys_with_choices_are_the_ones_checks_py_names():
    """has_choices finds the keys with a fixed set of words by probing; each is one checks.py compares with choices.py
    (so a free text key, e.g. run.compilation_cache, cannot pass the test above by being refused)."""
    assert len(STRING_KEYS) >= 20
    assert {"run.compilation_cache", "data.sources", "train.sample_prompt"} <= set(STRING_KEYS)
    source = Path(checks.__file__).read_text()
    chosen = [key for key in STRING_KEYS if has_choices(key)]
    assert {"model.attention", "remat.policy", "peft.method"} <= set(chosen) and "run.compilation_cache" not in chosen
    assert all(key in source for key in chosen), chosen


NUMBER_OR_WORD_KEYS = sorted(k for k, kind in schema_keys().items() if _is_union(kind))


@pytest.mark.parametrize("key", NUMBER_OR_WORD_KEYS)
def test_a_number_or_word_key_refuses_other_words_as_typed(key):
    """train.microbatches, checkpoint.every_steps, ...: a count or `auto`; checkpoint.mtbf_hours: hours or
    `observed`. Any other word is refused in one line that quotes it as typed."""
    word = BOUNDS[key].word
    assert get(load_config("tiny", [*COMPANIONS.get(key, []), f"{key}={word}"]), key) == word
    assert get(load_config("tiny", [*COMPANIONS.get(key, []), f"{key}=0002"]), key) == 2
    for text in ["off", "no", "on", "yes", "true", "null", word.upper(), *(["1e3"] if word == "auto" else [])]:
        with pytest.raises(ConfigError) as refused:
            load_config("tiny", [*COMPANIONS.get(key, []), f"{key}={text}"])
        assert len(str(refused.value).splitlines()) == 1 and f"got '{text}'" in str(refused.value)


def test_numbers_are_decimal_and_booleans_are_true_or_false(tmp_path):
    """0123 is 123 (YAML 1.1: octal 83); hex, times and floats are not whole numbers; true/false in any case."""
    settings = {
        "train.steps": ("0123", 123),
        "train.warmup_steps": ("1_0", 10),
        "train.lr": ("1e3", 1000.0),
        "inject.nan_steps": ("[010, 3]", [10, 3]),
        "model.tie_embeddings": ("True", True),
        "mesh.load_balance": ("FALSE", False),
    }
    config = load_config("tiny", [f"{key}={text}" for key, (text, _) in settings.items()])
    for key, (_, value) in settings.items():
        assert get(config, key) == value, key
    from_file = tmp_path / "c.yaml"
    from_file.write_text(
        "train:\n  steps: 0123\n  warmup_steps: 1_0\n  lr: 1e3\ninject:\n  nan_steps: [010, 3]\n"
        "model:\n  tie_embeddings: True\nmesh:\n  load_balance: FALSE\n"
    )
    assert load_config(str(from_file)) == dataclasses.replace(
        Config(),
        train=dataclasses.replace(Config().train, steps=123, warmup_steps=10, lr=1000.0),
        inject=dataclasses.replace(Config().inject, nan_steps=[10, 3]),
        model=dataclasses.replace(Config().model, tie_embeddings=True),
        mesh=dataclasses.replace(Config().mesh, load_balance=False),
    )
    for key, text in [
        ("train.steps", "0x10"),
        ("train.steps", "1:30"),
        ("train.steps", "1e3"),
        ("train.lr", "0x10"),
        ("model.tie_embeddings", "yes"),
        ("model.tie_embeddings", "1"),
        ("run.wandb", "off"),
    ]:
        with pytest.raises(ConfigError, match=rf"^'{key}' must be .*, got '{re.escape(text)}'$"):
            load_config("tiny", [f"{key}={text}"])


def test_text_that_yaml_would_change_survives_the_run_config(tmp_path):
    """A run's config.yaml (to_yaml) loads back to the same text: a prompt ending in ':', a trailing space,
    `${...}` (no interpolation), a quote, a float YAML writes as .inf."""
    config = load_config(
        "tiny",
        [
            "train.sample_prompt=ROMEO: ",
            "run.wandb_name=${oc.env:HOME}",
            "data.text_field='body'",
            "run.compilation_cache=off",
            "fault.hang_factor=inf",
        ],
    )
    assert config.train.sample_prompt == "ROMEO: " and config.run.wandb_name == "${oc.env:HOME}"
    assert config.data.text_field == "'body'" and config.fault.hang_factor == float("inf")
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(config))
    assert load_config(str(path)) == config


def test_compilation_cache_off_writes_no_cache_anywhere(tmp_path, corpus):
    """`llama-jax train tiny run.compilation_cache=off` (shrunk to 2 steps) in a fresh cwd: jax's persistent cache
    stays unset in the process, and no cache entry is written anywhere under the cwd, the run dir or the cache
    root (before: a directory ./False)."""
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    # No inherited cache dir (conftest sets one for the suite), $HOME and the user cache in tmp_path. Any cache in use
    # would be written, compiles under a second included (conftest: JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0).
    env = {k: v for k, v in subprocess_environment().items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), MPLCONFIGDIR=str(home / "mpl"))
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    # cli.main is the llama-jax console script's entry point; run so, the process can print jax's setting after it.
    probe = (
        "import sys, jax; from llama_jax import cli; status = cli.main(sys.argv[1:]); "
        "print('jax_compilation_cache_dir:', jax.config.jax_compilation_cache_dir); sys.exit(status)"
    )
    quick = [
        "train.steps=2",
        "train.warmup_steps=0",
        "train.batch_size=8",
        "train.seq_len=32",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=0",
        "model.vocab_size=320",
        "model.d_model=64",
        "model.ffn_dim=128",
        "run.tensorboard=false",
        f"data.sources=[{corpus}]",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", probe, "train", "tiny", "run.compilation_cache=off", *quick, "run.dir=run"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "jax_compilation_cache_dir: None" in proc.stdout, proc.stdout[-2000:]
    assert [p.name for p in cwd.iterdir()] == ["run"]  # no ./off, ./False
    assert load_config(str(cwd / "run" / "config.yaml")).run.compilation_cache == "off"
    assert (home / ".cache" / "llama_jax").is_dir()  # the data went to the user cache, the compiled steps did not
    cached = [
        p
        for p in tmp_path.rglob("*")  # jax's entries: <key>-cache, <key>-atime
        if p.name == "jax_compilation_cache" or p.name.endswith(("-cache", "-atime"))
    ]
    assert not cached, cached
