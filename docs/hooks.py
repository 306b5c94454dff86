"""MkDocs hook: links from docs/ to the repository's files outside docs/ (the package READMEs, configs, figures).

On GitHub and in an editor these relative links (``../exchange/README.md``) work as written; the site holds
only docs/, so here a link to an outside file becomes its path in code (``exchange/README.md``), and an outside
image is copied into the site under ``repo/``. A link to a file that does not exist fails the build.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(([^)\s]+)\)")


def _outside(src_uri: str, target: str, docs_dir: str) -> Path | None:
    """The repository file a link of page ``src_uri`` names, when it lies outside docs/; else None."""
    if "://" in target or target.startswith(("#", "mailto:")):
        return None
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(src_uri), target.split("#")[0]))
    return (Path(docs_dir) / joined).resolve() if joined.startswith("../") else None


def _site_uri(path: Path, docs_dir: str) -> str:
    return "repo/" + path.relative_to(Path(docs_dir).resolve().parent).as_posix()


def on_files(files, config):
    for page in list(files.documentation_pages()):
        for bang, _, target in LINK.findall(Path(page.abs_src_path).read_text()):
            path = _outside(page.src_uri, target, config.docs_dir)
            if bang and path is not None and path.is_file():
                uri = _site_uri(path, config.docs_dir)
                if files.get_file_from_path(uri) is None:
                    files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    root = Path(config.docs_dir).resolve().parent

    def swap(match: re.Match) -> str:
        bang, text, target = match.groups()
        path = _outside(page.file.src_uri, target, config.docs_dir)
        if path is None:
            return match.group(0)
        if not path.exists():
            raise PluginError(f"{page.file.src_uri}: the link {target} names no file of the repository")
        if bang:
            here = posixpath.dirname(page.file.src_uri) or "."
            return f"![{text}]({posixpath.relpath(_site_uri(path, config.docs_dir), here)})"
        rel = path.relative_to(root).as_posix() + ("/" if path.is_dir() else "")
        return f"`{rel}`" if text.strip("`") == rel else f"{text} (`{rel}`)"

    return LINK.sub(swap, markdown)
