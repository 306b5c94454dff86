"""The documentation: the generated configuration reference, README's shape, the site's navigation and links.

Cheap (no torch, no build): `mkdocs build --strict` itself runs in CI (.ci/run, docs/testing.md). That every
`python launch.py run ...` line of README and docs runs as written is tests/test_engine_config.py's.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from msgspec import inspect as mi

from engine.config import reference

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")


def test_every_config_key_has_a_meaning():
    assert reference.missing() == []


def test_the_config_reference_page_is_current():
    text = reference.render()
    stale = "docs/reference/config.md is stale: run python -m engine.config.reference"
    assert reference.PAGE.read_text() == text, stale
    for key in ("run.seed", "models[].checkpoint", "models[].lora.rank", "objective.lambda", "task.dataset",
                "pool.script[].worker", "timeouts.peer_silent_s"):
        assert f"| `{key}` |" in text, key


def test_a_key_without_a_meaning_is_named(tmp_path, monkeypatch):
    from policies.spec import ModelSpec

    with_comments = reference._comments
    n_layer_line = reference._field_lines(ModelSpec)["n_layer"][0]

    def n_layer_uncommented(path: str):  # policies/spec.py as if n_layer's comment were gone
        found, alone = with_comments(path)
        return ({k: v for k, v in found.items() if k != n_layer_line} if path.endswith("spec.py") else found), alone

    monkeypatch.setattr(reference, "_comments", n_layer_uncommented)
    assert any(line.startswith("models[].n_layer (policies.spec.ModelSpec.n_layer)") for line in reference.missing())
    assert reference.main(["--check"]) == 1

    (tmp_path / "demo_schema.py").write_text(
        "import msgspec\n\n"
        "class Demo(msgspec.Struct):\n"
        "    a: int = 1  # trailing\n"
        "    # above, first line\n"
        "    # and second\n"
        "    b: str = 'x#y'  # and trailing\n"
        "    c: float = 0.5\n")
    spec = importlib.util.spec_from_file_location("demo_schema", tmp_path / "demo_schema.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "demo_schema", module)
    spec.loader.exec_module(module)
    rows = {r.key: r for r in reference.rows(mi.type_info(module.Demo), "demo")}
    assert rows["demo.a"].meaning == "trailing" and rows["demo.a"].default == "`1`"
    assert rows["demo.b"].meaning == "above, first line and second; and trailing" and rows["demo.b"].type == "string"
    assert rows["demo.c"].meaning == ""


def test_readme_is_short_and_leads_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    first_block = lines[lines.index("```bash") + 1:lines.index("```")]
    assert [line.split("#")[0].strip() for line in first_block] == [
        "pip install -c constraints.txt -e . && python launch.py",
        "pip install -c constraints.txt -e '.[test]' && python -m pytest",
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -c constraints.txt -e '.[test]'" in ci and "\npython -m pytest\n" in ci
    testing = (DOCS / "testing.md").read_text()
    for command in ("pip install -c constraints.txt -e '.[docs]'", "mkdocs build --strict"):
        assert command in ci and command in testing, command


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md"))


def test_every_page_is_in_the_site_navigation():
    nav = set(re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE))
    assert nav == {p.relative_to(DOCS).as_posix() for p in _pages()}


def test_relative_links_name_files_that_exist():
    for page in [README, *_pages()]:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)}: {target}"
