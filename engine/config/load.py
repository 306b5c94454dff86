"""TOML -> typed config, with ``--set a.b=c`` overrides and errors that name the key and where it came from.

An error in a value given with ``--set`` names the flag, not the file; a misspelled key
gets the closest existing names ("did you mean ..."), and a key of TRL's ``GRPOConfig`` the key here
(``engine.config.trl_names``).
"""

from __future__ import annotations

import difflib
import tomllib
import typing
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from engine.config.trl_names import trl_hint

T = TypeVar("T")


class ConfigError(ValueError):
    """A config the user wrote cannot be used; the message names the key and the file or flag."""


class Origin:
    """Where each key of a config tree came from: the file, or what changed it, labelled in the words the user
    wrote it in (``--set train.lr=x`` on the command line, ``Trainer(train={'lr': 'x'})`` from Python)."""

    def __init__(self, path: str | Path, overrides: list[tuple[list[str], str]] = ()):
        self.file = str(path)
        self.overrides = list(overrides)  # (key path, its label)

    def of(self, key: str) -> str:
        """The label of what set ``key`` (or a table holding it) last, else the file's path."""
        parts = key.split(".")
        for path, label in reversed(self.overrides):
            if parts[: len(path)] == path or path[: len(parts)] == parts:
                return label
        return self.file

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.of(key)}: {key}: {message}")


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


def apply_override(tree: dict, path: list[str], value: Any, flag: str) -> None:
    node: Any = tree
    for depth, part in enumerate(path):
        where = ".".join(path[: depth + 1])
        last = depth == len(path) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {flag}: {where}: index must be 0..{len(node) - 1}")
            index = int(part)
            if last:
                node[index] = value
            node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            node = node.setdefault(part, {}) if not last else node
        else:
            raise ConfigError(f"--set {flag}: {'.'.join(path[:depth])} is a value, not a table")


SHIPPED = Path(__file__).resolve().parents[2] / "configs"  # the project's configs (an editable install reads them here)


def shipped_configs(folder: str = "") -> list[str]:
    """The names of the run configs that ship with the project (``smoke``, ...); ``folder="experiments"``: the
    experiment grids' (``experiments/cpu``, ...)."""
    return sorted(str(p.relative_to(SHIPPED).with_suffix("")) for p in (SHIPPED / folder).glob("*.toml"))


def config_path(path: str | Path) -> Path:
    """A config's file: ``path`` where it exists, else the shipped config it names, so that a script in the user's
    own folder reaches them: ``"smoke"``, ``"smoke.toml"`` or ``"configs/smoke.toml"`` (the docs' and the
    checkout's spelling) all name ``configs/smoke.toml`` of the installed project. A path that exists always wins."""
    given = Path(path)
    if given.exists() or given.is_absolute():
        return given
    name = given.with_suffix(".toml") if given.suffix != ".toml" else given
    for candidate in (SHIPPED / name, SHIPPED.parent / name):  # "smoke" / "experiments/cpu"; "configs/smoke.toml"
        if candidate.is_file():
            return candidate
    return given


