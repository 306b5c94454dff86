"""A learner's inbox: own groups complete per prompt, peer samples bridged on arrival, incomplete peer
groups counted as misses, late samples counted and dropped, a regenerated unit taken once.
Real tokenizers, real THL, real Experiences."""

from __future__ import annotations

import pytest

from engine.train.ingest import Ingest
from exchange.protocol import SCHEMA_VERSION, Experience, pack_floats, pack_ids
from policies.models import ModelSpec
from tasks.registry import ArithmeticConfig, CountdownConfig, make_task
from tokenbridge import load_tokenizer

G = 2


@pytest.fixture(scope="module")
def ingest(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("tok"))
    own_tok, peer_tok = load_tokenizer("gpt2", cache), load_tokenizer("mistral", cache)
    spec = ModelSpec(name="gpt2", arch="gpt2", tokenizer="gpt2")
    task = make_task(ArithmeticConfig(min_digits=1, max_digits=2, ops=["+"]))
    return Ingest(spec, own_tok, {"llama": peer_tok}, task, G), own_tok, peer_tok


def _exp(model: str, tok, prompt: int, k: int, maker: str = "g", reward: float = 1.0,
         finish: str = "stop") -> Experience:
    ids = tok.encode("12", add_special_tokens=False)
    return Experience(schema=SCHEMA_VERSION, run_id="t", experience_id=f"{model}/{prompt}/{k}/{maker}", model=model,
                      task="arithmetic", prompt_id=prompt, sample_index=k, group_size=G, weight_version=0,
                      prompt_ids=pack_ids([1, 2]), completion_ids=pack_ids(ids),
                      behaviour_logprobs=pack_floats([-1.0] * len(ids)), completion_text="12", reward=reward,
                      verified=True, finish_reason=finish, created_at=0.0, generated_at=0.0)


def test_an_incomplete_peer_group_is_a_miss_and_a_straggler_is_late(ingest):
    inbox, own_tok, peer_tok = ingest
    for p in (0, 1):
        for k in range(G):
            inbox.add(_exp("gpt2", own_tok, p, k))
    for k in range(G):  # the peer completed prompt 0 only; one sample of prompt 1 arrived
        inbox.add(_exp("llama", peer_tok, 0, k))
    inbox.add(_exp("llama", peer_tok, 1, 0))
    prompts = inbox.next_own_groups(2)
    assert prompts == [0, 1]
    assert inbox.peers_complete([0], ["llama"]) and not inbox.peers_complete(prompts, ["llama"])
    own, peers, misses = inbox.take(prompts, ["llama"])  # a step goes ahead with what arrived
    assert len(own) == 2 * G and len(peers) == G + 1
    assert misses == 1
    inbox.add(_exp("llama", peer_tok, 1, 1))  # the straggler is counted late, never trained on
    assert inbox.late == 1


def test_own_samples_cut_at_max_new_tokens_are_counted_per_step(ingest):
    """The learner's truncated_frac: own samples that finished on "length", of the prompts a step takes (a peer's
    are the peer's own figure), counted again from zero for the next step."""
    inbox, own_tok, peer_tok = ingest
    for k in range(G):
        inbox.add(_exp("gpt2", own_tok, 40, k, finish="length"))
        inbox.add(_exp("gpt2", own_tok, 41, k, finish="length" if k == 0 else "stop"))
        inbox.add(_exp("llama", peer_tok, 40, k, finish="length"))
    assert inbox.cut_in([40, 41]) == G + 1 and inbox.cut_in([41]) == 1
    inbox.take([40, 41], ["llama"])
    assert inbox.cut_in([40, 41]) == 0


def test_complete_peers_do_not_wait(ingest):
    inbox, own_tok, peer_tok = ingest
    for k in range(G):
        inbox.add(_exp("gpt2", own_tok, 5, k))
        inbox.add(_exp("llama", peer_tok, 5, k))
    assert inbox.peers_complete([5], ["llama"])
    assert inbox.take([5], ["llama"])[2] == 0


