"""A model's learner group: data-parallel ranks that can grow and shrink while the run goes.

One torch.distributed group (gloo) per formation (``GroupSpec``). Rank 0 is
the leader: it alone ingests experience, picks each step's prompts and broadcasts
the step's samples; every rank trains on its share of the prompts, gradients are
summed with all-reduce, and every rank applies the same optimizer step, so all
ranks hold identical weights and optimizer state after every step.

Protocol inside a formation (why nobody hangs):
- Every collective starts with the leader's header ``[command, epoch, nbytes]``.
  ``STEP`` is followed by the step's payload; ``TICK`` (sent every ``tick_s`` while
  the leader waits for data) keeps followers inside the gloo time-out; ``REGROUP``
  and ``STOP`` end the formation at a step boundary, for every rank at once.
- On joining, rank 0 broadcasts the whole training state: weights, AdamW moments
  and step counts, the learner's version (its step count) and its sampling RNG.
  A new rank therefore continues exactly where the group was; ``state_digest``
  lets a test check that bit for bit.

A rank that dies makes the others' next collective fail (gloo sees the closed
connection, or the group's time-out expires): they report ``GroupBroken`` and wait for
the coordinator's next formation, whose ``sync_state`` makes every rank equal again.

Devices: the group is gloo whatever ``pool.device`` says (a sharded group on GPUs adds NCCL
for FSDP2's own collectives: ``join``'s backend). Weights, gradients and
optimizer state may live on a GPU; every collective over them is staged through one
flat CPU tensor (``_on_host``, ``_pieces``). gloo does accept CUDA tensors for
broadcast and all_reduce, but only this staged path runs on the CPU box where the
tests live: correct first; NCCL on the device tensors would be the fast path. Headers,
the step payload and the RNG state are CPU tensors from the start.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import socket
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from engine.train.batching import OwnSample, PeerSample
from engine.train.capability import CapabilityWindow
from engine.train.reference import Reference

STEP, TICK, REGROUP, STOP = 0, 1, 2, 3


@dataclass
class TrainState:
    """What must survive a re-formation: everything an optimizer step depends on."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    rng: torch.Generator
    version: int = 0  # optimizer steps taken (= weight version)
    # the KL term's frozen starting policy (objective.kl_coef > 0): the same on every rank, built by each from
    # the run's warm start, so never synced or hashed
    reference: Reference | None = None
    # HACPO's capability window (objective.kind = "hacpo"): each rank's, updated once a step with the whole step
    capability: CapabilityWindow | None = None

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]


class GroupError(RuntimeError):
    """A learner group could not form, or one of its collectives failed (a rank likely died)."""


_rendezvous: list = []  # the store must outlive the group

# NCCL's defaults tear the whole process down when a collective times out (a dead peer): the failure policy
# that holds on gloo (the collective raises, the survivor goes on) needs the wait to block and raise, and a
# failed communicator to be aborted without ending the process. Read when an NCCL group is made, so every
# worker sets them first (set_nccl_failure_env, in engine.roles.worker); ours win over the user's, whose values would kill workers.
NCCL_FAILURE_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def set_nccl_failure_env(environ: dict | None = None) -> None:
    """Put NCCL_FAILURE_ENV into ``environ`` (this process's environment by default)."""
    (os.environ if environ is None else environ).update(NCCL_FAILURE_ENV)


def _store(endpoint: str, rank: int, world: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's rendezvous at ``tcp://HOST:PORT``. Rank 0 serves it on a socket bound to HOST only:
    torch's own TCPStore would listen on every interface of the machine, whatever HOST says."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    if rank != 0:
        return dist.TCPStore(host, int(port), world, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), int(port)))
    sock.listen(max(world, 8))
    fd = sock.detach()  # the store's server owns the descriptor from now on (and closes it)
    return dist.TCPStore(host, int(port), world, True, timeout=timeout, master_listen_fd=fd)


def join(endpoint: str, rank: int, world: int, timeout_s: float, backend: str = "gloo") -> None:
    """Form the group (blocks until all ``world`` ranks arrived, or raises GroupError after the time-out).

    ``backend``: "gloo", or "cpu:gloo,cuda:nccl" for a sharded group on GPUs (the protocol's CPU tensors go
    over gloo, FSDP2's collectives on device tensors over NCCL; not yet run on a GPU)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = _store(endpoint, rank, world, timeout)
        _rendezvous.append(store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    except Exception as exc:  # torch raises several unrelated types here
        raise GroupError(f"could not form the learner group at {endpoint} as rank {rank}/{world} "
                         f"within {timeout_s:.0f}s: {exc}") from exc


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _rendezvous.clear()


def collective(fn):
    """A function made of collectives: any failure (a peer died, the time-out expired) is one GroupError."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GroupError:
            raise
        except Exception as exc:  # gloo reports a dead peer as RuntimeError, DistBackendError, ...
            raise GroupError(f"{fn.__name__} failed: {exc}") from exc

    return wrapped


@collective
def send_header(command: int, epoch: int, nbytes: int = 0) -> None:
    dist.broadcast(torch.tensor([command, epoch, nbytes], dtype=torch.int64), src=0)


