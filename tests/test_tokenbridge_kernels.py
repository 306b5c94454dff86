"""THL compiled fast path (`fastspell.py`, `fastalign.py`): the inputs it makes risky, each checked against the
tokenizers' own encode/decode: token bytes on either side of what a record holds inline, ids given as arrays of
any integer type (checked inside the compiled loop, cached under one key), empty texts."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tokenbridge import (
    BUILTIN_NAMES,
    Bridge,
    EmptyCompletionError,
    InvalidTokenIdError,
    LengthMismatchError,
    load_tokenizer,
)
from tokenbridge.fastspell import INLINE_BYTES

PAIRS = list(itertools.product(BUILTIN_NAMES, repeat=2))
EOS = {"gpt2": 50256, "mistral": 2, "qwen2": 151643}
MISTRAL_MARKER = 28705  # "▁" alone: after the decoder's dummy-prefix strip, no text at all


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "tokenbridge-cache"
    return {name: load_tokenizer(name, cache) for name in BUILTIN_NAMES}


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False, split_special_tokens=True)


def words_of_length(tok, n_bytes: int, count: int = 3) -> list[int]:
    """Ids of single-token words (a space, then ASCII letters) of exactly n_bytes bytes, found by the
    tokenizer's own decode of each id."""
    found = []
    for i in range(len(tok)):
        piece = tok.convert_ids_to_tokens(i)
        word = piece.lstrip("\u0120\u2581")
        if len(piece) - len(word) == 1 and len(word) == n_bytes - 1 and word.isascii() and word.isalpha():
            found.append(i)
            if len(found) == count:
                return found
    raise AssertionError(f"no {n_bytes}-byte word in the vocabulary")


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=lambda p: str(p))
def test_tokens_either_side_of_the_inline_limit(toks, src, dst):
    """Source ids whose tokens hold INLINE_BYTES - 1 to 2 * INLINE_BYTES + 1 bytes (inline in a record or
    read from the blob), and a destination that meets the same lengths in its own encoding."""
    lengths = (INLINE_BYTES - 1, INLINE_BYTES, INLINE_BYTES + 1, 2 * INLINE_BYTES, 2 * INLINE_BYTES + 1)
    ids = [i for n in lengths if n <= 12 for i in words_of_length(toks[src], n)]
    ids += encode(toks[src], " " + "-" * (2 * INLINE_BYTES + 1) + " internationalization")
    for run in (ids, ids + [EOS[src]]):
        out = Bridge(toks[src], toks[dst], cache_size=0)(np.array(run), np.full(len(run), -0.5))
        text = toks[src].decode(ids)
        assert out.text == text and out.dst_ids.tolist() == encode(toks[dst], text) + [EOS[dst]] * (len(run) > len(ids))
        assert out.dst_logprobs.sum() == pytest.approx(-0.5 * len(run))
        for k_src, k_dst, c in zip(out.groups.src, out.groups.dst, out.groups.chars):
            assert toks[src].decode(run[: min(k_src, len(ids))]) == text[:c]
            if src != dst:
                assert toks[dst].decode(out.dst_ids[: min(k_dst, len(out.dst_ids) - (len(run) > len(ids)))]) == text[:c]


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint32, np.int16, None])
def test_ids_of_any_integer_type_give_the_same_result_and_cache_entry(toks, dtype):
    ids = encode(toks["gpt2"], "Typed ids, one result: 42 ✓")
    given = ids if dtype is None else np.array(ids, dtype=dtype)
    bridge = Bridge(toks["gpt2"], toks["qwen2"], cache_size=4)
    first = bridge(ids, np.full(len(ids), -1.0))
    again = bridge(given, np.full(len(ids), -1.0, dtype=np.float32))
    assert bridge.stats.cache_hits == 1 and again.dst_ids is first.dst_ids
    assert again.dst_logprobs.tolist() == first.dst_logprobs.tolist()
    fresh = Bridge(toks["gpt2"], toks["qwen2"], cache_size=0)(given)
    assert fresh.dst_ids.tolist() == first.dst_ids.tolist() and fresh.groups.chars.tolist() == first.groups.chars.tolist()


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize(
    ("ids", "message"),
    [([15496, 50257], r"src_ids\[1\] = 50257 is outside the source vocabulary \(size 50257\)"),
     ([-1, 995], r"src_ids\[0\] = -1 is outside"), ([995, 15496, -7, 99999], r"src_ids\[2\] = -7 is outside")],
)
def test_ids_outside_the_vocabulary_in_an_array(toks, dtype, ids, message):
    """Arrays of int32/int64 ids are range-checked inside the compiled spelling: same error, same message,
    and still before the log-probs are looked at."""
    bridge = Bridge(toks["gpt2"], toks["mistral"], cache_size=0)
    with pytest.raises(InvalidTokenIdError, match=message):
        bridge(np.array(ids, dtype=dtype))
    with pytest.raises(InvalidTokenIdError, match=message):
        bridge(np.array(ids, dtype=dtype), logprobs=[-0.1])  # wrong length too: the ids are reported
    with pytest.raises(LengthMismatchError):
        bridge(np.array([15496, 995], dtype=dtype), logprobs=[-0.1])
    assert bridge.stats.rejected == 3 and bridge.stats.bridged == 0


