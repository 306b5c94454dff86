"""When a destination tokenizer's tokens provably spell the text they encode, so the bridge need not
spell them out and compare bytes (the fast path's one check that costs as much as an alignment).

A pipeline qualifies when every stage only splits the text, or maps it in a way the profile's byte
table undoes, or inserts SentencePiece's marker at the very start:

- normalizer: none; exactly NFC (the text must then be NFC already); or only Replace / Prepend
  steps between " " and the marker U+2581 that swap one for one, or insert at the start (the text
  must then not hold U+2581);
- pre-tokenizers: ByteLevel, Metaspace (marker U+2581), Split and Punctuation that keep what they
  split on, Digits; one that inserts (ByteLevel's prefix space, Metaspace's prepend) comes first,
  while the text is still one piece, so it inserts at the start only;
- model: BPE without subword prefix or suffix, whose unknown token (if any) is a special token,
  which spells nothing; no added token that is not special (special ones are encoded as text).

Such a tokenizer can still add leading marker spaces or emit an unknown token, so lengths are
compared too: a length that matches the text after at most one leading space means equal bytes.
Anything else (an unknown component or parameter) returns no guard, and the bytes are compared.
"""

from __future__ import annotations

import json
import unicodedata
from functools import partial
from typing import Callable

from tokenizers import Tokenizer

MARKER = "\u2581"
SPLITTERS = frozenset({"Split", "Punctuation", "Digits"})  # pre-tokenizers that only split


def text_guard(backend: Tokenizer) -> Callable[[str], bool] | None:
    """A cheap test on a text under which the tokenizer's tokens spell it (given matching length), or None."""
    config = json.loads(backend.to_str())
    if not _model_ok(config["model"], config.get("added_tokens") or []):
        return None
    pre = config.get("pre_tokenizer")
    steps = [] if pre is None else pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if not all(_pre_ok(step, first=i == 0) for i, step in enumerate(steps)):
        return None
    uses_marker = any(step["type"] == "Metaspace" for step in steps)
    normalizer = config.get("normalizer")
    if normalizer is None:
        return _no_marker if uses_marker else _always
    if normalizer == {"type": "NFC"} and not uses_marker:
        return partial(unicodedata.is_normalized, "NFC")
    parts = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    return _no_marker if all(_marker_step(part) for part in parts) else None


def _always(text: str) -> bool:
    return True


def _no_marker(text: str) -> bool:
    return MARKER not in text


def _model_ok(model: dict, added: list[dict]) -> bool:
    if model.get("type") != "BPE" or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return False
    special = {token["content"] for token in added if token.get("special")}
    if any(not token.get("special") for token in added):
        return False
    return model.get("unk_token") is None or model["unk_token"] in special


def _pre_ok(step: dict, first: bool) -> bool:
    kind = step.get("type")
    if kind in SPLITTERS:
        return step.get("behavior", "Isolated") != "Removed"
    if kind == "ByteLevel":
        return first or not step.get("add_prefix_space", False)
    if kind == "Metaspace":
        return step.get("replacement") == MARKER and (first or step.get("prepend_scheme") == "never")
    return False


def _marker_step(part: dict) -> bool:
    """A normalizer step that only swaps spaces and markers one for one, or adds them at the start."""
    marks = set(" " + MARKER)
    if part.get("type") == "Prepend":
        return bool(part.get("prepend")) and set(part["prepend"]) <= marks
    if part.get("type") != "Replace":
        return False
    pattern, content = part.get("pattern", {}), part.get("content", "")
    if "String" in pattern:
        text, anchored = pattern["String"], False
    elif pattern.get("Regex", "").startswith("\\A"):  # a literal anchored at the start
        text, anchored = pattern["Regex"][2:], True
    else:
        return False
    if not text or not set(text) <= marks or not set(content) <= marks:
        return False
    return len(content) == len(text) or (anchored and len(content) > len(text))
