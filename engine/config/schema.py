"""The run config: one msgspec Struct tree, decoded strictly from TOML.

Every field has a default that runs on a laptop CPU; configs/default.toml spells out
the ones that matter. Cross-field rules live in ``engine.config.validate``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from policies.objective_config import ObjectiveConfig, SGTConfig
from policies.spec import LoraSpec, ModelSpec
from tasks.registry import ArithmeticConfig, TaskConfig
from tokenbridge.cachedir import default_cache_root

PosFloat = Annotated[float, Meta(gt=0)]
PosInt = Annotated[int, Meta(ge=1)]
Role = Literal["generator", "learner", "idle"]


class _Section(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class GenerationConfig(_Section):
    """`[models.generation]`: the engine that samples a model's completions (policies/backend.py)."""

    # hf: transformers sampling from the worker's module; hf-static: its own copy in `dtype`, a static KV cache (the
    # GPU path: bf16); sglang: an extra, needs CUDA
    backend: Literal["hf", "hf-static", "sglang"] = "hf"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # hf-static's and sglang's weights
    sglang_url: str = ""  # a running sglang server (http://host:port); "" = sglang's Engine in the worker, on its GPU
    # sglang's Engine: the fraction of a GPU's free memory its generators take for weights + KV cache, split
    # evenly between the workers placed on that GPU (sglang_args.mem_fraction_static overrides the share)
    sglang_memory: float = 0.7
    sglang_deterministic: bool = False  # --enable-deterministic-inference: slower, but run.seed reproduces samples
    sglang_args: dict[str, str | int | float | bool] = {}  # more sglang.Engine arguments (mem_fraction_static, ...)


class ModelConfig(ModelSpec, forbid_unknown_fields=True, frozen=True):
    """A model of the run: its spec plus its own training knobs."""

    lr: float | None = None  # per-model learning rate; None = train.lr
    generation: GenerationConfig = GenerationConfig()
    lora: LoraSpec | None = None  # train LoRA adapters on the frozen warm start instead of every weight (peft)
    # per-model warm-start length; None = warmstart.steps for a model built from scratch, 0 for a checkpoint (set
    # it to fine-tune a checkpoint on the task's worked solutions before RL)
    warmstart_steps: int | None = None


class RunSection(_Section):
    name: str = "mutual-rl"  # a label, kept in the run directory's config.toml; the W&B group of the run
    seed: int = 0  # seeds the RL phase: learners, generators' sampling, LoRA adapters (warmstart.seed: the warm start)
    mode: Literal["async", "sync"] = "async"  # sync: a unit of step k is generated with the weights of step k
    max_minutes: PosFloat = 14.0  # wall-clock cap of the RL phase; the run then stops cleanly
    cache_dir: str = ""  # warm starts, converted tokenizers; "" = $MUTUAL_RL_CACHE, else $XDG_CACHE_HOME/mutual_rl
    checkpoint_every: Annotated[int, Meta(ge=0)] = 50  # learner steps between resumable checkpoints (0: at the end)
    keep_checkpoints: PosInt = 2  # newest step checkpoints kept per model
    tensorboard: bool = True  # every learner metric as TensorBoard scalars in RUN_DIR/tensorboard/<model>/
    # the same metrics to Weights & Biases (an extra: pip install -e '.[wandb]'): "offline" writes RUN_DIR/wandb/
    # for a later `wandb sync`, "online" streams to a project set up with `wandb login`
    wandb: Literal["off", "offline", "online"] = "off"
    report: bool = True  # end with RUN_DIR/report.md and its plots (off: `launch.py report RUN_DIR` writes them later)
    # before anything starts, refuse a run whose estimated peak memory (engine.prep.memory_estimate) exceeds what
    # is available, in one line; false (launch.py run --ignore-memory-check) goes on anyway
    memory_check: bool = True
    # the memory the run may take, in GiB; 0 = what this machine has available now (MemAvailable, or its cgroup's
    # limit where smaller)
    memory_limit_gib: Annotated[float, Meta(ge=0)] = 0.0
    # a worker killed by SIGKILL while less than this (GiB) was available is named a likely out-of-memory kill;
    # 0 = a tenth of the machine's memory, at least 1 GiB
    memory_short_gib: Annotated[float, Meta(ge=0)] = 0.0


