"""``TE_Block``: timm's ViT ``Block`` built from Transformer Engine modules.

    x [B, N, C] --+-- qkv: LayerNorm+Linear (fused) -> [B, N, 3, H, D] -> q_norm/k_norm
                  |   -> DotProductAttention (bshd, no mask, bidirectional) -> [B, N, C]
                  |   -> proj (Linear; LayerNorm+Linear with scale_attn_norm) -> ls1 -> drop_path1
                  +-- (+) -> mlp: LayerNorm+fc1+act+fc2 (one LayerNormMLP, or unfused: fp8vit.blocks.mlp)
                             -> ls2 -> drop_path2 -> (+)

Why not ``te.TransformerLayer``: its defaults are GPT's (causal mask, ``sbhd`` layout, dropout
0.1, eps 1e-5), it has one bias flag for all GEMMs, no LayerScale, and it interleaves the QKV
weight. Composing the same four fused modules here costs the same kernels (docs/performance.md)
and keeps every timm option and timm's weight layout.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from typing import Optional

import torch
from timm.layers import DropPath, LayerScale, Mlp, trunc_normal_
from timm.models.vision_transformer import Block
from torch import nn

try:
    from timm.layers import register_notrace_module
except ImportError:  # timm < 1.0 keeps it with the FX helpers
    from timm.models._features_fx import register_notrace_module

from .._warn import warn_once
from .config import BlockConfig, config_from_timm_block
from .base import FP8Block
from .mlp import build_mlp, init_gates_like_timm_
from .weights import (copy_requires_grad, name_pairs, te_requires_grad, te_to_timm, timm_requires_grad, timm_shapes,
                      timm_to_te)

__all__ = ["TE_Block"]


class TE_Block(FP8Block):  # noqa: N801 - the name is the public contract
    """Drop-in ``block_fn`` for timm's ``VisionTransformer``, on Transformer Engine.

    Takes exactly timm ``Block``'s keywords with timm's meaning (see :class:`BlockConfig`);
    what TE cannot honour raises ``ValueError`` naming the keyword. Weights use timm's layout.

    Args:
        dim: channels ``C``.
        num_heads: attention heads.
        *args, **kwargs: the rest of timm ``Block``'s keywords (``mlp_ratio, qkv_bias, qk_norm,
            scale_attn_norm, scale_mlp_norm, proj_bias, proj_drop, attn_drop, init_values,
            drop_path, act_layer, norm_layer, mlp_layer, attn_layer, depth``), see
            :meth:`BlockConfig.from_timm_kwargs`.
        device: where parameters live; None means CUDA for the TE backend, CPU for reference.
            A TE block built on the CPU must be moved to the GPU (``.cuda()``) before it runs.
        dtype: parameter dtype (None: torch's default dtype).
        exact_gelu: keep timm's erf GELU (unfused MLP) instead of TE's tanh GELU kernel.
        backend: ``"te"``, ``"reference"`` (PyTorch modules, no FP8) or None (automatic).
        fp32_residual: keep the residual stream in fp32 under autocast, as timm's ``Block`` does.
            The default (False) carries it in the autocast dtype, as ``te.TransformerLayer``
            does: TE casts its inputs to that dtype anyway, and the fp32 stream costs 10% of a
            ViT-H FP8 step in casts and wider adds (docs/performance.md).
        config: a ready :class:`BlockConfig` instead of the timm keywords (see :meth:`from_config`).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *args,
        device=None,
        dtype: Optional[torch.dtype] = None,
        exact_gelu: bool = False,
        backend: Optional[str] = None,
        fp32_residual: bool = False,
        config: Optional[BlockConfig] = None,
        **kwargs,
    ) -> None:
        if config is None:
            # timm's keywords (and their positional order) are BlockConfig.from_timm_kwargs's: one
            # list, validated there. Unknown keywords raise TypeError naming them.
            config = BlockConfig.from_timm_kwargs(dim, num_heads, *args, exact_gelu=exact_gelu, **kwargs)
        elif args or kwargs or (dim, num_heads) != (config.dim, config.num_heads):
            raise TypeError(f"TE_Block(config=...) takes no other timm keywords; got dim={dim}, "
                            f"num_heads={num_heads} for a config of {config.dim}/{config.num_heads} "
                            f"and extra {list(args) + sorted(kwargs)}")
        super().__init__()
        self.cfg = cfg = config
        self._init_switches(backend, fp32_residual)
        m = self._impl.modules
        device = self._impl.default_device if device is None else device
        if self._impl.fp8 and torch.device(device).type not in ("cuda", "cpu", "meta"):
            raise ValueError(f"TE_Block on device {device!r}: Transformer Engine modules are built on "
                             "'cuda', 'cpu' (then moved with .cuda()) or 'meta'; or pass backend='reference'")
        dd = {"device": device, "params_dtype": dtype}  # TE's keyword names
        tdd = {"device": device, "dtype": dtype}  # torch's

        self.qkv = m.LayerNormLinear(cfg.dim, 3 * cfg.dim, eps=cfg.norm_eps, bias=cfg.qkv_bias,
                                     normalization=cfg.norm, **dd)
        self.q_norm = cfg.norm_layer(cfg.head_dim, **tdd) if cfg.qk_norm else nn.Identity()
        self.k_norm = cfg.norm_layer(cfg.head_dim, **tdd) if cfg.qk_norm else nn.Identity()
        self.attn = m.DotProductAttention(cfg.num_heads, cfg.head_dim, attention_dropout=cfg.attn_drop,
                                          qkv_format="bshd", attn_mask_type="no_mask")
        if cfg.scale_attn_norm:  # BEiT3's norm over the attention output: fused into proj, exact
            self.proj = m.LayerNormLinear(cfg.dim, cfg.dim, eps=cfg.norm_eps, bias=cfg.proj_bias,
                                          normalization=cfg.norm, **dd)
        else:
            self.proj = m.Linear(cfg.dim, cfg.dim, bias=cfg.proj_bias, **dd)
        self.proj_drop = nn.Dropout(cfg.proj_drop)
        self.ls1 = LayerScale(cfg.dim, init_values=cfg.init_values, **tdd) if cfg.init_values else nn.Identity()
        self.drop_path1 = DropPath(cfg.drop_path) if cfg.drop_path > 0 else nn.Identity()

        built = build_mlp(cfg.mlp, cfg.norm, cfg.norm_eps, m, dd, tdd)
        self.norm2 = built.norm  # None unless the MLP fuses a norm of its own (GeGluMlp)
        self.mlp = built.mlp
        self.ls2 = LayerScale(cfg.dim, init_values=cfg.init_values, **tdd) if cfg.init_values else nn.Identity()
        self.drop_path2 = DropPath(cfg.drop_path) if cfg.drop_path > 0 else nn.Identity()
        self._timm_aliases()

    # ------------------------------------------------------------------ construction, timm interop
    @classmethod
    def from_config(cls, cfg: BlockConfig, **kwargs) -> "TE_Block":
        """A ``TE_Block`` for a validated config; ``kwargs`` are ``device, dtype, backend, fp32_residual``."""
        return cls(cfg.dim, cfg.num_heads, config=cfg, **kwargs)

    @classmethod
    def from_timm(cls, block: nn.Module, *, exact_gelu: bool = False, backend: Optional[str] = None,
                  fp32_residual: bool = False) -> "TE_Block":
        """A ``TE_Block`` with the settings, weights, device, dtype, ``requires_grad`` flags and
        mode of a timm ``Block``.

        Raises:
            ValueError: a part of ``block`` that TE_Block does not implement, named.
        """
        ref = block.norm1.weight
        new = cls.from_config(config_from_timm_block(block, exact_gelu=exact_gelu), device=ref.device,
                              dtype=ref.dtype, backend=backend, fp32_residual=fp32_residual)
        new.load_timm_state_dict(block.state_dict())
        copy_requires_grad(block, new, te_requires_grad, new.cfg)
        return new.train(block.training)

    def load_timm_state_dict(self, sd) -> None:
        """Load a timm ``Block`` state dict (keys relative to the block) exactly.

        Raises:
            ValueError: keys that do not match this block's configuration, listed.
        """
        res = self.load_state_dict(timm_to_te(sd, self.cfg), strict=False)
        # strict=False only so that FP8 scaling state (_extra_state) may be absent.
        missing = [k for k in res.missing_keys if not k.endswith("_extra_state")]
        if missing or res.unexpected_keys:
            raise ValueError(f"TE_Block: tensors not set {missing}, unknown {res.unexpected_keys}")

    def to_timm(self) -> nn.Module:
        """The equivalent timm ``Block`` (same weights, device, dtype, ``requires_grad`` flags, mode).
        FP8 scaling state is dropped."""
        ref = self.qkv.weight
        block = Block(**_installed_block_kwargs(self.cfg.timm_kwargs())).to(device=ref.device, dtype=ref.dtype)
        block.load_state_dict(te_to_timm(self.state_dict(), self.cfg), strict=True)
        copy_requires_grad(self, block, timm_requires_grad, self.cfg)
        return block.train(self.training)

    def init_weights(self, mode: Optional[str] = None) -> None:
        """Initialise like timm initialises a ``Block`` in ``VisionTransformer(weight_init=mode)``.

        Args:
            mode: ``""`` (timm's default: truncated normal std 0.02, zero biases), ``"jax"`` /
                ``"jax_nlhb"`` (Xavier uniform, MLP biases normal 1e-6) or ``"moco"`` (Xavier,
                q/k/v each as its own matrix). None: the mode of the timm init function calling
                this (timm calls ``init_weights()`` without arguments from
                ``init_weights_vit_{timm,jax,moco}``), else the default. Norms get ones and zeros,
                LayerScale ``init_values``, in every mode.
        """
        if mode is None:
            mode = _TIMM_INIT_MODES.get(sys._getframe(1).f_code.co_name, "")
        # Initialise timm-shaped tensors as timm does, then lay them out as TE's: concatenated
        # GLU halves get each half's own fan-in/fan-out, padded units come out zero.
        ties = self.cfg.ties()
        params = dict(self.named_parameters())
        holder = dict(name_pairs(ties))
        with torch.no_grad():
            timm_sd = {}
            for name, shape in timm_shapes(ties, {k: p.shape for k, p in params.items()}).items():
                ref = params[holder[name]]
                timm_sd[name] = torch.empty(shape, device=ref.device, dtype=ref.dtype)
                _init_like_timm(timm_sd[name], name, mode, self.cfg.init_values)
            init_gates_like_timm_(timm_sd, self.cfg.mlp)  # GluMlp/SwiGLU.init_weights, as timm calls it
            for name, t in timm_to_te(timm_sd, ties).items():
                params[name].copy_(t)

    def _timm_aliases(self) -> None:
        """timm's ``fix_init_weight`` rescales ``attn.proj.weight`` and ``mlp.fc2.weight``: give it
        those names. Plain attributes, not submodules: no second copy in ``state_dict()``."""
        object.__setattr__(self.attn, "proj", self.proj)
        if self.cfg.fused_mlp:  # a rescale keeps padded zero columns zero
            object.__setattr__(self.mlp, "fc2", _WeightAlias(self.mlp, "fc2_weight"))

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        """Args:
            x: tokens ``[B, N, C]``.
            attn_mask: optional mask broadcastable to ``[B, H, N, N]``: boolean, True where a
                query may attend to a key (``scaled_dot_product_attention``'s convention, as
                timm), or additive float (NaFlexViT's, ``[B, 1, N, N]`` or ``[B, 1, 1, N]``) whose
                values are all 0 (attend) or masked (-inf, or at most half the dtype's most
                negative value), taken as the boolean mask it is. A query whose keys are all
                masked (NaFlexViT's padding tokens) gets an output no valid token sees: timm's
                additive path averages all values there, as TE's unfused attention (the one TE
                runs for arbitrary masks) does; the reference backend gives zeros.
            is_causal: causal attention, as in timm.

        Returns:
            ``[B, N, C]``, in the autocast dtype under autocast unless ``fp32_residual``.

        Raises:
            ValueError: a wrong ``x`` shape, a float mask with other values (TE has no
                additive-bias attention kernel), or both a mask and ``is_causal``.
        """
        if x.dim() != 3 or x.shape[-1] != self.cfg.dim:
            raise ValueError(f"TE_Block expects x of shape [B, N, {self.cfg.dim}], got {tuple(x.shape)}")
        return self._dispatch(x, self._bool_mask(attn_mask, is_causal), is_causal)

    def _forward(self, x, attn_mask, is_causal, mult: int, gelu_gemm: bool):
        x = self._stream(x)
        x = self._ls_add(x, self._attention(x, attn_mask, is_causal, mult), self.ls1, self.drop_path1)
        h = x if self.norm2 is None else self.norm2(x)
        if mult > 1 and not self.cfg.mlp.fp8_widths_ok(mult):
            # MXFP8 scales blocks of 32: an MLP whose widths are not multiples of it runs without FP8.
            warn_once(f"fp8vit: {self.cfg.mlp.describe()} has widths that are not multiples of {mult}, "
                      "which this FP8 recipe needs: that MLP runs with FP8 off (in the autocast dtype)",
                      RuntimeWarning, stacklevel=2)
            with self._impl.fp8_off():
                mlp = self._run_mlp(self.mlp, h, 1, False)
        else:
            mlp = self._run_mlp(self.mlp, h, mult, gelu_gemm)
        return self._ls_add(x, mlp, self.ls2, self.drop_path2)

    def _ls_add(self, x: torch.Tensor, y: torch.Tensor, ls: nn.Module, drop_path: nn.Module) -> torch.Tensor:
        """``x + drop_path(ls(y))``: timm's ``LayerScale`` through :meth:`FP8Block._add_branch` (in
        the stream's dtype under autocast), any other ``ls`` module (``nn.Identity``, a user's) as is."""
        if isinstance(ls, LayerScale):
            return self._add_branch(x, y, ls.gamma, drop_path)
        return self._add_branch(x, ls(y), None, drop_path)

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"dim={c.dim}, heads={c.num_heads}, mlp={c.mlp.describe()}, "
                f"norm={c.norm}(eps={c.norm_eps}), backend={self.backend}"
                + (", scale_attn_norm=True" if c.scale_attn_norm else "")
                + (", fp32_residual=True" if self.fp32_residual else "")
                + (", recompute_mlp=True" if self.recompute_mlp else ""))


