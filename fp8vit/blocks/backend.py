"""What a ``TE_Block`` is built from: Transformer Engine's modules, or PyTorch reference stand-ins.

=============  ============================================================================
``"te"``       TE's fused modules on CUDA; FP8 inside ``fp8_context``
``"reference"``  ``fp8vit.blocks.reference``: the same parameters and maths in plain PyTorch, no FP8;
               runs anywhere (CPU tests, machines without TE)
=============  ============================================================================

The choice is made once per block (``resolve_backend``); a :class:`Backend` then answers the
few questions whose answer differs (token-row alignment under FP8, checkpointing, turning FP8
off for one block), so the block itself has no backend branches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.utils.checkpoint

from .. import _te
from . import reference
from .._validate import check_bool, check_choice
from .._warn import warn_once
from ..errors import TEUnavailableError

__all__ = ["BACKENDS", "Backend", "check_backend", "get_backend", "resolve_backend", "set_cudnn_layernorm",
           "set_bias_grad_kernel", "set_residual_gemm", "set_norm_grad_add"]

BACKENDS = ("te", "reference")


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend's modules and behaviour.

    Attributes:
        name: ``"te"`` or ``"reference"``.
        modules: ``LayerNormLinear``, ``Linear``, ``LayerNormMLP``, ``DotProductAttention``.
        default_device: where parameters go when the caller names no device.
    """

    name: str
    modules: types.SimpleNamespace
    default_device: str

    @property
    def fp8(self) -> bool:
        """Whether this backend's GEMMs can run in FP8."""
        return self.name == "te"

    def active_recipe(self) -> Optional[Any]:
        """The FP8 recipe the enclosing ``fp8_context`` set, or None (always None for reference)."""
        return _te.active_fp8_recipe() if self.fp8 else None

    def fp8_off(self) -> ContextManager:
        """A nested TE autocast with FP8 disabled (this block runs bf16 inside fp8_context)."""
        return _te.autocast(enabled=False, recipe=None) if self.fp8 else contextlib.nullcontext()

    def attention(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        """``attn(q, k, v)`` for q, k, v that are views of one packed ``[B, N, 3, H, D]`` buffer."""
        if self.fp8:
            return _te.packed_attention(attn, q, k, v, **kwargs)
        return attn(query_layer=q, key_layer=k, value_layer=v, **kwargs)

    def rope(self, t: torch.Tensor, angles: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
        """RoPE on ``t`` ``[B, N, H, D]`` with ``angles`` ``[N, 1, 1, D]`` (TE's fused kernel for TE)."""
        if self.fp8:
            return _te.fused_rope(t, angles, interleaved)
        return reference.rope(t, angles, interleaved)

    def cast_small_params(self, block: torch.nn.Module) -> ContextManager:
        """TE: the block's TE modules get their norm weights and biases cast to the autocast dtype
        by one kernel for the forward (:func:`fp8vit._te.cast_small_params`), not one each."""
        return _te.cast_small_params(block) if self.fp8 else contextlib.nullcontext()

    def checkpoint(self, fn: Callable, *args) -> torch.Tensor:
        """Activation checkpointing; TE's version restores the FP8 state on recompute."""
        if self.fp8:
            return _te.checkpoint(fn, *args)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


@functools.lru_cache(maxsize=None)
def get_backend(name: str) -> Backend:
    """The :class:`Backend` called ``name`` (``"te"`` loads TE and raises if it cannot)."""
    check_choice("get_backend", "name", name, BACKENDS)
    if name == "te":
        return Backend("te", _te.modules(), "cuda")
    return Backend("reference", reference.modules(), "cpu")


def check_backend(fn: str, backend: Optional[str]) -> Optional[str]:
    """``backend`` if it is a name in :data:`BACKENDS` or None: the check :func:`resolve_backend`
    makes, for an entry (``fn``) to make at its call, before any work.

    Raises:
        TypeError: not a str (or None).
        ValueError: an unknown name.
    """
    return check_choice(fn, "backend", backend, BACKENDS, none_ok=True, also=" (automatic)")


def resolve_backend(backend: Optional[str], fn: str = "resolve_backend") -> str:
    """The backend name a block should use.

    Args:
        backend: ``"te"``, ``"reference"``, or None: TE where it is installed and a GPU is visible,
            else the reference modules with one warning saying why.
        fn: the public entry to name in the error for a bad ``backend`` (:func:`check_backend`).

    Raises:
        TypeError: ``backend`` is not a str or None.
        ValueError: an unknown name.
        TEUnavailableError: ``"te"`` was asked for, or TE is installed on a GPU machine, and
            TE does not import; the message has TE's import error and the fix. Pass
            ``backend="reference"`` to run without TE deliberately.
    """
    if check_backend(fn, backend) is not None:
        if backend == "te":
            _te.load_te()
        return backend
    gpu = torch.cuda.is_available()
    status = _te.te_status()
    if status.ok and gpu:
        return "te"
    if gpu and _te.installed():
        # TE is there but broken: silently training without FP8 would hide it.
        raise TEUnavailableError(f"Transformer Engine is installed but unusable: {status.reason}. "
                                 "Fix the install, or pass backend='reference' to run without TE")
    why = status.reason if not status.ok else "no CUDA GPU is visible"
    # Not "TE_Block": every fp8vit block (TE_EvaBlock too) and the swapped FP8 Linears come here.
    warn_once(f"fp8vit: the fused blocks and FP8 Linears use PyTorch reference modules (same weights, no FP8): {why}",
              RuntimeWarning, stacklevel=3)
    return "reference"


def set_cudnn_layernorm(enabled: bool = True) -> bool:
    """Run TE's LayerNorm kernels, forward and backward, on cuDNN instead of TE's own.

    TE 2.20 ships tuned LayerNorm kernels for a list of widths
    (``fp8vit.training.graph_cache.TE_TUNED_LAYERNORM_WIDTHS``: 768, 1024, 1536, ...); others, such
    as ViT-H's 1280 and Swin's and ConvNeXt's 128-512, run its general kernels. At ViT-H/16 on an
    H200 (batch 128, blocks CUDA-graphed) cuDNN's kernels cut LayerNorm time from 15.4 to 5.6 ms
    per step and the step from 160.2 to 154.2 ms; at ViT-B and ViT-L the graphed step did not change
    (docs/performance.md, lever 8). The switch is TE's and process-wide: it applies to every TE
    LayerNorm in this process, including models fp8vit did not build, until it is set back.
    Without CUDA graphs cuDNN's kernels cost more host time per call, which an eager ViT-H step
    (close to host-bound) can lose again; ``make_graphed_blocks(..., cudnn_layernorm=True)`` uses
    them in the captured graphs only.

    Args:
        enabled: True for cuDNN's kernels, False for TE's own (TE's default).

    Returns:
        The previous setting.

    Raises:
        TypeError: ``enabled`` is not a bool.
        TEUnavailableError: TE does not import, or its core library lacks the switch.
    """
    check_bool("set_cudnn_layernorm", "enabled", enabled)
    return _te.set_cudnn_norm(enabled)


def set_bias_grad_kernel(enabled: bool = True) -> bool:
    """Cast TE's FP8 output gradients, transpose them and sum their columns (the bias gradient) with
    fp8vit's Triton kernel instead of TE's ``bgrad_quantize``, in eager steps too.

    ``make_graphed_blocks`` captures this kernel in its backward graphs by default
    (``triton_dbias=True``; ViT-B/16 b128 on an H100: -0.6 ms a step, ViT-L/16 -1.5 ms;
    docs/performance.md, lever 49) and restores the setting after capture, so eager steps run TE's
    kernel. The FP8 bytes, amax and scale are TE's; the bias gradient is the same fp32 sum in
    another order, so it can differ from TE's in its last bf16 bit. Set it to make eager training
    run the graphs' kernels (graphed and eager then train bit for bit alike). The switch is
    process-wide: it applies to every TE module under delayed scaling in this process until it
    is set back; other recipes keep TE's kernel.

    Args:
        enabled: True for fp8vit's kernel, False for TE's own (the default outside the graphs).

    Returns:
        The previous setting.

    Raises:
        TypeError: ``enabled`` is not a bool.
        TEUnavailableError: TE does not import (turning the kernel on).
        RuntimeError: turning it on where fp8vit's Triton kernels cannot run (the reason given).
    """
    return _switch("set_bias_grad_kernel", enabled, _te.bias_grad_kernel_enabled, _te.set_bias_grad_kernel,
                   _no_triton("TE's kernel stays"))


def set_residual_gemm(enabled: bool = True) -> bool:
    """Add the classic ViT block's residual stream in the FP8 GEMM before each add (``x + proj(o)``,
    ``x + fc2(h)``: cuBLASLt reads ``x`` as its C matrix, by fp8vit's own call), in eager steps too.

    ``make_graphed_blocks`` captures it in its forward graphs by default (``residual_gemm=True``;
    ViT-L/16 b128 on an H100: -2.1 ms a step, ViT-B/16 -0.6, ViT-H/16 -2.4; docs/performance.md,
    lever 61) and restores the setting after capture, so eager steps add apart. The sum is rounded
    to bf16 once instead of twice. TE's input-gradient GEMMs (``Linear``, ``LayerNormLinear``,
    ``LayerNormMLP``) run by the same call, each GEMM form on the fastest of cuBLASLt's first 8
    algorithms, timed the first time it runs (lever 62; the heuristic's first, as TE, under
    ``torch.use_deterministic_algorithms(True)``). Set it to make eager training run the graphs'
    kernels (graphed and eager then train bit for bit alike). Process-wide, for ``TE_Block``s
    without LayerScale, drop path or dropout at work, with a bf16 stream, under per-tensor FP8
    recipes (``delayed``, ``current``); the other blocks and GEMMs add as before.

    Args:
        enabled: True to add the residual in the GEMM, False to add it after TE's GEMM (the default
            outside the graphs).

    Returns:
        The previous setting.

    Raises:
        TypeError: ``enabled`` is not a bool.
        RuntimeError: turning it on where it cannot run (no TE, no CUDA device, a GPU without FP8
            GEMMs, cuBLASLt not found; the reason given).
    """
    return _switch("set_residual_gemm", enabled, _te.residual_gemm_enabled, _te.set_residual_gemm,
                   lambda: f"{_te.residual_gemm_support().reason}; the residual is added after TE's GEMM")


def set_norm_grad_add(enabled: bool = True) -> bool:
    """Sum the classic ViT block's two gradients of its input (the skip path's and the LayerNorm's)
    inside TE's LayerNorm backward, in fp8vit's Triton kernel, in eager steps too.

    ``make_graphed_blocks`` captures it in its backward graphs by default (``norm_grad_add=True``;
    ViT-L/16 b128 on an H100: -1.1 ms a step, ViT-B/16 -0.1; docs/performance.md, lever 70) and
    restores the setting after capture, so eager steps add apart. The sum is rounded to bf16 once
    instead of twice. It applies where :func:`set_residual_gemm`'s add is taken (the block's
    gradients then meet in the norm); set both to make eager training run the graphs' kernels
    (graphed and eager then train bit for bit alike). Process-wide.

    Args:
        enabled: True to add in the norm's backward, False to add after TE's (the default outside
            the graphs).

    Returns:
        The previous setting.

    Raises:
        TypeError: ``enabled`` is not a bool.
        TEUnavailableError: TE does not import (turning it on).
        RuntimeError: turning it on where fp8vit's Triton kernels cannot run (the reason given).
    """
    return _switch("set_norm_grad_add", enabled, _te.norm_grad_add_enabled, _te.set_norm_grad_add,
                   _no_triton("the gradients are added after TE's backward"))


def _no_triton(instead: str) -> Callable[[], str]:
    """A :func:`_switch` ``why_not`` for a Triton kernel: Triton's reason, then what runs ``instead``."""
    return lambda: f"fp8vit's Triton kernels cannot run here ({_te.kernels.triton_support().reason}); {instead}"


def _switch(fn: str, enabled: bool, current: Callable[[], bool], setter: Callable[[bool], bool],
            why_not: Callable[[], str]) -> bool:
    """A process-wide switch of the graphs' kernels for eager steps: check ``enabled``, set it,
    return the previous setting; raise with ``why_not()`` where turning it on failed."""
    check_bool(fn, "enabled", enabled)
    old = current()
    if setter(enabled) != enabled:  # only turning it on can fail
        raise RuntimeError(f"{fn}(True): {why_not()}")
    return old
