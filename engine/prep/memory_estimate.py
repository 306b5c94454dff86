"""A run's peak memory on this machine, estimated from its config before any process starts.

Pure and cheap: the config in, bytes out, no torch. A model's size comes from its spec (a model built from
scratch: its widths and its tokenizer's vocabulary) or from its checkpoint's headers (config.json and the
safetensors headers of a save_pretrained directory; a GGUF file's, not yet converted). What each process
holds, on a CPU:

- every actor (broker, worker, warm start): its own torch + transformers heap (``RUNTIME``);
- a generator: its fp32 weights, the KV cache of its batch (a work unit's samples), a step's logits;
- a learner rank: weights + gradients + AdamW's two moments + AdamW's scratch (``STATE_COPIES``; with LoRA
  only the adapters', beside the frozen base; with ``fsdp2`` a 1/world share, plus the weights gathered to
  compute); and the step's
  transient: the activations kept for backward (each distinct prompt once, each sample's completion), and
  the (positions x vocabulary) logits at the completion positions only (``policies.logprobs``), in
  ``LOGIT_COPIES``, or past 64 MB a block of them at a time (``policies.chunked_head``); or a final evaluation's
  batch, whichever is larger;
- the weight channel: one more copy of a model's weights in shared memory, beside those its generators hold.

The figures are PSS, what the processes take of the machine together (a page shared by n processes counts
1/n in each), and the constants are measured: a process that imports torch, transformers and the roles holds
0.44 GiB RSS, 0.35 GiB PSS, but its forks share most of it (the smoke run's broker: 0.10 GiB PSS, a generator
of its tiny models 0.25); one SmolLM2-135M learner step of 32 samples of 64 + 48 tokens peaked at 6.3 GiB RSS
in a process of its own (this model: 6.0 GiB). Whole runs, PSS summed over their processes: configs/smoke.toml
peaked at 1.8 GiB (estimated: 2.4), configs/pool.toml at 2.6 GiB (4.4: MWRA might make a learner of any worker),
the solo SmolLM2 run of configs/smollm2.toml at 10.3 GiB (9.7).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.config.schema import ModelConfig, RunConfig, cache_root

GIB = 2 ** 30
FP32 = 4
RUNTIME = int(0.2 * GIB)  # an actor's own heap before it holds a model: a fork of the server, sharing its pages
SERVER = int(0.3 * GIB)  # the fork server's share of the torch + transformers pages every actor maps
COORDINATOR = int(0.1 * GIB)  # the launcher: asyncio, ZeroMQ, the task; never torch
STATE_COPIES = 5  # a trained weight's fp32 copies on a learner: itself, its gradient, two moments, a step's scratch
LOGIT_COPIES = 4  # the logits, logsumexp's exponentials, their gradient and the softmax behind it
# policies.chunked_head.BLOCK_BYTES (not imported: it imports torch): past it, a step's logits are computed a block of
# rows at a time, forward and backward, and at most a block's logits, exponentials and gradient exist at once
HEAD_BLOCK_BYTES = 64 * 2 ** 20
PROMPT_TOKENS = 64  # a prompt's length when nothing tells it (a chat template's prompt: 40-80 tokens)
GEN_MAX_BATCH = 256  # rows a generator samples at once (policies.backend.HFBackend.max_batch)
# len(tokenizer) of the built-in tokenbridge vocabularies (reading them would take transformers)
BUILTIN_VOCAB = {"gpt2": 50257, "mistral": 32000, "qwen2": 151646}


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model."""

    params: int
    vocab: int
    hidden: int
    layers: int
    intermediate: int
    kv_dim: int  # one layer's key (or value) width: key-value heads x head dim


@dataclass(frozen=True)
class Estimate:
    peak: int  # bytes, the larger of the two phases
    rl: int  # the RL phase: coordinator, fork server, broker, the workers of this machine
    warm_start: int  # before it: coordinator, fork server, one warm-start process per model
    workers: list[tuple[str, int]]  # each worker's costliest role, and its bytes


Role = tuple[str, str, int]  # ("generator" | "learner", model, ranks of the model's learner group)


