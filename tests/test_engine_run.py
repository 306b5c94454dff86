"""The whole engine, for real: `launch.py run` on the smoke config, as a user runs it.

Real processes (broker, four workers), real sockets, real tokenizers, real tiny models.
The warm starts are cached for the session, so only the first run pays for them.
"""

from __future__ import annotations

import collections
import glob
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from enginerun import ROOT, Run

from engine.record.rundir import disk_usage
from exchange.log import ExperienceLogReader
from monitor.rundata import ReportError, read_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, engine_cache) -> tuple[Run, int]:
    run = Run(tmp_path_factory.mktemp("smoke") / "run", engine_cache)
    return run, run.finish(timeout=1800)  # the session's first run makes the warm starts


def test_smoke_run_completes_and_writes_its_run_dir(smoke_run):
    run, code = smoke_run
    assert code == 0, run.out[-3000:]
    assert "mutual RL summary" in run.out and "lost 0, duplicated 0" in run.out
    assert not re.search(r"training (solo|with .*) from step 13\b", run.out)  # 12 steps: no 13th, solo or not
    assert (run.run_dir / "config.toml").exists() and not (run.run_dir / "FAILED").exists()
    assert not (run.run_dir / "INTERRUPTED").exists()
    assert "report: " not in run.out and not (run.run_dir / "report.md").exists()  # run.report=false (enginerun.Run)
    finals = {r["model"]: r for r in run.events("final")}
    assert set(finals) == {"gpt2", "llama"}
    for final in finals.values():
        assert final["step"] == 12 and not final["stopped_early"]
        assert 0.0 <= final["accuracy"] <= 1.0 and final["eval_n"] == 18  # every held-out question of smoke.toml
        assert (Path(final["checkpoint"]) / "model.safetensors").exists()
    result = run.result()
    assert result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0 and result["audit"]["logged"] > 0
    assert f"run dir: {run.run_dir}\n  the run writes there: metrics, the experience log and checkpoints" in run.out
    size = re.search(rf"run dir: {re.escape(str(run.run_dir))}: ([\d.]+) MB on disk \(checkpoints ([\d.]+) MB\)",
                     run.out)
    assert size and 0 < float(size[2]) <= float(size[1]), run.out[-3000:]
    assert abs(float(size[1]) - disk_usage(run.run_dir) / 1e6) < 0.5  # said after the last write
    assert run.leftover() == []  # no orphan processes ...
    own = [d for d in glob.glob(f"/dev/shm/mutual-rl-{run.run_dir.name}-*")  # this run's (other runs on the host
           if Path(d, "owner.pid").is_file() and Path(d, "owner.pid").read_text() == str(run.proc.pid)]  # may live)
    assert not own  # ... and no shared-memory slots


def test_the_launcher_says_how_each_warm_start_ended_and_each_final_evaluation(smoke_run):
    """On screen and in metrics.jsonl: stop_accuracy met or the cap (here from the session's cache), and a final
    evaluation shorter than its progress lines' 5 s still says its result."""
    run, code = smoke_run
    assert code == 0
    starts = {r["model"]: r for r in run.events("start")}
    for model in ("gpt2", "llama"):
        (record,) = run.events("warm_start", model)
        ended = record["ended"]
        assert re.fullmatch(r"loaded from cache \(it (reached stop_accuracy 0\.2 at step \d+|ran to its step cap 600) "
                            r"with train accuracy .*\)", ended), ended
        assert f"warm start {model}: {ended}\n" in run.out
        assert record["accuracy"] == starts[model]["warm_accuracy"] and record["eval_n"] == 18
        final = run.events("final", model)[-1]
        assert f"eval {model} final (held-out): 18/18 problems, accuracy {final['accuracy']:.3f}, " in run.out


def test_peer_experience_flows_through_the_thl(smoke_run):
    run, code = smoke_run
    assert code == 0
    required = {"time", "model", "step", "weight_version", "reward_mean", "own_experiences", "peer_experiences",
                "staleness_mean", "thl_residual_mean", "obj/rescue_set_size", "solo", "peers_gone"}
    for model in ("gpt2", "llama"):
        steps = run.steps(model)
        assert len(steps) == 12
        assert required <= set(steps[-1])
        assert steps[-1]["peer_experiences"] > 0 and not any(s["solo"] for s in steps)
        residuals = [s["thl_residual_mean"] for s in steps if s["thl_residual_mean"] is not None]
        assert residuals and all(0.0 <= r <= 1.0 for r in residuals)
        versions = [s["weight_version"] for s in steps]
        assert versions == list(range(1, 13))


