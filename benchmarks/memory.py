"""Where a run's memory goes: its peak PSS summed over every process, per process and role, and by component.

A run (by default ``configs/smollm2.toml``'s first model alone under solo GRPO, the setup of
``benchmarks.trl_compare``, for a few steps) is started as ``launch.py run`` in a subprocess, and every process of
its tree is read about once a second from ``/proc/PID/smaps``: PSS, RSS and USS (the kernel's counters psutil's
``memory_full_info`` reads), and the PSS split by what the pages are:

- ``libraries``: shared libraries' code and data (torch's and the rest: the runtime's code, shared by every process
  that maps the same files);
- ``inherited``: anonymous pages still shared copy-on-write with the fork server and its other forks (the Python
  objects of torch, transformers and the roles, imported once by the fork server): PSS counts each once over all;
- ``channel``: the weight channel's shared-memory slots (``/dev/shm/mutual-rl-*``), where a learner publishes
  weights and a generator's parameters are views of them on a CPU;
- ``checkpoint``: a checkpoint's weight files, which transformers maps rather than reads: a model's parameters
  are these pages until an optimizer step writes them (then the written pages are the process's own copy);
- ``files``: other mapped files and shared memory;
- ``private``: anonymous pages only this process holds (its USS, less private pages of files): weights, gradients,
  AdamW moments, activations, KV caches, and every page of the runtime it wrote to after its fork.

Each process's role at that moment comes from its name (actors name themselves ``mrl-w0``, ``mrl-broker``: see
``engine.runtime.actors``), the run directory's ``pids.json`` and the role records of ``metrics.jsonl``
(``allocation``, ``assign``, ``role_switch``). The JSON gives the run's peak summed PSS and its time, and per process
and per role their own peak PSS and their PSS at the run's peak, split as above.

Then the components, in fresh processes, per model of the run (a ``--model`` alone by default; ``--all-models``
runs the config's models with its objective):

- the runtime, measured: a Python that imports torch and transformers; one that imports what the fork server
  preloads for every actor; that and the run's task; a fork of such a server after one garbage collection, with and
  without ``gc.freeze()`` in the server (how much of the shared runtime a fork copies);
- the weights (parameters x 4 bytes), the gradients (as many) and AdamW's moments (the optimizer's state after a
  step), computed, the weights also measured as the resident memory they take once read;
- measured as the rise of the process's resident high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs``): the LM head and log-softmax alone at a step's completion positions (as the project
  computes them, and as one positions x vocabulary matrix); one generation unit (one prompt x ``group_size``
  samples) and one evaluation batch; one learner step of the run's shape (``prompts_per_step x group_size`` samples
  of ``max_new_tokens`` completion tokens each, through ``engine.train.step.train_share``, the learner's own code),
  with the tensors it saves for its backward pass counted by torch's saved-tensor hooks; a learner's checkpoint
  (``engine.train.checkpoint.save``).

The breakdown puts the two together: per role at the run's peak, its PSS by kind of page, and its private pages
split into the model state the role holds (computed) and the rest (measured, as what is left). The last line
printed is the JSON; docs/guides/memory.md reads it.

    python -m benchmarks.memory [--config configs/smollm2.toml] [--model NAME | --all-models] [--steps 6]
                                [--set KEY=VALUE ...] [--no-components] [--out results/memory/NAME.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import emit, git_commit
from benchmarks.memory_parts import child_main, in_child, measure_runtime
from benchmarks.smaps import EVERY_S, MIB, PARTS, RunRoles, Sample, TreeMemory
from exchange.records import read_records

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the samples, summed and attributed


def _add(into: dict[str, int], mem: dict[str, int]) -> dict[str, int]:
    for k, v in mem.items():
        into[k] = into.get(k, 0) + v
    return into


def peak_index(samples: list[Sample]) -> int:
    return max(range(len(samples)), key=lambda i: sum(r.mem["pss"] for r in samples[i].readings))


def per_process(samples: list[Sample], at: Sample) -> list[dict]:
    """Each process: its roles over the run, its own peak PSS, and its memory at the run's peak (None: not alive)."""
    procs: dict[int, dict] = {}
    for s in samples:
        for r in s.readings:
            p = procs.setdefault(r.pid, {"pid": r.pid, "actor": r.actor, "roles": [], "peak_pss": 0})
            if r.role not in p["roles"]:
                p["roles"].append(r.role)
            p["peak_pss"] = max(p["peak_pss"], r.mem["pss"])
    for r in at.readings:
        procs[r.pid].update(role_at_peak=r.role, at_peak=dict(r.mem))
    return list(procs.values())


