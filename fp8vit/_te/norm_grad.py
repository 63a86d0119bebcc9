"""The residual stream's gradient added inside TE's LayerNorm backward (lever 70).

A classic ViT block is ``x1 = x + attn(norm1(x))``, ``x2 = x1 + mlp(norm2(x1))``, each norm the
first op of TE's ``LayerNormLinear`` (qkv) or ``LayerNormMLP``. In the backward the gradient of
``x`` is the block output's gradient ``g`` (the skip path) plus the norm's input gradient from
TE's ``layernorm_bwd``, and autograd sums the two in a kernel of its own: at ViT-L/16 b128 on an
H100, 49 us a call next to the norm's 55, 48 calls a step
(``docs/results/profile/vit_large*_sync_h100.kernels.txt``). Here the norm's backward writes
``dx + g`` itself (:func:`fp8vit._te.kernels.layernorm_backward_add`).

How the two gradients meet, while :func:`set_norm_grad_add` has it on (fp8vit's graph capture by
default): a block passes ``x`` into the branch through :func:`fork` and ends it with :func:`join`
instead of adding ``x`` (the add itself is in the branch's last GEMM, lever 61). The join's
backward runs first and parks ``g`` under ``x``'s storage; TE's ``layernorm_bwd`` (which its
modules look up in the extension at each call) is routed here, and where its input is the parked
tensor it runs fp8vit's kernel and marks ``g`` taken; the fork's backward then passes its gradient
on as is, or adds ``g`` itself where no norm took it (TE ran the norm: RMSNorm, a zero-centred
gamma, rows the kernel does not take). Every path gives ``x`` the same sum, once.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch

from .kernels import kernel_takes, layernorm_backward_add, triton_support
from .loader import te_module
from .route import Route

__all__ = ["set_norm_grad_add", "norm_grad_add_enabled", "norm_grad_add", "Slot", "fork", "join"]


class Slot:
    """Where a block's skip-path gradient waits for the norm that reads the same ``x``."""

    __slots__ = ("key", "grad", "taken")

    def __init__(self) -> None:
        self.key: Optional[Tuple[int, int, int]] = None  # x's device, storage address, element count
        self.grad: Optional[torch.Tensor] = None
        self.taken = False


_PARKED: Dict[Tuple[int, int, int], Slot] = {}  # gradients waiting for their norm's backward
# TE's modules call the extension's layernorm_bwd; while installed it is _layernorm_bwd bound to TE's;
# installing needs TE (TEUnavailableError says why not) and Triton
_ROUTE = Route([("transformer_engine_torch", "layernorm_bwd")],
               lambda te_fn: functools.partial(_layernorm_bwd, te_fn),
               lambda: te_module("transformer_engine_torch") is not None and triton_support().ok,
               on_remove=_PARKED.clear)


def _key(x: torch.Tensor) -> Tuple[int, int, int]:
    return (x.device.index if x.is_cuda else -1, x.data_ptr(), x.numel())


def norm_grad_add_enabled() -> bool:
    """Whether TE's LayerNorm backward is routed here (:func:`set_norm_grad_add`)."""
    return _ROUTE.enabled()


def set_norm_grad_add(enable: bool = True) -> bool:
    """Route TE's ``layernorm_bwd`` here (it adds a parked skip-path gradient in fp8vit's kernel,
    and is TE's own function for every other call), or give TE its function back.

    Args:
        enable: install the route (True) or restore TE's function (False).

    Returns:
        whether the route is installed after the call: False where Triton cannot run
        (``fp8vit._te.kernels.triton_support()`` says why).

    Raises:
        TEUnavailableError: installing it where TE does not import (with the reason).
    """
    return _ROUTE.set(enable)


def norm_grad_add(enabled: bool) -> ContextManager[bool]:
    """:func:`set_norm_grad_add` for the duration of a ``with`` block (it yields whether the route
    is installed), then the previous setting again."""
    return _ROUTE.scope(enabled)


class _Fork(torch.autograd.Function):
    """``x`` into a branch whose first op is a norm; backward: the branch's gradient, plus the
    skip path's where no norm added it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slot: Slot) -> torch.Tensor:
        slot.key, slot.grad, slot.taken = _key(x), None, False
        _PARKED.pop(slot.key, None)  # one an interrupted backward left
        ctx.slot = slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slot = ctx.slot
        _PARKED.pop(slot.key, None)
        skip, slot.grad = slot.grad, None
        if slot.taken:
            slot.taken = False
            return grad, None
        return (grad if skip is None else grad + skip), None


class _Join(torch.autograd.Function):
    """The branch output that already holds ``x`` (lever 61); backward: the gradient goes on into
    the branch and is parked for the norm that reads ``x``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, slot: Slot) -> torch.Tensor:
        ctx.slot = slot
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        slot = ctx.slot
        slot.grad, slot.taken = grad, False
        _PARKED[slot.key] = slot
        return grad, None


def fork(x: torch.Tensor, slot: Slot) -> torch.Tensor:
    """``x`` for a branch that starts with a norm; pair with :func:`join` on the branch's output."""
    return _Fork.apply(x, slot)


def join(y: torch.Tensor, slot: Slot) -> torch.Tensor:
    """``y``, a branch output holding ``x`` (:func:`fork`'s) already: the gradient of ``y`` reaches
    ``x`` through the branch's norm, or through the fork where the norm could not add it."""
    return _Join.apply(y, slot)


def _layernorm_bwd(te_layernorm_bwd: Callable, dz: torch.Tensor, x: torch.Tensor, mu: torch.Tensor,
                   rsigma: torch.Tensor,
                   gamma: torch.Tensor, sm_margin: int, zero_centered_gamma: bool) -> List[Any]:
    """TE's ``layernorm_bwd`` (``[dx, dgamma, dbeta]``), with the parked gradient of ``x`` added in
    fp8vit's kernel where there is one and the kernel takes the tensors; TE's function (the first
    argument) otherwise."""
    slot = _PARKED.pop(_key(x), None) if _PARKED else None
    if slot is not None:
        skip = slot.grad
        if (not zero_centered_gamma and skip is not None and x.dim() == 2 and dz.shape == x.shape
                and skip.numel() == x.numel() and skip.is_contiguous() and gamma.is_contiguous()
                and gamma.shape == x.shape[-1:] and mu.is_contiguous() and rsigma.is_contiguous()
                and mu.dtype == rsigma.dtype == torch.float32 and kernel_takes(dz, x, skip)):
            dx, dgamma, dbeta = layernorm_backward_add(dz, x, mu, rsigma, gamma, skip.view(x.shape))
            slot.grad, slot.taken = None, True
            return [dx, dgamma, dbeta]
    return te_layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma)
