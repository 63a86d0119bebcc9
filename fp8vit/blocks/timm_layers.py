"""timm's norm and activation layers -> what TE's fused kernels run, and the exact timm classes a
family accepts: every block family asks here (and registers its block as one leaf for timm's FX
feature extraction, ``register_notrace_module``, timm's own, from where this timm keeps it).

A norm becomes TE's normalization name and eps (TE fuses LayerNorm and RMSNorm into the GEMM
that follows); an activation becomes the TE kernel that computes exactly it (or, for timm's erf
GELU, the tanh approximation with a note), or None where only torch's activation is exact.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch
from timm.layers import get_act_layer
from timm.layers import activations as timm_act
from torch import nn

from .._warn import warn_once

try:  # imported here for the block modules, from wherever this timm keeps it
    from timm.layers import register_notrace_module
except ImportError:  # timm < 1.0 keeps it with the FX helpers
    from timm.models._features_fx import register_notrace_module  # noqa: F401

__all__ = ["resolve_norm", "resolve_norm_module", "resolve_activation", "require_timm_class", "GELU_TANH_NOTE"]

# Measured once on CPU in fp32 (docs/numerics.md, tests/test_config.py checks the bound):
# max |gelu_erf(x) - gelu_tanh(x)| over all x is below 5e-4, at |x| ~ 2.
GELU_TANH_NOTE = (
    "timm's exact (erf) GELU runs as TE's tanh-approximate GELU kernel, which differs by at most "
    "5e-4 per activation (docs/numerics.md). Pass exact_gelu=True to keep the erf GELU (the MLP "
    "then runs unfused: TE fc1, torch GELU, TE fc2)."
)


def _instantiate(layer: Callable, *args):
    """Instantiate a timm layer constructor on the meta device, to read its settings."""
    try:
        return layer(*args, device="meta")
    except TypeError:  # older layers without a device argument
        return layer(*args)


def resolve_norm(norm_layer: Callable, dim: int) -> Tuple[str, float]:
    """``norm_layer`` -> (TE normalization name, eps).

    Args:
        norm_layer: a LayerNorm or RMSNorm constructor (``nn.LayerNorm``, timm's ``LayerNorm``,
            ``partial(nn.LayerNorm, eps=1e-6)``, ``nn.RMSNorm``, timm's ``RMSNorm``).
        dim: channels.

    Raises:
        ValueError: any other norm, or one without a learnable affine (TE always has one).
    """
    return resolve_norm_module(_instantiate(norm_layer, dim))


def resolve_norm_module(norm: nn.Module) -> Tuple[str, float]:
    """A built norm -> (TE normalization name, eps); see :func:`resolve_norm`."""
    name = type(norm).__name__
    kind = name.lower().replace("fp32", "")  # the Fp32 variants compute in fp32, as TE's kernels do
    weight = getattr(norm, "weight", None)
    if kind == "layernorm" and isinstance(norm, nn.LayerNorm):
        if weight is None or norm.bias is None:
            raise ValueError(f"norm_layer {name} without weight and bias (elementwise_affine="
                             f"{norm.elementwise_affine}) is not supported: TE's LayerNorm has both")
        return "LayerNorm", float(norm.eps)
    if kind == "rmsnorm" and weight is not None:
        eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
        return "RMSNorm", float(eps)
    raise ValueError(f"norm_layer {name} is not supported by fp8vit: TE fuses a LayerNorm or "
                     "RMSNorm over the last dim, with a learnable weight, into its GEMMs; use one of those")


# TE's gated kernels, by the activation they apply to the first half of fc1's output.
_GATED_KERNELS = {"gelu": "geglu", "qgelu": "qgeglu", "relu": "reglu", "silu": "swiglu", "sigmoid": "glu"}


def resolve_activation(act_layer: Union[str, Callable], exact_gelu: bool,
                       gated: bool = False) -> Tuple[Callable, Optional[str]]:
    """``act_layer`` -> (torch activation constructor, TE kernel name or None).

    None means no TE kernel computes exactly this activation, and the MLP runs unfused with
    the torch activation between TE's fc1 and fc2.

    Args:
        act_layer: the activation constructor (or timm's name for it).
        exact_gelu: keep an erf GELU exact (no TE kernel) instead of TE's tanh GELU.
        gated: the kernel for a gated MLP: TE applies it to the first half of fc1's output and
            multiplies by the second (``swiglu``, ``glu``, ``geglu``, ``reglu``, ``qgeglu``).
    """
    if isinstance(act_layer, str):
        act_layer = get_act_layer(act_layer)
    act = act_layer()

    def _of(*names):
        return tuple(c for c in (getattr(timm_act, n, None) for n in names) if c is not None)

    base = None
    if isinstance(act, _of("GELUTanh")) or (isinstance(act, nn.GELU) and act.approximate == "tanh"):
        base = "gelu"
    elif isinstance(act, nn.GELU) or isinstance(act, _of("GELU")):
        if exact_gelu:
            return act_layer, None
        warn_once(f"fp8vit: {GELU_TANH_NOTE}", UserWarning, stacklevel=3)
        base = "gelu"
    elif isinstance(act, nn.ReLU):
        base = "relu"
    elif isinstance(act, (nn.SiLU,) + _of("Swish")):
        base = "silu"
    elif type(act).__name__ == "QuickGELU":  # x * sigmoid(1.702 x), TE's "qgelu"
        base = "qgelu"
    elif isinstance(act, (nn.Sigmoid,) + _of("Sigmoid")):
        base = "sigmoid"  # TE has it gated only ("glu")
    if gated:
        return act_layer, _GATED_KERNELS.get(base)
    return act_layer, base if base != "sigmoid" else None  # None: torch activation, exact


def require_timm_class(block: nn.Module, classes: Tuple[type, ...], fused: str, part: Optional[str] = None) -> None:
    """Refuse ``block`` (or its submodule ``part``) unless its class is exactly one of ``classes``: a
    subclass may compute something else in its ``forward``, which the fused block would silently
    replace by timm's math.

    Args:
        block: the timm block being converted.
        classes: the timm classes the family reproduces.
        fused: the fp8vit block's name, for the message (``"TE_SwinBlock"``).
        part: the attribute of ``block`` to check instead (``"attn"``), or None for the block.

    Raises:
        ValueError: naming the class found, where, and the classes ``fused`` takes.
    """
    obj = block if part is None else getattr(block, part, None)
    if type(obj) in classes:
        return
    where = "" if part is None else f"{type(block).__name__}.{part} of type "
    found = f"{type(obj).__module__}.{type(obj).__qualname__}"
    want = " or ".join(f"{c.__module__}.{c.__qualname__}" for c in classes)
    raise ValueError(f"{where}{found} cannot be converted to {fused}: it takes exactly timm's {want} "
                     "(a subclass may compute something else)")
