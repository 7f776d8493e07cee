"""Reading config text: YAML files (with ``_base_`` includes), ``Section.key=value`` overrides
and typed coercion of values into the section dataclasses. ``build_config`` (``__init__.py``)
applies them; the sections themselves are in ``model.py``, ``train.py``, ``compress.py`` and
``apps.py``."""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Any, Optional

import yaml

from ..errors import ConfigError


def suggest(name: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``name``, or "" when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _strip_optional(tp):
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _coerce(tp, value, where: str):
    """Check/convert ``value`` to type ``tp``; ``where`` names the key for errors."""
    tp, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where} may not be null")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return build_section(tp, value, where)
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if tp in (int, float) and isinstance(value, str):
        # YAML 1.1 reads "1e-4" (no dot) as a string; users mean a number.
        try:
            value = float(value) if tp is float or not value.strip().lstrip("+-").isdigit() else int(value)
        except ValueError:
            pass
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


def build_section(cls, data: dict, where: str, origins: Optional[dict] = None):
    """Instantiate dataclass ``cls`` from ``data``, rejecting unknown keys by name. ``origins``
    maps keys set by `-o` to their override text, so an error blames the override, not the file."""
    origins = origins or {}
    source, _, section = where.rpartition(": ")
    source = "" if source == "<defaults>" else source
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        at = f"-o {origins[key]}: {section}" if key in origins else where
        if key not in names:
            where_key = f"-o {origins[key]}: unknown key {section}.{key}" if key in origins else \
                f"unknown key {where}.{key}"
            raise ConfigError(f"{where_key}{suggest(key, names)}; valid keys: {', '.join(names)}")
        kwargs[key] = _coerce(hints[key], value, f"{at}.{key}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        blamed = [text for key, text in origins.items() if f"{section}.{key} " in f"{e} "]
        raise ConfigError(f"-o {blamed[0]}: {e}" if blamed else f"{source}: {e}" if source else str(e)) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"Section.key.sub=value"`` -> (["Section", "key", "sub"], the value read as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like Section.key=value")
    path, raw = text.split("=", 1)
    keys = path.strip().split(".")
    if len(keys) < 2 or not all(keys):
        raise ConfigError(f"override {text!r} must look like Section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return keys, value


def merge(dst: dict, src: dict) -> dict:
    """``src`` merged into ``dst`` (nested mappings key by key); returns ``dst``."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        else:
            dst[k] = v
    return dst


def load_yaml(path: str) -> dict:
    """Read a YAML config file into raw sections (``_base_`` files are merged first)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not a YAML text file (byte {e.start} is not UTF-8)") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base = raw.pop("_base_", None)
    if base:
        base_path = os.path.join(os.path.dirname(path), base)
        raw = merge(load_yaml(base_path), raw)
    return raw
