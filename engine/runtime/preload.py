"""What the actors' fork server loads for a run before it forks any actor: the run's tokenizers and, for a
run of several models, each one's vocabulary profile (the THL's table of its tokens). Every actor is a fork
of the server, so each has them without paying for them. Before, every process paid for every tokenizer it
touched: a load parses megabytes of JSON (0.3 s for GPT-2's, 2 s for Qwen2's), and a smoke run loaded its two
tokenizers ten times (the pre-flight, each warm start, each worker and each learner's peer).

The launcher names them in ``MUTUAL_RL_PRELOAD`` (JSON) while it starts the server (``actors.start_server``);
the server imports this module, which warms them. Whatever fails here is skipped: the actor that needs it
loads it itself and says why it failed, as it did before."""

from __future__ import annotations

import contextlib
import json
import os

ENV = "MUTUAL_RL_PRELOAD"


def spec_for(cfg) -> str:
    """The preload of a run's config, as ``MUTUAL_RL_PRELOAD`` carries it."""
    from engine.config import tokenizer_cache

    cache = tokenizer_cache(cfg)
    names = list(dict.fromkeys(m.tokenizer for m in cfg.models))
    return json.dumps({"tokenizers": [[name, cache] for name in names], "bridges": len(cfg.models) > 1})


def warm(spec: dict) -> None:
    """Load each tokenizer of ``spec`` for this process and its forks; with ``bridges``, its vocabulary profile
    too (every learner's bridges read both models' profiles; tokenbridge caches them by tokenizer). A bridge's
    fast encoders are not built here: each destination's are built once a run, by its own learner, in parallel
    with the others (here they would delay every actor's start)."""
    from tokenbridge.loading import preload_tokenizer

    toks = []
    for name, cache in spec["tokenizers"]:
        with contextlib.suppress(Exception):  # the actor that needs it says why it failed (see above)
            toks.append(preload_tokenizer(name, cache))
    if spec.get("bridges"):
        from tokenbridge.profile import profile_of

        for tok in toks:
            with contextlib.suppress(Exception):
                profile_of(tok)


if os.environ.get(ENV):  # imported by the fork server the launcher started with a preload
    with contextlib.suppress(Exception):
        warm(json.loads(os.environ[ENV]))
