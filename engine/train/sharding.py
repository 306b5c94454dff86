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

FSDP2 needs every rank to run the same forwards (each one all-gathers), each of them part of
the loss (its backward all-gathers again): ranks agree on how many forwards each micro-batch
takes (own samples, plus one for peers' tokens; reward-only peers run none) and a rank with
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

import copy
import time
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from engine.train import group as dp
from engine.train.batching import build_batch, forward_count
from policies import logprobs
from engine.train.optim import adamw
from engine.train.step import merge_stats, micro_batches, step_totals
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


def sharded_step(state: dp.TrainState, data: dp.StepData, own, peers, rank: int, world: int, objective,
                 pad_id: int, grad_clip: float, lr: float, accum: int = 1) -> dict:
    """This rank's part of one sharded optimizer step; every rank of the mesh must call it.

    ``own`` and ``peers`` are what the objective reads (``engine.train.step.peers_for``), as for train_share."""
    started = time.time()
    state.optimizer.zero_grad(set_to_none=True)
    done = []
    pieces = micro_batches(data.prompts[rank::world], accum)
    totals = step_totals(state, data, own, peers, pieces, world, objective, pad_id)  # a collective: every rank
    capability = state.capability.update(own, peers) if state.capability is not None else None  # HACPO's
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        state.model.set_requires_gradient_sync(last)  # reduce-scatter once, after the last piece
        mine = set(piece)
        own_p, peers_p = [s for s in own if s.prompt_id in mine], [p for p in peers if p.prompt_id in mine]
        forwards = forward_count(own_p, peers_p) if piece else 0  # what build_batch runs
        # Agreed before any forward runs (each forward is a sequence of all-gathers every rank must join);
        # the last piece runs one somewhere, since its backward is what reduce-scatters the gradients.
        most = _most_forwards(forwards, at_least=int(last))
        loss, piece_stats = _piece_loss(state, data, own_p, peers_p, piece, pad_id, objective, totals, capability)
        loss = loss + _padding_forwards(state.model, most - forwards, pad_id)
        if loss.requires_grad:
            loss.backward()
        done.append((piece_stats, len(own_p)))
    grad_norm = torch.nn.utils.clip_grad_norm_(state.params, grad_clip)
    for g in state.optimizer.param_groups:
        g["lr"] = lr
    state.optimizer.step()
    state.version += 1
    return {"busy_s": time.time() - started, "grad_norm": _plain(grad_norm),
            "share_samples": sum(s.prompt_id in set(data.prompts[rank::world]) for s in own),
            **{f"obj/{k}": float(v) for k, v in merge_stats(done).items()}}


def _plain(value: torch.Tensor) -> float:
    """A DTensor (the norm of sharded gradients) or a tensor, as a float."""
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value)


def _piece_loss(state: dp.TrainState, data: dp.StepData, own, peers, piece: list[int], pad_id: int, objective,
                totals, capability=None):
    """The piece's numerator over the step's denominators (``totals``), and its stats."""
    if not piece:
        return torch.zeros(()), {}
    batch = build_batch(state.model, own, peers, piece, state.version, pad_id, data.peer_version,
                        capability=capability)
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


class ShardedTwin:
    """A learner group formation's FSDP2 copy of the training state (``train.sharding = "fsdp2"``).

    Every rank builds it from the replicated state that ``engine.train.group.sync_state`` has
    just made equal: a copy of the module sharded over the group, and AdamW moments cut the
    same way. While it lives, a follower's own module and moments are emptied (it holds 1/world
    of the weights, gradients and moments); the leader keeps whole weights only, refreshed
    after every step, which is what it publishes to generators, evaluates and saves.

    - ``step``: ``sharded_step``, then every rank all-gathers the new weights (a collective).
    - ``gather_moments``: the AdamW moments, whole, into the leader's optimizer (a collective:
      before a checkpoint); ``drop_moments`` empties them again afterwards.
    - ``close``: the moments, whole, back into the leader's own state (a collective, at the
      formation's end); the next formation's ``sync_state`` sends that state to every rank.
      A formation that broke cannot do it: a dead rank's shards are gone
      (``engine.failures`` then takes the model out of the run).
    Re-sharding whole tensors and gathering them back moves bits without arithmetic: the
    leader's state after ``close`` is the state the twin held, bit for bit (tests/test_sharding.py).
    """

    def __init__(self, state: dp.TrainState, leader: bool, device: torch.device, betas: tuple[float, float],
                 accum: int, checkpoint_activations: bool, bf16: bool = False):
        self.plain, self.leader, self.accum = state, leader, accum
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        model = shard(copy.deepcopy(state.model), mesh, checkpoint_activations, BF16_MASTER_FP32 if bf16 else None)
        twin_params = dict(model.named_parameters())
        self.pairs = [(p, twin_params[n]) for n, p in state.model.named_parameters() if p.requires_grad]
        self.shapes = [p.shape for p, _ in self.pairs]
        lr = state.optimizer.param_groups[0]["lr"]
        optimizer = adamw([q for _, q in self.pairs], lr=lr, betas=betas)
        for p, q in self.pairs:
            s = state.optimizer.state.get(p)
            if s:
                optimizer.state[q] = {"step": s["step"].clone(),
                                      "exp_avg": distribute_tensor(s["exp_avg"], mesh, q.placements),
                                      "exp_avg_sq": distribute_tensor(s["exp_avg_sq"], mesh, q.placements)}
        self.twin = dp.TrainState(model, optimizer, state.rng, state.version, capability=state.capability)
        state.optimizer.state.clear()
        if not leader:
            for p, _ in self.pairs:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def step(self, data: dp.StepData, own, peers, rank: int, world: int, objective, pad_id: int, grad_clip: float,
             lr: float) -> dict:
        result = sharded_step(self.twin, data, own, peers, rank, world, objective, pad_id, grad_clip, lr, self.accum)
        self.plain.version = self.twin.version
        with torch.no_grad():
            for p, q in self.pairs:
                whole = q.full_tensor()
                if self.leader:
                    p.copy_(whole)
        return result

    def gather_moments(self, keep: bool | None = None) -> None:
        """Every rank: the AdamW moments, whole, into its own optimizer if ``keep`` (default: the leader's only)."""
        keep = self.leader if keep is None else keep
        for p, q in self.pairs:
            s = self.twin.optimizer.state.get(q)
            if s:
                whole = {"step": s["step"].clone(), "exp_avg": s["exp_avg"].full_tensor(),
                         "exp_avg_sq": s["exp_avg_sq"].full_tensor()}
                if keep:
                    self.plain.optimizer.state[p] = whole

    def holdings(self) -> list:
        """What the twin keeps in memory (``engine.roles.memory.held_bytes`` counts this process's shards)."""
        return [] if self.twin is None else [self.twin.model, self.twin.optimizer]

    def drop_moments(self) -> None:
        self.plain.optimizer.state.clear()

    def close(self) -> None:
        """Every rank, at the formation's end: the leader's own state is whole again (its weights are already;
        the moments are gathered). A follower's module gets whole-sized storage back but no values: they come
        from the next formation's ``sync_state`` or, for a generator, the weight channel (leaders never move,
        so a follower never needs the whole state, and never holds it at once)."""
        self.gather_moments()
        self.abandon()

    def abandon(self) -> None:
        """Drop the twin (after ``close``, or when the formation broke and its shards are lost); a follower's
        module gets whole-sized, zeroed weights."""
        with torch.no_grad():
            for (p, _), shape in zip(self.pairs, self.shapes):
                if p.numel() == 0 and shape.numel():
                    p.data = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.twin = None