def test_completions_cut_at_max_new_tokens_are_counted_shown_and_warned_about(smoke_run):
    """Each step record says the share of its own samples cut at train.max_new_tokens, the warm start's and the
    final evaluation say theirs; run_result.json and the final table carry them, and a share past a fifth (over
    the last 10 steps, or in an evaluation) is one warning line and one truncation record per model and kind."""
    run, code = smoke_run
    assert code == 0
    result, warned = run.result()["truncated"], {(r["model"], r["kind"]) for r in run.events("truncation")}
    for model in ("gpt2", "llama"):
        fracs = [s["truncated_frac"] for s in run.steps(model)]
        assert len(fracs) == 12 and all(0.0 <= f <= 1.0 for f in fracs)
        (warm,) = run.events("warm_start", model)
        final = run.events("final", model)[-1]
        assert 0.0 <= warm["truncated"] <= 1.0 and 0.0 <= final["truncated"] <= 1.0  # this session's eval cache
        assert result[model] == {"before": warm["truncated"], "after": final["truncated"],
                                 "train": pytest.approx(sum(fracs[-10:]) / 10)}
        windows = [sum(fracs[i - 10:i]) / 10 for i in range(10, 13)]
        assert ((model, "train") in warned) == (max(windows) > 0.2)
        assert ((model, "eval") in warned) == (max(warm["truncated"], final["truncated"]) > 0.2)
        assert (f"warning: {model}: " in run.out) == any(m == model for m, _ in warned)
    assert "cut (eval)" in run.out and "cut (train)" in run.out
    assert "cut: no EOS by max_new_tokens (eval before → after RL: train.max_new_tokens=6; train, last 10 steps: " \
           "train.max_new_tokens=6)" in run.out


def test_experience_log_holds_every_experience_exactly_once(smoke_run):
    run, code = smoke_run
    assert code == 0
    ids = collections.Counter(e.experience_id for e in ExperienceLogReader(run.run_dir / "experience_log"))
    assert ids and max(ids.values()) == 1
    per_model = collections.Counter(i.split("/")[0] for i in ids)
    assert per_model["gpt2"] >= 12 * 64 and per_model["llama"] >= 12 * 64


def _mean_logprob(checkpoint: str, experiences) -> float:
    from policies.logprobs import completion_logprobs, pack
    from policies.models import load_policy

    model = load_policy(checkpoint).eval()
    pad = int(model.config.pad_token_id or 0)
    packed = pack([e.prompt_array for e in experiences], [e.completion_array for e in experiences], pad)
    with torch.no_grad():
        logp = completion_logprobs(model, packed)
    return float((logp.sum(1) / packed.comp_mask.sum(1)).mean())


def test_learning_moves_in_the_rewards_direction(smoke_run):
    """Verified-correct samples became more likely, against the wrong ones, than under the warm start.

    The smoke warm start trains until the model solves at least a fifth of its training problems
    (warmstart.stop_accuracy), so every machine has plenty of successes to judge by. The comparison is
    relative: in 12 steps the peer's successes (SGT) move every sample of a weak model's own, and a run
    of 2026-12-03 saw gpt2's correct samples fall 0.016 nats on their own while its wrong ones fell
    0.19; what the reward decides is which of the two gains on the other (a flipped advantage fails).
    """
    run, code = smoke_run
    assert code == 0
    finals = {r["model"]: r for r in run.events("final")}
    log = list(ExperienceLogReader(run.run_dir / "experience_log"))
    for model, final in finals.items():
        correct = [e for e in log if e.model == model and e.verified]
        wrong = [e for e in log if e.model == model and not e.verified]
        assert len(correct) >= 30, f"{model}: {len(correct)} verified samples; the warm start should give more"
        assert len(wrong) >= 30, f"{model}: {len(wrong)} wrong samples; the smoke task should not be solved yet"
        gain = {name: _mean_logprob(final["checkpoint"], samples) - _mean_logprob(final["warm_checkpoint"], samples)
                for name, samples in (("correct", correct), ("wrong", wrong))}
        assert gain["correct"] > gain["wrong"], f"{model}: mean log-prob change of its samples {gain}"


