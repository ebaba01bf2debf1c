"""Build nested config dataclasses from YAML and ``key=value`` overrides, naming any bad key."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Type, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the dotted key."""


def _suggest(key: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r}: must be one of {list(args)}")
        return value
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping of {annotation.__name__} fields, got {value!r}")
        return from_dict(annotation, value, prefix=key)
    if origin in (list, List, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin in (dict, Dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(value)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            return float(value)  # YAML reads 1e-6 (no dot) as a string
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if annotation is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return str(value)
    return value


def from_dict(cls: Type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Instantiate dataclass ``cls`` from ``data``; unknown keys and bad types raise ConfigError."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]  # T: a dataclass (checked by the caller's annotation)
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ConfigError(f"unknown config key {dotted!r}{_suggest(key, names)}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{prefix or cls.__name__}: {error}") from None


def to_dict(config: Any) -> Dict[str, Any]:
    """Plain-dict form of a (nested) config dataclass, for YAML dumps and checkpoints."""
    return dataclasses.asdict(config)


def parse_override(text: str) -> tuple:
    """``"train.lr=1e-6"`` -> ``(["train", "lr"], 1e-06)``; the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    if not raw.strip():
        return key.split("."), ""
    try:
        return key.split("."), yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({_yaml_problem(error)})") from None


def apply_overrides(data: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """Set dotted ``key=value`` overrides in a nested plain dict (creating sections as needed)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            existing = node.get(part)
            if existing is None:
                existing = node[part] = {}
            if not isinstance(existing, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = existing
        node[path[-1]] = value
    return data


class _RepeatedKeyRefusingLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with a key written twice (PyYAML keeps the last silently)."""


def _mapping_without_repeats(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Dict[Any, Any]:
    seen: Dict[Any, Any] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                f"while reading the mapping from line {node.start_mark.line + 1}",
                node.start_mark,
                f"key {key!r} is written twice (first on line {seen[key].line + 1}): the first would be dropped",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark
    return loader.construct_mapping(node, deep=True)


_RepeatedKeyRefusingLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_repeats)


def load_yaml(path: str | Path) -> Dict[str, Any]:
    """Read a YAML mapping from ``path`` (an empty file is an empty mapping; a key written twice is an error)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = yaml.load(text, Loader=_RepeatedKeyRefusingLoader) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        if mark is None:
            raise ConfigError(f"{path}: YAML syntax error: {_yaml_problem(error)}") from None
        lines = text.splitlines()
        shown = lines[mark.line] if mark.line < len(lines) else ""
        raise ConfigError(
            f"{path}:{mark.line + 1}:{mark.column + 1}: YAML syntax error: {_yaml_problem(error)}\n"
            f"    {shown}\n    {' ' * mark.column}^"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's own words for what is wrong, without its "<unicode string>" position lines."""
    parts = [getattr(error, "context", None), getattr(error, "problem", None)]
    words = "; ".join(part for part in parts if part)
    return words or str(error).splitlines()[0]


def validate_tree(config: Any, prefix: str = "") -> None:
    """Call ``validate()`` on ``config`` and every nested dataclass that defines it."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            validate_tree(value, f"{prefix}.{field.name}" if prefix else field.name)
    validate = getattr(config, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError:
            raise
        except ValueError as error:
            raise ConfigError(str(error)) from None