class TrainSection(_Section):
    steps: PosInt = 100  # optimizer steps per model
    prompts_per_step: PosInt = 8  # prompt groups per optimizer step
    group_size: PosInt = 8  # G: samples per prompt per model
    lr: PosFloat = 1e-3  # AdamW learning rate of every model (models.N.lr overrides it)
    adam_betas: tuple[float, float] = (0.9, 0.99)  # AdamW's (beta1, beta2)
    grad_clip: PosFloat = 1.0  # gradients are clipped to this global norm before each step
    warmup_steps: Annotated[int, Meta(ge=0)] = 0  # linear lr warm-up
    # longest completion a generator samples (and evaluations: eval.max_new_tokens); unset, 256 when a model
    # starts from a checkpoint
    max_new_tokens: PosInt = 12
    temperature: PosFloat = 1.0  # sampling temperature of the generators
    # generators sample from the fewest likeliest tokens holding this much probability (after top_k), renormalised;
    # 1 = all. Behaviour log-probs are of that renormalised distribution, so importance weights stay exact.
    # Evaluations ignore it; sglang refuses it (its log-probs are of the untruncated distribution)
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    # generators sample from the k likeliest tokens, renormalised (log-probs as for top_p); 0 = all. Evaluations
    # ignore it; sglang refuses it
    top_k: Annotated[int, Meta(ge=0)] = 0
    # a task's verifier (your reward function) that raises: "stop" ends the run cleanly, naming the exception, its
    # file and line and the problem; "zero" scores that completion 0 and counts it (metrics: reward_error)
    reward_errors: Literal["stop", "zero"] = "stop"
    max_inflight_steps: PosInt = 2  # steps of work a model's generators may run ahead of its learner
    max_model_lead_steps: PosInt = 4  # ... and ahead of the slowest live peer's learner
    # a learner group of several ranks: "replicate" (each rank holds the whole state, gradients all-reduced) or
    # "fsdp2" (each rank holds 1/world of the weights, gradients and AdamW moments: engine.train.sharding)
    sharding: Literal["replicate", "fsdp2"] = "replicate"
    # micro-batches per rank and step: a step's activations held a piece at a time, gradients added (and, across
    # ranks, reduced once) after the last; the update is the one-batch update, to float rounding
    grad_accum: PosInt = 1
    activation_checkpointing: bool = False  # fsdp2: recompute each block's activations in backward
    # fsdp2: "bf16" computes forward and backward in bfloat16; master weights, gradient reduction and AdamW stay fp32
    mixed_precision: Literal["fp32", "bf16"] = "fp32"


class EvalSection(_Section):
    num_problems: PosInt = 1000  # held-out problems for the accuracy before and after RL
    every_steps: Annotated[int, Meta(ge=0)] = 0  # live eval during RL (0 = off)
    live_problems: PosInt = 200  # problems for the live eval
    temperature: Annotated[float, Meta(ge=0)] = 0.0  # 0 = greedy
    batch_size: PosInt = 250  # problems generated together in an evaluation
    # longest completion an evaluation decodes (before, live, final); 0 = train.max_new_tokens, so the held-out
    # figures judge what RL trains (a completion cut here is counted: the `truncated` fraction)
    max_new_tokens: Annotated[int, Meta(ge=0)] = 0


class CostPhase(_Section):
    """A modelled compute budget (benchmarks): worker-seconds per sample from ``from_s`` on."""

    from_s: Annotated[float, Meta(ge=0)] = 0.0  # seconds after the first allocation (the RL phase) from which these hold
    gen_s: dict[str, PosFloat] = {}  # model -> worker-seconds to generate one sample
    train_s: dict[str, PosFloat] = {}  # model -> worker-seconds to train on one sample


