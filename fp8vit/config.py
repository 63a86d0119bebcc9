"""``BlockConfig``: timm ``Block`` arguments, validated and resolved to what TE can run.

Every keyword of timm's ``Block`` is either honoured with timm's meaning or rejected here,
before any TE module is built, so the checks run (and are tested) on machines without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Tuple, Union

import torch
from torch import nn
from timm.layers import DropPath, LayerNorm, LayerScale, Mlp, get_act_layer
from timm.layers import activations as timm_act
from timm.models.vision_transformer import Attention

from ._warn import warn_once

__all__ = ["BlockConfig", "config_from_timm_block", "resolve_norm", "resolve_activation", "GELU_TANH_NOTE"]

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
    norm = _instantiate(norm_layer, dim)
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
    raise ValueError(f"norm_layer {name} is not supported by TE_Block: TE fuses a LayerNorm or "
                     "RMSNorm over the last dim, with a learnable weight, into its GEMMs; use one of those")


def resolve_activation(act_layer: Union[str, Callable], exact_gelu: bool) -> Tuple[Callable, Optional[str]]:
    """``act_layer`` -> (torch activation constructor, TE kernel name or None).

    None means no TE kernel computes exactly this activation, and the MLP runs unfused with
    the torch activation between TE's fc1 and fc2.
    """
    if isinstance(act_layer, str):
        act_layer = get_act_layer(act_layer)
    act = act_layer()
    tanh_gelus = tuple(c for c in (getattr(timm_act, "GELUTanh", None),) if c is not None)
    exact_gelus = tuple(c for c in (getattr(timm_act, "GELU", None),) if c is not None)
    if isinstance(act, tanh_gelus) or (isinstance(act, nn.GELU) and act.approximate == "tanh"):
        return act_layer, "gelu"
    if isinstance(act, nn.GELU) or isinstance(act, exact_gelus):
        if exact_gelu:
            return act_layer, None
        warn_once(f"fp8vit: {GELU_TANH_NOTE}", UserWarning, stacklevel=3)
        return act_layer, "gelu"
    if isinstance(act, nn.ReLU):
        return act_layer, "relu"
    if isinstance(act, nn.SiLU):
        return act_layer, "silu"
    if type(act).__name__ == "QuickGELU":  # x * sigmoid(1.702 x), TE's "qgelu"
        return act_layer, "qgelu"
    return act_layer, None  # no TE kernel: unfused MLP with the torch activation, exact


def _mlp_ratio(hidden: int, dim: int) -> float:
    """The ``mlp_ratio`` for which timm's ``int(dim * mlp_ratio)`` gives back ``hidden``."""
    ratio = hidden / dim
    return ratio if int(dim * ratio) == hidden else (hidden + 0.5) / dim


def _is_timm_attention(attn_layer) -> bool:
    return attn_layer in (None, "", "attn") or attn_layer is Attention


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """A timm ``Block``'s settings in the form ``TE_Block`` builds from.

    Attributes:
        dim: channels ``C``.
        num_heads: attention heads ``H`` (``C % H == 0``).
        mlp_hidden: MLP hidden width, ``int(dim * mlp_ratio)`` as in timm.
        qkv_bias, proj_bias: biases of the QKV projection / of proj, fc1 and fc2 (timm's meaning).
        qk_norm: normalize q and k per head with ``norm_layer(head_dim)``.
        proj_drop, attn_drop: dropout after proj/fc2 and after the MLP activation / on attention
            probabilities.
        init_values: LayerScale init; None means no LayerScale.
        drop_path: stochastic-depth rate, per sample.
        norm, norm_eps: TE normalization (``"LayerNorm"``/``"RMSNorm"``) and its eps.
        norm_layer, act_layer: the timm constructors (kept to rebuild a timm ``Block``).
        te_activation: TE kernel for the fused MLP, or None for an unfused MLP.
    """

    dim: int
    num_heads: int
    mlp_hidden: int
    qkv_bias: bool = False
    proj_bias: bool = True
    qk_norm: bool = False
    proj_drop: float = 0.0
    attn_drop: float = 0.0
    init_values: Optional[float] = None
    drop_path: float = 0.0
    norm: str = "LayerNorm"
    norm_eps: float = 1e-6
    norm_layer: Callable = LayerNorm
    act_layer: Callable = nn.GELU
    te_activation: Optional[str] = "gelu"

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def fused_mlp(self) -> bool:
        """One ``te.LayerNormMLP``; needs a TE activation kernel and no dropout inside the MLP."""
        return self.te_activation is not None and self.proj_drop == 0.0

    @classmethod
    def from_timm_kwargs(
        cls,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_attn_norm: bool = False,
        scale_mlp_norm: bool = False,
        proj_bias: bool = True,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        init_values: Optional[float] = None,
        drop_path: float = 0.0,
        act_layer: Union[str, Callable] = nn.GELU,
        norm_layer: Callable = LayerNorm,
        mlp_layer: Optional[Callable] = None,
        attn_layer=None,
        depth: int = 0,
        *,
        exact_gelu: bool = False,
    ) -> "BlockConfig":
        """Validate timm ``Block.__init__`` keywords (timm 0.9 through 1.0) into a config.

        ``depth`` only matters to timm's DiffAttention, which is rejected, so it has no effect,
        as in timm's ``Block`` with standard attention.

        Raises:
            ValueError: a setting TE_Block cannot honour, naming it and what to do instead.
        """
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        if scale_attn_norm or scale_mlp_norm:
            raise ValueError(
                f"scale_attn_norm={scale_attn_norm}, scale_mlp_norm={scale_mlp_norm}: TE_Block has no "
                "norm between attention and proj / between the MLP activation and fc2; keep timm's "
                "Block for this model (convert_to_te(..., module_filter_fn=...) can skip it)")
        if not _is_timm_attention(attn_layer):
            raise ValueError(f"attn_layer={attn_layer!r} is not supported: TE_Block implements timm's "
                             "standard Attention only")
        if mlp_layer not in (None, Mlp):
            raise ValueError(f"mlp_layer={getattr(mlp_layer, '__name__', mlp_layer)!r} is not supported: "
                             "TE_Block implements timm's Mlp (fc1, activation, fc2) only")
        for name, p in (("proj_drop", proj_drop), ("attn_drop", attn_drop), ("drop_path", drop_path)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name}={p} must be in [0, 1)")
        norm, eps = resolve_norm(norm_layer, dim)
        act_layer, te_act = resolve_activation(act_layer, exact_gelu)
        return cls(dim=dim, num_heads=num_heads, mlp_hidden=int(dim * mlp_ratio), qkv_bias=qkv_bias,
                   proj_bias=proj_bias, qk_norm=qk_norm, proj_drop=float(proj_drop),
                   attn_drop=float(attn_drop), init_values=init_values or None,
                   drop_path=float(drop_path), norm=norm, norm_eps=eps, norm_layer=norm_layer,
                   act_layer=act_layer, te_activation=te_act)

    def timm_kwargs(self) -> dict:
        """Keywords that build the equivalent timm ``Block``."""
        return dict(dim=self.dim, num_heads=self.num_heads,
                    mlp_ratio=_mlp_ratio(self.mlp_hidden, self.dim),
                    qkv_bias=self.qkv_bias, qk_norm=self.qk_norm, proj_bias=self.proj_bias,
                    proj_drop=self.proj_drop, attn_drop=self.attn_drop, init_values=self.init_values,
                    drop_path=self.drop_path, act_layer=self.act_layer, norm_layer=self.norm_layer)


