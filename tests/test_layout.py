"""The layout ../shared/DESIGN.md asks for, checked on the source: imports flow one way, no import circle,
no private name imported across modules, no module grown past 400 lines; and the linter (ruff, pinned in the
``test`` extra, its rules in pyproject.toml) finds nothing."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mutual_rl", "engine", "exchange", "tokenbridge", "policies", "tasks", "monitor", "experiments")
MAX_LINES = 400
# each package, and the packages it may import; launch.py and benchmarks/ may import anything
MAY_IMPORT = {
    "exchange": set(),
    "tokenbridge": set(),
    "tasks": set(),
    "policies": set(),
    "engine": {"exchange", "tokenbridge", "policies", "tasks"},
    "monitor": {"exchange", "tokenbridge", "policies", "tasks"},  # it reads run directories, not the engine
    # the public layer, and launch.py's training commands as its users: nothing below imports it
    "mutual_rl": {"engine", "exchange", "tokenbridge", "policies", "tasks", "monitor"},
    # grids of runs: each run started through mutual_rl.runs' command line, its results read from disk
    "experiments": {"mutual_rl", "engine", "exchange", "tokenbridge", "policies", "tasks", "monitor"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(path: Path, name: str) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import statement, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[: -node.level] if path.name != "__init__.py" else name.split(".")
                base = ".".join(package + ([base] if base else []))
            out.append((base, [a.name for a in node.names]))
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target, names in _imports(path, name):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in mods]  # from pkg import submodule
            for candidate in subs or [target]:
                if candidate in mods and candidate != name:
                    graph[name].add(candidate)
    return graph


def test_packages_import_only_what_the_design_allows():
    wrong = []
    for name, path in _modules().items():
        own = name.split(".")[0]
        for target, _ in _imports(path, name):
            other = target.split(".")[0]
            if other in MAY_IMPORT and other != own and other not in MAY_IMPORT[own]:
                wrong.append(f"{name} imports {target}")
    assert not wrong, wrong


def test_no_import_circle():
    graph, state, circles = _graph(), {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, circles


def test_no_private_name_imported_across_modules():
    taken = [f"{name} takes {target}.{n}" for name, path in _modules().items()
             for target, names in _imports(path, name) for n in names
             if n.startswith("_") and not n.startswith("__") and target.split(".")[0] in PACKAGES]
    assert not taken, taken


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    done = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", str(ROOT)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_only_exchange_records_names_the_runs_records_file():
    """metrics.jsonl is written and read through ``exchange.records`` alone: no other module of the packages or the
    benchmarks builds the file's path (a string that is the name or a path ending in it; messages may name it)."""
    naming = []
    for path in [*_modules().values(), *sorted((ROOT / "benchmarks").glob("*.py"))]:
        if path == ROOT / "exchange" / "records.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        naming += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Constant)
                   and isinstance(n.value, str) and n.value.split("/")[-1] == "metrics.jsonl" and " " not in n.value
                   and id(n) not in docstrings]
    assert not naming, naming