def estimate(cfg: RunConfig, options: list[list[Role]]) -> Estimate:
    """The peak of a run whose workers on this machine may each hold any of its ``options`` (the costliest counts)."""
    shapes = {m.name: model_shape(m, cfg) for m in cfg.models}
    workers = [max(((f"{role} of {model}", role_bytes(cfg, role, model, world, shapes[model]))
                    for role, model, world in roles), key=lambda named: named[1]) for roles in options]
    channel = sum(s.params * FP32 for s in shapes.values())
    rl = COORDINATOR + SERVER + RUNTIME + channel + sum(b for _, b in workers)
    warm = COORDINATOR + SERVER + sum(prep_bytes(cfg, i, shapes[m.name]) for i, m in enumerate(cfg.models))
    return Estimate(max(rl, warm), rl, warm, workers)


def role_bytes(cfg: RunConfig, role: str, model: str, world: int, s: Shape) -> int:
    """One worker process in one role. On GPUs the host holds its runtime and its weights on their way to the
    device (the device's own memory is not estimated here)."""
    m = cfg.model(model)
    if cfg.pool.device == "cuda":
        return RUNTIME + s.params * FP32
    return generator_bytes(cfg, m, s) if role == "generator" else learner_bytes(cfg, m, s, world)


def generator_bytes(cfg: RunConfig, m: ModelConfig, s: Shape) -> int:
    """A generator: its weights (LoRA's frozen base and adapters), one batch's KV cache and one decode step's logits."""
    rows = min(GEN_MAX_BATCH, (cfg.pool.prompts_per_work or cfg.train.prompts_per_step) * cfg.train.group_size)
    weights = s.params * FP32 + (lora_params(m, s) * FP32 if m.lora else 0)
    if m.generation.backend == "hf-static":  # its own copy in generation.dtype, beside the module
        weights += s.params * (FP32 if m.generation.dtype == "float32" else 2)
    kv = rows * (_prompt_tokens(m, cfg) + cfg.train.max_new_tokens) * kv_bytes(s)
    return RUNTIME + weights + kv + rows * s.vocab * FP32 * LOGIT_COPIES


