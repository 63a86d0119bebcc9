"""Switches on a converted model's blocks: FP8 per block, activation checkpointing (whole blocks,
through TE's FP8-aware checkpoint), recompute of the MLP activations, and the patch embedding's
convolution as one GEMM.

``convert_to_te`` routes a timm model's own ``set_grad_checkpointing`` here
(:func:`install_checkpointing`): timm's ``checkpoint_seq`` around TE modules under FP8 fails on
recompute ("a different number of tensors was saved").
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
import torch.utils.checkpoint
from timm.layers import PatchEmbed
from torch import nn

from .. import _te
from .._validate import check_bool, check_int, check_items, check_model, check_module_filter
from ..blocks.base import FP8Block
from ..blocks.families import fp8vit_block_for
from ..blocks.linear import holds_linear, is_block, is_swapped
from ..blocks.patch_embed import PatchGemmConv2d, patchifies
from .autocast import own_forward, set_own_forward

__all__ = ["set_block_fp8", "set_grad_checkpointing", "set_mlp_recompute", "set_patch_gemm", "ModuleFilter",
           "install_checkpointing", "remove_checkpointing", "checkpointing_on", "patch_embed_convs"]

# ``fn(module, fqn) -> bool``: which modules a function acts on (``convert_to_te``, ``set_mlp_recompute``).
ModuleFilter = Callable[[nn.Module, str], bool]


def set_block_fp8(model: nn.Module, names: "str | Sequence[str]", enabled: bool) -> List[str]:
    """Turn FP8 on or off for the named modules of ``model`` (others are untouched).

    A name may be an fp8vit block, a swapped Linear (``fallback="linear"``), or any module holding
    such (then all of those it holds). With FP8 off they run their GEMMs in the autocast dtype
    inside ``fp8_context``.

    Args:
        model: a converted model.
        names: one block's name (``"blocks.0"``) or a sequence of them, as in ``model.named_modules()``.
        enabled: FP8 on (True) or off (False) for those blocks.

    Returns:
        the names, as a list.

    Raises:
        TypeError: ``model`` is not a module, ``names`` neither a str nor a sequence of them,
            ``enabled`` not a bool.
        ValueError: a name that is none of these in ``model``; nothing is changed then.
    """
    fn = "set_block_fp8"
    check_model(fn, model)
    # a str is one name, not its characters
    names = [names] if isinstance(names, str) else check_items(fn, "names", names, str, "module names (str)")
    check_bool(fn, "enabled", enabled)
    mods = dict(model.named_modules())
    targets, bad = [], []
    for n in names:
        mod = mods.get(n)
        inner = [] if mod is None else [m for m in mod.modules() if isinstance(m, FP8Block) or is_swapped(m)]
        if inner:
            targets.extend(inner)
        else:
            bad.append(n)
    if bad:
        known = [n for n, m in mods.items() if isinstance(m, FP8Block) or is_swapped(m)]
        if not known:
            raise ValueError(f"set_block_fp8: {bad}: this model has no fp8vit blocks or swapped Linears; "
                             "convert it with fp8vit.convert_to_te first")
        listed = ", ".join(known) if len(known) <= 4 else f"{known[0]}, {known[1]}, ..., {known[-1]}"
        raise ValueError(f"set_block_fp8: {bad} are not fp8vit blocks (TE_Block, ...), swapped Linears or "
                         f"modules holding them in this model; its {len(known)} are {listed} "
                         "(fp8vit.conversion_summary(model) lists what was converted)")
    for mod in targets:
        mod.fp8_enabled = enabled
    return names


def set_grad_checkpointing(model: nn.Module, enable: bool = True) -> nn.Module:
    """Activation checkpointing for every block of a converted ``model``.

    fp8vit's blocks checkpoint themselves through TE's checkpoint, which restores the FP8 state on
    recompute (timm's ``checkpoint_seq`` recomputes outside the FP8 autocast, and TE then saves a
    different set of tensors: "a different number of tensors was saved"). The other blocks
    (timm blocks kept by ``module_filter_fn`` or the fallback, and blocks whose Linears were
    swapped) checkpoint themselves too, each as a whole (the innermost blocks holding Linears),
    with TE's checkpoint where they hold TE Linears and torch's otherwise, since timm's own
    checkpointing must stay off around TE modules.

    Args:
        model: a converted model.
        enable: True to checkpoint, False to stop.

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, or ``enable`` not a bool.
    """
    check_model("set_grad_checkpointing", model)
    check_bool("set_grad_checkpointing", "enable", enable)
    for mod in model.modules():
        if isinstance(own_forward(mod), _CheckpointedForward):
            set_own_forward(mod, None)
        if isinstance(mod, FP8Block):
            mod.grad_checkpointing = enable
    if enable:
        for mod in _checkpoint_units(model):  # beneath set_fp8_autocast's forward, on a model that is a block
            set_own_forward(mod, _CheckpointedForward(mod))
    return model


def _checkpoint_units(model: nn.Module) -> List[nn.Module]:
    """The blocks other than fp8vit's that checkpoint themselves (:func:`set_grad_checkpointing`):
    blocks (``fp8vit.linear.is_block``, or of a family) that hold Linears and no other block."""
    units: List[nn.Module] = []

    def visit(mod: nn.Module, root: bool) -> bool:  # True: mod is or holds a block
        if isinstance(mod, FP8Block):
            return True
        nested = False
        for child in mod.children():
            nested |= visit(child, False)
        block = fp8vit_block_for(mod) is not None or is_block(mod, root)
        if block and not nested and holds_linear(mod):
            units.append(mod)
        return nested or block

    visit(model, True)
    return units


def set_mlp_recompute(model: nn.Module, enable: bool = True, *, every: int = 1,
                      module_filter_fn: Optional[ModuleFilter] = None) -> nn.Module:
    """Recompute the MLP activations of fp8vit's blocks (``TE_Block``, ...) in backward instead of saving them.

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
        every: change every ``every``-th of the chosen fp8vit blocks, in model order, starting
            with the first (1: all of them; 2: the 1st, 3rd, 5th, ...).
        module_filter_fn: ``fn(module, fqn) -> bool``; only fp8vit blocks for which it returns
            True are chosen (None: all of them).

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is not a module, ``enable`` not a bool, ``every`` not an integer,
            ``module_filter_fn`` not callable.
        ValueError: ``every`` is below 1, ``model`` has no fp8vit block, or ``module_filter_fn``
            selects none of them.
    """
    fn = "set_mlp_recompute"
    check_model(fn, model)
    check_bool(fn, "enable", enable)
    check_int(fn, "every", every, min=1, hint="(1: every chosen block, 2: every second, ...)")
    check_module_filter(fn, module_filter_fn)
    blocks = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, FP8Block)]
    if not blocks:
        raise ValueError(f"set_mlp_recompute: {type(model).__name__} has no fp8vit block (TE_Block, ...); "
                         "run fp8vit.convert_to_te(model) first (swapped Linears have no MLP to recompute)")
    chosen = [m for fqn, m in blocks if module_filter_fn is None or module_filter_fn(m, fqn)]
    if not chosen:
        raise ValueError(f"set_mlp_recompute: module_filter_fn selected none of the {len(blocks)} fp8vit blocks "
                         f"({blocks[0][0]} ... {blocks[-1][0]}); it must return True for the blocks to change")
    for blk in chosen[::every]:
        blk.recompute_mlp = enable
    return model


class _CheckpointedForward:
    """The ``forward`` of a block other than fp8vit's, with activation checkpointing: TE's
    checkpoint where the block holds TE's swapped Linears (it restores their FP8 state on
    recompute), torch's otherwise. An object, not a closure, so that the model still pickles."""

    def __init__(self, block: nn.Module):
        self.block = block
        self.te = any(isinstance(m, _te.SwappedLinear) for m in block.modules())

    def __call__(self, *args, **kwargs):
        forward = type(self.block).forward
        if not torch.is_grad_enabled():
            return forward(self.block, *args, **kwargs)
        if self.te:
            return _te.checkpoint(forward, self.block, *args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, self.block, *args, use_reentrant=False, **kwargs)


