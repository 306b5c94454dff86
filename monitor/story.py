"""A prompt's story: every model's samples for one prompt, and each peer sample as its receivers see it.

A sample shows what its ``Experience`` carries (reward, verified, weight version, finish
reason, text, tokens) and the staleness the monitor measured when it arrived. For every
other model it is bridged with the THL (``tokenbridge.Bridge``) exactly as that model's
learner bridges it, so the page can colour the sender's and the receiver's tokens by
aligned group and show the residual. Tokenizers come from the run's config and the local
cache, as the run loaded them; a model whose tokenizer cannot be loaded gets its samples
without the bridged view, and the story says so.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from exchange.protocol import Experience

MAX_BRIDGED_TOKENS = 200  # a long completion is cut for the view (the page has no room for more)


class Storyteller:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.tokenizer_names: dict[str, str] | None = None  # read on the first story (from its config.toml)
        self.cache = ""
        self._tokenizers: dict[str, object] = {}
        self._bridges: dict[tuple[str, str], object] = {}  # (sender, receiver) -> tokenbridge.Bridge or None
        self.problems: list[str] = []
        self._piece_of: dict[str, dict[int, str]] = {}  # model -> token id -> its text alone (at most a vocabulary)

    def tokenizer(self, model: str):
        from tokenbridge import TokenizerLoadError, load_tokenizer  # transformers: only once a story is asked for

        if self.tokenizer_names is None:
            self.tokenizer_names, self.cache = _tokenizers_of(self.run_dir)
        if model not in self._tokenizers:
            name = self.tokenizer_names.get(model)
            try:
                self._tokenizers[model] = load_tokenizer(name, self.cache) if name else None
            except TokenizerLoadError as exc:
                self._tokenizers[model] = None
                self.problems.append(f"{model}: tokenizer not loaded ({exc})")
        return self._tokenizers[model]

    def bridge(self, src: str, dst: str):
        from tokenbridge import Bridge

        if (src, dst) not in self._bridges:
            a, b = self.tokenizer(src), self.tokenizer(dst)
            self._bridges[(src, dst)] = Bridge(a, b) if a is not None and b is not None else None
        return self._bridges[(src, dst)]

    def story(self, prompt_id: int, samples: list[tuple[Experience, int]], models: list[str]) -> dict:
        """``samples``: (experience, staleness at arrival) of one prompt, any models, in arrival order."""
        by_model: dict[str, list[dict]] = {m: [] for m in models}
        prompt_text = ""
        for exp, staleness in sorted(samples, key=lambda s: (s[0].model, s[0].sample_index)):
            tok = self.tokenizer(exp.model)
            if not prompt_text and tok is not None:
                prompt_text = tok.decode(exp.prompt_array.tolist())
            by_model.setdefault(exp.model, []).append(self._sample(exp, staleness, models))
        return {"prompt_id": prompt_id, "prompt": prompt_text, "models": by_model, "missing": self.problems[-3:],
                "note": "colours: one colour per THL group (characters aligned between the two vocabularies); "
                        "residual: share of characters in groups that are not one token to one token"}

    def _sample(self, exp: Experience, staleness: int, models: list[str]) -> dict:
        ids = exp.completion_array[:MAX_BRIDGED_TOKENS]
        out = {"sample": exp.sample_index, "reward": exp.reward, "verified": exp.verified,
               "weight_version": exp.weight_version, "staleness": staleness, "finish": exp.finish_reason,
               "generator": exp.experience_id.rsplit("/", 1)[-1], "text": exp.completion_text,
               "tokens": self._pieces(exp.model, ids), "bridged": {}}
        for dst in models:
            if dst == exp.model or (bridge := self.bridge(exp.model, dst)) is None:
                continue
            try:
                b = bridge(ids)
            except ValueError as exc:  # tokenbridge.BridgeError: this sample cannot cross
                out["bridged"][dst] = {"error": str(exc)}
                continue
            out["bridged"][dst] = {"tokens": self._pieces(dst, b.dst_ids), "group": b.dst_group.tolist(),
                                   "src_group": b.src_group.tolist(), "residual": round(b.residual, 3)}
        return out

    def _pieces(self, model: str, ids) -> list[str]:
        """Each token's text as the model's tokenizer decodes it alone; remembered per id (a decode through
        transformers costs tens of microseconds, and a story shows a few thousand tokens)."""
        tok = self.tokenizer(model)
        if tok is None:
            return [str(i) for i in ids]
        known = self._piece_of.setdefault(model, {})
        ids = [int(i) for i in ids]
        new = [i for i in dict.fromkeys(ids) if i not in known]
        known.update(zip(new, tok.batch_decode([[i] for i in new])))
        return [known[i] for i in ids]


def _tokenizers_of(run_dir: Path) -> tuple[dict[str, str], str]:
    """model -> tokenizer name, and the tokenizer cache the run used (``run.cache_dir`` or the default)."""
    from tokenbridge.cachedir import default_cache_root  # the one place the cache's location is decided

    try:
        cfg = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}, str(default_cache_root() / "tokenizers")
    root = Path(cfg.get("run", {}).get("cache_dir") or default_cache_root()).expanduser()
    return {m.get("name"): m.get("tokenizer") for m in cfg.get("models", [])}, str(root / "tokenizers")
