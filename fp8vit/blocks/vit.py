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

import contextlib
import dataclasses
import inspect
import sys
from typing import Optional

import torch
from timm.layers import DropPath, LayerScale, Mlp
from timm.models._manipulate import named_apply
from timm.models.vision_transformer import Block, get_init_weights_vit
from torch import nn

from .._te.gemm_residual import into_residual, residual_added, residual_gemm_enabled
from .._te.norm_grad import Slot, fork, join, norm_grad_add_enabled
from .._validate import check_bool, check_type
from .._warn import warn_once
from .config import BlockConfig, config_from_timm_block
from .base import FP8Block, check_block_args
from .mlp import build_mlp, norm_in_dtype
from .timm_layers import register_notrace_module
from .weights import copy_requires_grad, te_requires_grad, te_to_timm, timm_requires_grad, timm_to_te

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

    Random numbers: a ``TE_Block`` draws its initial weights exactly as timm's ``Block`` does, on
    the device and with the dtype timm's would have (``device=None``: torch's default device, also
    for the TE backend, which then copies them to the GPU), and nothing else: after the same
    ``torch.manual_seed``, ``VisionTransformer(block_fn=TE_Block, ...)`` and timm's
    ``VisionTransformer(...)`` hold the same weights, bit for bit, in every ``weight_init`` mode and
    with ``fix_init``, and leave the RNG in the same state (tests/test_init_rng.py).

    Raises:
        TypeError: a keyword timm's ``Block`` does not take, or one of the wrong type (``backend``
            not a str, ``exact_gelu`` or ``fp32_residual`` not a bool, ``config`` not a
            :class:`BlockConfig`, ...); checked before anything is built.
        ValueError: a setting TE cannot honour, or an unknown ``backend``, named.
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
        _timm_init: bool = True,
        **kwargs,
    ) -> None:
        check_block_args("TE_Block", backend=backend, fp32_residual=fp32_residual, device=device, dtype=dtype)
        check_bool("TE_Block", "exact_gelu", exact_gelu)
        check_type("TE_Block", "config", config, BlockConfig, "a fp8vit.BlockConfig", none_ok=True)
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
        # Where timm's Block would hold (and draw) its parameters: see _draw_like_timm.
        self._timm_device = torch.get_default_device() if device is None else torch.device(device)
        device = self._impl.default_device if device is None else device
        if self._impl.fp8 and torch.device(device).type not in ("cuda", "cpu", "meta"):
            raise ValueError(f"TE_Block on device {device!r}: Transformer Engine modules are built on "
                             "'cuda', 'cpu' (then moved with .cuda()) or 'meta'; or pass backend='reference'")
        dd = {"device": device, "params_dtype": dtype}  # TE's keyword names
        tdd = {"device": device, "dtype": dtype}  # torch's

        # TE's modules (and the reference stand-ins) initialise their weights their own way, drawing
        # other numbers than timm's Block in other shapes: undone here, overwritten below.
        with _rng_untouched(device):
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
        if _timm_init:  # from_timm loads weights instead: no draws there
            self._draw_like_timm()

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
                              dtype=ref.dtype, backend=backend, fp32_residual=fp32_residual, _timm_init=False)
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

        timm's own init function runs, over a timm ``Block`` of this config on the device timm's
        would be on (:meth:`_draw_like_timm`), and its tensors are loaded: the same draws in the
        same order and shapes as timm's ``init_weights`` makes for its ``Block`` (``GluMlp`` and
        ``SwiGLU``'s ``init_weights`` included), padded units zero.
        """
        if mode is None:
            mode = _TIMM_INIT_MODES.get(sys._getframe(1).f_code.co_name, "")
        ref = self.qkv.layer_norm_weight
        device = getattr(self, "_timm_device", None) or ref.device
        if device.type == "meta" or ref.is_meta:  # timm draws nothing there either
            return
        # timm initialises a Block whose constructor has drawn already (as this block's did): the
        # twin's constructor draws are undone.
        with _rng_untouched(device):
            block = _timm_block(self.cfg, device, ref.dtype)
        named_apply(get_init_weights_vit(mode), block)
        self.load_timm_state_dict(block.state_dict())

    def _draw_like_timm(self) -> None:
        """Set the parameters as timm's ``Block`` constructor draws them: a timm ``Block`` of this
        config is built where timm's would be (its ``nn.Linear``\\ s draw from that device's RNG, in
        timm's order and shapes) and loaded, laid out by :func:`fp8vit.blocks.weights.timm_to_te` (padded
        units zero). That device is the one the block was built for (``device=None``: torch's
        default device, also when the TE backend puts the parameters on the GPU), following the
        block when it is moved (:meth:`_apply`)."""
        ref = self.qkv.layer_norm_weight
        if self._timm_device.type == "meta" or ref.is_meta:  # nothing drawn on the meta device
            return
        self.load_timm_state_dict(_timm_block(self.cfg, self._timm_device, ref.dtype).state_dict())

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .half(), to_empty(): timm's Block would go where this one goes; an empty
        # tensor through the same function says where (the parameters' own device if it cannot).
        dev = getattr(self, "_timm_device", None)
        if dev is not None:
            try:
                self._timm_device = fn(torch.empty(0, device=dev)).device
            except Exception:  # noqa: BLE001 - e.g. a copy out of the meta device
                self._timm_device = None
        return super()._apply(fn, *args, **kwargs)

    def _timm_aliases(self) -> None:
        """timm's ``fix_init_weight`` rescales ``attn.proj.weight`` and ``mlp.fc2.weight``: give it
        those names. Plain attributes, not submodules: no second copy in ``state_dict()``."""
        object.__setattr__(self.attn, "proj", self.proj)
        if self.cfg.fused_mlp:  # a rescale keeps padded zero columns zero
            object.__setattr__(self.mlp, "fc2", _WeightAlias(self.mlp, "fc2_weight"))

    # ------------------------------------------------------------------ forward
    # torch.compile(model) runs the block eagerly: its TE kernels are fused already, and dynamo,
    # breaking its graph at every TE module, made a compiled ViT-B step 15% slower (frames per
    # block, recompiled past its limit). The model around the blocks is compiled.
    @torch.compiler.disable
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
        layer_norm = self.cfg.norm == "LayerNorm"  # TE's LayerNorm backward can add the skip gradient (lever 70)
        x = self._branch(x, lambda inp: self._attention(inp, attn_mask, is_causal, mult), self.ls1, self.drop_path1,
                         self.proj_drop, self.cfg.dim, mult, norm_first=layer_norm)
        h = x if self.norm2 is None else norm_in_dtype(self.norm2, x)  # GeGluMlp's first norm (lever 33)
        if mult > 1 and not self.cfg.mlp.fp8_widths_ok(mult):
            # MXFP8 scales blocks of 32: an MLP whose widths are not multiples of it runs without FP8.
            warn_once(f"fp8vit: {self.cfg.mlp.describe()} has widths that are not multiples of {mult}, "
                      "which this FP8 recipe needs: that MLP runs with FP8 off (in the autocast dtype)",
                      RuntimeWarning, stacklevel=2)
            with self._impl.fp8_off():
                mlp = self._run_mlp(self.mlp, h, 1, False)
            return self._ls_add(x, mlp, self.ls2, self.drop_path2)
        # fc2's inner width: where it equals fc1's (C), fc1 could take the offer first
        inner = self.cfg.mlp.hidden_padded if self.cfg.fused_mlp and self.cfg.mlp.hidden_padded != self.cfg.dim else 0
        return self._branch(x, lambda inp: self._run_mlp(self.mlp, inp if self.norm2 is None else h, mult, gelu_gemm),
                            self.ls2, self.drop_path2, None, inner, mult,
                            norm_first=layer_norm and self.norm2 is None and self.cfg.fused_mlp)

    def _branch(self, x: torch.Tensor, branch, ls: nn.Module, drop_path: nn.Module, drop: Optional[nn.Module],
                inner: int, mult: int, norm_first: bool = False) -> torch.Tensor:
        """``x + drop_path(ls(branch(x)))``, the add in the branch's last FP8 GEMM where it can be
        (lever 61; where :func:`fp8vit.set_residual_gemm` has it on, as the graphs' capture does by
        default): a branch without LayerScale, drop path or dropout (``drop``, the one after its
        last GEMM) at work, a bf16 stream of aligned rows, ``inner`` the GEMM's input width (0:
        none takes it). Else, and where the GEMM does not take it, :meth:`_ls_add`. Where the
        branch starts with TE's LayerNorm (``norm_first``) and the graphs' capture routes its
        backward (:mod:`fp8vit._te.norm_grad`, lever 70), ``x``'s two gradients are summed there."""
        def idle(m: Optional[nn.Module]) -> bool:  # drops nothing: none, identity, eval, or a rate of 0
            return (m is None or isinstance(m, nn.Identity) or not self.training
                    or not getattr(m, "drop_prob", getattr(m, "p", 1)))

        B, N, _ = x.shape
        if not (inner and residual_gemm_enabled() and isinstance(ls, nn.Identity) and idle(drop_path)
                and idle(drop) and x.dtype == torch.bfloat16 and x.is_contiguous() and (B * N) % mult == 0):
            return self._ls_add(x, branch(x), ls, drop_path)
        slot = Slot() if norm_first and x.requires_grad and norm_grad_add_enabled() else None
        with into_residual(x, inner) as offer:
            y = branch(x if slot is None else fork(x, slot))
        if not offer.taken:
            return self._ls_add(x, y, ls, drop_path)
        return residual_added(x, y) if slot is None else join(y, slot)

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


@contextlib.contextmanager
def _rng_untouched(device):
    """Random draws inside leave torch's RNG as it was: the CPU generator and, for a CUDA
    ``device``, that GPU's are restored on exit."""
    dev = torch.device(device)
    gpus = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        yield


def _timm_block(cfg: BlockConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """timm's ``Block`` for ``cfg``, built as ``VisionTransformer`` builds it on ``device`` with
    ``dtype``: its constructor draws what timm's draws (``nn.Linear``'s init, in timm's order)."""
    kwargs = _installed_block_kwargs(cfg.timm_kwargs())
    if "device" in inspect.signature(Block.__init__).parameters:
        return Block(**kwargs, device=device, dtype=dtype)
    with device:  # a timm whose Block takes no device (nor does its VisionTransformer pass one)
        block = Block(**kwargs)
    return block.to(dtype=dtype)


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