class _SetGradCheckpointing:
    """``model.set_grad_checkpointing`` of a converted timm model: the class's own method for the
    other parts (e.g. the patch embedding), with timm's own checkpointing kept off around the
    blocks (``checkpoint_seq`` over ``blocks``, a Swin stage's flag), then
    :func:`set_grad_checkpointing` for the blocks. An object, not a closure, so the model pickles."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, enable: bool = True) -> None:
        check_bool("set_grad_checkpointing", "enable", enable)  # before the class's method changes anything
        type(self.model).set_grad_checkpointing(self.model, enable)
        blocks = {id(m) for m in self.model.modules() if isinstance(m, FP8Block)}
        blocks |= {id(m) for m in _checkpoint_units(self.model)}
        for mod in self.model.modules():
            if (not isinstance(mod, FP8Block) and isinstance(vars(mod).get("grad_checkpointing"), bool)
                    and any(id(m) in blocks for m in mod.modules())):
                mod.grad_checkpointing = False
        set_grad_checkpointing(self.model, enable)


def checkpointing_on(model: nn.Module) -> bool:
    """Whether any block of ``model`` checkpoints itself (:func:`set_grad_checkpointing`)."""
    return any(m.grad_checkpointing for m in model.modules() if isinstance(m, FP8Block)) or any(
        isinstance(own_forward(m), _CheckpointedForward) for m in model.modules())


def remove_checkpointing(model: nn.Module) -> bool:
    """Undo :func:`install_checkpointing`: ``model.set_grad_checkpointing`` is the class's own
    method again. Returns whether there was anything to undo."""
    if isinstance(vars(model).get("set_grad_checkpointing"), _SetGradCheckpointing):
        del model.set_grad_checkpointing
        return True
    return False


def install_checkpointing(model: nn.Module) -> None:
    """Route ``model.set_grad_checkpointing`` to the blocks' own checkpointing (see above)."""
    if getattr(type(model), "set_grad_checkpointing", None) is None or "set_grad_checkpointing" in vars(model):
        return
    model.set_grad_checkpointing = _SetGradCheckpointing(model)
    # A model converted while checkpointing was on keeps it, now through TE.
    if getattr(model, "grad_checkpointing", False):
        model.set_grad_checkpointing(True)


