"""Which end of which weight path a worker's role opens: one place, so a leader and its generators agree.

- ``pool.weights = "broadcast"`` (and ``"auto"``, the default, when every worker of a machine has a GPU of its
  own): pair groups over torch.distributed (``broadcast``), on any number of machines;
- else in a cluster: the leader sends to node 0's hub, each node's relay fills its channels (``relay``);
- else: the machine's shared-memory channel (``channel``).

Generators read a channel in both of the last two cases: a relay writes it as a leader would. Which case a
run is in, the coordinator decides (``engine.weights.places``) and the worker's plan carries.
"""

from __future__ import annotations

import torch

from engine.weights.broadcast import BroadcastReader, BroadcastWriter
from engine.weights.channel import WeightReader, WeightWriter
from engine.weights.relay import RelayWriter


def weight_writer(worker, model: str, module: torch.nn.Module):
    """A learner leader's end (``publish``, ``take_lead``, ``nbytes``, ``close``)."""
    plan = worker.plan
    if plan.weights_board:
        return BroadcastWriter(plan.weights_board, model, module, worker.cfg.timeouts.weights_s, worker.id)
    if plan.weights_hub:
        return RelayWriter(plan.weights_hub, model, module, plan.curve)
    return WeightWriter(worker.plan_channel(model), module)


def weight_reader(worker, model: str, module: torch.nn.Module):
    """A generator's end (``load``, ``close``)."""
    plan = worker.plan
    if plan.weights_board:
        return BroadcastReader(plan.weights_board, model, module, worker.cfg.timeouts.weights_s, worker.id)
    return WeightReader(worker.plan_channel(model), module)
