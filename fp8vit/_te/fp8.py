"""TE's FP8 execution state: its autocast, the active recipe, FP8 primary weights, the optimizer
and checkpointing that go with them, and the delayed-scaling state (amax histories, scales) that
diagnostics and guards read and repair."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from .loader import load_te, te_module, te_status

__all__ = ["autocast", "active_fp8_recipe", "quantized_model_init", "is_quantized", "fused_adam", "checkpoint",
           "scaling_state", "repair_amax_histories"]


def autocast(enabled: bool, recipe: Any, amax_reduction_group=None):
    """TE's FP8 autocast (``te.autocast``; ``te.fp8_autocast`` is its deprecated name).

    Args:
        amax_reduction_group: the process group over which delayed scaling's amaxes are
            max-reduced when the autocast (forward) and the first module's backward end. None:
            TE reduces over the default group whenever ``torch.distributed`` is initialized
            (TE 2.20 ``quantization.py``, ``reduce_and_update_fp8_tensors``: it asks
            ``get_world_size(group=None)``).
    """
    return load_te().autocast(enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group)


def quantized_model_init(recipe: Any):
    """``te.quantized_model_init(enabled=True, recipe=recipe)``: TE modules built inside hold only
    quantized (FP8) copies of their GEMM weights, as ``QuantizedTensor`` parameters."""
    return load_te().quantized_model_init(enabled=True, recipe=recipe)


def is_quantized(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or, for an FSDP2 ``DTensor``, its local shard) is a TE ``QuantizedTensor``
    (an FP8 primary weight). False where TE is absent."""
    if not te_status().ok:
        return False
    local = getattr(tensor, "_local_tensor", tensor)
    return isinstance(local, load_te().QuantizedTensor)


def fused_adam(params, **kwargs):
    """``te.optimizers.FusedAdam(params, **kwargs)``: the optimizer TE pairs with FP8 primary
    weights (``master_weights=True`` keeps an fp32 master copy of each one in its state)."""
    return load_te().optimizers.FusedAdam(params, **kwargs)


def checkpoint(function, *args, **kwargs):
    """Activation checkpointing that keeps TE's FP8 state consistent on recompute."""
    return load_te().checkpoint(function, *args, use_reentrant=False, **kwargs)


def _state_manager():
    return te_module("transformer_engine.pytorch.quantization").FP8GlobalStateManager


def active_fp8_recipe() -> Optional[Any]:
    """The recipe of the innermost enabled TE FP8 autocast, or None (also when TE is absent)."""
    if not te_status().ok:
        return None
    mgr = _state_manager()
    return mgr.get_fp8_recipe() if mgr.is_fp8_enabled() else None


def _delayed_states(module: nn.Module):
    """``(name, key, state)`` for every delayed-scaling state (``fp8_meta[scaling_fwd/bwd]``)."""
    for name, mod in module.named_modules():
        meta = getattr(mod, "fp8_meta", None)
        if not isinstance(meta, dict):
            continue
        for key in ("scaling_fwd", "scaling_bwd"):
            state = meta.get(key)
            if isinstance(getattr(state, "amax_history", None), torch.Tensor):
                yield name, key, state


def scaling_state(module: nn.Module) -> Dict[str, List[float]]:
    """``{submodule: [amax, scale]}`` of the forward input of every TE module under ``module``
    that ran delayed scaling (empty for stateless recipes and the reference backend)."""
    return {name: [float(st.amax_history[0][0]), float(st.scale[0])]
            for name, key, st in _delayed_states(module) if key == "scaling_fwd"}


def repair_amax_histories(module: nn.Module) -> int:
    """Replace non-finite values in every TE amax history under ``module`` by zero.

    One non-finite step would otherwise freeze the FP8 scales for the whole history length.

    Returns:
        how many histories held a non-finite value.
    """
    fixed = 0
    with torch.no_grad():
        for _, _, state in _delayed_states(module):
            hist = state.amax_history
            if not bool(torch.isfinite(hist).all()):
                torch.nan_to_num_(hist, nan=0.0, posinf=0.0, neginf=0.0)
                fixed += 1
    return fixed
