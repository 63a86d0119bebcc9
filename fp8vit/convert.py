"""Swap the blocks of a built timm ViT for ``TE_Block`` and back, keeping weights.

Modelled on torchao's ``convert_to_float8_training(module, *, module_filter_fn, config)``:
in place, returns the model, an optional filter decides per module.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.utils.checkpoint
from timm.models.vision_transformer import Block
from torch import nn

from .block import TE_Block
from .errors import ConversionError

__all__ = ["convert_to_te", "convert_from_te", "set_grad_checkpointing", "set_mlp_recompute", "set_block_fp8",
           "ModuleFilter"]

ModuleFilter = Callable[[nn.Module, str], bool]


def _unconvertible(mod: nn.Module) -> bool:
    """A ViT block variant of timm's (``ResPostBlock``, ``ParallelScalingBlock``, ``DiffBlock``, ...)
    that is not the pre-norm ``Block`` TE_Block implements."""
    cls = type(mod)
    return cls.__module__ == Block.__module__ and cls.__name__.endswith("Block") and not isinstance(mod, Block)


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
    fp32_residual: bool = False,
) -> nn.Module:
    """Replace every timm ``Block`` of ``model`` by an equivalent ``TE_Block``, in place.

    Weights are copied exactly (timm's QKV layout is kept), as are training mode, device, dtype
    and frozen parameters (``requires_grad``). Also makes ``model.set_grad_checkpointing()`` use
    TE's FP8-aware checkpointing. Calling it on a model built with ``block_fn=TE_Block`` only does
    the latter. All blocks are built before any is swapped: a failure leaves the model unchanged.

    Args:
        model: a timm ``VisionTransformer`` (vit_*, deit_*, deit3_*, eva-free ViTs with
            register tokens, no class token, any pooling), any module containing timm ``Block``s,
            or a timm ``Block`` itself (then the new ``TE_Block`` is returned).
        module_filter_fn: ``fn(module, fqn) -> bool``; blocks for which it returns False stay
            timm blocks (e.g. keep the first and last block in bf16).
        exact_gelu: keep timm's erf GELU (unfused MLP) instead of TE's tanh GELU kernel.
        backend: ``"te"``, ``"reference"`` or None (automatic); see ``TE_Block``.
        fp32_residual: keep the residual stream in fp32 under autocast (timm's behaviour; slower,
            see ``TE_Block``).

    Returns:
        ``model`` (or the ``TE_Block`` replacing it, if ``model`` is a ``Block``).

    Raises:
        ConversionError: ``model`` holds no timm ``Block``, or a block (selected by the filter)
            cannot be converted; named with its path and the reason.
    """
    kw = dict(exact_gelu=exact_gelu, backend=backend, fp32_residual=fp32_residual)
    if isinstance(model, Block) and not _unconvertible(model):
        return _convert_one(model, type(model).__name__, kw)
    found, new = False, {}
    for fqn, mod in model.named_modules():
        if isinstance(mod, TE_Block) or not (isinstance(mod, Block) or _unconvertible(mod)):
            continue
        found = True
        if module_filter_fn is None or module_filter_fn(mod, fqn):
            new[fqn] = _convert_one(mod, fqn, kw)
    if not found and not any(isinstance(m, TE_Block) for m in model.modules()):
        raise ConversionError(f"{type(model).__name__} holds no timm Block "
                                  f"({Block.__module__}.Block) to convert")
    for fqn, block in new.items():  # every block built: swap them all
        _swap(model, fqn, block)
    _install_checkpointing(model)
    return model


def _convert_one(mod: nn.Module, fqn: str, kw: dict) -> TE_Block:
    if _unconvertible(mod):
        raise ConversionError(f"{fqn} ({type(mod).__name__}) cannot be converted: TE_Block implements "
                              "timm's pre-norm Block only; exclude it with module_filter_fn")
    try:
        return TE_Block.from_timm(mod, **kw)
    except ValueError as err:
        raise ConversionError(f"{fqn}: {err}") from err


def convert_from_te(model: nn.Module) -> nn.Module:
    """Replace every ``TE_Block`` by the equivalent timm ``Block``, in place.

    The result's ``state_dict()`` loads into ``timm.create_model(name)``. FP8 scaling state has no
    timm counterpart and is dropped. Frozen parameters stay frozen; activation checkpointing, if
    on, goes back to timm's own.

    Returns:
        ``model`` (or the timm ``Block`` replacing it, if ``model`` is a ``TE_Block``).
    """
    if isinstance(model, TE_Block):
        return model.to_timm()
    checkpointing = any(m.grad_checkpointing for m in model.modules() if isinstance(m, TE_Block))
    set_grad_checkpointing(model, False)
    new = {fqn: mod.to_timm() for fqn, mod in model.named_modules() if isinstance(mod, TE_Block)}
    for fqn, block in new.items():
        _swap(model, fqn, block)
    if isinstance(vars(model).get("set_grad_checkpointing"), _SetGradCheckpointing):
        del model.set_grad_checkpointing  # back to the class's own method
        if checkpointing:
            model.set_grad_checkpointing(True)
    return model


def set_block_fp8(model: nn.Module, names: "str | Sequence[str]", enabled: bool) -> List[str]:
    """Turn FP8 on or off for the named ``TE_Block``s of ``model`` (others are untouched).

    A block with FP8 off runs its GEMMs in the autocast dtype inside ``fp8_context``.

    Args:
        model: a converted model.
        names: one block's name (``"blocks.0"``) or a sequence of them, as in ``model.named_modules()``.
        enabled: FP8 on (True) or off (False) for those blocks.

    Returns:
        the names, as a list.

    Raises:
        ValueError: a name that is not a ``TE_Block`` of ``model``; nothing is changed then.
    """
    names = [names] if isinstance(names, str) else list(names)  # a str is one name, not its characters
    mods = dict(model.named_modules())
    bad = [n for n in names if not isinstance(mods.get(n), TE_Block)]
    if bad:
        known = [n for n, m in mods.items() if isinstance(m, TE_Block)]
        if not known:
            raise ValueError(f"not TE_Blocks of this model: {bad}; it has none: convert it with "
                             "fp8vit.convert_to_te first")
        listed = ", ".join(known) if len(known) <= 4 else f"{known[0]}, {known[1]}, ..., {known[-1]}"
        raise ValueError(f"not TE_Blocks of this model: {bad}; its {len(known)} TE_Blocks are {listed}")
    for n in names:
        mods[n].fp8_enabled = enabled
    return names


def set_grad_checkpointing(model: nn.Module, enable: bool = True) -> nn.Module:
    """Activation checkpointing for every block of a converted ``model``.

    ``TE_Block``s checkpoint themselves through TE's checkpoint, which restores the FP8 state on
    recompute (timm's ``checkpoint_seq`` recomputes outside the FP8 autocast, and TE then saves a
    different set of tensors: "a different number of tensors was saved"). timm ``Block``s kept by
    ``module_filter_fn`` beside them checkpoint themselves with torch's checkpoint, since timm's
    own ``checkpoint_seq`` must stay off for such a model.
    """
    for mod in model.modules():
        if isinstance(mod, TE_Block):
            mod.grad_checkpointing = enable
        elif isinstance(mod, Block):
            if enable:
                mod.forward = _CheckpointedForward(mod)
            elif isinstance(vars(mod).get("forward"), _CheckpointedForward):
                del mod.forward
    return model


def set_mlp_recompute(model: nn.Module, enable: bool = True, *, every: int = 1,
                      module_filter_fn: Optional[ModuleFilter] = None) -> nn.Module:
    """Recompute the MLP activations of ``TE_Block``s in backward instead of saving them.

    Selective activation checkpointing: the MLP's saved activations (fc1's output and the
    activation's, ``[B, N, 4C]`` each) are most of a block's. With TE's fused ``LayerNormMLP`` this is
    TE's own ``checkpoint=True`` (LayerNorm, fc1 and the activation rerun in backward, with the
    forward's FP8 scales; fc2 is not rerun). Memory and time scale with the number of blocks chosen,
    so a subset trades between the two (``every=2``: blocks 0, 2, 4, ...). :func:`make_graphed_blocks` captures it with
    the blocks when the MLP is TE's fused one. Measured on ViT-H/16, blocks graphed with cuDNN
    LayerNorm (H200, docs/performance.md, levers 14 and 15): the largest batch grows from 576 images
    to 768 with every second block (592 to 784 with ``fused_wgrad=False``, +5% step time) and to 1120
    with all (+10%, ``fused_wgrad=False``). Blocks whose whole forward
    is checkpointed (:func:`set_grad_checkpointing`) ignore it.

    Args:
        model: a converted model.
        enable: True to recompute, False to save the activations again.
        every: change every ``every``-th of the chosen ``TE_Block``s, in model order, starting
            with the first (1: all of them; 2: the 1st, 3rd, 5th, ...).
        module_filter_fn: ``fn(module, fqn) -> bool``; only ``TE_Block``s for which it returns
            True are chosen (None: all of them).

    Returns:
        ``model``.

    Raises:
        ValueError: ``model`` has no ``TE_Block``, ``module_filter_fn`` selects none of them, or
            ``every`` is not a positive integer.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"set_mlp_recompute: every={every!r}; it must be an integer >= 1 "
                         "(1: every chosen block, 2: every second, ...)")
    blocks = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, TE_Block)]
    if not blocks:
        raise ValueError(f"set_mlp_recompute: {type(model).__name__} has no TE_Block; "
                         "run fp8vit.convert_to_te(model) first")
    chosen = [m for fqn, m in blocks if module_filter_fn is None or module_filter_fn(m, fqn)]
    if not chosen:
        raise ValueError(f"set_mlp_recompute: module_filter_fn selected none of the {len(blocks)} TE_Blocks "
                         f"({blocks[0][0]} ... {blocks[-1][0]}); it must return True for the blocks to change")
    for blk in chosen[::every]:
        blk.recompute_mlp = bool(enable)
    return model


