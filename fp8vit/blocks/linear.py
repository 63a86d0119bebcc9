"""The generic path: FP8 for the blocks fp8vit has no fused block for, by swapping their
``nn.Linear``s for TE's FP8 ``Linear`` (as torchao's module swap does), weights kept.

What is a block (:func:`is_block`): a module whose class name contains ``Block`` or ends with
``Layer`` or ``Transformer``, which is how timm names the repeated units of its models
(``Block``, ``EvaBlock``, ``SwinTransformerBlock``, ``LayerScaleBlockClassAttn``, ``XCABlock``,
``ConvNeXtBlock``, ``TransformerLayer``, VOLO's and PiT's ``Transformer``, ...). The model itself
is a block only if its class name contains ``Block`` (a bare block passed to ``convert_to_te``):
timm's model classes end with ``Transformer``. Linears outside every block (the classifier head,
patch and token embeddings, attention-pool heads, Swin's patch merging, VOLO's outlookers) are
never swapped, as torchao leaves the head and the embeddings out by default.

Which Linears are swapped (:func:`swap_refusal`): exactly ``nn.Linear`` (or timm's
``timm.layers.Linear``; a subclass may be used through its weight by its owner, as
``nn.MultiheadAttention`` does with ``out_proj``), with input and output features that are
multiples of 16 (TE's FP8 GEMMs need them; MXFP8 needs 32, which the swapped Linear checks when
it runs and otherwise runs in bf16).

The swapped Linear (``fp8vit._te.SwappedLinear``; ``fp8vit.blocks.reference.FP8Linear`` on the reference
backend) holds the very same ``weight`` and ``bias`` parameters, so its state dict keys are
``nn.Linear``'s and an optimizer built before the swap still updates them. It takes any leading
dims, pads the token rows to the recipe's multiple under FP8, and runs FP8 only inside
``fp8_context``.
"""

from __future__ import annotations

import re
from typing import Optional

from torch import nn

from .. import _te
from . import reference

__all__ = ["FEATURE_MULTIPLE", "holds_linear", "is_block", "is_swapped", "swap_refusal", "to_fp8_linear", "switch_owner",
           "to_torch_linear", "restore_owner"]

# TE's FP8 GEMMs need the inner (feature) dims to be multiples of 16 (MXFP8: 32, checked at run time).
FEATURE_MULTIPLE = 16

_BLOCK_NAME = re.compile(r"Block|Layer$|Transformer$")


def _linear_types() -> tuple:
    try:
        from timm.layers import Linear as TimmLinear  # nn.Linear with a TorchScript-only cast
    except ImportError:
        return (nn.Linear,)
    return (nn.Linear, TimmLinear)


_LINEAR_TYPES = _linear_types()


def is_block(module: nn.Module, root: bool = False) -> bool:
    """Whether ``module`` is a block whose Linears the generic path may swap (module docstring).

    Args:
        root: ``module`` is the model passed to ``convert_to_te`` (a block only if its class name
            contains ``Block``).
    """
    name = type(module).__name__
    return "Block" in name if root else _BLOCK_NAME.search(name) is not None


def is_swapped(module: nn.Module) -> bool:
    """Whether ``module`` is a Linear the generic path swapped in (either backend)."""
    return isinstance(module, (_te.SwappedLinear, reference.FP8Linear))


def swap_refusal(linear: nn.Module) -> Optional[str]:
    """Why the ``nn.Linear`` ``linear`` inside a block is kept as it is (None: it can be swapped)."""
    if type(linear) not in _LINEAR_TYPES:
        return (f"{type(linear).__name__}, a subclass of nn.Linear, is kept: its owner may use its weight "
                "without calling it (as nn.MultiheadAttention does)")
    if linear.in_features % FEATURE_MULTIPLE or linear.out_features % FEATURE_MULTIPLE:
        return f"Linear features not multiples of {FEATURE_MULTIPLE} (FP8 GEMMs need them)"
    return None


# timm's BEiT, Swin V2 and EVA attention with separate q/v biases compute qkv as
# F.linear(x, self.qkv.weight, bias), never calling self.qkv, unless qkv_bias_separate is set, their
# own switch for self.qkv(x) + bias (the same sum). switch_owner sets it while qkv is swapped, else
# the swapped qkv would never run, and restore_owner sets it back. That path adds the bias in place
# (qkv += bias), which TE's output (a view made inside its autograd Function) does not allow: the
# swapped qkv then returns a copy (one [tokens, 3C] copy per attention).
_OWNER_SWITCHES = {"qkv": ("qkv_bias_separate", True)}


def to_fp8_linear(linear: nn.Linear, backend: str) -> nn.Module:
    """The swapped Linear for ``linear``: the same parameters, training mode and ``requires_grad``.

    Args:
        linear: an ``nn.Linear`` that :func:`swap_refusal` accepts.
        backend: ``"te"`` (TE's FP8 ``Linear``) or ``"reference"``.
    """
    cls = _te.fp8_linear_class() if backend == "te" else reference.FP8Linear
    # Built on the meta device: no memory and no init kernels for parameters replaced right away.
    new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
              params_dtype=linear.weight.dtype, device="meta")
    new.weight = linear.weight
    if linear.bias is not None:
        new.bias = linear.bias
    return new.train(linear.training)


def switch_owner(new: nn.Module, owner: nn.Module, name: str) -> None:
    """Make ``owner``, which is about to hold the swapped Linear ``new`` as ``name``, call it where
    it would bypass its forward (``_OWNER_SWITCHES`` above); ``new`` keeps the old setting for
    :func:`restore_owner`."""
    switch = _OWNER_SWITCHES.get(name)
    if switch is None or getattr(owner, "q_bias", None) is None:
        return
    attr, value = switch
    if hasattr(owner, attr) and getattr(owner, attr) != value:
        new.restore_owner[attr] = getattr(owner, attr)
        setattr(owner, attr, value)


def to_torch_linear(module: nn.Module) -> nn.Linear:
    """The ``nn.Linear`` for a swapped Linear: the same parameters, mode and ``requires_grad``."""
    bias = getattr(module, "bias", None)
    has_bias = isinstance(bias, nn.Parameter)  # TE keeps an empty plain tensor when there is none
    linear = nn.Linear(module.in_features, module.out_features, bias=has_bias, device="meta",
                       dtype=module.weight.dtype)
    linear.weight = module.weight
    if has_bias:
        linear.bias = bias
    return linear.train(module.training)


def restore_owner(module: nn.Module, owner: nn.Module) -> None:
    """Give ``owner`` back the settings :func:`to_fp8_linear` changed for the swapped ``module``."""
    for attr, value in getattr(module, "restore_owner", {}).items():
        setattr(owner, attr, value)


def holds_linear(mod: nn.Module) -> bool:
    """Whether ``mod`` holds an ``nn.Linear`` or a swapped FP8 Linear."""
    return any(isinstance(m, nn.Linear) or is_swapped(m) for m in mod.modules())
