"""Config files (`configs/*.py`) to ModelConfig, and overrides without absl flags.

A preset is a standalone file with `get_config(arg=None) -> ml_collections.ConfigDict`
whose `model` field holds every ModelConfig field, so any of them can be overridden
(`--config.model.hidden_size=128` on a command line, `"model.hidden_size=128"` here).
Fields whose default is None are typed placeholders, so an override still knows what
type to parse.

    cfg = load_config("configs/tiny.py", ["model.num_hidden_layers=2", "train.steps=100"])
    model_cfg = model_config_from(cfg)
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import ml_collections
from ml_collections import config_dict

from glmjax.config import ModelConfig

_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(ModelConfig))


def _placeholder_type(name: str) -> type:
    """The first non-None type in ModelConfig's annotation of `name` (`tuple[str, ...] | None` -> tuple)."""
    hint = typing.get_type_hints(ModelConfig)[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else (hint,)
    first = next(a for a in args if a is not type(None))
    return typing.get_origin(first) or first


def model_config_dict(**fields: Any) -> ml_collections.ConfigDict:
    """Every ModelConfig field at its default, with `fields` set on top, as a ConfigDict."""
    unknown = sorted(set(fields) - set(_FIELD_NAMES))
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown}; valid fields: {', '.join(_FIELD_NAMES)}")
    defaults = ModelConfig()
    out = ml_collections.ConfigDict()
    for name in _FIELD_NAMES:
        value = fields[name] if name in fields else getattr(defaults, name)
        if name == "rope_parameters":
            value = dict(value)
        elif name in ("mlp_layer_types", "indexer_types") and name not in fields:
            value = None  # derived in ModelConfig.__post_init__ from the fields it depends on
        out[name] = config_dict.placeholder(_placeholder_type(name)) if value is None else value
    return out


def model_config_from(cfg: ml_collections.ConfigDict | Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a preset's ConfigDict (its `model` field) or from the model dict itself."""
    model = cfg["model"] if "model" in cfg else cfg
    if isinstance(model, ml_collections.ConfigDict):
        model = model.to_dict()
    unknown = sorted(set(model) - set(_FIELD_NAMES))
    if unknown:
        raise ValueError(f"config.model has unknown field(s) {unknown}; valid fields: {', '.join(_FIELD_NAMES)}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in model.items()}
    return ModelConfig(**kwargs)


def load_config(path: str | os.PathLike, overrides: Iterable[str] = (), arg: str | None = None) -> ml_collections.ConfigDict:
    """Imports the config file at `path`, calls `get_config(arg)` and applies `key.sub=value` overrides.

    Each value is parsed as the type the field already has (int, float, bool, str, tuple /
    list, dict); a leading `--config.` is accepted so command lines can be pasted.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    name = "glmjax_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path!r} defines no get_config(arg=None)")
    cfg = module.get_config(arg)
    for override in overrides:
        apply_override(cfg, override)
    return cfg


def apply_override(cfg: ml_collections.ConfigDict, override: str) -> None:
    """Sets one `key.sub=value` on `cfg` in place, parsing `value` as the field's type."""
    key, sep, text = override.removeprefix("--config.").partition("=")
    if not sep or not key:
        raise ValueError(f"override {override!r} is not of the form key.sub=value")
    *parents, leaf = key.split(".")
    holder, where = cfg, "config"
    for part in parents:
        if not isinstance(holder, ml_collections.ConfigDict) or part not in holder:
            _unknown(key, part, holder, where)
        holder, where = holder[part], f"{where}.{part}"
    if not isinstance(holder, ml_collections.ConfigDict) or leaf not in holder:
        _unknown(key, leaf, holder, where)
    field_type = holder.get_type(leaf)
    try:
        value = _parse(text, field_type)
        holder[leaf] = value
    except (TypeError, ValueError) as e:
        raise ValueError(f"override {override!r}: cannot set {key} (a {field_type.__name__}) to {text!r}: {e}") from None


def _unknown(key: str, part: str, holder: Any, where: str) -> typing.NoReturn:
    if isinstance(holder, ml_collections.ConfigDict):
        raise ValueError(f"unknown config key {key!r}: {where} has no field {part!r}; "
                         f"valid fields of {where}: {', '.join(sorted(holder.keys()))}")
    raise ValueError(f"unknown config key {key!r}: {where} is a {type(holder).__name__}, not a ConfigDict")


def _parse(text: str, field_type: type) -> Any:
    if field_type is bool:
        lowered = text.strip().lower()
        if lowered not in ("true", "false", "1", "0"):
            raise ValueError("expected true or false")
        return lowered in ("true", "1")
    if field_type is int:
        return int(text)
    if field_type is float:
        return float(text)
    if field_type is str:
        return text
    if field_type in (tuple, list):
        value = _literal(text)
        if isinstance(value, str):  # a bare "a,b,c"
            value = [_literal(v.strip()) for v in text.split(",") if v.strip()]
        if not isinstance(value, (tuple, list)):
            value = [value]
        return field_type(value)
    if isinstance(field_type, type) and issubclass(field_type, ml_collections.ConfigDict):
        value = _literal(text)
        if not isinstance(value, dict):
            raise ValueError("expected a dict literal such as {'rope_theta': 1e6}")
        return ml_collections.ConfigDict(value)
    return _literal(text)


def _literal(text: str) -> Any:
    """A Python literal (`1`, `2.5`, `[1, 2]`, `None`, `true`), else the text itself as a string."""
    try:
        return ast.literal_eval({"true": "True", "false": "False"}.get(text, text))
    except (SyntaxError, ValueError):
        return text
