"""What a coordinator hands out: each worker process's typed plan, and each prompt batch's problems."""

from __future__ import annotations

from typing import Literal

import msgspec

from engine.config import ModelConfig, RunConfig
from exchange.protocol import Problem


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


class PromptBook:
    """Batch k's problems: the same global prompt ids for every model, so cross-model groups line up."""

    def __init__(self, task, prompts_per_step: int):
        self.task, self.Q = task, prompts_per_step
        self._batches: dict[int, list[Problem]] = {}

    def batch(self, batch_id: int) -> list[Problem]:
        if batch_id not in self._batches:
            ids = range(batch_id * self.Q, (batch_id + 1) * self.Q)
            self._batches[batch_id] = [Problem(p.prompt_id, p.task, p.question, p.answer)
                                       for p in map(self.task.problem, ids)]
        return self._batches[batch_id]
