"""The LM head's log-probs of chosen tokens, computed a block of rows at a time, forward and backward.

``log p(t_n) = h_n . w_{t_n} - logsumexp_v(h_n . w_v)`` over the whole vocabulary. Computed as one matrix, the
(N, V) float32 logits live from the forward to the backward (autograd keeps them, and the softmax's
intermediates beside them): for Gemma 3's 262,144-token vocabulary a step of 32 samples x 48 completion
tokens holds 1.6 GB of logits, more than the model's float32 weights. Here autograd keeps only the hidden
states, the targets and each row's logsumexp; the backward recomputes each block's logits from them, so no
more than ``rows`` x V logits exist at a time (the idea of Liger's fused linear cross-entropy; written anew
for a gather of chosen tokens rather than a loss).

The gradient is exact: d log p(t_n) / d logits_n = onehot(t_n) - softmax(logits_n). Blocks add up in float32
as the one-matrix path does, so the two agree to float rounding (tests/test_models_logprobs.py).

Inside ``grads_into_params()`` (a learner's backward) the head's weight gradient is added straight into
``weight.grad`` rather than returned: autograd would hold it as a second (V, D) matrix, and for a tied embedding
a third, their sum, before adding it to ``.grad`` (0.67 GB each for Gemma 3). Outside it the gradient is
returned, as ``torch.autograd.grad`` needs.
"""

from __future__ import annotations

import contextlib
import threading

import torch

BLOCK_BYTES = 64 * 2**20  # float32 logits a block may hold: 64 rows of a 262,144-token vocabulary


_into = threading.local()


@contextlib.contextmanager
def grads_into_params():
    """Backward passes run inside add a float32 leaf head weight's gradient into its ``.grad`` in place."""
    before, _into.on = getattr(_into, "on", False), True
    try:
        yield
    finally:
        _into.on = before


def sparse_input_embedding(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Make a plain float32 input embedding's gradient its looked-up rows only (``sparse``), and return its weight:
    dense, autograd would build a (V, D) matrix per backward to add into ``.grad``. The caller gives the weight a
    dense ``.grad`` before the backward (``dense_grads``), which the rows are added into in place; a sharded
    (DTensor) or frozen embedding is left as it is."""
    emb = model.get_input_embeddings()
    weight = getattr(emb, "weight", None)
    if not (isinstance(emb, torch.nn.Embedding) and type(weight) is torch.nn.Parameter and weight.requires_grad
            and weight.dtype == torch.float32 and emb.max_norm is None):
        return []
    emb.sparse = True
    return [weight]


def dense_grads(params: list[torch.nn.Parameter]) -> None:
    """A zero dense ``.grad`` where there is none yet (a sparse gradient would otherwise become ``.grad``)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def block_rows(vocab: int) -> int:
    return max(1, BLOCK_BYTES // (4 * vocab))


class ChunkedHeadLogprobs(torch.autograd.Function):
    """(N, D) hidden, (V, D) head weight, optional (V,) bias, (N,) targets -> (N,) float32 log-probs."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets):
        rows = block_rows(weight.shape[0])
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)  # kept for the backward: softmax = exp(logits - lse)
        for start in range(0, hidden.shape[0], rows):
            block = slice(start, start + rows)
            logits = _logits(hidden[block], weight, bias)  # (n, V)
            lse[block] = torch.logsumexp(logits, dim=-1)
            out[block] = logits.gather(-1, targets[block, None]).squeeze(-1) - lse[block]
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets, lse)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        rows = block_rows(weight.shape[0])
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        in_place = ctx.needs_input_grad[1] and _in_place(weight)
        if in_place and weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        grad_weight = weight.grad if in_place else \
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_out = grad_out.float()
        for start in range(0, hidden.shape[0], rows):
            block = slice(start, start + rows)
            h, g = hidden[block], grad_out[block]
            # d out / d logits = onehot(target) - softmax, scaled by the incoming gradient
            d_logits = torch.exp(_logits(h, weight, bias) - lse[block, None]).mul_(-g[:, None])  # (n, V)
            d_logits.scatter_add_(-1, targets[block, None], g[:, None])
            if grad_hidden is not None:
                grad_hidden[block] = (d_logits @ weight.float()).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(d_logits.t(), h.float())
            if grad_bias is not None:
                grad_bias += d_logits.sum(0)

        def cast(t, like):
            return t.to(like.dtype) if t is not None else None

        return grad_hidden, None if in_place else cast(grad_weight, weight), cast(grad_bias, bias), None


def _in_place(weight: torch.Tensor) -> bool:
    """Inside grads_into_params, for a float32 leaf whose ``.grad`` is a plain dense tensor (or none yet)."""
    grad = weight.grad
    return (getattr(_into, "on", False) and weight.is_leaf and weight.dtype == torch.float32
            and (grad is None or (grad.layout == torch.strided and grad.dtype == torch.float32)))


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One block's logits in the model's dtype (as its head computes them), then float32."""
    return torch.nn.functional.linear(hidden, weight, bias).float()


def chunkable_head(head: torch.nn.Module) -> bool:
    """A plain linear head with ordinary tensors: a sharded (DTensor) or adapted head keeps its own forward."""
    return (type(head) is torch.nn.Linear and type(head.weight) in (torch.Tensor, torch.nn.Parameter)
            and not head._forward_hooks and not head._forward_pre_hooks)


def chunked_head_logprobs(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, D), (N,) -> (N,): ``log_softmax(head(hidden)).gather(targets)`` without the (N, V) logits kept."""
    return ChunkedHeadLogprobs.apply(hidden, head.weight, head.bias, targets)