@collective
def recv_header() -> tuple[int, int, int]:
    header = torch.zeros(3, dtype=torch.int64)
    dist.broadcast(header, src=0)
    return int(header[0]), int(header[1]), int(header[2])


@collective
def broadcast_bytes(data: bytes | None, nbytes: int) -> bytes:
    """Rank 0 sends ``data``; every rank returns it."""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        dist.broadcast(buf, src=0)
    return buf.numpy().tobytes()


def _opt_tensors(state: TrainState) -> list[torch.Tensor]:
    """AdamW moments and step counters in parameter order (created as zeros where missing).

    ``step`` goes where torch.optim.AdamW would create it: on the parameter's device for a
    fused (or capturable) optimizer, whose kernel reads it there, else on the CPU.
    """
    out = []
    for group in state.optimizer.param_groups:
        on_param = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            s = state.optimizer.state[p]
            if not s:
                s["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_param else "cpu")
                s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out += [s["step"].reshape(1), s["exp_avg"].reshape(-1), s["exp_avg_sq"].reshape(-1)]
    return out


@collective
def sync_state(state: TrainState, rank: int) -> None:
    """Rank 0's training state -> every rank (weights, AdamW state, version, RNG)."""
    has_opt = int(bool(state.optimizer.state)) if rank == 0 else 0
    rng = state.rng.get_state()
    meta = torch.tensor([state.version, has_opt, rng.numel()], dtype=torch.int64)
    dist.broadcast(meta, src=0)
    state.version, has_opt = int(meta[0]), int(meta[1])
    rng_buf = rng.clone() if rank == 0 else torch.empty(int(meta[2]), dtype=torch.uint8)
    dist.broadcast(rng_buf, src=0)
    state.rng.set_state(rng_buf)
    with torch.no_grad():
        _broadcast_flat([p.data for p in state.params])
        if has_opt:
            _broadcast_flat(_opt_tensors(state))
        else:
            state.optimizer.state.clear()


def _on_host(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One fresh flat CPU tensor holding ``tensors`` in order, wherever each of them lives.

    Each piece comes to the host on its own: a non-fused AdamW on a GPU keeps its step
    counters on the CPU and its moments on the GPU, and one ``cat`` cannot mix devices.
    """
    return torch.cat([t.reshape(-1).cpu() for t in tensors])


def _pieces(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut back into views shaped as ``like`` (still on ``flat``'s device)."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def _broadcast_flat(tensors: list[torch.Tensor]) -> None:
    flat = _on_host(tensors)
    dist.broadcast(flat, src=0)
    for t, piece in zip(tensors, _pieces(flat, tensors)):
        t.copy_(piece)  # host -> t's device


@collective
def allreduce_grads(params: list[torch.Tensor]) -> None:
    """Sum gradients over the group (a rank whose share had no sample contributes zeros)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _on_host(grads)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for p, piece in zip(params, _pieces(flat, params)):
        p.grad = piece.to(p.device, copy=True)  # owns its memory, on p's device


@collective
def allreduce_counts(counts: torch.Tensor) -> torch.Tensor:
    """``counts`` (a CPU tensor) summed over the group, in place; every rank must call it, with the same length."""
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return counts


def _host_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes as a CPU tensor holds them (the same on any device)."""
    return t.detach().cpu().contiguous().numpy().tobytes()


def state_digest(state: TrainState) -> str:
    """sha256 over weights, optimizer state, version and RNG: equal digests = bit-identical state."""
    h = hashlib.sha256()
    h.update(str(state.version).encode())
    for p in state.params:
        h.update(_host_bytes(p))
        for key in ("step", "exp_avg", "exp_avg_sq"):
            value = state.optimizer.state.get(p, {}).get(key)
            if value is not None:
                h.update(_host_bytes(value))
    h.update(state.rng.get_state().numpy().tobytes())
    return h.hexdigest()


def params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(_host_bytes(p))
    return h.hexdigest()


# --- the step payload: what the leader broadcasts (msgpack; arrays as dtype + bytes, never pickle) ---


class StepData(msgspec.Struct, array_like=True):
    """One optimizer step's samples; rank r trains on ``prompts[r::world]``."""

    prompts: list[int]
    own: list[OwnSample]
    peers: list[PeerSample]
    peer_version: dict[str, int]
    peer_misses: int
    solo: bool = False


def _enc_array(obj):
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, np.ascontiguousarray(obj).tobytes())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_array(kind, obj):
    if kind is np.ndarray:
        return np.frombuffer(obj[1], dtype=np.dtype(obj[0]))
    raise NotImplementedError(f"cannot decode {kind}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_array)
_DECODER = msgspec.msgpack.Decoder(StepData, dec_hook=_dec_array)


def encode_step(prompts: list[int], own: list[OwnSample], peers: list[PeerSample], peer_version: dict[str, int],
                misses: int, solo: bool) -> bytes:
    return _ENCODER.encode(StepData(prompts, own, peers, dict(peer_version), misses, solo))


def decode_step(raw: bytes) -> tuple[StepData, list[OwnSample], list[PeerSample]]:
    data = _DECODER.decode(raw)
    return data, data.own, data.peers
