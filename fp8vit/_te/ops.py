"""TE kernels the blocks call one by one: attention on a packed QKV buffer, fused RoPE, gated
activations, and the switch between TE's and cuDNN's LayerNorm kernels."""

from __future__ import annotations

import functools
import os
import warnings
from typing import ContextManager, Optional

import torch
from torch import nn

from ..errors import TEUnavailableError
from .._warn import warn_once
from .fp8 import active_fp8_recipe
from .loader import te_module, te_status, te_version
from .route import switched

__all__ = ["packed_attention", "attention_backend", "fused_rope", "gated_activation", "cudnn_norm_available",
           "cudnn_norm_enabled", "set_cudnn_norm", "cudnn_norm"]


def packed_attention(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """``DotProductAttention`` on q, k, v that are views of one packed buffer (layout ``bs3hd``).

    TE finds the packed layout from the views' pointers and strides and warns that this is
    deprecated in favour of ``qkv_layer=``. But ``qkv_layer=`` slices the buffer inside TE with
    ``select``, whose autograd backward zero-fills and copies the whole packed gradient once per
    view (docs/performance.md); fp8vit splits the buffer itself so that the gradient comes back
    packed. Should a later TE drop the detection, q, k, v are still valid separate inputs.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Relying on pointer-based detection", category=DeprecationWarning)
        try:
            out = attn(query_layer=q, key_layer=k, value_layer=v, **kwargs)
        except ValueError as err:
            if "No dot product attention backend" not in str(err):
                raise
            raise ValueError(_no_attention_kernel(q, k, kwargs)) from err
    if q.dtype in (torch.bfloat16, torch.float16) and attention_backend() == "unfused":
        # bf16 attention that TE runs in its unfused backend ([B, H, N, N] probabilities in memory,
        # bmm + softmax): slower and larger than cuDNN's, and nothing else would say so
        d = q.shape[3]
        # both of TE's kernels need head dims that are multiples of 8: the likely reason, named
        likely = (f"head dim {d} is not a multiple of 8, which both need" if d % 8 else
                  "NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 prints why (e.g. a cuDNN other than the one TE was built "
                  "for on LD_LIBRARY_PATH, or deterministic mode with a bias)")
        warn_once(f"fp8vit: Transformer Engine runs attention unfused (UnfusedDotProductAttention: slower, "
                  f"and [B, H, N, N] probabilities in memory) for q [B, N={q.shape[1]}, H={q.shape[2]}, D={d}] "
                  f"{q.dtype}: its fused (cuDNN) and flash backends turned the call down; {likely}",
                  RuntimeWarning, stacklevel=3)
    return out


def attention_backend() -> Optional[str]:
    """The backend TE's ``DotProductAttention`` chose for its last call: ``"flash"``, ``"fused"``
    (cuDNN), ``"unfused"``, or None (no call yet, or a TE that does not say). One selection is
    process-wide in TE, kept until a call with other parameters."""
    chosen = _te_backends()
    if not chosen or chosen.get("attention_params") is None:
        return None
    for key, name in (("use_flash_attention", "flash"), ("use_fused_attention", "fused"),
                      ("use_unfused_attention", "unfused")):
        if chosen.get(key):
            return name
    return None


@functools.lru_cache(maxsize=None)
def _te_backends() -> Optional[dict]:
    """TE's module-level record of its attention backend selection (updated in place)."""
    try:
        mod = te_module("transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention")
    except Exception:  # noqa: BLE001 - an older or newer TE lays this out otherwise: no answer
        return None
    chosen = getattr(mod, "_attention_backends", None)
    return chosen if isinstance(chosen, dict) else None


def _no_attention_kernel(q: torch.Tensor, k: torch.Tensor, kwargs: dict) -> str:
    """What to say when TE finds no attention kernel for a call: its shapes, and the likely fix."""
    b, n, h, d = q.shape
    bias = kwargs.get("core_attention_bias")
    what = (f"q [B={b}, N={n}, H={h}, D={d}] {q.dtype}, k/v {k.shape[2]} heads"
            + (f", bias {list(bias.shape)}" if bias is not None else "")
            + (f", mask {kwargs.get('attn_mask_type')}" if kwargs.get("attn_mask_type") else ""))
    recipe = active_fp8_recipe()
    if getattr(recipe, "fp8_dpa", False):
        return (f"fp8vit: Transformer Engine has no FP8 attention kernel for this block ({what}). FP8 "
                f"attention (make_recipe(..., fp8_attention=True), TE's fp8_dpa) is on"
                + (f": on the H200 (TE 2.20, cuDNN 9.19) TE's FP8 attention takes head dim 128 only, this "
                   f"block's is {d}. " if d != 128 else ". ") +
                "Use the recipe without fp8_attention (the attention then runs in bf16, as by default); "
                "NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 prints TE's reasons")
    return (f"fp8vit: Transformer Engine has no attention kernel for this block ({what}); "
            "NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 prints why TE turned down each of its backends")



def fused_rope(t: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """TE's fused RoPE kernel on ``t`` ``[B, N, H, D]`` (``bshd``, any strides: a view of a packed
    QKV buffer is read in place), ``angles`` ``[N, 1, 1, D]`` fp32, one angle per channel.

    ``out = t * cos(angles) + rot(t) * sin(angles)`` with ``rot`` pairing channels ``(2i, 2i+1)``
    (``interleaved``) or ``(i, i + D/2)``; forward and backward are one kernel each.
    """
    rope = te_module("transformer_engine.pytorch.attention.rope")
    return rope.apply_rotary_pos_emb(t, angles, tensor_format="bshd", interleaved=interleaved, fused=True)


class _GatedActivation(torch.autograd.Function):
    """TE's gated activation kernel and its backward, for the unfused MLP (:func:`gated_activation`)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, name: str) -> torch.Tensor:
        tex = te_module("transformer_engine_torch")
        ctx.name = name
        ctx.save_for_backward(h)  # [..., 2H]: less than torch keeps (gate, act(gate), value)
        return getattr(tex, name)(h, None)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (h,) = ctx.saved_tensors
        return getattr(te_module("transformer_engine_torch"), "d" + ctx.name)(dy.contiguous(), h, None), None


def gated_activation(name: str):
    """``h [..., 2H] -> act(h[..., :H]) * h[..., H:]`` in one TE kernel (``swiglu``, ``geglu``,
    ``reglu``, ``qgeglu``, ``glu``), the backward in one more.

    Torch runs ``act(gate) * value`` on the two halves, views with a row stride of 2H that its
    vectorized kernels do not take: three strided kernels forward and backward, a third of EVA02-B's
    step time outside the GEMMs (docs/performance.md, lever 18).
    """
    # A partial of a module-level function, not a closure: the unfused MLP keeps it as an attribute
    # (``UnfusedMlp.gated_act``), and a closure made ``torch.save(model)`` / pickling fail.
    return functools.partial(_apply_gated_activation, name=name)


def _apply_gated_activation(h: torch.Tensor, name: str) -> torch.Tensor:
    return _GatedActivation.apply(h.contiguous(), name)


# TE's core library reads NVTE_NORM_{FWD,BWD}_USE_CUDNN once and nvte_enable_cudnn_norm_* changes
# it afterwards; TE's torch extension reads the variable on every call to pick the current-scaling
# path (TE's fused norm + amax kernel, which cuDNN cannot replace). Both must agree, and TE has no
# getter, so the setting is kept here.
_CUDNN_NORM_VARS = ("NVTE_NORM_FWD_USE_CUDNN", "NVTE_NORM_BWD_USE_CUDNN")
_cudnn_norm = {"on": all(os.environ.get(v, "0") == "1" for v in _CUDNN_NORM_VARS)}


def cudnn_norm_enabled() -> bool:
    """Whether TE's LayerNorm runs on cuDNN's kernels (see :func:`set_cudnn_norm`)."""
    return _cudnn_norm["on"]


def _cudnn_norm_switches():
    lib = getattr(te_module("transformer_engine.common"), "_TE_LIB_CTYPES", None)
    return getattr(lib, "nvte_enable_cudnn_norm_fwd", None), getattr(lib, "nvte_enable_cudnn_norm_bwd", None)


def cudnn_norm_available() -> bool:
    """Whether TE imports and its core library has the cuDNN LayerNorm switch (:func:`set_cudnn_norm`)."""
    return te_status().ok and None not in _cudnn_norm_switches()


def set_cudnn_norm(enabled: bool) -> bool:
    """Run TE's LayerNorm forward and backward on cuDNN's kernels (process-wide). Returns the old setting."""
    switches = _cudnn_norm_switches()
    if None in switches:
        raise TEUnavailableError(
            f"Transformer Engine {te_version()} does not expose nvte_enable_cudnn_norm_fwd/bwd in its "
            "core library; upgrade TE, or leave fp8vit.set_cudnn_layernorm off")
    for switch, var in zip(switches, _CUDNN_NORM_VARS):
        switch(bool(enabled))
        os.environ[var] = "1" if enabled else "0"
    old, _cudnn_norm["on"] = _cudnn_norm["on"], bool(enabled)
    return old


def cudnn_norm(enabled: bool) -> ContextManager[bool]:
    """:func:`set_cudnn_norm` for the duration of a ``with`` block, then the previous setting again."""
    return switched(cudnn_norm_enabled, set_cudnn_norm, enabled)
