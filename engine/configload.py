"""TOML -> typed config, with ``--set a.b=c`` overrides and errors that name the key and file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


class ConfigError(ValueError):
    """A config the user wrote cannot be used; the message names the file and key."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.lr=3e-4"`` -> (["train", "lr"], 0.0003). Values are TOML literals, else strings."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set train.lr=3e-4")
    key, raw = text.split("=", 1)
    path = [part for part in key.strip().split(".") if part]
    if not path:
        raise ConfigError(f"--set {text!r}: the key is empty")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word: treat as a string
    return path, value


def apply_override(tree: dict, path: list[str], value: Any, origin: str) -> None:
    node: Any = tree
    for depth, part in enumerate(path[:-1]):
        where = ".".join(path[: depth + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, where, origin)]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            raise ConfigError(f"{origin}: --set {'.'.join(path)}: {where} is a value, not a table")
    last = path[-1]
    if isinstance(node, list):
        node[_list_index(node, last, ".".join(path), origin)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError(f"{origin}: --set {'.'.join(path)}: parent is a value, not a table")


def _list_index(node: list, part: str, where: str, origin: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"{origin}: --set {where}: index must be 0..{len(node) - 1}")
    return int(part)


def read_tree(path: str | Path, overrides: list[str] = ()) -> dict:
    """A TOML file as a dict, with ``--set`` overrides applied (not yet typed)."""
    path = Path(path)
    try:
        tree = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for text in overrides:
        key_path, value = parse_override(text)
        apply_override(tree, key_path, value, str(path))
    return tree


def load_config(path: str | Path, cls: type[T], overrides: list[str] = ()) -> T:
    """Read a TOML file, apply overrides, decode into ``cls`` (strict: unknown keys are errors)."""
    return convert(read_tree(path, overrides), cls, str(path))


def convert(tree: dict, cls: type[T], origin: str) -> T:
    try:
        return msgspec.convert(tree, cls)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{origin}: {_readable(str(exc))}") from None


def _readable(message: str) -> str:
    """msgspec says "Expected `int`, got `str` - at `$.train.lr`"; say "train.lr: expected int, got str"."""
    if " - at `$" in message:
        text, where = message.rsplit(" - at `$", 1)
        where = where.rstrip("`").lstrip(".").replace("[", ".").replace("]", "")
        text = text.replace("`", "")
        return f"{where or '(top level)'}: {text[0].lower()}{text[1:]}"
    return message.replace("`", "")


def to_toml_dict(config: msgspec.Struct) -> dict:
    """The resolved config as plain builtins (for writing next to a run)."""
    return msgspec.to_builtins(config)
