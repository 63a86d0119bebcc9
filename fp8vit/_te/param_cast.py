"""A block's small parameters cast to the autocast dtype in one kernel, not one kernel each (lever 42).

On every forward TE's modules cast each fp32 norm weight and bias and each GEMM bias to the
activation dtype (``cast_if_needed`` in TE 2.20's ``layernorm_linear.py``, ``layernorm_mlp.py``
and ``linear.py``), and autograd casts each of their gradients back: at ViT-B that is 97 copy
kernels forward and 97 backward per step, 2-3.4 us each plus a kernel boundary each in the CUDA
graph (0.53 ms of kernel time in a 28.7 ms step on an H100,
``docs/results/profile/vit_base*sync_h100.kernels.txt``).

:func:`cast_small_params` makes the same copies with one ``torch._foreach_copy_`` (its CUDA
kernel converts dtypes, a tensor list at a time) and hands them to the block's TE modules for
the forward through their parameter slots, which TE reads with ``getattr``; the backward turns
their gradients back to the parameters' dtype with one more. The casts are the same roundings,
so results are bit-identical; only the kernel count changes.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, List, Tuple

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .module_types import modules

__all__ = ["cast_small_params"]

_PLAIN = (torch.Tensor, nn.Parameter)  # not a DTensor (FSDP2's shard) nor an FP8 QuantizedTensor


class _CastTogether(torch.autograd.Function):
    """``params`` (one dtype) as new tensors of ``dtype``: one multi-tensor copy each way."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *params: torch.Tensor):
        ctx.src_dtype = params[0].dtype
        out = [torch.empty_like(p, dtype=dtype, memory_format=torch.contiguous_format) for p in params]
        torch._foreach_copy_(out, params)
        # a frozen parameter's copy needs no gradient: TE then computes none for it
        ctx.mark_non_differentiable(*(o for o, p in zip(out, params) if not p.requires_grad))
        return tuple(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        todo = [i for i, g in enumerate(grads) if g is not None and ctx.needs_input_grad[i + 1]]
        out: List = [None] * len(grads)
        if todo:
            src = [grads[i] for i in todo]
            dst = [torch.empty_like(g, dtype=ctx.src_dtype, memory_format=torch.contiguous_format) for g in src]
            torch._foreach_copy_(dst, src)
            for i, g in zip(todo, dst):
                out[i] = g
        return (None, *out)


def _slots(block: nn.Module, dtype: torch.dtype) -> Tuple[Tuple[nn.Module, str], ...]:
    """``(TE module, parameter name)`` of every vector parameter (norm weights and biases, GEMM
    biases) of ``block``'s TE modules that TE would cast to ``dtype``: one other floating dtype
    than ``dtype``, plain tensors. Matrices (the GEMM weights) TE quantizes itself."""
    te = modules()
    kinds = (te.LayerNormLinear, te.Linear, te.LayerNormMLP)
    out, src = [], None
    for m in block.modules():
        if not isinstance(m, kinds):
            continue
        for name, p in m._parameters.items():
            if p is None or p.dim() != 1 or p.dtype == dtype or not p.is_floating_point() or type(p) not in _PLAIN:
                continue
            if src is None:
                src = p.dtype
            if p.dtype != src:  # mixed dtypes: left to TE (one copy kernel needs one source dtype)
                return ()
            out.append((m, name))
    return tuple(out)


def cast_small_params(block: nn.Module) -> ContextManager:
    """Inside, ``block``'s TE modules hold their vector parameters already cast to the CUDA
    autocast dtype, made by one kernel (module docstring); outside autocast, or with nothing to
    cast, nothing changes. The parameters are put back on exit, also on an exception.

    Args:
        block: an fp8vit block built on TE's modules.
    """
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    dtype = torch.get_autocast_dtype("cuda")
    # the walk runs each forward (about 15 us a ViT block on a 2-core CPU): only eager steps pay
    # it, a graph replay runs no Python of the block
    slots = _slots(block, dtype)
    return _swapped(slots, dtype) if slots else contextlib.nullcontext()


@contextlib.contextmanager
def _swapped(slots: Tuple[Tuple[nn.Module, str], ...], dtype: torch.dtype):
    params = [m._parameters[n] for m, n in slots]
    casts = _CastTogether.apply(dtype, *params)
    try:
        # the dict entry, not setattr: nn.Module accepts only Parameters there, and TE's forward
        # reads the slot with getattr, which returns whatever the entry holds
        for (m, n), c in zip(slots, casts):
            m._parameters[n] = c
        yield
    finally:
        for (m, n), p in zip(slots, params):
            m._parameters[n] = p
