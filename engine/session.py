"""The engine's part of a run, for ``mutual_rl.runs`` (the run's one home) to call: the pre-flight checks and the
memory check, the actors' fork server, the coordinator's loop with a watch of its steps, a stopped run made ready
to resume; this node's place in a torchrun cluster."""

from __future__ import annotations

import contextlib
import sys
from typing import Protocol


def preflight(cfg, forked: bool = False) -> None:
    """Fail before starting anything if a tokenizer or the task cannot be loaded, or LoRA cannot adapt a model.

    ``forked``: the tokenizers are loaded in a fork of the actor server, which has torch and transformers
    imported already, so that the launcher never imports them (3-5 s of CPU a run)."""
    from engine.config import ConfigError
    from tasks.jsonl import TaskFileError
    from engine.config import run_task
    from tasks.rewards import RewardLoadError

    if forked:
        from engine.runtime import actors

        problem = actors.call_forked(_model_problem, cfg)
    else:
        problem = _model_problem(cfg)
    if problem:
        raise ConfigError(problem)
    try:
        task = run_task(cfg)
    except RewardLoadError as exc:
        raise ConfigError(f"reward.funcs: {exc}") from None
    except (OSError, ValueError, TaskFileError) as exc:
        raise ConfigError(f"task: {exc}") from None
    if note := getattr(task, "split_note", None):
        print(note, flush=True)
    if note := success_note(task, cfg.reward.success):
        print(note, flush=True)
    if cfg.pool.allocator == "mwra":
        from engine.schedule.allocator import controller_config

        try:
            controller_config(cfg)
        except ValueError as exc:
            raise ConfigError(f"pool.controller: {exc}") from None


def success_note(task, configured) -> str | None:
    """One line, said at the start, of what counts as a success (held-out accuracy, SGT's shared successes, the
    warm start's stop rule) where the reward is the user's functions: a shaping penalty among them, which never
    gives full marks, must not silently decide it (issue 58). None for the task's own check alone."""
    from tasks.rewards import RewardedTask

    if not isinstance(task, RewardedTask):
        return None
    rule, said = task.success, f"reward.success = {configured!r}"
    if rule == "task":
        column = getattr(task.config, "answer", "")
        what = "the task's answer check" + (f" of the {column!r} column" if column else "")
        if "task" not in task.specs:
            what += " (it judges, pays nothing: \"task\" is no reward function here)"
    elif rule == "all":
        what = "full marks (1.0) from every reward function that judged"
    elif isinstance(rule, str):
        weight = task.weights[task.names.index(rule)]
        what = f"full marks (1.0) from {rule}" + (" (weight 0: it judges, pays nothing)" if weight == 0 else "")
    else:
        what = f"a weighted reward of at least {rule:g}"
    pays = " + ".join(f"{w:g} x {n}" for n, w in zip(task.names, task.weights) if w)
    return f"success (held-out accuracy, SGT, the warm start): {what}; reward = {pays} ({said})"


def check_memory(cfg) -> None:
    """Refuse, before any process starts, a run whose estimated peak memory exceeds what is available
    (``run.memory_limit_gib``, else this machine's now): one ConfigError with both figures and what lowers the
    peak. ``run.memory_check = false`` (``--ignore-memory-check``) skips it."""
    if not cfg.run.memory_check:
        return
    from engine.config import ConfigError
    from engine.prep.memory_estimate import estimate
    from engine.runtime.memory import GIB, gib, lower_it, read

    est = estimate(cfg, worker_options(cfg))
    limit = cfg.run.memory_limit_gib
    available = int(limit * GIB) if limit > 0 else read().available
    if est.peak <= available:
        return
    name, most = max(est.workers, key=lambda w: w[1])
    where = (f"RL: {len(est.workers)} workers, the costliest a {name} at {gib(most)}" if est.rl >= est.warm_start
             else "the warm starts")
    raise ConfigError(f"the run's estimated peak memory, {gib(est.peak)} ({where}), exceeds the {gib(available)} "
                      + ("of run.memory_limit_gib" if limit > 0 else "available on this machine")
                      + f"; lower it with {lower_it(cfg)}, or go on with --ignore-memory-check (run.memory_check = false)")