def test_a_signal_in_the_rl_phase_stops_with_checkpoints_and_an_honest_run_dir(tmp_path, engine_cache):
    """Ctrl-C (SIGTERM takes the same path, with exit code 143: tests/test_resume.py stops a run with it)."""
    sig, code = signal.SIGINT, 130
    run = Run(tmp_path / "run", engine_cache, "train.steps=1000")
    run.wait_steps(4)
    run.signal(sig)
    assert run.finish() == code, run.out[-3000:]
    finals = {r["model"]: r for r in run.events("final")}
    assert set(finals) == {"gpt2", "llama"} and all(f["stopped_early"] for f in finals.values())
    for final in finals.values():  # the printed summary has what metrics.jsonl has
        assert f"{final['accuracy'] * 100:.1f}% ±" in run.out and str(final["peer_used"]) in run.out
    interrupted = (run.run_dir / "INTERRUPTED").read_text()
    assert signal.Signals(sig).name in interrupted and "during the run" in interrupted and "gpt2 at step" in interrupted
    assert not (run.run_dir / "FAILED").exists()
    result = run.result()  # run_result.json counts what metrics.jsonl shows trained, steps finished while stopping too
    trained = [{p for s in run.steps(model) for p in s["prompts"]} for model in ("gpt2", "llama")]
    assert result["trained_prompts"] == len(trained[0] & trained[1]) > 0
    assert result["steps"] == {model: run.steps(model)[-1]["step"] for model in ("gpt2", "llama")}
    assert result["useful_prompts"] <= result["trained_prompts"]
    assert f"[run] {result['trained_prompts']} prompts trained by every model" in run.out
    if result["useful_prompts"] < result["trained_prompts"]:
        assert f"{result['useful_prompts']} of them in the " in run.out
    assert run.leftover() == []


