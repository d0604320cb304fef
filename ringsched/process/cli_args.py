"""The engine's command-line flags, shared by `launch`, `generate` and `bench` (argparse lives only here and
in the entry points). Each flag maps to one `EngineConfig` field."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from ringsched.config import ConfigError, EngineConfig
from ringsched.spec import ModelSpec
from ringsched.weights.fetch import FetchError
from ringsched.weights.model_config import UnsupportedModelError
from ringsched.weights.model_files import BadModelError


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
    """One flag per `EngineConfig` field made with `_flag`."""
    add_flags(p, _engine_fields())


def add_flags(p: argparse.ArgumentParser, fields: list[dataclasses.Field]) -> None:
    """One flag per field made with `config._flag`: name, default, type, choices, group and help all come from
    the field."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields:
        meta = f.metadata
        group = groups.get(meta["group"]) or groups.setdefault(meta["group"], p.add_argument_group(meta["group"]))
        kind = meta["type"] or type(f.default)
        if kind is type(None):
            raise TypeError(f"the flag of field {f.name} defaults to None: give its _flag a type")
        if kind is bool:  # --enable-x / --no-enable-x
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                default=f.default,
                action=argparse.BooleanOptionalAction,
                help=meta["help"] if f.default is None else f"{meta['help']} (default: {'on' if f.default else 'off'})",
            )
            continue
        group.add_argument(
            "--" + f.name.replace("_", "-"), default=f.default, type=kind, choices=meta["choices"], help=meta["help"]
        )


def resolve_args(args: argparse.Namespace, **extra) -> tuple[EngineConfig, ModelSpec]:
    """Build and fully validate the config, and resolve the model once (fetching it if needed); on a bad flag
    print the error and exit 2."""
    try:
        cfg = EngineConfig(**{k: getattr(args, k) for k in ENGINE_FLAGS}, **extra)
        spec = ModelSpec.resolve(cfg, quiet=False)
        return dataclasses.replace(cfg, model=spec.model_dir), spec
    except (ConfigError, FetchError, UnsupportedModelError, BadModelError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def config_from_args(args: argparse.Namespace, **extra) -> EngineConfig:
    """`resolve_args`' config, for the commands that hand it to an `Engine` (which resolves its model itself)."""
    return resolve_args(args, **extra)[0]


def engine_kwargs(cfg: EngineConfig) -> dict:
    """`Engine(model=cfg.model, **engine_kwargs(cfg))`: the validated flags, back as keyword arguments."""
    return {k: getattr(cfg, k) for k in ENGINE_FLAGS if k != "model"} | {"log_level": cfg.log_level}
