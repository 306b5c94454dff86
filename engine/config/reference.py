"""The configuration reference, generated from the msgspec schema: every key, its type, default and meaning.

``python -m engine.config.reference`` writes ``docs/reference/config.md``; ``--check`` exits 1 when that page
is stale or a key has no meaning (tests/test_docs.py does the same). A key's meaning is the comment on its
field in the module that defines it: the trailing ``# ...`` of its line, after the comment lines right above
it (joined into one line). Imports no torch.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import msgspec
from msgspec import inspect as mi

from engine.config.schema import RunConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    meaning: str
    where: str  # Module.Class.field (or Module.Class for a table), for the error when the meaning is missing


@functools.cache
def _comments(path: str) -> tuple[dict[int, str], set[int]]:
    """Line number -> the comment on it, and the lines that hold nothing but a comment."""
    text = Path(path).read_text()
    found, alone = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[: tok.start[1]].strip():
                alone.add(tok.start[0])
    return found, alone


@functools.cache
def _field_lines(cls: type) -> dict[str, tuple[int, int]]:
    """Field name -> (first line, last line) of its annotated assignment in ``cls``'s own body."""
    try:
        tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text())
    except (TypeError, OSError):  # a built-in class (object, msgspec.Struct): no fields of ours
        return {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return {n.target.id: (n.lineno, n.end_lineno) for n in node.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return {}


def _owner(cls: type, name: str) -> type:
    """The class in ``cls``'s MRO whose body declares field ``name``."""
    for klass in cls.__mro__:
        if name in _field_lines(klass):
            return klass
    return cls


def meaning_of(cls: type, name: str) -> tuple[str, str]:
    """(meaning, "module.Class.field") of field ``name`` of Struct ``cls``, from its source comments."""
    owner = _owner(cls, name)
    where = f"{owner.__module__}.{owner.__qualname__}.{name}"
    first, last = _field_lines(owner).get(name, (0, 0))
    if not first:
        return "", where
    found, alone = _comments(inspect.getsourcefile(owner))
    above, line = [], first - 1
    while line in alone:
        above.insert(0, found[line])
        line -= 1
    parts = [" ".join(above)] if above else []
    parts += [found[n] for n in range(first, last + 1) if n in found and n not in alone]
    return "; ".join(p for p in parts if p), where


def _doc(cls: type) -> str:
    """The first sentence of a class docstring, or ""."""
    doc = " ".join((cls.__doc__ or "").split()).replace("``", "`")
    return doc.split(". ")[0].rstrip(".") if doc else ""


def _bounds(t) -> str:
    lo = f"≥ {t.ge}" if t.ge is not None else f"> {t.gt}" if t.gt is not None else ""
    hi = f"≤ {t.le}" if t.le is not None else f"< {t.lt}" if t.lt is not None else ""
    return ", ".join(b for b in (lo, hi) if b)


def type_name(t) -> str:
    """A msgspec.inspect type as a reader of TOML would call it."""
    if isinstance(t, (mi.IntType, mi.FloatType)):
        base, bounds = ("int" if isinstance(t, mi.IntType) else "float"), _bounds(t)
        return f"{base} ({bounds})" if bounds else base
    simple = {mi.StrType: "string", mi.BoolType: "bool", mi.AnyType: "any", mi.NoneType: "unset"}
    if type(t) in simple:
        return simple[type(t)]
    if isinstance(t, mi.LiteralType):
        values = [f'`{v!r}`'.replace("'", '"') for v in t.values]
        return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        return f"list of {type_name(t.item_type)}"
    if isinstance(t, mi.TupleType):
        return "[" + ", ".join(type_name(i) for i in t.item_types) + "]"
    if isinstance(t, mi.DictType):
        return f"table: {type_name(t.key_type)} → {type_name(t.value_type)}"
    if isinstance(t, mi.StructType):
        return "table"
    if isinstance(t, mi.UnionType):
        names = [type_name(u) for u in t.types if not isinstance(u, mi.NoneType)]
        return " or ".join(names) + (", or unset" if any(isinstance(u, mi.NoneType) for u in t.types) else "")
    raise TypeError(f"no name for {t!r}: teach engine.config.reference.type_name")


def default_text(field: mi.Field) -> str:
    if field.required:
        return "required"
    value = field.default if field.default_factory is msgspec.NODEFAULT else field.default_factory()
    if value is None:
        return "unset"
    if isinstance(value, msgspec.Struct):
        return "(its fields' defaults)"
    return "`" + msgspec.json.encode(value).decode().replace('":', '" = ').replace(",", ", ") + "`"


def _struct(t):
    """The Struct type inside ``t`` (a Struct, a list of Structs, or a Struct or None), else None."""
    if isinstance(t, mi.StructType):
        return t
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        return _struct(t.item_type)
    if isinstance(t, mi.UnionType):
        structs = [u for u in t.types if isinstance(u, mi.StructType)]
        return structs[0] if len(structs) == 1 and len(t.types) == 2 else None
    return None


def rows(struct: mi.StructType, prefix: str, skip: frozenset[str] = frozenset()) -> list[Row]:
    """One row per key of ``struct`` (sub-tables and lists of tables recursively), keys under ``prefix``."""
    out = []
    for field in struct.fields:
        if field.name in skip:
            continue
        key = f"{prefix}.{field.encode_name}"
        meaning, where = meaning_of(struct.cls, field.name)
        inner = _struct(field.type)
        if inner is not None:
            key += "[]" if isinstance(field.type, (mi.ListType, mi.VarTupleType)) else ""
            out.append(Row(key, type_name(field.type), default_text(field), meaning or _doc(inner.cls), where))
            out += rows(inner, key)
        else:
            out.append(Row(key, type_name(field.type), default_text(field), meaning, where))
    return out


@dataclass(frozen=True)
class Section:
    heading: str
    intro: str  # a sentence under the heading (the Struct's docstring), or ""
    rows: list[Row]


def _tagged(section: str, union: mi.UnionType, default: str) -> list[Section]:
    """A tagged union (task, objective): the fields every kind shares, then each kind's own."""
    kinds = union.types
    shared = frozenset.intersection(*(frozenset(f.name for f in k.fields) for k in kinds))
    kind_names = [f'`"{k.tag}"`' for k in kinds]
    tag = Row(f"{section}.kind", ", ".join(kind_names[:-1]) + " or " + kind_names[-1], f'`"{default}"`',
              f"which kind of {section}; each kind's own keys are listed below", f"{section}.kind")
    own = frozenset(f.name for f in kinds[0].fields) - shared
    out = [Section(f"`[{section}]`: every kind", "", [tag] + (rows(kinds[0], section, own) if shared else []))]
    out += [Section(f'`[{section}]`, `kind = "{k.tag}"`', _doc(k.cls), rows(k, section, shared)) for k in kinds]
    return out


def sections() -> list[Section]:
    """Every table of the run config, in the schema's order."""
    out = []
    for field in mi.type_info(RunConfig).fields:
        t, name = field.type, field.encode_name
        if isinstance(t, mi.UnionType) and all(isinstance(u, mi.StructType) for u in t.types):
            out += _tagged(name, t, field.default.__struct_config__.tag)
        elif isinstance(t, mi.ListType):
            out.append(Section(f"`[[{name}]]`", _doc(t.item_type.cls), rows(t.item_type, f"{name}[]")))
        else:
            out.append(Section(f"`[{name}]`", _doc(t.cls), rows(t, name)))
    return out


def _cell(text: str) -> str:
    """Text for a table cell: markdown's own characters escaped outside `code spans`, pipes everywhere."""
    pieces = text.split("`")
    for i in range(0, len(pieces), 2):  # outside code spans
        pieces[i] = pieces[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(pieces).replace("|", "\\|")


HEADER = """# Configuration reference

<!-- Generated from the msgspec schema by `python -m engine.config.reference`; do not edit by hand.
     tests/test_docs.py fails when this page is stale or a key has no meaning. -->

Every key a run config may hold, with its type, its default and what it does. A config is TOML decoded
strictly into these msgspec Structs (`engine/config/schema.py` and the Structs it uses from `policies/` and
`tasks/`): an unknown key or a wrong type is one line naming the key, exit code 2. `--set a.b=c` overrides any
key; `[[models]]` is a list, so `--set models.1.n_layer=4` sets the second model's key. A value of *unset* is
the key left out; a default is what a key left out gets (`configs/default.toml` sets several of them for the
default job). `[task] kind = "rg:DATASET"` is short for `kind = "rg"` with `dataset = "DATASET"`.
Cross-field rules (which keys need which others) are checked by `engine/config/validate.py`.
"""


def render() -> str:
    parts = [HEADER]
    for sec in sections():
        parts.append(f"\n## {sec.heading}\n\n" + (f"{_cell(sec.intro)}.\n\n" if sec.intro else ""))
        if not sec.rows:
            parts.append("No keys of its own: only those every kind takes.\n")
            continue
        parts.append("| key | type | default | meaning |\n|---|---|---|---|\n")
        parts += [f"| `{r.key}` | {_cell(r.type)} | {_cell(r.default)} | {_cell(r.meaning)} |\n" for r in sec.rows]
    return "".join(parts)


def missing() -> list[str]:
    """Keys without a meaning, each with where to write one."""
    return [f"{r.key} ({r.where}): add a trailing `# ...` comment to the field" for sec in sections() for r in sec.rows if not r.meaning.strip()]


def main(argv: list[str]) -> int:
    lacking = missing()
    if lacking:
        print("keys without a meaning:\n  " + "\n  ".join(lacking), file=sys.stderr)
        return 1
    text = render()
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python -m engine.config.reference", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE} ({sum(len(sec.rows) for sec in sections())} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
