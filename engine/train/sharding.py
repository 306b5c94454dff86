"""Sharded learners: FSDP2 (``fully_shard``) over a model's learner ranks, the same loss as the data-parallel step.

``shard`` wraps each decoder block, then the whole model, over a 1-D device mesh (gloo on CPU,
NCCL on GPUs): every rank holds 1/world of each parameter, gradient and AdamW moment, and
gathers a block's weights only while that block runs. ``sharded_step`` is one optimizer step
of ``engine.train.step.train_share`` in that form: rank r trains on ``prompts[r::world]``,
split into ``accum`` micro-batches whose gradients accumulate locally and are reduce-scattered
(summed: the divide factor is 1) after the last one. Each micro-batch's loss is its numerator
over the whole step's denominators: before any forward, every rank counts each normalising
site over all of its micro-batches, on batches without a forward, and one all-reduce adds the
ranks' counts (``engine.train.step.step_totals``). The micro-batches' losses of all ranks
then add up to the loss of the whole batch on one process, and the step's gradient is its
gradient to float rounding, for any objective, aggregation and token counts.

FSDP2 needs every rank to run the same forwards (each one all-gathers): ranks agree on how
many forwards each micro-batch takes (own samples, plus one for peers' tokens) and a rank with
fewer runs zero-weighted ones on two pad tokens. Options: activation checkpointing (HF's
non-reentrant one, per block) and a MixedPrecisionPolicy (``BF16_MASTER_FP32``: bf16 compute,
fp32 master weights and fp32 gradient reduction; for GPUs, not yet run on one).

Tested on two gloo ranks (tests/test_sharding.py): bit for bit against one process computing
the same pieces with the same denominators, and to float32 rounding against one batch of
every prompt. What it took on torch 2.13 + gloo: a plain SUM reduction (gloo has no
PREMUL_SUM, which a divide factor of 1 otherwise asks for), the divide factor set on every
unit (the root's does not reach its children), and policies.logprobs entered through an
FSDP-hooked method, since it calls base_model and the head itself, never the root's forward.
"""

from __future__ import annotations

import time
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from engine.train import group as dp
from engine.train.batching import build_batch
from policies import logprobs
from engine.train.step import step_totals
from policies.objectives import compute_loss

BF16_MASTER_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: HF names their classes in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no decoder block class (_no_split_modules): cannot shard it")
    return blocks


def shard(model: torch.nn.Module, mesh: DeviceMesh | None = None, checkpoint_activations: bool = False,
          mp_policy: MixedPrecisionPolicy | None = None) -> torch.nn.Module:
    """``model`` sharded in place over ``mesh`` (default: all ranks of the default group, on its device)."""
    if mesh is None:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    if checkpoint_activations:  # recompute each block's activations in backward instead of keeping them
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs = {"mesh": mesh, **({"mp_policy": mp_policy} if mp_policy is not None else {})}
    for block in decoder_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # policies.logprobs runs base_model, then the head on the positions it needs, never model.forward:
    # its entry point goes through the root unit's hooks instead, which gather the embeddings, the
    # final norm and the (possibly tied) head, and reduce their gradients after backward.
    model.sharded_token_logprobs = types.MethodType(_unsharded_token_logprobs, model)
    register_fsdp_forward_method(model, "sharded_token_logprobs")
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):  # each unit: not inherited
        unit.set_gradient_divide_factor(1.0)  # sum the ranks' gradients, as the data-parallel step does
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def _unsharded_token_logprobs(model: torch.nn.Module, *args) -> torch.Tensor:
    return logprobs.token_logprobs(model, *args, sharded=False)


def micro_batches(share: list[int], accum: int) -> list[list[int]]:
    """``share`` cut into ``accum`` consecutive pieces (as even as can be; some may be empty)."""
    size, extra = divmod(len(share), accum)
    out, start = [], 0
    for i in range(accum):
        end = start + size + (i < extra)
        out.append(share[start:end])
        start = end
    return out


def sharded_step(state: dp.TrainState, data: dp.StepData, own, peers, rank: int, world: int, objective,
                 pad_id: int, grad_clip: float, lr: float, accum: int = 1) -> dict:
    """This rank's part of one sharded optimizer step; every rank of the mesh must call it.

    ``own`` and ``peers`` are what the objective reads (``engine.train.step.peers_for``), as for train_share."""
    started = time.time()
    state.optimizer.zero_grad(set_to_none=True)
    stats: dict = {}
    pieces = micro_batches(data.prompts[rank::world], accum)
    totals = step_totals(state, data, own, peers, pieces, world, objective, pad_id)  # a collective: every rank
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        state.model.set_requires_gradient_sync(last)  # reduce-scatter once, after the last piece
        mine = set(piece)
        own_p, peers_p = [s for s in own if s.prompt_id in mine], [p for p in peers if p.prompt_id in mine]
        forwards = bool(piece) + bool(piece and peers_p)  # build_batch: one for own samples, one for peers
        # Agreed before any forward runs (each forward is a sequence of all-gathers every rank must join);
        # the last piece runs one somewhere, since its backward is what reduce-scatters the gradients.
        most = _most_forwards(forwards, at_least=int(last))
        loss, piece_stats = _piece_loss(state, data, own_p, peers_p, piece, pad_id, objective, totals)
        loss = loss + _padding_forwards(state.model, most - forwards, pad_id)
        if loss.requires_grad:
            loss.backward()
        stats = piece_stats or stats
    grad_norm = torch.nn.utils.clip_grad_norm_(state.params, grad_clip)
    for g in state.optimizer.param_groups:
        g["lr"] = lr
    state.optimizer.step()
    state.version += 1
    return {"busy_s": time.time() - started, "grad_norm": _plain(grad_norm),
            **{f"obj/{k}": float(v) for k, v in stats.items()}}


def _plain(value: torch.Tensor) -> float:
    """A DTensor (the norm of sharded gradients) or a tensor, as a float."""
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


def _piece_loss(state: dp.TrainState, data: dp.StepData, own, peers, piece: list[int], pad_id: int, objective,
                totals):
    """The piece's numerator over the step's denominators (``totals``), and its stats."""
    if not piece:
        return torch.zeros(()), {}
    batch = build_batch(state.model, own, peers, piece, state.version, pad_id, data.peer_version)
    batch.totals = totals
    return compute_loss(batch, objective, state.rng)


def _most_forwards(forwards: int, at_least: int) -> int:
    count = torch.tensor([max(forwards, at_least)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count)


def _padding_forwards(model: torch.nn.Module, n: int, pad_id: int) -> torch.Tensor:
    """``n`` zero-weighted forwards on two pad tokens, down the path build_batch takes (base_model, head)."""
    device = next(model.parameters()).device
    extra = torch.zeros((), device=device)
    ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
    for _ in range(n):
        logp = logprobs.token_logprobs(model, ids, torch.ones_like(ids), torch.tensor([[False, True]], device=device))
        extra = extra + logp.sum() * 0.0
    return extra
