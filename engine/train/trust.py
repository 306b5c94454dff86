"""What an experience that decoded cleanly must still satisfy before a learner trains on it.

The codec has checked types, sizes, finite numbers and aligned arrays; what it cannot know
is this run: its id, its group size, and each sender's vocabulary (an id past it would crash
the model's embedding lookup). The learners' inbox drops what fails here (counted), and the
end-of-run audit ignores it the same way: a hostile frame cannot make the audit fail.
"""

from __future__ import annotations

from exchange.protocol import Experience


def untrusted(exp: Experience, run_id: str | None, group_size: int, vocab: dict[str, int]) -> str | None:
    """Why ``exp`` cannot be trained on in this run, or None."""
    if exp.model not in vocab:
        return "a model this run does not have"
    if run_id is not None and exp.run_id != run_id:
        return "another run's id"
    if exp.group_size != group_size or not 0 <= exp.sample_index < group_size:
        return f"group_size/sample_index {exp.group_size}/{exp.sample_index} (this run: G={group_size})"
    if exp.prompt_id < 0 or exp.weight_version < 0:
        return "negative prompt_id or weight_version"
    for field, ids in (("completion", exp.completion_array), ("prompt", exp.prompt_array)):
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab[exp.model]):
            return f"{field} token id outside {exp.model}'s vocabulary ({vocab[exp.model]})"
    return None