def test_ctrl_c_during_the_warm_start_stops_at_once(tmp_path):
    run = Run(tmp_path / "run", tmp_path / "fresh-cache")  # nothing cached: the warm start runs
    run.wait_for(lambda: "warm start + held-out eval" in run.out, "the warm start")
    run.wait_for(lambda: len(run.seen) >= 2, "the warm-start processes")
    run.signal(signal.SIGINT)
    assert run.finish(timeout=60) == 130, run.out[-3000:]
    assert "during the warm start" in (run.run_dir / "INTERRUPTED").read_text()
    assert "Traceback" not in run.out
    assert run.leftover() == []
    # the directory the launcher named is a run's, one that ended before RL: monitor and report say so
    out = subprocess.run([sys.executable, str(ROOT / "launch.py"), "monitor", str(run.run_dir), "--once"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    said = "this run ended before RL began (stopped by SIGINT during the warm start); nothing to show"
    assert out.returncode == 2 and out.stderr.strip() == f"error: {run.run_dir}: {said}", out
    with pytest.raises(ReportError, match="this run ended before RL began"):
        read_run(run.run_dir)


def test_a_pause_of_the_whole_machine_is_not_silence(tmp_path, engine_cache):
    """A suspended laptop or a paused VM stops every process at once: on waking, no model is presumed gone."""
    # steps of the smoke run come under a second apart here, a few seconds with the suite's other workers running
    # beside it: 10 s of silence is a pause, on a slower machine too
    run = Run(tmp_path / "run", engine_cache, "timeouts.peer_silent_s=10")
    run.wait_steps(2, "gpt2")
    run.signal(signal.SIGSTOP)  # the whole run, as a suspend stops it
    time.sleep(20)  # the pause itself is the stimulus: well past peer_silent_s
    run.signal(signal.SIGCONT)
    assert run.finish() == 0, run.out[-3000:]
    assert run.events("paused") and run.events("paused")[0]["seconds"] >= 4, run.events("paused")
    assert "did not run for" in run.out
    silent = [e for e in run.events("peer_gone") if not e["reason"].startswith("finished")]  # a peer done with its
    assert not silent and "presumed gone" not in run.out, run.out[-3000:]  # steps first is gone, but not for silence
    assert run.result()["steps"] == {"gpt2": 12, "llama": 12}


def _kill_a_gpt2_learner_rank(tmp_path, cache, worker: str, *sets: str) -> Run:
    """A run where gpt2's learner group is w2 (leader) and w3 (rank 1); ``worker`` is SIGKILLed at step 2."""
    run = Run(tmp_path / "run", cache, "pool.workers=5", "train.steps=16", *sets,
              "pool.split={'generator:gpt2' = 1, 'generator:llama' = 1, 'learner:gpt2' = 2, 'learner:llama' = 1}")
    run.wait_steps(2, "gpt2")
    run.kill_worker(worker)
    assert run.finish() == 0, run.out[-3000:]
    return run


def test_a_dead_learner_rank_leaves_its_group_which_re_forms(tmp_path, engine_cache):
    run = _kill_a_gpt2_learner_rank(tmp_path, engine_cache, "w3")
    assert "[run] w3 (learner of gpt2) exited with code -9: its group re-forms with w2" in run.out
    result = run.result()
    gpt2 = [f for f in result["formations"] if f["model"] == "gpt2"]
    assert sorted(gpt2[0]["digests"]) == ["w2", "w3"]
    assert "w2" in gpt2[1]["digests"] and "w3" not in gpt2[1]["digests"]  # a fresh worker may join it (forks start fast)
    assert all(len(set(f["digests"].values())) == 1 for f in result["formations"])  # every rank: rank 0's state
    assert result["steps"]["gpt2"] == 16 and result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0
    assert run.leftover() == []


def test_a_dead_leader_hands_its_group_to_a_survivor_which_refills_its_inbox_from_the_log(tmp_path, engine_cache):
    """Over pair groups (``pool.weights=broadcast``, the default where every worker has a GPU): the generator's ask
    of the dead leader fails and it asks the new one. The same death on the channel, a slot its writer left torn,
    is test_engine_weights.py's test_a_slot_torn_by_a_dead_writer_is_never_loaded; a run's death of a learner
    rank on the channel is test_a_dead_learner_rank_leaves_its_group_which_re_forms."""
    run = _kill_a_gpt2_learner_rank(tmp_path, engine_cache, "w2", "pool.weights=broadcast")
    assert "[run] w2 (learner of gpt2) exited with code -9: its group re-forms with w3, whose new leader takes" in run.out
    result = run.result()
    assert result["steps"]["gpt2"] == 16 and result["audit"]["lost"] == 0 and result["audit"]["duplicates"] == 0
    taken = run.events("take_over", "gpt2")
    # step 2's record is written just before its StepDone is sent: the kill may beat that message, not step 1's
    assert len(taken) == 1 and taken[0]["trained"] >= 8 and taken[0]["replayed"] > 0, taken
    gpt2 = [f for f in result["formations"] if f["model"] == "gpt2"]
    assert all(len(set(f["digests"].values())) == 1 for f in gpt2)
    # the generator goes on with the new leader's versions, over the new leader's pair groups
    versions = {e.weight_version for e in ExperienceLogReader(run.run_dir / "experience_log") if e.model == "gpt2"}
    assert max(versions) > taken[0]["step"], sorted(versions)
    assert run.leftover() == []


def test_a_model_whose_last_learner_dies_leaves_and_its_peer_trains_solo(tmp_path, engine_cache):
    """Its SIGKILL counts as one while memory was short (run.memory_short_gib past any machine's): it is named a
    likely out-of-memory kill. The run starts past a memory limit it would be refused for, as
    --ignore-memory-check lets it (tests/test_memory_guard.py: the refusal; a SIGKILL with memory to spare is
    said by its exit code: test_a_dead_learner_rank_leaves_its_group_which_re_forms)."""
    run = Run(tmp_path / "run", engine_cache, "train.steps=20", "run.checkpoint_every=0",  # nothing to restart from
              "run.memory_limit_gib=0.5", "run.memory_short_gib=100000", flags=("--ignore-memory-check",))
    run.wait_steps(2, "llama")
    run.kill_worker("w3")  # llama's only learner rank
    assert run.finish() == 1, run.out[-3000:]  # the run could not train every model: it says so ...
    assert "llama leaves the run" in run.out and "gpt2 trains without it" in run.out
    oom = "w3 (learner of llama) was killed by SIGKILL while memory was short ("
    assert f"[run] {oom}" in run.out and "likely the kernel's out-of-memory killer" in run.out, run.out[-3000:]
    assert "llama left the run" in (run.run_dir / "FAILED").read_text()
    assert "out-of-memory killer" in (run.run_dir / "FAILED").read_text()
    lost = run.events("worker_lost")
    assert [(e["worker"], e["role"], e["gen_model"], e["cause"]) for e in lost] == [("w3", "learner", "llama", "oom")]
    assert "memory_check = false" in (run.run_dir / "config.toml").read_text()
    finals = {r["model"]: r for r in run.events("final")}
    assert finals["gpt2"]["step"] == 20 and not finals["gpt2"]["stopped_early"]  # ... but its peer went on
    gone = run.events("peer_gone", "gpt2")
    assert len(gone) == 1 and gone[0]["peer"] == "llama" and "w3" in gone[0]["reason"]
    assert "[gpt2] peer llama sends no more experience" in run.out
    after = [s for s in run.steps("gpt2") if s["step"] > gone[0]["step"]]
    assert after and all(s["solo"] and s["peers_gone"] == ["llama"] for s in after)
    assert all(s["peer_wait_s"] < 1.0 for s in after)  # no waiting for a peer that is gone
    assert run.leftover() == []


def test_death_of_the_broker_past_its_restarts_stops_the_run_with_one_error(tmp_path, engine_cache):
    run = Run(tmp_path / "run", engine_cache, "train.steps=1000", "pool.max_broker_restarts=0")
    run.wait_steps(2)
    run.kill_worker("broker")
    assert run.finish() == 1, run.out[-3000:]
    assert "error: the broker exited with code -9 while the run was going" in run.out
    assert "Traceback" not in run.out and (run.run_dir / "FAILED").exists()
    assert run.leftover() == []


FLAKY_TASK = '''
from tasks.arithmetic import ArithmeticConfig, ArithmeticTask


class Flaky(ArithmeticTask):
    """The smoke config's arithmetic, with a reward function that breaks on some answers."""

    def verify(self, problem, completion_text):
        if problem.answer.endswith(BREAKS_ON):
            return {}["no reward for " + problem.answer]
        return super().verify(problem, completion_text)


def make():
    return Flaky(ArithmeticConfig(min_digits=1, max_digits=1, ops=["+"], eval_fraction=0.2))
'''


@pytest.mark.parametrize("breaks_on, mode", [("3", "stop"), ("3", "zero"), ("", "stop")])
def test_a_reward_function_that_raises_is_named_once_and_stops_or_scores_zero(tmp_path, breaks_on, mode):
    """A user's Python task whose verify raises (on answers ending in 3, never in the smoke's held-out problems;
    or always, so first in the warm start's evaluation): train.reward_errors = "stop" ends the run with one line
    naming the exception, its file and line and the problem, no traceback; "zero" trains to the end with those
    completions scored 0 and counted."""
    import tomli_w
    import tomllib

    (tmp_path / "flaky_task.py").write_text(f"BREAKS_ON = {breaks_on!r}\n{FLAKY_TASK}")
    tree = tomllib.loads((ROOT / "configs/smoke.toml").read_text())
    tree["task"] = {"kind": "python", "factory": "flaky_task:make"}
    (tmp_path / "flaky.toml").write_text(tomli_w.dumps(tree))
    run = Run(tmp_path / "run", tmp_path / "cache", "warmstart.steps=0", "train.steps=4",
              f"train.reward_errors='{mode}'", config=str(tmp_path / "flaky.toml"), env={"PYTHONPATH": str(tmp_path)})
    code = run.finish()
    said = re.findall(r"the task's verifier raised KeyError: 'no reward for \d*3?' at (\S+):(\d+) \(in verify\), "
                      r"judging problem \d+", run.out)
    assert "Traceback" not in run.out and len(said) == 1, run.out[-3000:]
    assert said[0] == (str(tmp_path / "flaky_task.py"), "11")  # the line of its raise
    if mode == "zero":
        assert code == 0 and run.result()["steps"] == {"gpt2": 4, "llama": 4}, run.out[-3000:]
        assert sum(r["completions"] for r in run.events("reward_error")) > 0
        assert run.result()["audit"]["lost"] == 0
    else:
        assert code == 1 and "error: " in run.out and (run.run_dir / "FAILED").exists(), run.out[-3000:]
        assert ("the warm start of gpt2 stopped: " in run.out) == (breaks_on == "")
        assert run.leftover() == []
