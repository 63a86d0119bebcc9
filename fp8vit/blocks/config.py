"""``BlockConfig``: timm ``Block`` arguments, validated and resolved to what TE can run.

Every keyword of timm's ``Block`` is either honoured with timm's meaning or rejected here,
before any TE module is built, so the checks run (and are tested) on machines without a GPU.
The MLP's part of the config is :class:`~fp8vit.blocks.mlp.MlpConfig`, shared with the other block
families, as is the norm and activation resolution (:mod:`fp8vit.blocks.timm_layers`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, List, Optional, Union

from torch import nn
from timm.layers import DropPath, LayerNorm, LayerScale, Mlp, get_act_layer
from timm.models.vision_transformer import Attention, Block

from .._validate import check_bool, check_callable, check_choice, check_int, check_number, check_type
from .mlp import MlpConfig, mlp_config_from_kwargs, mlp_config_from_timm, mlp_ties
from .timm_layers import require_timm_class, resolve_norm, resolve_norm_module
from .weights import Tie, rename

__all__ = ["BlockConfig", "config_from_timm_block"]

def _mlp_ratio(hidden: int, dim: int) -> float:
    """The ``mlp_ratio`` for which timm's ``int(dim * mlp_ratio)`` gives back ``hidden``."""
    ratio = hidden / dim
    return ratio if int(dim * ratio) == hidden else (hidden + 0.5) / dim


def _is_timm_attention(attn_layer) -> bool:
    return attn_layer in (None, "", "attn") or attn_layer is Attention