def set_patch_gemm(model: nn.Module, enable: bool = True) -> List[str]:
    """Run the patch embedding's convolution of ``model`` as one GEMM under bf16/fp16 autocast.

    The ``proj`` ``Conv2d`` of every timm ``PatchEmbed`` in ``model`` whose kernel equals its stride
    (no padding, dilation or groups: a ViT's, a Swin's) becomes a
    :class:`fp8vit.blocks.patch_embed.PatchGemmConv2d` in place: the same module, parameters and
    state dict, its class only changed, so it can be called before or after ``convert_to_te``,
    before the optimizer is built or after. It then cuts the images into patches in one copy and
    multiplies them by the weight in one GEMM, in place of cuDNN's convolution and its NCHW <-> NHWC
    conversions, under 16-bit autocast only (fp32: the convolution, as timm's). Its output has the
    convolution's shape, laid out channels-last.

    Args:
        model: any module holding timm patch embeddings (converted or not).
        enable: True: GEMM; False: back to ``nn.Conv2d``.

    Returns:
        the names of the convolutions switched (``"patch_embed.proj"``).

    Raises:
        TypeError: ``model`` is not a module, or ``enable`` not a bool.
        ValueError: ``enable`` and ``model`` holds no patchifying timm ``PatchEmbed`` convolution.
    """
    check_model("set_patch_gemm", model)
    check_bool("set_patch_gemm", "enable", enable)
    found = patch_embed_convs(model)
    if enable and not found:
        embeds = [f"{n}: {type(getattr(m, 'proj', None)).__name__}" for n, m in model.named_modules()
                  if isinstance(m, PatchEmbed)]
        raise ValueError(f"set_patch_gemm: {type(model).__name__} holds no timm PatchEmbed whose proj is a Conv2d "
                         f"with kernel == stride and no padding, dilation or groups (its PatchEmbeds: "
                         f"{embeds or 'none'}); nothing to switch")
    for conv in found.values():
        conv.__class__ = PatchGemmConv2d if enable else nn.Conv2d
    return list(found)


def patch_embed_convs(model: nn.Module) -> dict:
    """The convolutions :func:`set_patch_gemm` switches: each timm ``PatchEmbed``'s patchifying
    ``proj``, by name (``"patch_embed.proj"``); empty where ``model`` holds none."""
    return {f"{n}.proj" if n else "proj": m.proj for n, m in model.named_modules()
            if isinstance(m, PatchEmbed) and patchifies(getattr(m, "proj", None))}
