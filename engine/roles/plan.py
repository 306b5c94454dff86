"""What a worker process is started with: the coordinator encodes it, ``engine.roles.worker`` decodes it.

A plain msgspec Struct (no torch), so the coordinator can build one without importing a worker's libraries.
"""

from __future__ import annotations

import msgspec

from engine.config import RunConfig
from exchange.security import ClientKeys


class WorkerPlan(msgspec.Struct, frozen=True):
    worker_id: str
    device_index: int  # which device of the host (GPU index mod the count)
    run_id: str
    run_dir: str
    config: RunConfig
    broker_in: str
    broker_out: str
    plane: str
    weights_root: str  # the run's weight channels on this machine (engine.weights.channel)
    warm_checkpoints: dict[str, str]  # model -> warm-start checkpoint
    warm_accuracy: dict[str, list[float]]  # model -> [accuracy, stderr] of the warm start on held-out problems
    # model -> checkpoint a resumed run continues from (workers spawned at its start); "": from the warm start, the
    # experience log replayed all the same (a run stopped before its first checkpoint)
    resume: dict[str, str] = {}
    weights_hub: str = ""  # a cluster's weight hub: a leader publishes there, not in this machine's channel
    weights_board: str = ""  # pool.weights = "broadcast": the run's TCPStore (engine.weights.broadcast)
    curve: ClientKeys | None = None  # a cluster's CurveZMQ keys: for the plane, the exchange and the weight hub
