"""Every key of the run config is read by some code: a documented key that nothing reads fails here, by name.

The keys are every field of every Struct reachable from ``RunConfig``: nested sections, list elements
(``models[]``, ``pool.script[]``) and each member of a tagged union (``task``, ``objective``). A key is read
when a source file of the project (engine/, policies/, tasks/, exchange/, tokenbridge/, monitor/,
experiments/, launch.py; not tests/, docs/ or benchmarks/) holds an attribute load ``.<field>``, or the key's
TOML name as a whole string literal (``getattr(cfg, "name")``, ``table["name"]``, a msgspec rename such as
``lambda``). Field declarations do not count: neither their annotated names nor the strings inside them
(``Literal["..."]``, ``msgspec.field(name=...)``).

A heuristic, lenient by design: the match is by name only, so a common name (``steps``, ``seed``, ``name``,
``size``) read for something else anywhere counts as read (``run.name``, a label no code reads, passes on the
many ``.name`` of other objects), as does a read in a ``__post_init__`` check or in engine/config/validate.py.
It catches a key that nothing reads at all; that a key, once read, does what it says is its own tests' job
(``objective.kl_coef`` was read and still crashed: nothing computed the reference log-probs it needed). The
tags ``task.kind`` and ``objective.kind`` are msgspec's, not fields, and are not checked. Keys read
generically (a whole Struct handed on without naming its fields) go in ``GENERIC``, each with where it is read.

No torch, no models: parses the sources with ``ast`` (about a second).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from msgspec import inspect as mi

from engine.config.schema import RunConfig, TrainSection

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("engine", "policies", "tasks", "exchange", "tokenbridge", "monitor", "experiments", "launch.py")

# Keys read without their name in the code, each checked by reading the code that reads it.
GENERIC: dict[str, str] = {
}


def config_keys(struct: mi.StructType, prefix: str) -> dict[str, tuple[str, str]]:
    """Dotted key -> (field name, TOML name) of every field under ``struct``, sub-tables included."""
    out = {}
    for field in struct.fields:
        key = f"{prefix}{field.encode_name}"
        out[key] = (field.name, field.encode_name)
        for inner, is_list in _structs(field.type):
            out.update(config_keys(inner, f"{key}[]." if is_list else f"{key}."))
    return out


def _structs(t, in_list: bool = False):
    """(Struct type, inside a list) for every Struct a field's type holds: itself, a list's item, a union's members."""
    if isinstance(t, mi.StructType):
        yield t, in_list
    elif isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        yield from _structs(t.item_type, True)
    elif isinstance(t, mi.TupleType):
        for item in t.item_types:
            yield from _structs(item, True)
    elif isinstance(t, mi.DictType):
        yield from _structs(t.value_type, in_list)
    elif isinstance(t, mi.UnionType):
        for member in t.types:
            yield from _structs(member, in_list)


def _source_files() -> list[Path]:
    files = []
    for name in SOURCES:
        path = ROOT / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


@functools.cache
def reads() -> tuple[frozenset[str], frozenset[str]]:
    """(attribute names loaded, whole string literals) in the project's sources, field declarations left out."""
    attrs, strings = set(), set()
    for path in _source_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        declared = set()  # the nodes inside a class body's field declarations
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef):
                for stmt in cls.body:
                    if isinstance(stmt, ast.AnnAssign):
                        declared.update(map(id, ast.walk(stmt)))
        for node in ast.walk(tree):
            if id(node) in declared:
                continue
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                attrs.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    return frozenset(attrs), frozenset(strings)


def unread_keys(root: type = RunConfig) -> list[str]:
    """The dotted keys under ``root`` that no source reads, sorted."""
    attrs, strings = reads()
    keys = config_keys(mi.type_info(root), "")
    return sorted(key for key, (name, toml_name) in keys.items()
                  if name not in attrs and toml_name not in strings and key not in GENERIC)


def test_every_config_key_is_read_by_some_code():
    unread = unread_keys()
    assert not unread, (
        "config keys that no code outside tests/ and docs/ reads (make each work, or remove it from the schema, "
        "configs/ and docs; a key read generically goes in GENERIC with where it is read):\n  " + "\n  ".join(unread))


class _Train(TrainSection):
    never_read_by_anything: int = 0  # what a documented key that no code reads looks like


class _Run(RunConfig):
    train: _Train = _Train()


def test_a_key_nothing_reads_is_named():
    assert "train.never_read_by_anything" in unread_keys(_Run)


def test_the_generic_list_holds_only_real_keys_nothing_reads_by_name():
    attrs, strings = reads()
    keys = config_keys(mi.type_info(RunConfig), "")
    unknown = [key for key in GENERIC if key not in keys]
    assert not unknown, f"GENERIC names keys the config no longer has: {unknown}"
    read_by_name = [key for key in GENERIC if keys[key][0] in attrs or keys[key][1] in strings]
    assert not read_by_name, f"GENERIC keys that are read by name (take them out of GENERIC): {read_by_name}"
