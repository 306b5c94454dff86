"""Cost model of the MWRA simulator: what one GPU-second buys for each model and role.

Every figure is a public one, cited where it is used; the model is a roofline, so it
is right in shape (what grows with what) and within a small factor in level.

Hardware: NVIDIA H100 SXM5 80 GB (NVIDIA H100 Tensor Core GPU datasheet):
989 TFLOP/s dense BF16, 3.35 TB/s HBM3.

Generation (one GPU per generator, vLLM/sglang-style continuous batching). Decode is
memory-bound: every iteration reads the weights once and the KV cache of every
sequence in flight. Per iteration: (weight_bytes + sum of context * kv_bytes_per_token)
/ achieved bandwidth. A public sweep of vLLM with Llama-3.1-8B (johnmusgrave.com,
"vLLM throughput-latency sweep on NVIDIA A100") measured single-request decode at ~77%
of the HBM roofline; we use 75%. Concurrency is capped by vLLM's default max_num_seqs
(256) and by the KV memory left at gpu_memory_utilization = 0.9 (vLLM default), so long
responses decode fewer sequences at once and cost more per token: the reason the
generation/training balance moves as responses grow.

Training: FLOPs = 6 N per token for forward + backward (Kaplan et al. 2020) plus 2 N
per token to recompute the proximal policy's log-probs (AReaL's decoupled PPO does
this forward), at 40% MFU (the Llama 3 report, Dubey et al. 2024, Table 4: 38-43% BF16
MFU on H100). Gradient all-reduce is assumed overlapped with backward (FSDP/DDP).

Models: the Qwen3 family's published configs (hf.co/Qwen/Qwen3-{1.7B,4B,8B}/config.json):
layers 28/36/36, 8 KV heads of dim 128 each, 2.0/4.0/8.2 B parameters (with embeddings).

Response lengths: RL on reasoning tasks makes responses grow several-fold during
training (DeepSeek-R1 report, Fig. 3: R1-Zero's mean length grows steadily over
thousands of steps; DAPO, Yu et al. 2025, Fig. 2/7: mean length roughly triples).
When each model's growth happens is our assumption (stated in ``drifting_workload``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PEAK_BF16_FLOPS = 989e12  # H100 SXM5, dense
HBM_BYTES_PER_S = 3.35e12  # H100 SXM5 HBM3
HBM_BYTES = 80e9
DECODE_BW_EFFICIENCY = 0.75  # achieved / peak HBM bandwidth in decode (see module doc)
DECODE_STEP_OVERHEAD_S = 0.003  # per decode iteration: scheduling + sampling on the host (assumed)
PREFILL_MFU = 0.5  # prefill is compute-bound; prompt prefilled once per group (prefix caching)
MAX_NUM_SEQS = 256  # vLLM default
GPU_MEMORY_UTILIZATION = 0.9  # vLLM default
TRAIN_MFU = 0.40  # Llama 3 report: 38-43% on H100
TRAIN_FLOPS_PER_PARAM_TOKEN = 8.0  # 6 (fwd+bwd) + 2 (proximal log-prob forward)
BF16_BYTES = 2

# Reassignment costs, seconds (assumed; order of magnitude from public startup logs):
GENERATOR_START_S = 45.0  # load weights from host/peer (~16 GB at ~25 GB/s) + CUDA-graph capture (~20-40 s in vLLM)
LEARNER_JOIN_S = 30.0  # receive parameter + Adam shards (16 B/param) and initialise NCCL
LEARNER_REFORM_S = 20.0  # the whole learner group stalls while its process group re-forms


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float  # with embeddings: weight bytes = 2 * params
    layers: int
    kv_heads: int
    head_dim: int
    group_size: int = 8  # G samples per prompt

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16_BYTES  # K and V

    @property
    def weight_bytes(self) -> float:
        return self.params * BF16_BYTES


QWEN3_1_7B = ModelSpec("qwen3-1.7b", 2.0e9, 28, 8, 128)
QWEN3_4B = ModelSpec("qwen3-4b", 4.0e9, 36, 8, 128)
QWEN3_8B = ModelSpec("qwen3-8b", 8.2e9, 36, 8, 128)
MODELS = (QWEN3_1_7B, QWEN3_4B, QWEN3_8B)

PROMPT_TOKENS = 256
LENGTH_CV = 0.6  # response lengths ~ lognormal with this coefficient of variation (assumed)


def decode_concurrency(model: ModelSpec, mean_len):
    """Sequences a generator decodes at once when mean response length is ``mean_len`` (scalar or array)."""
    kv_tokens = (HBM_BYTES * GPU_MEMORY_UTILIZATION - model.weight_bytes) / model.kv_bytes_per_token
    # Time-averaged KV held per sequence: prompt + half a length-biased response.
    held = PROMPT_TOKENS + 0.5 * mean_len * (1 + LENGTH_CV ** 2)
    return np.minimum(MAX_NUM_SEQS, kv_tokens / held)


def generation_seconds(model: ModelSpec, lengths: np.ndarray, mean_len) -> np.ndarray:
    """GPU-seconds to decode each sample of ``lengths`` (tokens) on one GPU, prefill included.

    ``mean_len`` (broadcast against ``lengths``) sets the engine's concurrency.
    """
    bw = HBM_BYTES_PER_S * DECODE_BW_EFFICIENCY
    conc = decode_concurrency(model, mean_len)
    per_token_fixed = (model.weight_bytes / bw + DECODE_STEP_OVERHEAD_S) / conc  # shared per iteration
    kv_per_ctx_token = model.kv_bytes_per_token / bw
    # Sum over decode steps i=1..L of context (P + i): P*L + L(L+1)/2.
    ctx_sum = PROMPT_TOKENS * lengths + lengths * (lengths + 1) / 2
    prefill = 2 * model.params * PROMPT_TOKENS / (PEAK_BF16_FLOPS * PREFILL_MFU) / model.group_size
    return lengths * per_token_fixed + ctx_sum * kv_per_ctx_token + prefill


def training_seconds(model: ModelSpec, lengths: np.ndarray) -> np.ndarray:
    """GPU-seconds of learner work per sample."""
    flops = TRAIN_FLOPS_PER_PARAM_TOKEN * model.params * (PROMPT_TOKENS + lengths)
    return flops / (PEAK_BF16_FLOPS * TRAIN_MFU)


# --- workloads: mean response length of each model as a function of training progress p in [0, 1]

def _logistic(p: np.ndarray, lo: float, hi: float, mid: float, width: float = 0.08) -> np.ndarray:
    return lo + (hi - lo) / (1 + np.exp(-(p - mid) / width))


def stationary_workload(p: np.ndarray) -> dict[str, np.ndarray]:
    """Mean lengths that do not change: a mid-training snapshot."""
    return {QWEN3_1_7B.name: np.full_like(p, 1500.0), QWEN3_4B.name: np.full_like(p, 1800.0),
            QWEN3_8B.name: np.full_like(p, 1200.0)}


def drifting_workload(p: np.ndarray) -> dict[str, np.ndarray]:
    """Lengths grow 3-6x, at different points of the run for each model (assumed timing).

    The small model learns to reason at length early, the mid-size one in the middle,
    the large one late; all end in the 3-5k range seen in DeepSeek-R1 and DAPO runs.
    """
    return {QWEN3_1_7B.name: _logistic(p, 700.0, 3500.0, 0.25),
            QWEN3_4B.name: _logistic(p, 800.0, 3000.0, 0.5),
            QWEN3_8B.name: _logistic(p, 700.0, 4500.0, 0.75)}


WORKLOADS = {"stationary": stationary_workload, "drifting": drifting_workload}


@dataclass(frozen=True)
class BlockCosts:
    """GPU-seconds of every block of prompts, per model and role; fixed for a seed."""

    gen: dict[str, np.ndarray]  # model -> (n_blocks,) generator GPU-seconds
    train: dict[str, np.ndarray]  # model -> (n_blocks,) learner GPU-seconds
    tokens: dict[str, np.ndarray]  # model -> (n_blocks,) completion tokens


def block_costs(workload: str, n_blocks: int, block_prompts: int, seed: int) -> BlockCosts:
    """Sample every block's response lengths once, so every allocation runs the same work.

    Block b belongs to training progress p = b / n_blocks: its prompts are generated and
    trained around that point of the run (the staleness bound keeps it so).
    """
    rng = np.random.default_rng(seed)
    p = (np.arange(n_blocks) + 0.5) / n_blocks
    means = WORKLOADS[workload](p)
    sigma = np.sqrt(np.log(1 + LENGTH_CV ** 2))
    gen, train, tokens = {}, {}, {}
    for model in MODELS:
        n = block_prompts * model.group_size
        parts = []
        for lo in range(0, n_blocks, 4096):  # chunks keep memory small at 512 GPUs
            mean = means[model.name][lo:lo + 4096, None]  # (b, 1)
            z = rng.standard_normal((len(mean), n))
            lengths = np.maximum(1.0, np.round(mean * np.exp(sigma * z - sigma ** 2 / 2)))  # (b, n)
            parts.append((generation_seconds(model, lengths, mean).sum(axis=1),
                          training_seconds(model, lengths).sum(axis=1), lengths.sum(axis=1)))
        gen[model.name], train[model.name], tokens[model.name] = (np.concatenate(x) for x in zip(*parts))
    return BlockCosts(gen=gen, train=train, tokens=tokens)