class _CheckpointedForward:
    """The ``forward`` of a timm ``Block`` kept beside ``TE_Block``s, with activation checkpointing.
    An object, not a closure, so that the model still pickles."""

    def __init__(self, block: nn.Module):
        self.block = block

    def __call__(self, *args, **kwargs):
        forward = type(self.block).forward
        if not torch.is_grad_enabled():
            return forward(self.block, *args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, self.block, *args, use_reentrant=False, **kwargs)


class _SetGradCheckpointing:
    """``model.set_grad_checkpointing`` of a converted timm model: the class's own method for the
    other parts (e.g. the patch embedding), with timm's ``checkpoint_seq`` kept off, then
    :func:`set_grad_checkpointing` for the blocks. An object, not a closure, so the model pickles."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, enable: bool = True) -> None:
        type(self.model).set_grad_checkpointing(self.model, enable)
        self.model.grad_checkpointing = False
        set_grad_checkpointing(self.model, enable)


def _install_checkpointing(model: nn.Module) -> None:
    """Route ``model.set_grad_checkpointing`` to the blocks' own checkpointing (see above)."""
    if getattr(type(model), "set_grad_checkpointing", None) is None or "set_grad_checkpointing" in vars(model):
        return
    model.set_grad_checkpointing = _SetGradCheckpointing(model)
    # A model converted while checkpointing was on keeps it, now through TE.
    if getattr(model, "grad_checkpointing", False):
        model.set_grad_checkpointing(True)