class ScriptedMove(_Section):
    """A forced reassignment (tests, demos): once ``step_of``'s learner reaches ``at_step``."""

    at_step: Annotated[int, Meta(ge=0)]  # the move is due once `step_of`'s learner has taken this many steps
    step_of: str  # the model whose learner step triggers the move
    worker: str  # the worker moved, by id ("w0", "w1", ...)
    role: Role  # its new role
    model: str = ""  # the model of its new role ("" for idle)


class PoolSection(_Section):
    workers: Annotated[int, Meta(ge=2)] = 4  # worker processes, each one device (a GPU; here a CPU process)
    allocator: Literal["static", "mwra"] = "static"  # static: keep `split`; mwra: the controller moves workers
    split: dict[str, int] = {}  # static: "generator:<m>"/"learner:<m>" -> workers; {} = a learner per model, rest generate
    device: Literal["cpu", "cuda"] = "cpu"  # cuda: worker i on GPU i mod the GPU count
    # learner -> generator weights: "channel" = shared-memory slots on each machine (relayed between machines);
    # "broadcast" = a torch.distributed pair group per leader and generator (NCCL between GPUs, gloo on CPUs);
    # "auto" = broadcast when every worker of a machine has a GPU of its own (NCCL pairs distinct GPUs), else channel
    weights: Literal["auto", "channel", "broadcast"] = "auto"
    threads_per_worker: PosInt = 1  # torch threads of each worker process
    prompts_per_work: Annotated[int, Meta(ge=0)] = 0  # prompts per work unit; 0 = a whole step's batch
    max_respawns: Annotated[int, Meta(ge=0)] = 3  # dead workers replaced by fresh processes, per run
    max_broker_restarts: Annotated[int, Meta(ge=0)] = 3  # a dead broker started again on its endpoints and log
    restart_backoff_s: Annotated[float, Meta(ge=0)] = 1.0  # a model's n-th learner restart waits 2**(n-1) times this
    controller: dict[str, float] = {}  # MWRA settings (decision_interval_s, cooldown_s, ...)
    controller_every_s: PosFloat = 1.0  # how often the coordinator consults the allocator
    script: list[ScriptedMove] = []  # forced moves, on top of the allocator
    costs: list[CostPhase] = []  # modelled compute budget over time; [] = real compute only

    def workers_per_node(self) -> int:
        """Workers on each machine: under torchrun one launcher runs per node (``WORLD_SIZE`` of them)."""
        return -(-self.workers // int(os.environ.get("WORLD_SIZE", "1")))

    def cost(self, kind: Literal["gen", "train"], model: str, t: float) -> float:
        """Worker-seconds per sample of ``model`` at ``t`` seconds into the run (0: no budget)."""
        current = 0.0
        for phase in sorted(self.costs, key=lambda p: p.from_s):
            if phase.from_s <= t:
                current = (phase.gen_s if kind == "gen" else phase.train_s).get(model, 0.0)
        return current


class TimeoutSection(_Section):
    """Every blocking wait of the engine, by name; an expiry is a logged failure, never a hang."""

    worker_start_s: PosFloat = 120.0  # a spawned worker says hello
    group_form_s: PosFloat = 120.0  # a learner group forms, or one of its collectives completes
    tick_s: PosFloat = 1.0  # a leader waiting for data pings its ranks this often (inside group_form_s)
    peer_wait_s: PosFloat = 5.0  # a learner waits this long for its peers' groups on a step's prompts
    peer_silent_s: PosFloat = 60.0  # a model whose learner has not stepped this long is declared gone
    weights_s: PosFloat = 60.0  # a generator waits for the weight version a unit asks for
    logged_s: PosFloat = 60.0  # a generator waits for the broker to confirm a unit's samples (logged, routed)
    halt_s: PosFloat = 60.0  # generators finish their units after the stop
    final_s: PosFloat = 600.0  # learners checkpoint and run the final evaluation after the stop
    stop_s: PosFloat = 10.0  # a process told to stop exits within this, else it is killed
    node_silent_s: Annotated[float, Meta(ge=6.0)] = 30.0  # a node silent this long is gone (a beat every 2 s)


class RewardSection(_Section):
    """The reward: reward functions in TRL's shape, summed with weights (tasks/rewards.py says how they are
    called and what counts as a success)."""

    # "task" (the task's own verifier), "exact_answer", "module:function", or "file:PATH" (a pickled function)
    funcs: list[str] = msgspec.field(default_factory=lambda: ["task"])
    weights: list[float] = []  # one per function; [] = 1.0 each
    # a NaN a function returns: "error" is an error naming the function, as a wrong length is (a NaN is most often
    # a bug: 0/0, a failed parse; train.reward_errors says what an error does); "abstain" reads it as None, as TRL
    nan: Literal["error", "abstain"] = "error"
    # what counts as a success (SGT's peer successes, the warm start's stop rule, held-out accuracy): "auto" = the
    # task's answer check wherever the task has answers (a dataset's answer column), whether or not "task" pays;
    # "task" = the answer check; "all" = full marks (1.0) from every function that judged; a function's name
    # (reward_names: "brief", "task", ...) = full marks from it; a number = the weighted reward at least that
    success: str | float = "auto"


class WarmStartConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How long and how hard to imitate worked solutions."""

    steps: Annotated[int, Meta(ge=0)] = 300  # optimizer steps (an upper bound if seconds is set)
    seconds: Annotated[float, Meta(gt=0)] | None = None  # wall-clock budget; result then depends on the machine
    batch_size: Annotated[int, Meta(ge=1)] = 32  # worked solutions per optimizer step
    lr: Annotated[float, Meta(gt=0)] = 1e-3  # AdamW learning rate of the warm start
    warmup_steps: Annotated[int, Meta(ge=0)] = 10  # linear lr ramp; Adam's first steps are noisy
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0  # AdamW weight decay of the warm start
    stop_accuracy: Annotated[float, Meta(gt=0, le=1)] | None = None  # stop once greedy train accuracy reaches it
    check_every: Annotated[int, Meta(ge=1)] = 50  # steps between accuracy checks
    check_problems: Annotated[int, Meta(ge=1)] = 64  # training problems per check
    seed: int = 0  # model init and problem order



class RunConfig(_Section):
    run: RunSection = RunSection()
    models: list[ModelConfig] = []
    task: TaskConfig = ArithmeticConfig()
    objective: ObjectiveConfig = SGTConfig()
    reward: RewardSection = RewardSection()
    train: TrainSection = TrainSection()
    warmstart: WarmStartConfig = WarmStartConfig()
    eval: EvalSection = EvalSection()
    pool: PoolSection = PoolSection()
    timeouts: TimeoutSection = TimeoutSection()

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def model(self, name: str) -> ModelConfig:
        return self.models[self.names.index(name)]

    @property
    def eval_max_new_tokens(self) -> int:
        """The length every held-out evaluation decodes: eval.max_new_tokens, or the training length where it is 0."""
        return self.eval.max_new_tokens or self.train.max_new_tokens


def model_spec(m: ModelConfig, checkpoint: str | None = None) -> ModelSpec:
    """The plain ModelSpec of a model entry (lr and warm-start length do not change the architecture)."""
    fields = {f: getattr(m, f) for f in ModelSpec.__struct_fields__}
    if checkpoint is not None:
        fields["checkpoint"] = checkpoint
    return ModelSpec(**fields)


def cache_root(cfg: RunConfig) -> Path:
    """Warm starts and converted tokenizers, shared by every run on the machine.

    ``run.cache_dir`` if set, else ``$MUTUAL_RL_CACHE``, else ``$XDG_CACHE_HOME/mutual_rl``
    (``~/.cache/mutual_rl`` when XDG_CACHE_HOME is unset). ``launch.py cache`` shows and clears it.
    """
    if cfg.run.cache_dir:
        return Path(cfg.run.cache_dir).expanduser()
    return default_cache_root()
