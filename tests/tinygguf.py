"""A tiny Llama written as a GGUF file the way llama.cpp's converter writes one, for tests: no 93 MB download.

The weights are a seeded two-layer Llama (F32 tensors, Q/K rows permuted as llama.cpp stores them), the
tokenizer GPT-2's byte-level BPE (tokens, merges and special ids as GGUF metadata) with a ChatML template,
so a test can compare the converted model's logits with the model the file was written from.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

from policies.models import build_policy
from policies.spec import ModelSpec
from tokenbridge import load_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPEC = ModelSpec(name="tiny", arch="llama", tokenizer="gpt2", n_layer=2, n_embd=32, n_head=4, n_kv_head=2,
                 max_seq_len=64)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for Q and K (rotary halves interleaved); transformers' GGUF loader undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_odd_gguf(path: Path, arch: str) -> None:
    """A GGUF file of another architecture: one tensor, no tokenizer (what is refused is the architecture)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((10, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_gguf(path: Path, cache_dir: Path | None) -> torch.nn.Module:
    """Write the file; returns the model it holds (float32)."""
    tok = load_tokenizer("gpt2", cache_dir)
    model = build_policy(SPEC, tok, seed=3)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None)
                         else float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(tok))
    _add_tokenizer(w, tok)
    for name, tensor in _tensors(model):
        w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def _add_tokenizer(w: gguf.GGUFWriter, tok) -> None:
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tok.all_special_ids)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_chat_template(CHAT_TEMPLATE)


def _tensors(model):
    cfg, sd = model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}
    yield "token_embd.weight", sd["model.embed_tokens.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        yield f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"]
        yield f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads)
        yield f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads)
        yield f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"]
        yield f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"]
        yield f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"]
        yield f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"]
        yield f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"]
        yield f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"]
    yield "output_norm.weight", sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        yield "output.weight", sd["lm_head.weight"]