def _reject(block: nn.Module, what: str) -> None:
    raise ValueError(f"{type(block).__name__} with {what} cannot be converted to TE_Block")


def config_from_timm_block(block: nn.Module, *, exact_gelu: bool = False) -> BlockConfig:
    """Read the settings of a built timm ``Block`` (the inverse of constructing one).

    Raises:
        ValueError: a part of the block TE_Block does not implement, named.
    """
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    if not isinstance(attn, Attention):
        _reject(block, f"attn of type {type(attn).__name__} (only timm's Attention)")
    if not isinstance(mlp, Mlp):
        _reject(block, f"mlp of type {type(mlp).__name__} (only timm's Mlp)")
    if not isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity):
        _reject(block, "a norm before the attention projection (scale_attn_norm=True)")
    if not isinstance(getattr(mlp, "norm", nn.Identity()), nn.Identity):
        _reject(block, "a norm inside the MLP (scale_mlp_norm=True)")
    if getattr(attn, "gate", None) is not None:
        _reject(block, "a gated attention output (gated=True)")
    if attn.qkv.out_features != 3 * block.norm1.weight.shape[0]:
        _reject(block, f"attention width {attn.qkv.out_features // 3} != dim (attn_head_dim set)")
    proj_bias = attn.proj.bias is not None
    if (mlp.fc1.bias is not None) != proj_bias or (mlp.fc2.bias is not None) != proj_bias:
        _reject(block, "MLP biases that differ from the attention projection's (timm ties them)")
    proj_drop = attn.proj_drop.p
    if not (mlp.drop1.p == mlp.drop2.p == proj_drop):
        _reject(block, f"different dropouts (attn.proj_drop={proj_drop}, mlp.drop1={mlp.drop1.p}, "
                       f"mlp.drop2={mlp.drop2.p})")
    norm1 = block.norm1
    norm_layer = functools.partial(type(norm1), eps=norm1.eps)
    act = mlp.act
    act_layer = (functools.partial(nn.GELU, approximate=act.approximate)
                 if isinstance(act, nn.GELU) else type(act))
    init_values = None
    if isinstance(block.ls1, LayerScale):
        # Recent timm keeps the init value; older timm did not, and the current gamma stands in.
        # It only matters to init_weights(); the weights themselves are copied.
        init_values = getattr(block.ls1, "init_values", None)
        if init_values is None:
            gamma = block.ls1.gamma
            init_values = 1e-5 if gamma.is_meta else (float(gamma.detach().flatten()[0]) or 1e-5)
    drop_path = block.drop_path1.drop_prob if isinstance(block.drop_path1, DropPath) else 0.0
    dim = norm1.weight.shape[0]
    return BlockConfig.from_timm_kwargs(
        dim=dim, num_heads=attn.num_heads, mlp_ratio=_mlp_ratio(mlp.fc1.out_features, dim),
        qkv_bias=attn.qkv.bias is not None, qk_norm=not isinstance(attn.q_norm, nn.Identity),
        proj_bias=proj_bias, proj_drop=proj_drop, attn_drop=attn.attn_drop.p,
        init_values=init_values, drop_path=drop_path, act_layer=act_layer, norm_layer=norm_layer,
        exact_gelu=exact_gelu,
    )
