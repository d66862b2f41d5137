"""Reference LM head + cross-entropy, chunked over tokens so no full ``[t, vocab]`` logits ever exist.

NAM56R's head is 131072 x 4096: at 4096 tokens a full fp32 logits tensor is 2 GiB, and autograd would keep
it (and its softmax) for backward. Here the loss and both gradients are computed chunk by chunk in forward,
the way Liger-Kernel's fused linear cross-entropy does for ``reduction="sum"``::

    logits_c = h_c W^T                          # [c, v] in fp32 (fp64 for fp64 inputs): the only big buffer
    loss    += sum_i mask_i * (logsumexp(logits_c,i) - logits_c,i[y_i])
    G_c      = mask * (softmax(logits_c) - onehot(y_c))   # d loss / d logits_c, written over logits_c
    dh_c     = G_c W          dW += G_c^T h_c

Backward then only scales the stored ``dh`` and ``dW`` by the incoming scalar. Cost: ``dh [t, d]`` and an fp32
``dW [v, d]`` (2 GiB for NAM56R's head) are held from forward to backward, plus an fp32 copy of a bf16 ``W``
during forward; in exchange one logits pass instead of two (recomputing in backward would trade that memory
for a second ``[t, d] x [d, v]`` matmul). Masked tokens contribute 0 to the loss and
to both gradients; their targets are never read, so any placeholder id (-100, -1) is safe there.
"""

from __future__ import annotations

import torch

CHUNK_TOKENS = 1024
"""Tokens per chunk: 1024 x 131072 (NAM56R vocab) fp32 logits = 512 MiB, the largest buffer the head needs."""


class ChunkedLinearCE(torch.autograd.Function):
    """``sum_i mask_i * CE(hidden_i W^T, target_i)`` with gradients computed in forward, one chunk at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, target, mask, chunk: int, need_hidden: bool, need_weight: bool):
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 logits; fp64 inputs stay fp64
        w = weight.to(acc)  # [v, d]
        t = hidden.shape[0]
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # [t, d]
        grad_weight = torch.zeros_like(w) if need_weight else None  # [v, d], accumulated in acc
        for start in range(0, t, chunk):
            h = hidden[start : start + chunk].to(acc)  # [c, d]
            m = mask[start : start + chunk].to(acc)  # [c]
            y = torch.where(m != 0, target[start : start + chunk], 0)  # [c]; masked targets never read
            logits = h @ w.T  # [c, v]
            lse = logits.logsumexp(dim=-1)  # [c]
            picked = logits.gather(1, y.unsqueeze(1)).squeeze(1)  # [c]
            loss += ((lse - picked) * m).sum()
            if not (need_hidden or need_weight):
                continue
            g = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in the logits buffer
            g[torch.arange(g.shape[0], device=g.device), y] -= 1
            g.mul_(m.unsqueeze(1))  # [c, v] = d loss / d logits
            if need_hidden:
                grad_hidden[start : start + chunk] = (g @ w).to(hidden.dtype)
            if need_weight:
                grad_weight.addmm_(g.T, h)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = (grad_hidden * grad_loss).to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


class ReferenceCEHead:
    """``CEHead`` (nam56r/backends.py) in pure PyTorch; the parity target for fused GPU heads.

    Returns the masked sum as an fp32 scalar (fp64 when the inputs are fp64, so tests can compare tightly);
    the caller divides by the mask sum. ``mask`` is a weight per token and gets no gradient.
    """

    def __init__(self, chunk_tokens: int = CHUNK_TOKENS):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, found {chunk_tokens}")
        self.chunk_tokens = chunk_tokens

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        # Gradients are computed in forward, so skip them when nobody will ask (eval, no_grad).
        grad_on = torch.is_grad_enabled()
        return ChunkedLinearCE.apply(
            hidden,  # [t, d]
            weight,  # [v, d]
            target,  # [t] int64
            mask,  # [t]
            self.chunk_tokens,
            grad_on and hidden.requires_grad,
            grad_on and weight.requires_grad,
        )