# timm's per-module init functions, by name -> the weight_init mode they implement.
_TIMM_INIT_MODES = {"init_weights_vit_timm": "", "init_weights_vit_jax": "jax", "init_weights_vit_moco": "moco"}


def _init_like_timm(p: torch.Tensor, timm_name: str, mode: str, init_values: Optional[float]) -> None:
    """Initialise one timm-shaped tensor of a ``Block`` as timm's init ``mode`` does."""
    module, leaf = timm_name.rsplit(".", 1)
    last = module.rsplit(".", 1)[-1]
    if leaf == "gamma":
        nn.init.constant_(p, init_values)
    elif last.startswith("norm") or last.endswith("_norm"):  # norm1/2, attn.norm, q/k_norm, mlp.norm
        (nn.init.ones_ if leaf == "weight" else nn.init.zeros_)(p)
    elif leaf == "weight":  # a GEMM, [out, in]
        if mode.startswith("jax"):
            nn.init.xavier_uniform_(p)
        elif mode == "moco" and module == "attn.qkv":  # q, k and v each as its own [C, C] matrix
            bound = math.sqrt(6.0 / float(p.shape[0] // 3 + p.shape[1]))
            nn.init.uniform_(p, -bound, bound)
        elif mode == "moco":
            nn.init.xavier_uniform_(p)
        else:
            trunc_normal_(p, std=0.02)
    elif mode.startswith("jax") and module.startswith("mlp"):
        nn.init.normal_(p, std=1e-6)
    else:
        nn.init.zeros_(p)


class _WeightAlias:
    """``obj.<name>`` as ``.weight`` (a fused TE MLP's ``fc2_weight`` as timm's ``mlp.fc2.weight``)."""

    def __init__(self, obj: nn.Module, name: str):
        self.obj, self.name = obj, name

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self.obj, self.name)


# timm's FX feature extraction (features_only, AttentionExtract, get_graph_node_names) traces
# models symbolically; TE's modules cannot be traced, so a TE_Block is one leaf node, as timm does
# for its own untraceable layers.
register_notrace_module(TE_Block)


def _installed_block_kwargs(kwargs: dict) -> dict:
    """Drop keywords the installed timm's ``Block`` lacks (``proj_bias`` before timm 1.0.10), if
    they hold timm's default value; otherwise that timm cannot build this block."""
    params = inspect.signature(Block.__init__).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(BlockConfig)}
    defaults["mlp_layer"] = Mlp
    for k, v in kwargs.items():
        if k not in params and defaults.get(k, object()) != v:
            raise ValueError(f"the installed timm's Block has no {k!r} keyword, needed for {k}={v}; "
                             "upgrade timm")
    return {k: v for k, v in kwargs.items() if k in params}