def per_role(samples: list[Sample], at: Sample) -> dict[str, dict]:
    """Each role: its processes at the run's peak and their summed memory then; its own peak of summed PSS."""
    roles: dict[str, dict] = {}
    for s in samples:
        summed: dict[str, int] = {}
        for r in s.readings:
            summed[r.role] = summed.get(r.role, 0) + r.mem["pss"]
        for role, pss in summed.items():
            empty = dict.fromkeys(("pss", "rss", "uss", *PARTS), 0)
            entry = roles.setdefault(role, {"processes": 0, "peak_pss": 0, "at_peak": empty})
            entry["peak_pss"] = max(entry["peak_pss"], pss)
    for r in at.readings:
        roles[r.role]["processes"] += 1
        _add(roles[r.role]["at_peak"], r.mem)
    return roles


def summarise(samples: list[Sample]) -> dict:
    """The run's peak summed PSS, when, and who held it (bytes; times in seconds from the first sample)."""
    at = samples[peak_index(samples)]
    start = samples[0].t
    return {"samples": len(samples), "seconds": round(samples[-1].t - start, 1),
            "start": start, "peak_pss": sum(r.mem["pss"] for r in at.readings), "peak_t": round(at.t - start, 1),
            "peak_time": at.t, "rss_at_peak": sum(r.mem["rss"] for r in at.readings),
            "peak_summed_rss": max(sum(r.mem["rss"] for r in s.readings) for s in samples),
            "channel_files_at_peak": at.shm_bytes, "channel_files_peak": max(s.shm_bytes for s in samples),
            "roles": per_role(samples, at), "per_process": per_process(samples, at), "timeline": timeline(samples)}


def timeline(samples: list[Sample], points: int = 120) -> dict[str, list]:
    """The summed PSS over time, in all and per role (MiB, at most ``points`` samples, evenly spaced)."""
    every = max(1, -(-len(samples) // points))
    kept = samples[::every]
    roles = sorted({r.role for s in samples for r in s.readings})
    out: dict[str, list] = {"t": [round(s.t - samples[0].t) for s in kept],
                            "all": [round(sum(r.mem["pss"] for r in s.readings) / MIB) for s in kept]}
    for role in roles:
        out[role] = [round(sum(r.mem["pss"] for r in s.readings if r.role == role) / MIB) for s in kept]
    return out


def events(records: list[dict], start: float) -> list[list]:
    """When the run did what (seconds from the first sample): warm starts, learner starts, steps, finals."""
    kinds = ("warm_start", "start", "step", "final")
    return [[round(r["time"] - start, 1), f"{r.get('model')} {r['event']}" + (f" {r['step']}" if "step" in r else "")]
            for r in records if r.get("event") in kinds]


def phase_at(records: list[dict], t: float) -> str:
    """What the run was doing at unix time ``t``: its last metrics record before it."""
    before = [r for r in records if r.get("time", 0) <= t]
    if not before:
        return "before the first record (pre-flight, warm start, held-out evaluation)"
    last = before[-1]
    what = last.get("event", "?")
    step = last.get("step")
    return f"after {last.get('model')}'s {what}" + (f" (step {step})" if step is not None else "")


# ---------------------------------------------------------------- the run, and the breakdown per role


def run_tree(tree: dict, workdir: Path, run_dir: Path | None = None) -> tuple[list[Sample], list[dict], int]:
    """``launch.py run`` of ``tree`` (into ``run_dir``, kept, where one is named), read every second: its samples,
    its metrics records, its exit code."""
    import tomli_w

    config = workdir / "memory.toml"
    config.write_text(tomli_w.dumps(tree))
    run_dir = run_dir or workdir / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "run", "--config", str(config), "--run-dir",
                             str(run_dir)], cwd=ROOT, stdout=sys.stderr, stderr=sys.stderr)
    tracker = TreeMemory(proc.pid, RunRoles(run_dir, proc.pid, [m["name"] for m in tree["models"]]))
    code = proc.wait()
    samples = tracker.stop()
    return samples, read_records(run_dir).records, code


def held_components(role: str, parts: dict, checkpoint: float) -> dict[str, float]:
    """The model state a role holds in its private pages, in bytes, computed (``parts``: the components child's;
    ``checkpoint``: the process's PSS of mapped checkpoint files). A learner rank: gradients, AdamW's moments, and
    its weights where they are not the checkpoint's mapped pages; a warm start or held-out evaluation: its weights,
    likewise. A generator's weights are views of the channel's slots on a CPU (``engine.weights.channel``)."""
    kind, _, rest = role.partition(":")
    model = parts["models"].get(rest.split(" ")[0])
    if model is None or kind not in ("learner", "prep"):
        return {}
    w = model["weights"]["bytes"]
    own = {"weights": max(0.0, w - checkpoint)}
    if kind == "learner":
        own.update(gradients=w, adamw=model["learner_step"]["optimizer_state_bytes"])
    return own


