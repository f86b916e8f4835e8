"""Configuration: the one schema of every section, its allowed values, loading and checks.

    schema.py   the frozen dataclasses (Config and its sections): every key, its type and default
    choices.py  every choice a user can type: dtypes, kernels, mesh and logical axes, remat tags and
                policies, peft methods, the model fields a checkpoint must agree on
    bounds.py   every numeric key's range (BOUNDS), and what a documented 0 or -1 means
    checks.py   the checks of values that depend on each other (one ConfigError line each)
    load.py     a preset (presets/*.yaml) or YAML file plus key=value overrides -> a checked Config
    stages.py   a staged run's stages (train.stages), each a Config of its own
    presets/    tiny (the default), bench, and the Llama 3 recipes

The bottom of the package: it imports nothing of llama_jax but errors.py and files.py. The names below are the ones
scripts use: `from llama_jax.config import Config, load_config`.
"""

from llama_jax.config.checks import validate
from llama_jax.config.load import all_keys, load_config, preset_dir, preset_names, summary, to_dict, to_yaml
from llama_jax.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    FaultConfig,
    InjectConfig,
    MeshConfig,
    ModelConfig,
    MuonConfig,
    PeftConfig,
    RematConfig,
    RunConfig,
    StageConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "FaultConfig",
    "InjectConfig",
    "MeshConfig",
    "ModelConfig",
    "MuonConfig",
    "PeftConfig",
    "RematConfig",
    "RunConfig",
    "StageConfig",
    "TrainConfig",
    "all_keys",
    "load_config",
    "preset_dir",
    "preset_names",
    "summary",
    "to_dict",
    "to_yaml",
    "validate",
]
