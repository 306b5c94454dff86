"""What the supervisor hands each worker process: one typed plan, msgpack-encoded."""

from __future__ import annotations

from typing import Literal

import msgspec

from engine.config import ModelConfig, RunConfig


class WorkerPlan(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    run_id: str
    run_dir: str
    config: RunConfig
    model_index: int  # which of config.models this worker serves
    role: Literal["generator", "learner"]
    worker_index: int  # generator index within its model (learners: 0)
    broker_in: str  # endpoint publishers connect to
    broker_out: str  # endpoint subscribers connect to
    weight_group: str  # torch.distributed init_method of this model's weight-sync group
    warm_checkpoint: str  # the warm-started weights every worker of this model starts from
    warm_eval: dict[str, float] = {}  # cached held-out accuracy of the warm start (learner reports it)

    @property
    def model(self) -> ModelConfig:
        return self.config.models[self.model_index]

    @property
    def worker_id(self) -> str:
        return f"{self.model.name}.{self.role[0]}{self.worker_index}"

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(raw: bytes) -> "WorkerPlan":
        return msgspec.msgpack.decode(raw, type=WorkerPlan)
