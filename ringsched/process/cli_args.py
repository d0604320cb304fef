"""The engine's command-line flags, shared by `launch`, `generate` and `bench` (argparse lives only here and
in the entry points). Each flag maps to one `EngineConfig` field."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ringsched.config import ConfigError, EngineConfig
from ringsched.models.config import ModelConfig, UnsupportedModelError
from ringsched.models.fetch import FetchError, resolve_model


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default (a derived default, None, is described in the help itself)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        shown = action.option_strings and not (d is None or d is False or d == argparse.SUPPRESS)
        if shown and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if "help" in f.metadata]


ENGINE_FLAGS = tuple(f.name for f in _engine_fields())


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per `EngineConfig` field made with `_flag`: name, default, type, choices and help all come from
    the field."""
    groups = {name: p.add_argument_group(name) for name in ("engine", "nodes")}
    for f in _engine_fields():
        meta = f.metadata
        kind = meta["type"] or type(f.default)
        groups[meta["group"]].add_argument(
            "--" + f.name.replace("_", "-"), default=f.default, type=kind, choices=meta["choices"], help=meta["help"]
        )


def config_from_args(args: argparse.Namespace, **extra) -> EngineConfig:
    """Build and fully validate the config (model included); on a bad flag print the error and exit 2."""
    try:
        model_dir = str(resolve_model(args.model, quiet=False))
        cfg = EngineConfig(**{k: getattr(args, k) for k in ENGINE_FLAGS if k != "model"}, model=model_dir, **extra)
        mcfg = ModelConfig.from_dir(model_dir)
        cfg.check_partition(mcfg.num_layers)
        cfg.context_len(mcfg.max_position_embeddings)
        return cfg
    except (ConfigError, FetchError, UnsupportedModelError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def engine_kwargs(cfg: EngineConfig) -> dict:
    """`Engine(model=cfg.model, **engine_kwargs(cfg))`: the validated flags, back as keyword arguments."""
    return {k: getattr(cfg, k) for k in ENGINE_FLAGS if k != "model"} | {"log_level": cfg.log_level}