def learner_bytes(cfg: RunConfig, m: ModelConfig, s: Shape, world: int = 1) -> int:
    """A learner rank of a group of ``world``: its training state and the larger of a step and an evaluation."""
    t = cfg.train
    frozen, trained = (s.params, lora_params(m, s)) if m.lora else (0, s.params)  # LoRA: the base, held once
    state = frozen * FP32 + trained * FP32 * STATE_COPIES
    if t.sharding == "fsdp2" and world > 1:  # a 1/world shard of the state, the whole weights gathered to compute
        state = trained * FP32 * STATE_COPIES // world + trained * FP32
    if cfg.objective.kl_coef > 0 and not m.lora:  # the frozen reference (LoRA's is its base, adapters off)
        state += s.params * FP32
    prompts = -(-t.prompts_per_step // world)  # this rank's share of a step's prompt groups
    step = step_bytes(cfg, m, s, prompts, _samples(cfg, prompts))
    evaluation = eval_bytes(cfg, m, s)
    return RUNTIME + state + max(step, evaluation)


def step_bytes(cfg: RunConfig, m: ModelConfig, s: Shape, prompts: int, samples: int) -> int:
    """One optimisation step's transient: activations kept for backward, each sample's copy of its prompt's keys
    and values (and their gradients), and the completion positions' logits."""
    t = cfg.train
    prompt, completion = _prompt_tokens(m, cfg), t.max_new_tokens
    tokens = prompts * prompt + samples * completion  # a group's samples share their prompt's forward
    per_token = activation_bytes(s) * (2 if t.mixed_precision == "bf16" else FP32) // FP32
    if t.activation_checkpointing:  # each block's input is kept, one block's activations recomputed at a time
        activations = tokens * s.hidden * FP32 * s.layers + tokens * per_token
    else:
        activations = tokens * per_token * s.layers
    activations //= t.grad_accum
    kv = 2 * samples * prompt * kv_bytes(s) // t.grad_accum
    return activations + kv + logit_bytes(samples * completion // t.grad_accum, s.vocab)


def logit_bytes(rows: int, vocab: int) -> int:
    """A learner step's logits at ``rows`` completion positions: whole, or a block at a time (policies.logprobs)."""
    whole = rows * vocab * FP32
    return whole * LOGIT_COPIES if whole <= HEAD_BLOCK_BYTES else HEAD_BLOCK_BYTES * 3


def eval_bytes(cfg: RunConfig, m: ModelConfig, s: Shape) -> int:
    """A held-out evaluation's batch: its KV cache and one decode step's logits."""
    rows = min(GEN_MAX_BATCH, cfg.eval.batch_size)
    return rows * ((_prompt_tokens(m, cfg) + cfg.eval_max_new_tokens) * kv_bytes(s) + s.vocab * FP32 * LOGIT_COPIES)


def prep_bytes(cfg: RunConfig, index: int, s: Shape) -> int:
    """A model's warm-start process: supervised steps on ``warmstart.batch_size`` worked solutions (every weight
    trained, each solution its own forward), then its held-out evaluation."""
    m = cfg.models[index]
    steps = m.warmstart_steps if m.warmstart_steps is not None else 0 if m.checkpoint else cfg.warmstart.steps
    if steps == 0:
        return RUNTIME + s.params * FP32 + eval_bytes(cfg, m, s)
    n = cfg.warmstart.batch_size
    tokens = n * (_prompt_tokens(m, cfg) + cfg.train.max_new_tokens)
    step = tokens * activation_bytes(s) * s.layers + logit_bytes(n * cfg.train.max_new_tokens, s.vocab)
    return RUNTIME + s.params * FP32 * STATE_COPIES + max(step, eval_bytes(cfg, m, s))


def activation_bytes(s: Shape) -> int:
    """Bytes one token keeps for backward in one block (fp32): the residual stream, norms, query/key/value,
    attention output and the MLP's hidden activations (SmolLM2-135M's measured step: 34 KiB; this says 39)."""
    return (6 * s.hidden + 4 * s.intermediate + 2 * s.kv_dim) * FP32


def kv_bytes(s: Shape) -> int:
    """One token's keys and values over every layer, fp32."""
    return 2 * s.layers * s.kv_dim * FP32


def lora_params(m: ModelConfig, s: Shape) -> int:
    """LoRA's adapters: rank x (in + out) for each target matrix; attention's four and the MLP's three per block
    at most (peft's default targets fewer, so this is an upper bound)."""
    per_block = 4 * (s.hidden + s.hidden) + 3 * (s.hidden + s.intermediate)
    return m.lora.rank * per_block * s.layers


def _samples(cfg: RunConfig, prompts: int) -> int:
    """Samples a learner trains on ``prompts`` prompt groups: its own, and PRP's peer groups, or SGT's one peer
    success per rescued prompt (at most every prompt)."""
    own = prompts * cfg.train.group_size
    if cfg.objective.kind == "prp":
        return own * len(cfg.models)
    return own + prompts if cfg.objective.kind.startswith("sgt") else own


def _prompt_tokens(m: ModelConfig, cfg: RunConfig) -> int:
    """A prompt's tokens: ``PROMPT_TOKENS``, within what a model built from scratch can hold besides its completion."""
    if m.checkpoint is None:
        return max(1, min(PROMPT_TOKENS, m.max_seq_len - cfg.train.max_new_tokens))
    return PROMPT_TOKENS


# --- model sizes ---

def model_shape(m: ModelConfig, cfg: RunConfig) -> Shape:
    """A model's size: from its checkpoint's headers, or its spec and its tokenizer's vocabulary."""
    if m.checkpoint is not None:
        return checkpoint_shape(m.checkpoint, cfg)
    vocab = tokenizer_vocab(m.tokenizer)
    d, n_layer = m.n_embd, m.n_layer
    if m.arch == "gpt2":  # learned positions; per block: attention 4d^2, MLP 8d^2, biases and two norms 13d
        body = m.max_seq_len * d + n_layer * (12 * d * d + 13 * d) + 2 * d
        return Shape(vocab * d * (1 if m.tie_embeddings else 2) + body, vocab, d, n_layer, 4 * d, d)
    heads, kv_heads = m.n_head, m.n_kv_head or m.n_head
    head_dim = d // heads
    intermediate = m.intermediate_size or -(-(8 * d // 3) // 32) * 32  # as policies.models builds it
    block = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + 3 * d * intermediate + 2 * d
    params = vocab * d * (1 if m.tie_embeddings else 2) + n_layer * block + d
    return Shape(params, vocab, d, n_layer, intermediate, kv_heads * head_dim)


def tokenizer_vocab(tokenizer: str) -> int:
    """``len(tokenizer)``: a built-in's from the table, a directory's from its tokenizer.json (the vocabulary and
    the added tokens past it) or its config.json."""
    if tokenizer in BUILTIN_VOCAB:
        return BUILTIN_VOCAB[tokenizer]
    path = Path(tokenizer).expanduser()
    try:
        data = json.loads((path / "tokenizer.json").read_text())
        ids = [t["id"] for t in data.get("added_tokens", [])]
        return max([len(data["model"]["vocab"]), *(i + 1 for i in ids)])
    except (OSError, ValueError, KeyError, TypeError):
        return _config_json(path).get("vocab_size") or BUILTIN_VOCAB["qwen2"]  # unknown: the largest we know


def checkpoint_shape(checkpoint: str, cfg: RunConfig) -> Shape:
    """A checkpoint's size: a save_pretrained directory's config.json and safetensors headers, or (not yet
    converted: a config checked without this machine) a GGUF file's header."""
    from policies.sources import resolve

    source = resolve(checkpoint, cache_root(cfg))
    if source.gguf is not None and not source.converted:
        return gguf_shape(source.gguf)
    c = _config_json(source.directory)
    c = c.get("text_config", c)  # a multimodal config holds its language model's
    hidden = c.get("hidden_size") or c.get("n_embd", 0)
    heads = c.get("num_attention_heads") or c.get("n_head", 1)
    head_dim = c.get("head_dim") or hidden // heads
    kv = (c.get("num_key_value_heads") or heads) * head_dim
    params = safetensors_params(source.directory) or _params_from_config(c, hidden, kv)
    return Shape(params, c.get("vocab_size", 0), hidden, c.get("num_hidden_layers") or c.get("n_layer", 0),
                 c.get("intermediate_size") or c.get("n_inner") or 4 * hidden, kv)


def safetensors_params(directory: Path) -> int:
    """Elements of every tensor in a directory's *.safetensors (each file's JSON header: no weights read); 0 where
    a header does not read (loading the checkpoint says what is wrong with it, in the worker that loads it)."""
    total = 0
    try:
        for path in directory.glob("*.safetensors"):
            with path.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, info in header.items():
                if name != "__metadata__":
                    n = 1
                    for dim in info["shape"]:
                        n *= dim
                    total += n
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError):
        return 0
    return total


def _params_from_config(c: dict, hidden: int, kv: int) -> int:
    layers, inter, vocab = c.get("num_hidden_layers", 0), c.get("intermediate_size") or 4 * hidden, c.get("vocab_size", 0)
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings", True) else 2)
    return embeddings + layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter)


def gguf_shape(path: Path) -> Shape:
    """A GGUF file's size from its header (the ``gguf`` package: the '.[gguf]' extra a GGUF checkpoint needs)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def field(key: str, default: int = 0) -> int:
        found = reader.fields.get(f"{arch}.{key}")
        return int(found.contents()) if found is not None else default

    hidden, heads = field("embedding_length"), field("attention.head_count", 1)
    head_dim = field("attention.key_length", hidden // heads)
    vocab = field("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return Shape(sum(int(t.n_elements) for t in reader.tensors), vocab, hidden, field("block_count"),
                 field("feed_forward_length", 4 * hidden), field("attention.head_count_kv", heads) * head_dim)


def _config_json(directory: Path) -> dict:
    try:
        found = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