def _check_settings(fn: str, dim, num_heads, flags: dict, rates: dict, init_values) -> None:
    """The settings :class:`BlockConfig` and :meth:`BlockConfig.from_timm_kwargs` share, checked
    before anything is derived from them: widths, bool flags, dropout rates, LayerScale init."""
    check_int(fn, "dim", dim, min=1)
    check_int(fn, "num_heads", num_heads, min=1)
    if dim % num_heads:
        raise ValueError(f"{fn}: dim={dim} is not divisible by num_heads={num_heads}; pick num_heads that divides dim")
    for name, value in flags.items():
        check_bool(fn, name, value)
    for name, p in rates.items():
        check_number(fn, name, p, min=0, max=1, max_open=True)
    check_number(fn, "init_values", init_values, none_ok=True)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """A timm ``Block``'s settings in the form ``TE_Block`` builds from.

    Attributes:
        dim: channels ``C``.
        num_heads: attention heads ``H`` (``C % H == 0``).
        mlp: the MLP (kind, widths, activation, TE kernel, inner norm, padding), shared with the
            other block families.
        qkv_bias, proj_bias: biases of the QKV projection / of proj, fc1 and fc2 (timm's meaning).
        qk_norm: normalize q and k per head with ``norm_layer(head_dim)``.
        scale_attn_norm: a norm over the attention output before proj (BEiT3), fused into proj.
        scale_mlp_norm: timm's keyword: ``norm_layer`` is passed to the MLP (a norm over its
            hidden units before fc2; GeGluMlp's own input norm takes its type).
        proj_drop, attn_drop: dropout after proj/fc2 and after the MLP activation / on attention
            probabilities.
        init_values: LayerScale init; None means no LayerScale.
        drop_path: stochastic-depth rate, per sample.
        norm, norm_eps: TE normalization (``"LayerNorm"``/``"RMSNorm"``) and its eps.
        norm_layer: the timm constructor (kept to rebuild a timm ``Block``).

    Raises:
        TypeError: a field of the wrong type (``mlp`` not an ``MlpConfig``, a flag not a bool, ...).
        ValueError: a width, rate, eps or norm name out of range, or ``dim`` not divisible by
            ``num_heads``.
    """

    dim: int
    num_heads: int
    mlp: MlpConfig
    qkv_bias: bool = False
    proj_bias: bool = True
    qk_norm: bool = False
    scale_attn_norm: bool = False
    scale_mlp_norm: bool = False
    proj_drop: float = 0.0
    attn_drop: float = 0.0
    init_values: Optional[float] = None
    drop_path: float = 0.0
    norm: str = "LayerNorm"
    norm_eps: float = 1e-6
    norm_layer: Callable = LayerNorm

    def __post_init__(self) -> None:
        from .mlp import MlpConfig

        fn = "BlockConfig"
        _check_settings(fn, self.dim, self.num_heads,
                        dict(qkv_bias=self.qkv_bias, proj_bias=self.proj_bias, qk_norm=self.qk_norm,
                             scale_attn_norm=self.scale_attn_norm, scale_mlp_norm=self.scale_mlp_norm),
                        dict(proj_drop=self.proj_drop, attn_drop=self.attn_drop, drop_path=self.drop_path),
                        self.init_values)
        check_type(fn, "mlp", self.mlp, MlpConfig, "a fp8vit.mlp.MlpConfig")
        check_choice(fn, "norm", self.norm, ("LayerNorm", "RMSNorm"))
        check_number(fn, "norm_eps", self.norm_eps, min=0, min_open=True)
        check_callable(fn, "norm_layer", self.norm_layer, "a norm constructor (nn.LayerNorm, ...)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        """timm's ``hidden_features``, ``int(dim * mlp_ratio)`` (fc1's width: both halves for GluMlp)."""
        return self.mlp.timm_hidden

    @property
    def act_layer(self) -> Callable:
        return self.mlp.act_layer

    @property
    def te_activation(self) -> Optional[str]:
        """TE's activation kernel in the MLP, or None (a torch activation, unfused MLP)."""
        return self.mlp.te_activation

    @property
    def fused_mlp(self) -> bool:
        """The MLP is one ``te.LayerNormMLP`` (see :attr:`~fp8vit.blocks.mlp.MlpConfig.fused`)."""
        return self.mlp.fused

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

        ``mlp_layer`` may be timm's ``Mlp``, ``SwiGLU``, ``GluMlp`` (``SwiGLUPacked`` and other
        partials of it), ``GeGluMlp`` (ViTamin), or a partial of one of them: it is built on the
        meta device, as timm's ``Block`` calls it, and read back (:mod:`fp8vit.blocks.mlp`).
        ``depth`` only matters to timm's DiffAttention, which is rejected, so it has no effect,
        as in timm's ``Block`` with standard attention.

        Raises:
            TypeError: a keyword of the wrong type (a flag that is not a bool, a width that is not
                an integer, a layer that is not callable), named.
            ValueError: a setting TE_Block cannot honour, naming it and what to do instead.
        """

        fn = "BlockConfig.from_timm_kwargs"
        _check_settings(fn, dim, num_heads,
                        dict(qkv_bias=qkv_bias, qk_norm=qk_norm, scale_attn_norm=scale_attn_norm,
                             scale_mlp_norm=scale_mlp_norm, proj_bias=proj_bias, exact_gelu=exact_gelu),
                        dict(proj_drop=proj_drop, attn_drop=attn_drop, drop_path=drop_path), init_values)
        check_number(fn, "mlp_ratio", mlp_ratio, min=0, min_open=True)
        if not isinstance(act_layer, str):
            check_callable(fn, "act_layer", act_layer, "an activation constructor or timm's name for one")
        check_callable(fn, "norm_layer", norm_layer, "a norm constructor (nn.LayerNorm, ...)")
        check_callable(fn, "mlp_layer", mlp_layer, "an MLP constructor (timm's Mlp, SwiGLU, ...)", none_ok=True)
        check_int(fn, "depth", depth, min=0)
        if not _is_timm_attention(attn_layer):
            raise ValueError(f"attn_layer={attn_layer!r} is not supported: TE_Block implements timm's "
                             "standard Attention only")
        norm, eps = resolve_norm(norm_layer, dim)
        if isinstance(act_layer, str):  # timm's Block takes constructors; VisionTransformer names
            act_layer = get_act_layer(act_layer)
        mlp = mlp_config_from_kwargs(dim, int(dim * mlp_ratio), mlp_layer=mlp_layer or Mlp,
                                     act_layer=act_layer, norm_layer=norm_layer if scale_mlp_norm else None,
                                     bias=proj_bias, drop=proj_drop, exact_gelu=exact_gelu)
        return cls(dim=dim, num_heads=num_heads, mlp=mlp, qkv_bias=qkv_bias, proj_bias=proj_bias,
                   qk_norm=qk_norm, scale_attn_norm=scale_attn_norm, scale_mlp_norm=scale_mlp_norm,
                   proj_drop=float(proj_drop), attn_drop=float(attn_drop), init_values=init_values or None,
                   drop_path=float(drop_path), norm=norm, norm_eps=eps, norm_layer=norm_layer)

    def timm_kwargs(self) -> dict:
        """Keywords that build the equivalent timm ``Block``."""
        return dict(dim=self.dim, num_heads=self.num_heads,
                    mlp_ratio=_mlp_ratio(self.mlp_hidden, self.dim),
                    qkv_bias=self.qkv_bias, qk_norm=self.qk_norm, scale_attn_norm=self.scale_attn_norm,
                    scale_mlp_norm=self.scale_mlp_norm, proj_bias=self.proj_bias,
                    proj_drop=self.proj_drop, attn_drop=self.attn_drop, init_values=self.init_values,
                    drop_path=self.drop_path, act_layer=self.act_layer, norm_layer=self.norm_layer,
                    mlp_layer=self.mlp.timm_layer)

    def ties(self) -> List[Tie]:
        """The weight layout (:mod:`fp8vit.blocks.weights`) of a ``TE_Block`` with this config: timm
        ``Block`` tensors -> TE tensors, names relative to the block."""
        cfg = self
        ln = cfg.norm == "LayerNorm"  # RMSNorm has no bias
        ties = [rename("norm1.weight", "qkv.layer_norm_weight"), rename("attn.qkv.weight", "qkv.weight"),
                rename("attn.proj.weight", "proj.weight")]
        if ln:
            ties.append(rename("norm1.bias", "qkv.layer_norm_bias"))
        if cfg.qkv_bias:
            ties.append(rename("attn.qkv.bias", "qkv.bias"))
        if cfg.proj_bias:
            ties.append(rename("attn.proj.bias", "proj.bias"))
        if cfg.scale_attn_norm:  # the norm before proj is fused into proj (a LayerNormLinear)
            ties.append(rename("attn.norm.weight", "proj.layer_norm_weight"))
            if ln:
                ties.append(rename("attn.norm.bias", "proj.layer_norm_bias"))
        if cfg.qk_norm:
            for t in ("q_norm", "k_norm"):
                ties.append(rename(f"attn.{t}.weight", f"{t}.weight"))
                if ln:
                    ties.append(rename(f"attn.{t}.bias", f"{t}.bias"))
        if cfg.init_values is not None:
            ties += [rename("ls1.gamma", "ls1.gamma"), rename("ls2.gamma", "ls2.gamma")]
        ties += mlp_ties(cfg.mlp, cfg.norm)
        return ties


def _reject(block: nn.Module, what: str) -> None:
    raise ValueError(f"{type(block).__name__} with {what} cannot be converted to TE_Block")


def config_from_timm_block(block: nn.Module, *, exact_gelu: bool = False) -> BlockConfig:
    """Read the settings of a built timm ``Block`` (the inverse of constructing one).

    The MLP is read from the module (:func:`fp8vit.blocks.mlp.mlp_config_from_timm`) and must be what
    timm's ``Block`` builds from keywords, so that :meth:`TE_Block.to_timm` can rebuild it.

    Raises:
        ValueError: a part of the block TE_Block does not implement, named.
    """

    require_timm_class(block, (Block,), "TE_Block")
    require_timm_class(block, (Attention,), "TE_Block", "attn")
    attn, mlp = block.attn, block.mlp
    if getattr(attn, "gate", None) is not None:
        _reject(block, "a gated attention output (gated=True)")
    if attn.qkv.out_features != 3 * block.norm1.weight.shape[0]:
        _reject(block, f"attention width {attn.qkv.out_features // 3} != dim (attn_head_dim set)")
    try:
        mlp_cfg = mlp_config_from_timm(mlp, exact_gelu=exact_gelu)
    except ValueError as err:
        _reject(block, f"this MLP: {err}")
    proj_bias = attn.proj.bias is not None
    proj_drop = attn.proj_drop.p
    norm1 = block.norm1
    norm_layer = functools.partial(type(norm1), eps=norm1.eps)
    scale_attn_norm = not isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity)
    if scale_attn_norm and resolve_norm_module(attn.norm) != resolve_norm_module(norm1):
        _reject(block, f"a norm before the attention projection (scale_attn_norm) of "
                       f"{resolve_norm_module(attn.norm)} unlike norm1's {resolve_norm_module(norm1)} "
                       "(timm's Block builds both from norm_layer)")
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
    kwargs = dict(
        dim=dim, num_heads=attn.num_heads, mlp_ratio=_mlp_ratio(mlp_cfg.timm_hidden, dim),
        qkv_bias=attn.qkv.bias is not None, qk_norm=not isinstance(attn.q_norm, nn.Identity),
        scale_attn_norm=scale_attn_norm, proj_bias=proj_bias, proj_drop=proj_drop,
        attn_drop=attn.attn_drop.p, init_values=init_values, drop_path=drop_path,
        act_layer=mlp_cfg.act_layer, norm_layer=norm_layer, mlp_layer=mlp_cfg.timm_layer,
    )
    # scale_mlp_norm: a norm inside the MLP; GeGluMlp always has one (over its input), whose type
    # follows norm_layer only with scale_mlp_norm=True: the keyword that rebuilds it wins.
    built = None
    for scale_mlp_norm in ((False, True) if mlp_cfg.kind == "GeGluMlp" else (mlp_cfg.norm is not None,)):
        cfg = BlockConfig.from_timm_kwargs(**kwargs, scale_mlp_norm=scale_mlp_norm, exact_gelu=exact_gelu)
        if cfg.mlp == mlp_cfg:  # same act_layer object: the comparison is of everything else
            return cfg
        built = built or cfg.mlp
    _reject(block, f"an MLP that timm's Block does not build from its keywords (read {mlp_cfg}; "
                   f"Block(mlp_layer={mlp_cfg.kind}, ...) builds {built}): biases, dropouts or the "
                   "inner norm differ from the block's proj_bias, proj_drop or norm_layer")
