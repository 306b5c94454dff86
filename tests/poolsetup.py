"""Overrides for a short static pool run on cheap costs, shared by the real pool-run tests."""

from __future__ import annotations


def static_pool(workers: int, duration_s: float, split: tuple[int, int, int, int], gen_s: float = 0.05,
                train_s: float = 0.02) -> list[str]:
    """``--set`` overrides of configs/pool.toml: a static split (generators gpt2, llama; learners gpt2, llama).

    Workers take their roles in pool-key order: the gpt2 generators come first (w0, ...).
    """
    g_gpt2, g_llama, l_gpt2, l_llama = split
    return [f"pool.workers={workers}", f"pool.duration_s={duration_s:g}", "pool.mode=static",
            f"pool.static_split={{'generator:gpt2' = {g_gpt2}, 'generator:llama' = {g_llama}, "
            f"'learner:gpt2' = {l_gpt2}, 'learner:llama' = {l_llama}}}",
            f"pool.phases=[{{from_s = 0.0, gen_s = {{gpt2 = {gen_s:g}, llama = {gen_s:g}}}, "
            f"train_s = {{gpt2 = {train_s:g}, llama = {train_s:g}}}}}]"]
