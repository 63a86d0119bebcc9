"""Swap the blocks of a built timm ViT for ``TE_Block`` and back, keeping weights.

Modelled on torchao's ``convert_to_float8_training(module, *, module_filter_fn, config)``:
in place, returns the model, an optional filter decides per module.
"""

from __future__ import annotations

import types
from typing import Callable, Optional

import torch
from torch import nn

from .block import TE_Block
from .errors import ConversionError

__all__ = ["convert_to_te", "convert_from_te", "set_grad_checkpointing"]

ModuleFilter = Callable[[nn.Module, str], bool]


def _timm_block_types():
    from timm.models.vision_transformer import Block
    return (Block,)


def _known_unconvertible():
    """timm block classes that look like ViT blocks but that TE_Block does not implement."""
    import timm.models.vision_transformer as vt
    names = ("ResPostBlock", "ParallelScalingBlock", "ParallelThingsBlock", "DiffBlock")
    return tuple(getattr(vt, n) for n in names if hasattr(vt, n))


def _swap(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def convert_to_te(
    model: nn.Module,
    *,
    module_filter_fn: Optional[ModuleFilter] = None,
    exact_gelu: bool = False,
    backend: Optional[str] = None,
) -> nn.Module:
    """Replace every timm ``Block`` of ``model`` by an equivalent ``TE_Block``, in place.

    Weights are copied exactly (timm's QKV layout is kept), as are training mode, device and
    dtype. Also makes ``model.set_grad_checkpointing()`` use TE's FP8-aware checkpointing.
    Calling it on a model built with ``block_fn=TE_Block`` only does the latter.

    Args:
        model: a timm ``VisionTransformer`` (vit_*, deit_*, deit3_*, eva-free ViTs with
            register tokens, no class token, any pooling) or any module containing timm ``Block``s.
        module_filter_fn: ``fn(module, fqn) -> bool``; blocks for which it returns False stay
            timm blocks (e.g. keep the first and last block in bf16).
        exact_gelu: keep timm's erf GELU (unfused MLP) instead of TE's tanh GELU kernel.
        backend: ``"te"``, ``"torch"`` or None (automatic); see ``TE_Block``.

    Returns:
        ``model``.

    Raises:
        ConversionError: a block (selected by the filter) that cannot be converted, named with
            its path and the reason.
    """
    block_types, odd_types = _timm_block_types(), _known_unconvertible()
    for fqn, mod in list(model.named_modules()):
        if not isinstance(mod, block_types + odd_types) or isinstance(mod, TE_Block):
            continue
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            continue
        if isinstance(mod, odd_types):
            raise ConversionError(f"{fqn} ({type(mod).__name__}) cannot be converted: TE_Block implements "
                                  "timm's pre-norm Block only; exclude it with module_filter_fn")
        try:
            new = TE_Block.from_timm(mod, exact_gelu=exact_gelu, backend=backend)
        except ValueError as err:
            raise ConversionError(f"{fqn}: {err}") from err
        _swap(model, fqn, new)
    _install_checkpointing(model)
    return model


def convert_from_te(model: nn.Module) -> nn.Module:
    """Replace every ``TE_Block`` by the equivalent timm ``Block``, in place.

    The result's ``state_dict()`` loads into ``timm.create_model(name)``. FP8 scaling state has no
    timm counterpart and is dropped.

    Returns:
        ``model``.
    """
    for fqn, mod in list(model.named_modules()):
        if isinstance(mod, TE_Block):
            _swap(model, fqn, mod.to_timm())
    if "set_grad_checkpointing" in vars(model):
        del model.set_grad_checkpointing  # back to the class's own method
    return model


def set_grad_checkpointing(model: nn.Module, enable: bool = True) -> nn.Module:
    """Activation checkpointing for every ``TE_Block`` of ``model``, through TE's checkpoint.

    timm's ``checkpoint_seq`` recomputes blocks outside the FP8 autocast, and TE then saves a
    different set of tensors ("a different number of tensors was saved"). ``TE_Block`` instead
    checkpoints itself with ``te.distributed.checkpoint``, which restores the FP8 state on recompute.
    """
    for mod in model.modules():
        if isinstance(mod, TE_Block):
            mod.grad_checkpointing = enable
    return model


def _install_checkpointing(model: nn.Module) -> None:
    """Route ``model.set_grad_checkpointing`` to TE_Block's own checkpointing.

    timm's flag stays False for the blocks (so timm never wraps them in ``checkpoint_seq``);
    the method of the class still runs for the other parts (e.g. the patch embedding).
    """
    original = getattr(type(model), "set_grad_checkpointing", None)  # may live in a base class
    if original is None or "set_grad_checkpointing" in vars(model):
        return

    def _set(self, enable: bool = True):
        original(self, enable)
        if any(isinstance(m, TE_Block) for m in getattr(self, "blocks", self).modules()):
            self.grad_checkpointing = False
        set_grad_checkpointing(self, enable)

    model.set_grad_checkpointing = types.MethodType(_set, model)
    # A model converted while checkpointing was on keeps it, now through TE.
    if getattr(model, "grad_checkpointing", False):
        model.set_grad_checkpointing(True)