def worker_options(cfg) -> list[list[tuple[str, str, int]]]:
    """The roles each worker of this machine may hold during the run, (role, model, learner ranks of the model):
    the static split's role and any a scripted move gives it; under MWRA, which may make a learner of any worker
    but a generator per model, every role of every model (the first rank of a group carries the most)."""
    from engine.schedule.allocator import static_split

    split = static_split(cfg)
    ranks = {m: split.get(f"learner:{m}", 0) for m in cfg.names}
    if cfg.pool.allocator == "mwra":  # it keeps a generator per model (controller: min_generators)
        every = [(r, m, 1) for m in cfg.names for r in ("generator", "learner")]
        options = [[("generator", m, 1)] for m in cfg.names]
        options += [list(every) for _ in range(cfg.pool.workers - len(cfg.names))]
    else:  # workers take the split's roles in pool-key order (engine.schedule.allocator)
        options = [[(role, m, ranks[m])] for key in sorted(split) for role, m in [key.split(":", 1)]
                   for _ in range(split[key])]
        for move in cfg.pool.script:
            i = int(move.worker.lstrip("w")) if move.worker.lstrip("w").isdigit() else -1
            if move.role != "idle" and 0 <= i < len(options):
                options[i].append((move.role, move.model, max(1, ranks[move.model] + (move.role == "learner"))))
    per_node = cfg.pool.workers_per_node()  # this machine's share of a cluster: its costliest, to be safe
    return options if per_node >= len(options) else _costliest(cfg, options, per_node)


def _costliest(cfg, options, n: int):
    from engine.prep.memory_estimate import estimate

    costs = estimate(cfg, options).workers
    order = sorted(range(len(options)), key=lambda i: -costs[i][1])
    return [options[i] for i in order[:n]]


def _model_problem(cfg) -> str | None:
    """The first model whose tokenizer does not load, LoRA targets what it lacks or sglang server cannot serve
    it, as the line to print; None when every model can start."""
    from engine.config import model_spec, tokenizer_cache
    from tokenbridge import TokenizerLoadError, load_tokenizer

    for i, m in enumerate(cfg.models):
        try:
            tok = load_tokenizer(m.tokenizer, tokenizer_cache(cfg))
        except TokenizerLoadError as exc:
            return f"models.{i}.tokenizer: {exc}"
        if m.lora is not None:  # a target the model lacks: now, not in every worker after the warm start
            from policies.lora import lora_problem
            from policies.models import skeleton

            if problem := lora_problem(skeleton(model_spec(m), tok), m.lora):
                return f"models.{i}.lora: {problem}"
        if m.generation.backend == "sglang" and m.generation.sglang_url:
            if problem := _unreachable(m.generation.sglang_url) or _unservable(m.generation):
                return f"models.{i}.generation.sglang_url: {problem}"
    return None


