"""ObjectiveBatch: the tensors every objective reads, and nothing else.

Layout rules (the engine builds these, objectives only read them):

- The receiver's own samples are rows of ``(B, T)`` tensors, right-padded to ``T``;
  ``mask`` is 1.0 on completion tokens that count and 0.0 elsewhere. Values under
  ``mask == 0`` may be anything finite or not: objectives never let them reach the loss.
- Peer samples (``P`` rows, possibly ``P == 0``) are already bridged into the
  receiver's tokens by the THL, right-padded to ``T2``. ``peer_behav_logp`` is the
  peer's behaviour log-prob moved onto these tokens (THL conserves the sum per aligned
  group), ``peer_align`` the aligned-group id of each token (-1 on padding).
- ``group`` / ``peer_group`` hold prompt-group indices in ``0..num_groups-1``: the same
  index means the same prompt for own and peer samples.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass
class ObjectiveBatch:
    """One learner step's worth of own samples plus bridged peer samples."""

    # the receiver's own samples, right-padded to T
    logp: Tensor  # (B, T) current-policy log-probs of the sampled tokens (requires grad)
    behav_logp: Tensor  # (B, T) behaviour log-probs recorded by the generator
    prox_logp: Tensor | None  # (B, T) proximal-policy log-probs (no grad); None -> logp.detach()
    mask: Tensor  # (B, T) float 0/1, completion tokens that count
    rewards: Tensor  # (B,)
    group: Tensor  # (B,) long, prompt-group index 0..Q-1
    staleness: Tensor  # (B,) long, learner version - sample weight version
    verified: Tensor  # (B,) bool
    num_groups: int  # Q
    # peer samples already bridged into the receiver's tokens by the THL; P may be 0
    peer_logp: Tensor  # (P, T2) receiver's current log-probs of the bridged tokens (requires grad)
    peer_behav_logp: Tensor  # (P, T2) peer's behaviour log-probs aligned onto these tokens
    peer_mask: Tensor  # (P, T2)
    peer_rewards: Tensor  # (P,)
    peer_group: Tensor  # (P,) long
    peer_verified: Tensor  # (P,) bool
    peer_residual: Tensor  # (P,) THL residual of each peer sample
    peer_align: Tensor  # (P, T2) long, THL aligned-group id of each token (-1 on padding)
    ref_logp: Tensor | None = None  # (B, T) reference policy, for the optional KL
    peer_staleness: Tensor | None = None  # (P,) long; None -> peers are never dropped for age
    # (P,) long, distinct within a group: a uniform draw among a group's peer rows takes the largest key.
    # The engine derives it from the row's place in its group and the step, never from the batch's other
    # rows, so any split of a step draws what the whole batch draws. None -> drawn from the objective's rng.
    peer_draw: Tensor | None = None
    # HACPO's (policies.hacpo): each peer row's length in its source's own tokens (its sequence ratio averages the
    # source's log-probs over them; None: the bridged length), and each model's capability, its share of rewards > 0
    # over its recent steps (the engine's window over whole steps, so every split of a step reads the same; None:
    # this batch's own share)
    peer_source_len: Tensor | None = None  # (P,) long
    own_capability: float | None = None
    peer_capability: Tensor | None = None  # (P,) the capability of each peer row's source model
    # A data-parallel step's denominators (policies.denominators): (site, this batch's count) -> the count
    # over the whole step's batch. None: this batch is the whole batch, as in one process.
    totals: Callable[[str, Tensor], Tensor] | None = None

    def total(self, site: str, local: Tensor) -> Tensor:
        """The denominator at normalising site ``site``: ``local`` (this batch's count), or the whole step's."""
        return local if self.totals is None else self.totals(site, local)

    @property
    def num_own(self) -> int:
        return int(self.logp.shape[0])

    @property
    def num_peers(self) -> int:
        return int(self.peer_logp.shape[0])

    @staticmethod
    def empty_peers(
        seq_len: int = 0, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> dict[str, Tensor]:
        """Peer fields for a batch without peers (P = 0): ``ObjectiveBatch(**own, **empty_peers())``."""
        floats = torch.zeros(0, seq_len, device=device, dtype=dtype)
        return {
            "peer_logp": floats,
            "peer_behav_logp": floats.clone(),
            "peer_mask": floats.clone(),
            "peer_rewards": torch.zeros(0, device=device, dtype=dtype),
            "peer_group": torch.zeros(0, device=device, dtype=torch.long),
            "peer_verified": torch.zeros(0, device=device, dtype=torch.bool),
            "peer_residual": torch.zeros(0, device=device, dtype=dtype),
            "peer_align": torch.zeros(0, seq_len, device=device, dtype=torch.long),
        }

    @classmethod
    def solo(
        cls,
        *,
        logp: Tensor,
        behav_logp: Tensor,
        mask: Tensor,
        rewards: Tensor,
        group: Tensor,
        num_groups: int,
        prox_logp: Tensor | None = None,
        staleness: Tensor | None = None,
        verified: Tensor | None = None,
        ref_logp: Tensor | None = None,
    ) -> ObjectiveBatch:
        """A batch of own samples only; staleness defaults to 0, verified to ``rewards > 0``."""
        B = logp.shape[0]
        if staleness is None:
            staleness = torch.zeros(B, dtype=torch.long, device=logp.device)
        if verified is None:
            verified = rewards > 0
        return cls(
            logp=logp,
            behav_logp=behav_logp,
            prox_logp=prox_logp,
            mask=mask,
            rewards=rewards,
            group=group,
            staleness=staleness,
            verified=verified,
            num_groups=num_groups,
            ref_logp=ref_logp,
            **cls.empty_peers(device=logp.device, dtype=logp.dtype),
        )

    def to(self, device: torch.device | str) -> ObjectiveBatch:
        """This batch with every tensor field on ``device``; None and int fields as they are.

        ``Tensor.to`` is differentiable and returns the tensor itself when it is already on
        ``device``, so log-probs keep their graph and a CPU batch moved to CPU is unchanged.
        """
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: v.to(device) for k, v in values.items() if isinstance(v, Tensor)})

    def validate(self) -> None:
        """Raise ValueError naming the first field whose shape, range or device breaks the layout rules."""
        for f in dataclasses.fields(self):  # one device: a mixed batch fails deep in a kernel, naming nothing
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and value.device != self.logp.device:
                raise ValueError(f"ObjectiveBatch.{f.name} is on {value.device}, logp on {self.logp.device}: "
                                 f"every tensor of a batch must be on the model's device")
        B, T = _shape2("logp", self.logp)
        for name in ("behav_logp", "prox_logp", "mask", "ref_logp"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (B, T):
                raise ValueError(f"ObjectiveBatch.{name} has shape {tuple(value.shape)}, expected ({B}, {T}) like logp")
        for name in ("rewards", "group", "staleness", "verified"):
            _check_rows(name, getattr(self, name), B, "logp")
        P, T2 = _shape2("peer_logp", self.peer_logp)
        for name in ("peer_behav_logp", "peer_mask", "peer_align"):
            value = getattr(self, name)
            if tuple(value.shape) != (P, T2):
                raise ValueError(f"ObjectiveBatch.{name} has shape {tuple(value.shape)}, expected ({P}, {T2}) like peer_logp")
        for name in ("peer_rewards", "peer_group", "peer_verified", "peer_residual", "peer_staleness", "peer_draw",
                     "peer_source_len", "peer_capability"):
            if getattr(self, name) is not None:
                _check_rows(name, getattr(self, name), P, "peer_logp")
        if self.num_groups < 0:
            raise ValueError(f"ObjectiveBatch.num_groups is {self.num_groups}; it must be >= 0")
        for name in ("group", "peer_group"):
            ids = getattr(self, name)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_groups):
                raise ValueError(
                    f"ObjectiveBatch.{name} holds ids outside 0..{self.num_groups - 1}; "
                    "renumber prompt groups densely and set num_groups to their count"
                )
        if self.peer_align.numel() and int(self.peer_align.max()) >= max(T2, 1):
            raise ValueError(f"ObjectiveBatch.peer_align holds a group id >= T2={T2}; aligned-group ids count tokens per row")


def _shape2(name: str, value: Tensor) -> tuple[int, int]:
    if value.dim() != 2:
        raise ValueError(f"ObjectiveBatch.{name} must be 2-D (rows, tokens), got shape {tuple(value.shape)}")
    return int(value.shape[0]), int(value.shape[1])


def _check_rows(name: str, value: Tensor, rows: int, like: str) -> None:
    if tuple(value.shape) != (rows,):
        raise ValueError(f"ObjectiveBatch.{name} has shape {tuple(value.shape)}, expected ({rows},): one entry per row of {like}")
