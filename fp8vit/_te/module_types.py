"""The TE modules fp8vit builds from: the block modules (``LayerNormLinear``, ``Linear``,
``LayerNormMLP``, ``DotProductAttention``) with plain-tensor FP8 state, and the FP8 ``Linear``
swapped in for a model's ``nn.Linear``.

The classes are made on first use (TE is imported then) and named as attributes of the package
``fp8vit._te`` (its ``__getattr__``), which is where a whole-model pickle finds them again.
"""

from __future__ import annotations

import functools
import math
import types

import torch

from .._warn import warn_once
from .extra_state import SafeExtraState
from .fp8 import active_fp8_recipe, autocast
from .loader import load_te
from .ops import gated_activation
from .recipe_switch import RecipeSwitchFix
from .recipes import recipe_name, row_multiple

__all__ = ["MODULE_NAMES", "modules", "SwappedLinear", "fp8_linear_class", "transformer_layer_class"]

# Where pickles look the classes up: the package's __getattr__ (they are made at run time).
_PICKLE_MODULE = "fp8vit._te"

MODULE_NAMES = ("LayerNormLinear", "Linear", "LayerNormMLP", "DotProductAttention")


@functools.lru_cache(maxsize=None)
def modules() -> types.SimpleNamespace:
    """TE's block modules with :class:`~fp8vit._te.extra_state.SafeExtraState` and
    :class:`~fp8vit._te.recipe_switch.RecipeSwitchFix` mixed in."""
    te = load_te()

    def safe(name: str) -> type:
        # Module-level name and qualname: pickle finds the class again through __getattr__ below.
        return type(name, (RecipeSwitchFix, SafeExtraState, getattr(te, name)),
                    {"__module__": _PICKLE_MODULE, "__qualname__": name})

    return types.SimpleNamespace(
        **{name: safe(name) for name in MODULE_NAMES}, gated_activation=gated_activation,
    )


# --------------------------------------------------------------------------- generic FP8 Linear
class _OwnOutput(torch.autograd.Function):
    """Identity whose output is not a view in autograd's eyes (``detach`` shares the memory), so it
    may be modified in place; the gradient passes through. Safe because TE's Linear does not keep
    its output for backward."""

    @staticmethod
    def forward(ctx, out):
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


class SwappedLinear:
    """Mixin of :func:`fp8_linear_class`: TE's ``Linear`` standing in for a model's ``nn.Linear``
    (``convert_to_te(fallback="linear")``), where nothing around it knows about TE.

    * ``forward`` takes any leading dims, and under FP8 pads the rows (the product of the leading
      dims) with zeros to the recipe's multiple, then slices them off the output: TE's FP8 GEMMs
      need it, and the weight-gradient GEMM reduces over the rows, so padded rows change nothing.
    * ``fp8_enabled = False`` runs it in the autocast dtype inside ``fp8_context``; so does a recipe
      whose multiple the features are not (MXFP8 needs 32; fp8vit swaps multiples of 16), with one
      warning.
    * its state dict is ``nn.Linear``'s (``weight``, ``bias``) plus ``_extra_state``, the FP8
      scaling state as a tensor of one size whether FP8 ran or not, so that the keys never change
      while training: helpers that pair two state dicts by position (timm's ``ModelEmaV3``: an EMA
      copy made before the first FP8 step) stay aligned. It may be absent on load, so a timm
      checkpoint loads as is.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp8_enabled = True
        self.restore_owner = {}  # owner settings fp8vit.blocks.linear.switch_owner changed, for convert_from_te

    # TE's Linear is not for dynamo to trace (its FP8 state lives in Python): under torch.compile
    # (convert_to_te(fallback="linear", compile=True)) each swapped Linear is one graph break and
    # runs as TE runs it, as the fused blocks do.
    @torch.compiler.disable
    def forward(self, inp: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # TE returns a view made inside its autograd Function, which autograd refuses to modify in
        # place; timm code around an nn.Linear may (BEiT: qkv += bias). _OwnOutput hands it out as
        # a tensor of its own, without a copy.
        return _OwnOutput.apply(self._forward(inp, *args, **kwargs))

    def _forward(self, inp: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        recipe = active_fp8_recipe()
        if recipe is None:  # outside fp8_context: TE's Linear in the autocast dtype
            return super().forward(inp, *args, **kwargs)
        mult = row_multiple(recipe_name(recipe))
        if not self.fp8_enabled or self.in_features % mult or self.out_features % mult:
            if self.fp8_enabled:
                warn_once(f"fp8vit: a swapped Linear ({self.in_features} -> {self.out_features} features) runs "
                          f"in bf16: this FP8 recipe needs features that are multiples of {mult}", RuntimeWarning)
            with autocast(enabled=False, recipe=None):
                return super().forward(inp, *args, **kwargs)
        rows = math.prod(inp.shape[:-1])
        pad = -rows % mult
        if pad == 0:
            return super().forward(inp, *args, **kwargs)
        out = super().forward(torch.nn.functional.pad(inp.reshape(rows, inp.shape[-1]), (0, 0, 0, pad)),
                              *args, **kwargs)
        return out[:rows].view(*inp.shape[:-1], out.shape[-1])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        key = prefix + "_extra_state"
        if key in missing_keys:  # an nn.Linear checkpoint, or a stateless recipe's
            missing_keys.remove(key)


@functools.lru_cache(maxsize=None)
def fp8_linear_class() -> type:
    """``FP8Linear``: TE's ``Linear`` with :class:`SwappedLinear`, :class:`RecipeSwitchFix` and
    :class:`~fp8vit._te.extra_state.SafeExtraState` mixed in. Build it with ``device="meta"`` and
    assign the ``nn.Linear``'s parameters."""
    te = load_te()
    return type("FP8Linear", (SwappedLinear, RecipeSwitchFix, SafeExtraState, te.Linear),
                {"__module__": _PICKLE_MODULE, "__qualname__": "FP8Linear"})


def transformer_layer_class() -> type:
    """``te.TransformerLayer`` (the bench's speed reference; fp8vit's blocks do not use it)."""
    return load_te().TransformerLayer