def test_a_regenerated_unit_keeps_the_first_copy_of_each_sample(ingest):
    """A generator died after publishing sample 0 of prompt 9; another regenerates the whole unit.
    The group holds G samples, one per index, the first copy of each (own and peer alike)."""
    inbox, own_tok, peer_tok = ingest
    inbox.add(_exp("gpt2", own_tok, 9, 0, maker="dead", reward=1.0))
    inbox.add(_exp("llama", peer_tok, 9, 0, maker="dead", reward=1.0))
    for k in range(G):
        inbox.add(_exp("gpt2", own_tok, 9, k, maker="new", reward=0.0))
        inbox.add(_exp("llama", peer_tok, 9, k, maker="new", reward=0.0))
    assert list(inbox.complete).count(9) == 1
    own, peers, misses = inbox.take([9], ["llama"])
    assert [s.reward for s in own] == [1.0, 0.0] and [p.reward for p in peers] == [1.0, 0.0] and misses == 0


def test_a_batch_of_peer_completions_crosses_the_thl_together_and_one_bad_one_costs_nothing(ingest):
    inbox, own_tok, peer_tok = ingest
    good = [_exp("llama", peer_tok, 20, k) for k in range(G)]
    bad = _exp("llama", peer_tok, 21, 0)
    bad.completion_ids = pack_ids([peer_tok.bos_token_id, 29896])  # a special token inside: the THL refuses it
    failures = inbox.failures
    inbox.add_many([*good, bad])
    assert inbox.failures == failures + 1
    bridged = inbox.peers[20]
    one_by_one = [inbox.bridges["llama"](e.completion_array, logprobs=e.logprob_array) for e in good]
    assert [list(p.completion_ids) for p in bridged] == [list(b.dst_ids) for b in one_by_one]
    assert [list(p.behaviour_logprobs) for p in bridged] == [list(b.dst_logprobs) for b in one_by_one]
    assert inbox.peers_complete([20], ["llama"])


@pytest.mark.parametrize("task_config", [ArithmeticConfig(min_digits=1, max_digits=2, ops=["+"]),
                                         CountdownConfig(n_numbers=3, max_number=9, max_target=30)])
def test_reference_samples_are_the_tasks_verified_solution_in_our_tokens(tmp_path, task_config):
    """The answer-key control (sgt_ref) reads these in the peer slots: each must verify, in the receiver's tokens."""
    tok = load_tokenizer("mistral", str(tmp_path))
    task = make_task(task_config)
    inbox = Ingest(ModelSpec(name="llama", arch="llama", tokenizer="mistral"), tok, {}, task, G)
    refs = inbox.reference_samples([3, 7, 11])
    assert [r.prompt_id for r in refs] == [3, 7, 11]
    for r in refs:
        assert r.verified and r.reward == 1.0 and r.residual == 0.0 and r.model == "reference"
        assert r.completion_ids[-1] == tok.eos_token_id and len(r.align) == len(r.completion_ids)
        text = tok.decode(r.completion_ids, skip_special_tokens=True)
        assert task.verify(task.problem(r.prompt_id), text).verified


def test_untrusted_experiences_are_counted_per_sender_and_never_reach_a_model(tmp_path):
    """What decodes cleanly can still be wrong for this run: another run's id, a group size that would
    complete a group early, token ids past the sender's vocabulary (they would crash the embedding)."""
    import msgspec

    cache = str(tmp_path)
    own_tok, peer_tok = load_tokenizer("gpt2", cache), load_tokenizer("mistral", cache)
    task = make_task(ArithmeticConfig(min_digits=1, max_digits=2, ops=["+"]))
    inbox = Ingest(ModelSpec(name="gpt2", arch="gpt2", tokenizer="gpt2"), own_tok, {"llama": peer_tok}, task, G,
                   run_id="t")
    good = _exp("gpt2", own_tok, 1, 0)
    bad = [
        msgspec.structs.replace(good, run_id="intruder"),
        msgspec.structs.replace(good, group_size=1),
        msgspec.structs.replace(good, sample_index=5),
        msgspec.structs.replace(good, completion_ids=pack_ids([len(own_tok) + 7])),
        msgspec.structs.replace(_exp("llama", peer_tok, 1, 0), prompt_ids=pack_ids([-3, 1])),
    ]
    inbox.add_many(bad)
    assert inbox.rejected_total == 5 and not inbox.own and not inbox.peers
    assert inbox.rejected["gpt2: another run's id"] == 1
    assert any(k.startswith("llama: prompt token id outside") for k in inbox.rejected)
    inbox.add_many([good, _exp("gpt2", own_tok, 1, 1)])  # the honest sender is still served
    assert inbox.complete_own_groups() == 1 and inbox.rejected_total == 5
