"""The KL term's reference policy (``objective.kl_coef > 0``): the weights RL started from, frozen.

TRL's ``beta``: the loss adds ``kl_coef`` times the k3 estimate of KL(pi_theta || pi_ref) over the
receiver's own tokens (``policies.surrogate.k3_kl``), with pi_ref the model as its RL began: the warm
start (or the loaded checkpoint when there is none), also after ``launch.py resume`` (the learner
builds it from the run's warm-start checkpoint, never from the checkpoint it resumes).

Where it lives, on the learner's device, costing as little as it can:
- a full model: a second copy of the starting weights, in eval mode with no gradients (one more
  model's weights on the learner; no gradients or AdamW moments, so about a quarter of what the
  trained copy costs with them);
- a LoRA model: no copy. The frozen base *is* the starting policy (peft starts B at zero), so the
  reference is the learner's own module with its adapters switched off for the reference forward.

``logprobs`` runs one forward per batch, shaped as the policy's (``completion_logprobs``: a group's
prompt runs once), under ``torch.no_grad``: the reference is a constant of the loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from policies.logprobs import Packed, completion_logprobs
from policies.lora import has_adapters


class Reference:
    """A frozen policy's log-probs: ``module`` itself, or (``adapters_off``) ``module`` with its LoRA adapters off."""

    def __init__(self, module: torch.nn.Module, adapters_off: bool = False):
        self.module, self.adapters_off = module, adapters_off

    def logprobs(self, packed: Packed) -> torch.Tensor:
        """(N, T) reference log-probs of ``packed``'s completion tokens (no graph); 0 on padding."""
        with torch.no_grad(), self._as_reference():
            return completion_logprobs(self.module, packed)

    def holdings(self) -> list[torch.nn.Module]:
        """The memory this reference adds to its learner (``engine.roles.memory.held_bytes``): none for LoRA."""
        return [] if self.adapters_off else [self.module]

    @contextlib.contextmanager
    def _as_reference(self) -> Iterator[None]:
        if not self.adapters_off:
            yield
            return
        from peft.tuners.tuners_utils import BaseTunerLayer  # LoRA's extra: present when adapters are

        layers = [m for m in self.module.modules() if isinstance(m, BaseTunerLayer)]
        trainable = {p: p.requires_grad for p in self.module.parameters()}
        training = self.module.training
        self.module.eval()  # dropout (LoRA's among it) off: the reference is a fixed function
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)
            for p, flag in trainable.items():  # peft's toggles set requires_grad: the optimizer's view is restored
                p.requires_grad_(flag)
            self.module.train(training)


def starting_reference(policy: torch.nn.Module, load_start: Callable[[], torch.nn.Module]) -> Reference:
    """The reference of a learner whose trained module is ``policy``: its adapters switched off (LoRA), or a
    frozen copy of the starting weights, ``load_start()``, moved to ``policy``'s device."""
    if has_adapters(policy):
        return Reference(policy, adapters_off=True)
    device = next(policy.parameters()).device
    module = load_start().to(device).eval()
    module.requires_grad_(False)
    return Reference(module)
