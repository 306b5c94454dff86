"""Overrides for a short static run of configs/pool.toml on cheap modelled costs, shared by the pool tests."""

from __future__ import annotations


def static_pool(workers: int, steps: int, split: tuple[int, int, int, int], gen_s: float = 0.05,
                train_s: float = 0.02) -> list[str]:
    """``--set`` overrides: a static split (generators gpt2, llama; learners gpt2, llama) ending after ``steps``.

    Workers take their roles in pool-key order: the gpt2 generators come first (w0, ...).
    """
    g_gpt2, g_llama, l_gpt2, l_llama = split
    return [f"pool.workers={workers}", f"train.steps={steps}", "pool.allocator=static", "run.max_minutes=8",
            f"pool.split={{'generator:gpt2' = {g_gpt2}, 'generator:llama' = {g_llama}, "
            f"'learner:gpt2' = {l_gpt2}, 'learner:llama' = {l_llama}}}",
            f"pool.costs=[{{from_s = 0.0, gen_s = {{gpt2 = {gen_s:g}, llama = {gen_s:g}}}, "
            f"train_s = {{gpt2 = {train_s:g}, llama = {train_s:g}}}}}]"]


def script(*moves: tuple[str, int, str, str, str]) -> str:
    """``pool.script`` of (step_of, at_step, worker, role, model) moves, as one ``--set`` value."""
    items = ", ".join(f"{{step_of = '{m}', at_step = {k}, worker = '{w}', role = '{r}', model = '{to}'}}"
                      for m, k, w, r, to in moves)
    return f"pool.script=[{items}]"