def _unreachable(url: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing serves ``url`` (sglang's GET /health; any HTTP answer counts as a server), or None."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None  # a server answered, if not with a health route
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"nothing answers at {url} ({reason}); start the sglang server first, or leave sglang_url out"


def _unservable(generation) -> str | None:
    """Why the sglang server at ``generation.sglang_url`` cannot sample this model (its dtype), or None."""
    from policies.sglang_backend import SGLANG_VERSION, SglangError, SglangHTTP, server_problem

    try:
        return server_problem(SglangHTTP(generation.sglang_url, timeout_s=5.0).info, generation.dtype)
    except SglangError as exc:
        return f"{exc} (is it sglang {SGLANG_VERSION}?)"


def this_node():
    """This launcher's node when torchrun started one per node (``engine.cluster.node``); None on one machine.
    A launch environment that cannot make a cluster is a ClusterError saying why."""
    from engine.cluster.node import from_env

    return from_env()


def serve_node(node) -> int:
    """Node r > 0: take node 0's plan and serve its run (its own --config and --run-dir are not used)."""
    from engine.cluster import agent
    from engine.cluster.node import NODE_WAIT_S, ClusterError, share_plan

    with actor_server():
        print(f"[node{node.rank}] waiting for node 0 at {node.master_addr} (up to {NODE_WAIT_S:.0f}s)", flush=True)
        try:
            plan = share_plan(node, None, NODE_WAIT_S)
        except ClusterError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return agent.serve(node, plan)


def refuse_nodes(node) -> None:
    """Node 0 could not start the run: every other node hears so at once, instead of waiting out its time-out."""
    from engine.cluster.node import NODE_WAIT_S, ClusterError, ClusterPlan, share_plan

    if node is not None:
        try:
            share_plan(node, ClusterPlan(error="its config or run directory was refused (see node 0's output)"),
                       NODE_WAIT_S)
        except ClusterError:
            pass


@contextlib.contextmanager
def actor_server(cfg=None):
    """The actors' fork server while the block runs (``start_actor_server``), stopped however the block ends: the
    one place a run starts and stops it."""
    start_actor_server(cfg)
    try:
        yield
    finally:
        stop_actor_server()


def start_actor_server(cfg=None) -> None:
    """The actors' fork server: it loads torch and transformers, this process never does (the pre-flight's
    tokenizers load in a fork of it: ``preflight``); with ``cfg``, the run's tokenizers too, for every actor
    (``engine.runtime.preload``)."""
    from engine.runtime import actors
    from engine.runtime.preload import spec_for

    actors.start_server(None if cfg is None else spec_for(cfg))


def stop_actor_server() -> None:
    from engine.runtime import actors

    actors.stop_server()


class RunWatch(Protocol):
    """What a caller of ``train`` hears on the run's loop, as it happens (``mutual_rl``'s callbacks): each learner
    step (``step`` returns a reason to stop the run, as Ctrl-C stops it, or None) and each model's final."""

    def step(self, model: str, step: int, report) -> str | None: ...  # report: engine.runtime.plane.StepReport

    def final(self, final) -> None: ...  # engine.runtime.plane.LearnerFinal


def train(cfg, run_dir, resume: bool = False, node=None, quiet: bool = False, started=None,
          watch: RunWatch | None = None) -> int:
    """The RL phase and what follows it (final evaluations, checkpoints) on a uvloop loop; the actors' fork server
    stopped after. ``started(loop, coordinator)`` is called on the run's loop before it begins (``mutual_rl``
    forwards a notebook's interrupt through it); ``watch`` hears each step and final."""
    import uvloop

    from engine.coordinator import Coordinator

    return uvloop.run(_begun(Coordinator(cfg, run_dir, resume=resume, node=node, quiet=quiet, watch=watch), started))


async def _begun(coordinator, started) -> int:
    if started is not None:
        import asyncio

        started(asyncio.get_running_loop(), coordinator)
    return await coordinator.run()


def run_config(cfg, run_dir, quiet: bool = True):
    """One whole run in this process (benchmarks, checks), no fork server of its own: its exit code and its
    ``engine.outcome.RunResult``, if it got that far."""
    import msgspec
    import uvloop

    from engine.coordinator import Coordinator
    from engine.outcome import RunResult

    run_dir.mkdir(parents=True, exist_ok=True)
    code = uvloop.run(Coordinator(cfg, run_dir, quiet=quiet).run())
    path = run_dir / "run_result.json"
    return code, msgspec.json.decode(path.read_bytes(), type=RunResult) if path.exists() else None


# what may differ from the stopped run: the rest decides the training
RESUMABLE = ("train.steps", "run.max_minutes", "run.checkpoint_every", "run.keep_checkpoints", "run.tensorboard",
             "run.wandb", "run.report", "eval.", "timeouts.")


def resume_config(run_dir, overrides: list[str]):
    """The stopped run's config with the allowed changes (``overrides``, ``--set``'s form), before any process
    starts; a run that cannot resume is the one line that says why (a str)."""
    if not (run_dir / "config.toml").is_file():  # before the imports of torch below: a typo answers at once
        return f"{run_dir}: not a run directory (no config.toml)"
    from engine.config import ConfigError, load_run_config

    try:
        for o in overrides:
            key = o.split("=", 1)[0].strip()
            if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE):
                raise ConfigError(f"--set {key}: a resumed run keeps what it trained with; only "
                                  f"{', '.join(RESUMABLE)} may change")
        return load_run_config(str(run_dir / "config.toml"), overrides)
    except (ConfigError, OSError) as exc:
        return str(exc)


def prepare_resume(run_dir, cfg, overrides: list[str]) -> str | None:
    """The stopped run made ready to train again (the actors' fork server running): its pre-flight, its markers
    turned into a ``resumed`` record, its config rewritten with the changes. A run that cannot resume is the one
    line that says why (a str), nothing changed; None when it is ready."""
    from engine.config import ConfigError
    from exchange.records import MetricsWriter
    from engine.record.rundir import write_resolved_config
    from engine.train import checkpoint

    try:
        preflight(cfg, forked=True)
    except (ConfigError, OSError) as exc:
        return str(exc)
    steps = {m: checkpoint.read_state(p)["step"] for m in cfg.names if (p := checkpoint.latest(run_dir, m))}
    if len(steps) == len(cfg.names) and min(steps.values()) >= cfg.train.steps:
        return f"{run_dir}: every model has its {cfg.train.steps} steps; nothing to resume"
    before = {name.lower(): (run_dir / name).read_text().strip() for name in ("FAILED", "INTERRUPTED")
              if (run_dir / name).is_file()}
    MetricsWriter(run_dir, "engine").write(event="resumed", previous_end=before or "killed (no marker)")
    for name in ("FAILED", "INTERRUPTED", "run_result.json"):
        (run_dir / name).unlink(missing_ok=True)  # how it ended before is now the record above
    if overrides:
        write_resolved_config(cfg, run_dir)  # a later resume continues with these values
    print(f"resuming {run_dir}", flush=True)
    return None