def breakdown(roles: dict[str, dict], parts: dict) -> dict[str, dict[str, float]]:
    """Per role, per process at the run's peak (MiB): its PSS by kind of page, and its private pages split into the
    model state it holds (computed) and the rest (activations, KV caches, heap, runtime pages written after the
    fork: measured as what is left)."""
    out = {}
    for role, r in roles.items():
        n = r["processes"]
        if not n:
            continue
        each = {k: v / n for k, v in r["at_peak"].items()}
        state = held_components(role, parts, each["checkpoint"])
        row = {"pss": each["pss"], **{k: each[k] for k in PARTS if k != "private"}, "private": each["private"],
               **state, "private_rest": each["private"] - sum(state.values())}
        out[role] = {"processes": n, **{k: round(v / MIB, 1) for k, v in row.items()}}
    return out


def by_component(rows: dict[str, dict]) -> dict[str, float]:
    """The run's peak PSS by component (MiB), over every process: each breakdown column summed, the private rest
    by kind of role (learner, generator, the rest). Adds up to the peak."""
    out: dict[str, float] = {}
    for role, row in rows.items():
        kind = role.split(":")[0] if role.startswith(("learner:", "generator:", "prep:")) else "other"
        for key, value in row.items():
            if key not in ("processes", "pss", "private"):
                name = f"private_rest_{kind}" if key == "private_rest" else key
                out[name] = out.get(name, 0.0) + value * row["processes"]
    return {k: round(v, 1) for k, v in out.items()}


COUNTS = {"pid", "processes", "params", "prompts", "samples", "max_new_tokens", "completion_tokens", "vocab",
          "positions"}