@pytest.mark.parametrize("dst", ["gpt2", "qwen2"])  # Mistral itself: the identity, ids pass through
def test_sentencepiece_marker_alone_is_empty_text(toks, dst):
    """Mistral's "▁" alone spells one space, which its decoder strips: no text. Without EOS nothing can
    cross; with EOS the completion is that EOS alone. Calls (list or array) and a batch agree."""
    bridge = Bridge(toks["mistral"], toks[dst], cache_size=0)
    assert toks["mistral"].decode([MISTRAL_MARKER]) == ""
    for given in ([MISTRAL_MARKER], np.array([MISTRAL_MARKER]), np.array([MISTRAL_MARKER], dtype=np.int32)):
        with pytest.raises(EmptyCompletionError, match="decode to empty text and carry no EOS"):
            bridge(given)
    out = bridge(np.array([MISTRAL_MARKER, EOS["mistral"]]), [-0.25, -0.5])
    assert out.text == "" and out.dst_ids.tolist() == [EOS[dst]] and out.dst_logprobs.tolist() == [-0.75]
    empty, eos_only, fine = bridge.batch([[MISTRAL_MARKER], [MISTRAL_MARKER, EOS["mistral"]], [MISTRAL_MARKER, 22557]])
    assert isinstance(empty, EmptyCompletionError) and eos_only.dst_ids.tolist() == [EOS[dst]]
    assert fine.text == toks["mistral"].decode([MISTRAL_MARKER, 22557]) == " Hello"  # one space of two stripped
    assert fine.dst_ids.tolist() == encode(toks[dst], " Hello")


FRESH_PROCESS = """
import sys, numpy as np
from tokenbridge import Bridge, fastalign, fastspell, load_tokenizer
gpt2, mistral = load_tokenizer("gpt2", sys.argv[1]), load_tokenizer("mistral", sys.argv[1])
bridge = Bridge(gpt2, mistral, cache_size=0)
dispatchers = {name: f for kernels in (fastspell, fastalign) for name, f in vars(kernels).items()
               if hasattr(f, "signatures")}
before = {name: set(f.signatures) for name, f in dispatchers.items()}
ids = gpt2.encode("warm, all the way") + [50256]
for dtype, lp_dtype in ((np.int64, np.float64), (np.int32, np.float32)):
    bridge(np.array(ids, dtype=dtype), np.full(len(ids), -0.5, dtype=lp_dtype))
    bridge.batch([np.array(ids, dtype=dtype)] * 2, [np.full(len(ids), -0.5, dtype=lp_dtype)] * 2)
bridge(ids, [-0.5] * len(ids))
print(sorted(name for name, f in dispatchers.items() if set(f.signatures) - before[name]))
"""