def read_toml(path: str | Path, what: str = "config file") -> dict:
    """A TOML file as a dict; a missing file or bad TOML is one ConfigError naming the path (for a config, with the
    names of the shipped ones)."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        folder = {"config file": "", "experiment file": "experiments"}.get(what)
        known = f" (or a shipped one's name: {', '.join(shipped_configs(folder))})" if folder is not None else ""
        raise ConfigError(f"{path}: {what} not found{known}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def read_tree(path: str | Path, overrides: list[str] = ()) -> tuple[dict, Origin]:
    """A TOML file (or a shipped config's name: ``config_path``) as a dict with ``--set`` overrides applied (not yet
    typed), and where each key came from."""
    path = config_path(path)
    tree = read_toml(path)
    applied = []
    for text in overrides:
        key_path, value = parse_override(text)
        apply_override(tree, key_path, value, text)
        applied.append((key_path, f"--set {text}"))
    return tree, Origin(path, applied)


def convert(tree: dict, cls: type[T], origin: Origin) -> T:
    """Decode ``tree`` into ``cls`` strictly; an error names the key, its origin, and close names."""
    try:
        return msgspec.convert(tree, cls)
    except msgspec.ValidationError as exc:
        key, text = _split(str(exc))
        if text.startswith("object contains unknown field "):
            unknown = text.removeprefix("object contains unknown field ")
            full = f"{key}.{unknown}" if key else unknown
            trl = trl_hint(unknown)  # a name carried over from TRL: its key here, not a spelling guess
            hint = f"; {trl}" if trl else did_you_mean(unknown, _fields_at(cls, tree, key))
            raise ConfigError(f"{origin.of(full)}: {key or '(top level)'}: unknown field {unknown}{hint}") from None
        if text.startswith("invalid value") and key.split(".")[-1] == "kind":  # a tagged union's tag
            parent = key.rpartition(".")[0]
            kinds = _tags_at(cls, tree, parent)
            raise origin.error(key, f"unknown kind {_value_at(tree, key)!r}; known: {', '.join(kinds)}") from None
        if text.startswith("invalid enum value") and (choices := _choices_at(cls, key)):
            raise origin.error(key, f"{_value_at(tree, key)!r} is not one of {', '.join(map(repr, choices))}") from None
        if ", got" not in text and key:  # "expected int >= 1": say what it got
            text += f", got {_value_at(tree, key)!r}"
        raise origin.error(key or "(top level)", text) from None


def _choices_at(cls: type, key: str) -> tuple:
    """The values a Literal field at ``key`` (dotted, list indices included) allows; () if it is not one."""
    hint: Any = cls
    for part in key.split("."):
        while typing.get_origin(hint) in (list, typing.Annotated):
            hint = typing.get_args(hint)[0]
        if part.isdigit():
            continue
        try:
            hint = typing.get_type_hints(hint)[part]
        except (TypeError, KeyError, NameError):
            return ()
    while typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    return typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else ()


def _value_at(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree.get(part) if isinstance(tree, dict) else None
    return tree


def _split(message: str) -> tuple[str, str]:
    """msgspec says "Expected `int`, got `str` - at `$.train.lr`" -> ("train.lr", "expected int, got str")."""
    text, where = message, ""
    if " - at `$" in message:
        text, where = message.rsplit(" - at `$", 1)
        where = where.rstrip("`").lstrip(".").replace("[", ".").replace("]", "")
    text = text.replace("`", "")
    return where, text[:1].lower() + text[1:]


def _fields_at(cls: type, tree: Any, key: str) -> list[str]:
    """Field names of the Struct at dotted ``key`` (tagged unions resolved by the tree's tag value)."""
    info: Any = mi.type_info(cls)
    node = tree
    for part in [p for p in key.split(".") if p]:
        info = _resolve(info, node)
        if isinstance(info, mi.StructType):
            field = next((f for f in info.fields if f.encode_name == part), None)
            if field is None:
                return []
            info, node = field.type, node.get(part) if isinstance(node, dict) else None
        elif isinstance(info, mi.ListType) and part.isdigit():
            info, node = info.item_type, node[int(part)] if isinstance(node, list) else None
        else:
            return []
    info = _resolve(info, node)
    return [f.encode_name for f in info.fields] if isinstance(info, mi.StructType) else []


def _tags_at(cls: type, tree: Any, key: str) -> list[str]:
    """The tags a tagged union at dotted ``key`` accepts (``objective`` -> grpo, prp, ...)."""
    info: Any = mi.type_info(cls)
    node = tree
    for part in [p for p in key.split(".") if p]:
        info = _resolve(info, node)
        field = next((f for f in getattr(info, "fields", ()) if f.encode_name == part), None)
        if field is None:
            return []
        info, node = field.type, node.get(part) if isinstance(node, dict) else None
    return sorted(str(t.tag) for t in getattr(info, "types", ()) if isinstance(t, mi.StructType))


def _resolve(info: Any, node: Any) -> Any:
    """The member of a tagged union (or optional) that ``node`` selects."""
    if not isinstance(info, mi.UnionType):
        return info
    structs = [t for t in info.types if isinstance(t, mi.StructType)]
    tag = node.get(structs[0].tag_field) if structs and isinstance(node, dict) else None
    return next((t for t in structs if t.tag == tag), structs[0] if structs else info)


def did_you_mean(word: str, choices: list[str], list_all: bool = True) -> str:
    """" (did you mean X?)" for the closest choices, else (``list_all``) "; known: " and every choice."""
    close = difflib.get_close_matches(word, choices, n=2, cutoff=0.5)
    if close:
        return f" (did you mean {' or '.join(close)}?)"
    return f"; known: {', '.join(choices)}" if choices and list_all else ""