def mib(value, key: str = ""):
    """Every byte count (an int not named in COUNTS) in MiB, recursively: the JSON's unit."""
    if isinstance(value, dict):
        return {k: mib(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [mib(v, key) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and key not in COUNTS:
        return round(value / MIB, 1)
    return value


HOW = {"runtime": "measured: fresh Pythons, their smaps",
       "weights": "computed: parameters x 4 bytes (engine.roles.memory.held_bytes); rss_rise: measured",
       "gradients": "computed: as many bytes as the weights (a full fine-tune)",
       "adamw": "computed: the optimizer state's tensors after a step (two moments and a step count per parameter)",
       "learner_step": "measured: VmHWM rise over one step of train_share (the second: gradients and moments "
                       "exist); saved_*: saved-tensor hooks; checkpoint_save_peak_rise: over "
                       "engine.train.checkpoint.save",
       "logits": "measured: VmHWM rise over the LM head and log-softmax alone at the step's completion positions, "
                 "forward and backward: the project's head_logprobs, and one (positions x vocabulary) matrix",
       "generation": "measured: VmHWM rise over one unit and over one eval batch; kv_cache_at_cap: computed",
       "breakdown": "per process of each role at the run's peak: PSS by kind of page, measured (smaps); its private "
                    "pages split into the model state the role holds (computed) and the rest (measured remainder)"}


def model_components(parts: dict) -> dict:
    out = {}
    for name, p in parts["models"].items():
        out[name] = {**p, "gradients": {"bytes": p["weights"]["bytes"]},
                     "adamw": {"bytes": p["learner_step"]["optimizer_state_bytes"]}}
    return out


def report(tree: dict, config: str, overrides: list[str], summary: dict, records: list[dict], runtime: dict | None,
           parts: dict | None) -> dict:
    t = tree["train"]
    gib = lambda b: round(b / 2**30, 3)  # noqa: E731
    return {"benchmark": "memory", "commit": git_commit(), "config": config, "set": overrides,
            "models": [m["name"] for m in tree["models"]], "objective": tree.get("objective", {}).get("kind"),
            "workers": tree.get("pool", {}).get("workers"), "steps": t.get("steps"),
            "shape": {k: t.get(k) for k in ("prompts_per_step", "group_size", "max_new_tokens")},
            "cores": os.cpu_count(), "interval_s": EVERY_S, "samples": summary["samples"],
            "seconds": summary["seconds"],
            "peak_pss_gib": gib(summary["peak_pss"]), "peak_t_s": summary["peak_t"],
            "peak_phase": phase_at(records, summary["peak_time"]), "rss_at_peak_gib": gib(summary["rss_at_peak"]),
            "peak_summed_rss_gib": gib(summary["peak_summed_rss"]), "units": "MiB unless named otherwise",
            "channel_files_at_peak": mib(summary["channel_files_at_peak"]),
            "channel_files_peak": mib(summary["channel_files_peak"]),
            "peak_pss_mib": mib(summary["peak_pss"]), "roles": mib(summary["roles"]),
            "per_process": mib(summary["per_process"]), **components(summary, runtime, parts),
            "timeline_mib": summary["timeline"], "events": events(records, summary["start"])}


def components(summary: dict, runtime: dict | None, parts: dict | None) -> dict:
    """The components and the breakdown by role (none with ``--no-components``)."""
    if parts is None:
        return {}
    rows = breakdown(summary["roles"], parts)
    return {"breakdown": rows, "at_peak_by_component": by_component(rows),
            "components": {"how": HOW, "runtime": mib({**runtime, "components_child": parts["runtime_before_models"]}),
                           "models": mib(model_components(parts))}}


def setup(args) -> dict:
    """The run's config tree: the config's model alone under solo GRPO for ``--steps`` steps (trl_compare's), or with
    ``--all-models`` every model under the config's objective; a held-out evaluation of one batch either way (its
    shape is the full evaluation's; its length is not)."""
    import tomllib

    from benchmarks.trl_compare import solo_tree

    batch = tomllib.loads(args.config.read_text()).get("eval", {}).get("batch_size", 100)
    overrides = [f"eval.num_problems={batch}", *args.set]  # the user's --set comes last: it wins
    if args.as_configured:  # the config as a user runs it: its steps, its minutes, its evaluations
        from engine.config.load import apply_override, parse_override

        tree = tomllib.loads(args.config.read_text())
        for text in args.set:
            apply_override(tree, *parse_override(text), text)
        return tree
    if args.all_models:
        return _whole_tree(args.config, args.steps, overrides)
    return solo_tree(args.config, 0, None, args.steps, overrides, args.model)


def _whole_tree(config: Path, steps: int, overrides: list[str]) -> dict:
    import tomllib

    from engine.config.load import apply_override, parse_override

    tree = tomllib.loads(config.read_text())
    for text in overrides:
        apply_override(tree, *parse_override(text), text)
    tree.setdefault("run", {}).update(report=False, tensorboard=False, max_minutes=24 * 60.0)
    tree.setdefault("eval", {})["every_steps"] = 0
    tree.setdefault("train", {})["steps"] = steps
    return tree


def measure(tree: dict, components: bool, run_dir: Path | None = None) -> tuple[list[Sample], list[dict], dict | None,
                                                                            dict | None]:
    """The run (kept in ``run_dir`` where one is named), read as it goes, then (``components``) the components in
    fresh processes."""
    with tempfile.TemporaryDirectory(prefix="memory-") as tmp:
        samples, records, code = run_tree(tree, Path(tmp), run_dir)
        if code != 0 or not samples:
            raise SystemExit(f"memory: the run failed (exit code {code}); its output is above")
        if not components:
            return samples, records, None, None
        print("memory: the run is done; measuring the components in fresh processes ...", file=sys.stderr, flush=True)
        config = Path(tmp) / "memory.toml"
        return samples, records, measure_runtime(config), in_child("components", str(config))



def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2.toml")
    ap.add_argument("--model", help="the config's model to run alone (default: its first)")
    ap.add_argument("--all-models", action="store_true", help="every model of the config, with its objective")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    ap.add_argument("--as-configured", action="store_true",
                    help="the config as it is, every model, its steps, minutes and evaluations (with --set)")
    ap.add_argument("--run-dir", type=Path, help="keep the run there (it must not exist yet)")
    ap.add_argument("--no-components", action="store_true", help="the run's processes only (a quick check)")
    ap.add_argument("--out", type=Path, help="also write the JSON here (results/memory/NAME.json)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        return child_main(*args.child)
    from engine.config import ConfigError

    try:
        tree = setup(args)
        if args.run_dir is not None and args.run_dir.exists():
            raise ConfigError(f"--run-dir {args.run_dir}: already exists; name a new directory")
    except (ConfigError, OSError) as exc:
        print(f"memory: {exc}", file=sys.stderr)
        return 2
    samples, records, runtime, parts = measure(tree, not args.no_components,
                                               args.run_dir.resolve() if args.run_dir else None)
    config = args.config.resolve()
    shown = str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config)
    result = report(tree, shown, args.set, summarise(samples), records, runtime, parts)
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