def test_a_new_bridge_has_compiled_what_its_calls_use(tmp_path_factory):
    """Compiling takes seconds: it happens when a bridge is built (a learner's start), so in a fresh process
    no call or batch with the id and log-prob types the engine passes compiles anything later."""
    cache = tmp_path_factory.getbasetemp() / "tokenbridge-cache"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(cache)], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_destination_shift_is_0_1_or_neither_by_the_bytes_of_the_first_token(toks):
    """The destination pass finds a SentencePiece run's dummy-prefix shift by checking its bytes: "▁Hello"
    spells " Hello", so against the text "Hello" it holds one dropped space (shift 1), against " Hello"
    none (shift 0), and against " Hallo" it spells neither (-1: the offsets path)."""
    from array import array

    from tokenbridge import fastalign, fastspell
    from tokenbridge.profile import profile_of

    gpt2, mistral = profile_of(toks["gpt2"]), profile_of(toks["mistral"])
    hello = encode(toks["mistral"], "Hello")
    assert toks["mistral"].convert_ids_to_tokens(hello) == ["\u2581Hello"]
    for text, shift in (("Hello", 1), (" Hello", 0), (" Hallo", -1)):
        src = np.array(encode(toks["gpt2"], text), dtype=np.int64)
        _, _, _, raw, bounds = fastspell.spell_one(src, gpt2.record, gpt2.inline, gpt2.blob, False)
        got, ok, _, m, g_count, ints, _ = fastalign.align_one(array("I", hello), 0, 2, mistral.record, mistral.inline,
                                                            mistral.blob, True, raw, bounds)
        assert got == shift and bool(ok) == (shift >= 0)
        if shift >= 0:  # ints: dst_ids (m) | dst_group (m) | src_group (n) | src_at | dst_at | chars (G+1 each)
            src_at = ints[2 * m + len(src) :][: g_count + 1]
            dst_at = ints[2 * m + len(src) + g_count + 1 :][: g_count + 1]
            assert ints[:m].tolist() == hello and src_at.tolist() == [0, len(src)] and dst_at.tolist() == [0, 1]


WITHOUT_NUMBA = """
import sys
if sys.argv[2] == "absent":
    sys.modules["numba"] = None  # import numba now fails, as where the GPU check's wheelhouse leaves it out
import numpy as np
from tokenbridge import Bridge, load_tokenizer
from tokenbridge import fastspell
assert hasattr(fastspell.spell, "signatures") == (sys.argv[2] == "present")
names = ("gpt2", "mistral", "qwen2")
toks = {n: load_tokenizer(n, sys.argv[1]) for n in names}
texts = [" 12 + 34 = 46", "Hello, world: naïve café ☕ 你好", "  two  spaces\\tand a tab", "x"]
out = []
for src, dst in zip(names, names[1:] + names[:1]):  # each tokenizer once as source, once as destination
    bridge = Bridge(toks[src], toks[dst], cache_size=0)
    for text in texts:
        ids = toks[src].encode(text, add_special_tokens=False)
        b = bridge(np.array(ids, dtype=np.int64), np.linspace(-2.0, -0.1, len(ids)))
        out.append([b.dst_ids.tolist(), b.dst_logprobs.tolist(), b.dst_group.tolist(), b.src_group.tolist(),
                    b.residual])
print(repr(out))
"""


@pytest.mark.slow  # heavy for the fast tier (docs/testing.md)
def test_without_numba_the_kernels_run_as_python_and_bridge_alike(tmp_path_factory):
    """The GPU check's wheelhouse leaves numba out (llvmlite is 58 MB): the loops then run as plain Python and
    must bridge exactly as compiled, each tokenizer as source and as destination."""
    cache = tmp_path_factory.getbasetemp() / "tokenbridge-cache"
    root = Path(__file__).resolve().parents[1]
    runs = {how: subprocess.run([sys.executable, "-c", WITHOUT_NUMBA, str(cache), how], cwd=root, capture_output=True,
                                text=True, timeout=600) for how in ("present", "absent")}
    for how, done in runs.items():
        assert done.returncode == 0, (how, done.stderr[-2000:])
    compiled, plain = (eval(runs[how].stdout) for how in ("present", "absent"))  # noqa: S307  our own output
    assert len(compiled) == len(plain) == 12
    for c, p in zip(compiled, plain):  # ids and groups exactly; log-probs and residual to float rounding
        assert (c[0], c[2], c[3]) == (p[0], p[2], p[3])
        np.testing.assert_allclose(p[1], c[1], rtol=0, atol=1e-12)
        assert abs(p[4] - c[4]) < 1e-12
