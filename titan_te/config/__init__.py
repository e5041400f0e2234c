"""Configuration: one dataclass per TOML section (schema.py), loading from TOML and the command line
(loading.py), validation before any heavy work (validation.py), `--help` and the resolved TOML (render.py).

Precedence is CLI > TOML > defaults. Every mistake raises ConfigError *before* any model or data is
built; `train.py` turns it into `config error: ...` on stderr and exit code 2.
"""
from titan_te.config.loading import PRESETS, CliArgs, build, load, load_toml, parse_argv, presets, resolve_config_path
from titan_te.config.render import help_text, to_toml
from titan_te.config.schema import (FP8, FRACTION, NON_NEGATIVE, POSITIVE, UNIT_OPEN, WEEK_S, ActivationCheckpoint,
                                    Bounds, Checkpoint, Compile, Config, Data, Job, LRScheduler, Metrics, Model,
                                    Optimizer, Parallelism, Profiling, Training, Validation, opt, sections)
from titan_te.config.validation import component_options, dp_degrees, readers, validate, world_size_from_env
from titan_te.errors import ConfigError

__all__ = ["ActivationCheckpoint", "Bounds", "Checkpoint", "CliArgs", "Compile", "Config", "ConfigError", "Data", "FP8",
           "FRACTION", "Job", "LRScheduler", "Metrics", "Model", "NON_NEGATIVE", "Optimizer", "POSITIVE", "PRESETS",
           "Parallelism", "Profiling", "Training", "UNIT_OPEN", "Validation", "WEEK_S", "build", "component_options",
           "dp_degrees", "help_text", "load", "load_toml", "opt", "parse_argv", "presets", "readers",
           "resolve_config_path", "sections", "to_toml", "validate", "world_size_from_env"]
