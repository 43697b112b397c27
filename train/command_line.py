"""Run configs on the command line: config files and `--config.a.b=value` overrides.

    config, path, rest = config_from_argv(argv, default_path)              # --config FILE, --config.KEY=VALUE

Config files are plain Python with a `get_config()` returning an ml_collections.ConfigDict (big_vision style).
An override is parsed by the type of the key's current value (bool: true/false/1/0/yes/no), so
`--config.model.n_shared_experts=True` or `--config.train.steps=1e3` is an error naming the key, and an unknown
key names the closest valid one.
"""

import argparse
import difflib
import importlib.util
import sys
from pathlib import Path

import ml_collections

from plumbing.errors import UserError
from rundir.config_layout import MOVED_KEYS
from rundir.run_config import RunConfig, field_docs

_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def load_config_file(path) -> ml_collections.ConfigDict:
    """get_config() of the Python file at `path`; UserError naming the file for every way this can fail."""
    p = Path(path)
    if not p.is_file():
        known = sorted(str(c) for c in p.parent.glob("*.py") if c.stem not in ("__init__", "base")) if \
            p.parent.is_dir() else []
        known = known or sorted(str(c) for c in Path("configs").glob("*.py") if c.stem not in ("__init__", "base"))
        close = difflib.get_close_matches(str(path), known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else (f" (e.g. {', '.join(known)})" if known else "")
        raise UserError(f"config file {path} not found; pass an existing file{hint}")
    name = f"_moe_lm_config_{abs(hash(str(p.resolve())))}"
    try:
        spec = importlib.util.spec_from_file_location(name, p)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise UserError(f"config file {path} has a syntax error at line {e.lineno}: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - any failure of the user's file is reported as that file's
        raise UserError(f"config file {path} failed to load ({type(e).__name__}: {e})") from None
    if not callable(getattr(module, "get_config", None)):
        raise UserError(f"config file {path} defines no get_config() function")
    try:
        config = module.get_config()
    except Exception as e:  # noqa: BLE001
        raise UserError(f"get_config() in {path} failed ({type(e).__name__}: {e})") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise UserError(f"get_config() in {path} returned a {type(config).__name__}, "
                        "expected an ml_collections.ConfigDict")
    return config


def all_keys(config: ml_collections.ConfigDict, prefix: str = "") -> dict:
    """{"train.steps": 400, ...}: every leaf of the config with its value."""
    out = {}
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update(all_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def unknown_key_error(key: str, known, where: str = "") -> UserError:
    if key in MOVED_KEYS:
        return UserError(f"config key {key}{where} is now {MOVED_KEYS[key]}; use --config.{MOVED_KEYS[key]}=... or "
                         f"set c.{MOVED_KEYS[key]} in the file")
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "configs/base.py lists every key"
    return UserError(f"unknown config key {key}{where}; {hint}")


def parse_value(key: str, text: str, current):
    """`text` as the type of `current` (the key's value in the config file)."""
    if isinstance(current, bool):
        if text.strip().lower() not in _BOOLS:
            raise UserError(f"--config.{key} takes true or false, got {text!r}")
        return _BOOLS[text.strip().lower()]
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise UserError(f"--config.{key} takes an integer, got {text!r}") from None
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            raise UserError(f"--config.{key} takes a number, got {text!r}") from None
    if isinstance(current, str):
        return text
    raise UserError(f"--config.{key} ({type(current).__name__}) cannot be set from the command line; "
                    "set it in a config file")


def apply_override(config: ml_collections.ConfigDict, key: str, text: str) -> None:
    known = all_keys(config)
    if key not in known:
        raise unknown_key_error(key, known, " on the command line")
    *path, leaf = key.split(".")
    node = config
    for p in path:
        node = node[p]
    node[leaf] = parse_value(key, text, known[key])


def config_from_argv(argv, default_config: str) -> tuple[ml_collections.ConfigDict, str, list[str]]:
    """(config, config path, remaining args): takes `--config FILE` and every `--config.KEY=VALUE` (or
    `--config.KEY VALUE`) out of argv, loads the file and applies the overrides in order."""
    path, overrides, rest = default_config, [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--config", "-config") or name.startswith(("--config.", "-config.")):
            if not eq:
                if i + 1 >= len(argv):
                    raise UserError(f"{name} needs a value, e.g. {name}=VALUE")
                value, i = argv[i + 1], i + 1
            if name.lstrip("-") == "config":
                path = value
            else:
                overrides.append((name.lstrip("-")[len("config."):], value))
        else:
            rest.append(arg)
        i += 1
    config = load_config_file(path)
    for key, value in overrides:
        apply_override(config, key, value)
    return config, path, rest


def format_keys(config: ml_collections.ConfigDict) -> str:
    """Every key = value of a config with what it means, grouped by section in the run config's order, for --help."""
    docs, values = field_docs(), all_keys(config)
    order = [f"{section}.{k}" for section, keys in RunConfig().to_dict().items() for k in keys]
    lines, section = [], None
    for key in sorted(values, key=lambda k: order.index(k) if k in order else len(order)):
        top = key.split(".", 1)[0]
        if top != section:
            lines.append(f"  [{top}]")
            section = top
        setting = f"    {key} = {values[key]!r}"
        lines.append(f"{setting:<48} {docs[key]}" if docs.get(key) else setting)
    return "\n".join(lines)


def print_help(parser: argparse.ArgumentParser, config=None, file=None) -> None:
    file = file or sys.stdout
    parser.print_help(file)
    if config is not None:
        print("\nconfig keys (override any with --config.KEY=VALUE):", file=file)
        print(format_keys(config), file=file)


