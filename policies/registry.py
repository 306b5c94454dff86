"""Objective registry: a config's ``kind`` names the function that computes the loss.

Adding an objective is one config Struct (a ``SurrogateConfig`` subclass with a new tag)
plus one function registered with ``@register_objective(name, ConfigType, peers=...)``.
Every registered function has the same keyword-only signature (``Objective``), so
signatures cannot drift between objectives. ``peers`` declares which peer experience
the objective reads (``PeerNeed``); the engine waits for, bridges and ships exactly that.
"""

from __future__ import annotations

import importlib
from typing import Callable, Literal, Protocol, TypeVar

import msgspec
import torch
from torch import Tensor

from policies.batch import ObjectiveBatch

Stats = dict[str, float]

# Which peer experience an objective reads:
#   "none":    none (solo GRPO; the learner never waits for peers)
#   "rewards": peer rewards on the step's prompts, no tokens (XGRPO's pooled baseline)
#   "rescue":  verified peer successes on prompts where every own sample failed (SGT)
#   "samples": every bridged peer sample on the step's prompts (PRP)
#   "reference": no peer at all; the task's reference solution, on prompts where every own
#                sample failed, in the peer slots (the answer-key control of SGT)
PeerNeed = Literal["none", "rewards", "rescue", "samples", "reference"]


class Objective(Protocol):
    """What every registered objective is: pure function of the batch, its config and an RNG."""

    def __call__(self, *, batch: ObjectiveBatch, config: msgspec.Struct, rng: torch.Generator) -> tuple[Tensor, Stats]:
        ...


F = TypeVar("F", bound=Objective)

_REGISTRY: dict[str, tuple[type[msgspec.Struct], Objective]] = {}
_PEERS: dict[str, PeerNeed] = {}

# Importing these modules registers the built-in objectives (grpo, xgrpo, prp, sgt, sgt_ref; hacpo).
_BUILTINS = ("policies.objectives", "policies.hacpo")  # the modules that register the built-in objectives


def register_objective(name: str, config_type: type[msgspec.Struct], peers: PeerNeed = "none") -> Callable[[F], F]:
    """Decorator: register ``fn`` under ``name``, reading ``peers``; ``config_type``'s tag must equal ``name``."""
    tag = getattr(getattr(config_type, "__struct_config__", None), "tag", None)
    if tag != name:
        raise ValueError(f"objective {name!r}: config type {config_type.__name__} must be tagged {name!r}, found {tag!r}")

    def decorate(fn: F) -> F:
        if name in _REGISTRY:
            raise ValueError(f"objective {name!r} is already registered (by {_REGISTRY[name][1].__qualname__})")
        _REGISTRY[name] = (config_type, fn)
        _PEERS[name] = peers
        return fn

    return decorate


def _import_builtins() -> None:
    for module in _BUILTINS:
        importlib.import_module(module)


def objective_names() -> list[str]:
    """Names of every registered objective, sorted."""
    _import_builtins()
    return sorted(_REGISTRY)


def get_objective(name: str) -> tuple[type[msgspec.Struct], Objective]:
    """(config type, function) registered under ``name``; the error lists what exists."""
    _import_builtins()
    if name not in _REGISTRY:
        raise KeyError(f"unknown objective {name!r}; registered objectives: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def peer_need(name: str) -> PeerNeed:
    """Which peer experience objective ``name`` reads (see ``PeerNeed``)."""
    get_objective(name)
    return _PEERS[name]


def compute_loss(batch: ObjectiveBatch, config: msgspec.Struct, rng: torch.Generator) -> tuple[Tensor, Stats]:
    """Validate ``batch`` and run the objective that ``config.kind`` names: (scalar loss, float stats)."""
    name = getattr(config, "kind", None)
    if not isinstance(name, str):
        raise TypeError(f"objective config {type(config).__name__} has no 'kind'; use one of the registered config Structs")
    config_type, fn = get_objective(name)
    if not isinstance(config, config_type):
        raise TypeError(f"objective {name!r} expects a {config_type.__name__}, got {type(config).__name__}")
    batch.validate()
    return fn(batch=batch, config=config, rng=rng)
