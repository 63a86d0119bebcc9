"""``TE_EvaBlock``: timm's ``EvaBlock`` (EVA02, EVA-CLIP, Perception Encoder, the RoPE ViTs, DINOv3,
Sapiens2, ...) and ``EvaBlockPostNorm`` built from Transformer Engine modules.

    x [B, N, C] --+-- qkv: norm1 + Linear (fused) -> [B, N, (H + 2 Hkv) * D (+ A gate)] -> q_norm/k_norm
                  |   -> RoPE on q and k of the patch tokens (TE's fused kernel) -> DotProductAttention (bshd)
                  |   -> [B, N, A = H*D] -> (inner norm +) proj (gated: inner norm, * sigmoid(gate), proj)
                  |   -> gamma_1 -> drop_path1
                  +-- (+) -> mlp: norm2 fused into fc1; GELU, SwiGLU or GLU; optional norm before fc2
                  |   -> gamma_2 -> drop_path2 -> (+)

``EvaBlockPostNorm`` (``cfg.post_norm``): qkv is a plain Linear, norm1 follows proj and norm2 the
MLP (torch norms), and the MLP runs unfused (TE's ``LayerNormMLP`` always normalizes its input).

What differs from the classic ViT block (``block.py``), and how it is kept exact:

* EVA's attention has q and v biases but no k bias (``EvaAttention``: a zero buffer). TE's fused QKV
  GEMM takes one ``[3A]`` bias; its k third is held at zero: it starts at zero and its gradient is
  zeroed before it reaches the parameter (with RoPE a k bias would not cancel in the softmax, so
  training it would change the model).
* RoPE: timm passes one table ``[N_patch, 2D]`` (sin, cos) to every block; it rotates q and k of the
  patch tokens only. TE's fused RoPE kernel takes angles ``[N, 1, 1, D]``; the table becomes angles
  with zero angles for the prefix (class/register) tokens, which the kernel then leaves exactly as
  they are. Interleaved pairs (timm's default) and rotate-half (``rotate_half=True``) both map to
  the kernel. The angles are computed once per table, not once per block (:func:`forward_rope_angles`).
  Other tables (per head, per batch: mixed RoPE, patch dropout) run timm's own RoPE code.
* timm's separate ``q_proj``/``k_proj``/``v_proj`` (``qkv_fused=False``) become the one fused GEMM:
  their weights are concatenated in timm's ``(q, k, v)`` order, exactly; so do k/v projections
  with fewer heads (grouped-query attention: TE's ``num_gqa_groups``) and the gate of a gated
  attention output (a Linear of the same input as q, k, v).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import List, Optional, Tuple

import torch
from timm.layers import DropPath
from timm.layers.attention import AttentionRope
from timm.layers.pos_embed_sincos import apply_rot_embed_cat
from timm.models.eva import EvaAttention, EvaBlock, EvaBlockPostNorm
from torch import nn

from .._te.kernels import rope_packed_qkv, rope_support
from .._validate import check_type
from .._warn import warn_once
from .base import FP8Block, LastResult, packed_gradient
from .mlp import MlpConfig, build_mlp, mlp_config_from_timm, mlp_ties, norm_in_dtype, torch_norm
from .timm_layers import register_notrace_module, require_timm_class, resolve_norm
from .weights import Part, Tie, block_from_timm, load_timm_state, rename, timm_block_of

__all__ = ["TE_EvaBlock", "EvaBlockConfig", "eva_config_from_timm", "eva_like_config", "rope_angles",
           "forward_rope_angles", "RopeQKV", "ROPE_KERNELS"]

# TE_EvaBlock.rope_kernel's values: "auto" (default), fp8vit's Triton pass over the packed QKV
# buffer where it can run, else TE's (lever 43 of docs/performance.md: faster on every RoPE model
# benched); "te", TE's fused RoPE on q and k apart; "triton", the Triton pass, said where it cannot run
ROPE_KERNELS = ("auto", "te", "triton")


@dataclasses.dataclass(frozen=True)
class EvaBlockConfig:
    """A timm ``EvaBlock``'s settings in the form ``TE_EvaBlock`` builds from.

    Attributes:
        dim: channels ``C``.
        num_heads, head_dim: attention heads ``H`` and their width ``D`` (``H * D`` may differ
            from ``C``: timm's ``attn_head_dim``).
        num_kv_heads: key/value heads ``Hkv``; fewer than ``H`` is grouped-query attention
            (``AttentionRope``'s ``num_kv_heads``: query head ``h`` uses k/v head ``h // (H / Hkv)``).
        qkv_bias: ``"none"``, ``"qv"`` (EVA: q and v biases, k held at zero) or ``"qkv"``.
        qkv_fused: timm holds one ``qkv`` Linear (True) or ``q_proj``/``k_proj``/``v_proj``.
        attn_type: ``"eva"`` (``EvaAttention``), ``"rope"`` (``AttentionRope``) or ``"beit"``
            (BEiT's ``Attention``: :mod:`fp8vit.blocks.beit`).
        proj_bias: the output projection has a bias.
        qk_norm: q and k are normalized per head (timm's ``q_norm``/``k_norm`` modules kept).
        inner_norm: a norm over ``H * D`` before proj (timm's ``scale_attn_inner``), fused into proj
            unless ``gated``.
        gated: timm's ``gated_attn``: the attention output (after the inner norm) is multiplied by
            ``sigmoid(gate(x))`` before proj, ``gate`` a Linear of the attention's input.
        post_norm: timm's ``EvaBlockPostNorm``: ``x + norm1(attn(x))``, ``x + norm2(mlp(x))``
            instead of ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``.
        rotate_half: RoPE rotates the two halves of each head (else interleaved pairs).
        num_prefix_tokens: leading tokens RoPE leaves alone (class and register tokens).
        attn_drop, proj_drop, drop_path: dropout rates as in timm.
        layer_scale: whether ``gamma_1`` / ``gamma_2`` exist (LayerScale on attention / MLP).
        norm, norm_eps: the block's norms (norm1, norm2, the inner norms): TE name and eps.
        mlp: the MLP (``fp8vit.blocks.mlp``).
    """

    dim: int
    num_heads: int
    head_dim: int
    qkv_bias: str
    qkv_fused: bool
    attn_type: str
    proj_bias: bool
    qk_norm: bool
    inner_norm: bool
    rotate_half: bool
    num_prefix_tokens: int
    attn_drop: float
    proj_drop: float
    drop_path: float
    layer_scale: Tuple[bool, bool]
    norm: str
    norm_eps: float
    mlp: MlpConfig
    num_kv_heads: int
    gated: bool
    post_norm: bool

    @property
    def attn_dim(self) -> int:
        """``A = H * D``: the width of q, of the attention output and of the gate."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """``Hkv * D``: the width of k and of v."""
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        """Rows of the fused GEMM: q, k, v, then the gate's (timm's gate is a Linear of the same
        input, so it joins the GEMM)."""
        return self.attn_dim + 2 * self.kv_dim + (self.attn_dim if self.gated else 0)

    @property
    def fused_inner_norm(self) -> bool:
        """The inner norm runs fused into proj (TE ``LayerNormLinear``); with a gate between the
        two it cannot, and runs in torch."""
        return self.inner_norm and not self.gated

    @property
    def fused_mlp(self) -> bool:
        """The MLP is one TE ``LayerNormMLP`` (as ``BlockConfig.fused_mlp``)."""
        return self.mlp.fused

    def ties(self) -> List[Tie]:
        """The weight layout (:mod:`fp8vit.blocks.weights`) of a ``TE_EvaBlock`` with this config."""
        return _ties(self)


def _reject(block: nn.Module, what: str) -> None:
    raise ValueError(f"{type(block).__name__} with {what} cannot be converted to TE_EvaBlock")


def eva_config_from_timm(block: nn.Module, *, exact_gelu: bool = False) -> EvaBlockConfig:
    """Read the settings of a built timm ``EvaBlock``.

    Raises:
        ValueError: a part of the block TE_EvaBlock does not implement, named.
    """
    require_timm_class(block, (EvaBlock, EvaBlockPostNorm), "TE_EvaBlock")
    require_timm_class(block, (EvaAttention, AttentionRope), "TE_EvaBlock", "attn")
    attn = block.attn
    if attn.qkv is not None:
        fused = True
        if isinstance(attn, EvaAttention):
            qkv_bias = "none" if attn.q_bias is None else "qv"
        else:
            qkv_bias = "none" if attn.qkv.bias is None else "qkv"
    else:
        fused = False
        has = [getattr(attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj")]
        qkv_bias = {(False, False, False): "none", (True, False, True): "qv", (True, True, True): "qkv"}.get(tuple(has))
        if qkv_bias is None:
            _reject(block, f"q/k/v biases {has}")
    cfg = eva_like_config(block, num_heads=attn.num_heads, head_dim=attn.head_dim, qkv_bias=qkv_bias,
                          exact_gelu=exact_gelu, post_norm=type(block) is EvaBlockPostNorm)
    norm, eps = cfg.norm, cfg.norm_eps
    inner = not isinstance(attn.norm, nn.Identity)
    if inner:
        _check_norm(block, "attn.norm", attn.norm, norm, eps)
    qk_norm = not isinstance(attn.q_norm, nn.Identity)
    if qk_norm:
        for name in ("q_norm", "k_norm"):
            if not isinstance(getattr(attn, name), nn.Module):
                _reject(block, f"attn.{name} that is not a module")
    gate = getattr(attn, "gate", None)  # timm >= 1.0.28
    if gate is not None and (type(gate) is not nn.Linear or (gate.bias is not None) != (qkv_bias != "none")):
        _reject(block, f"a gated attention output whose gate is {type(gate).__name__}(bias="
                       f"{gate.bias is not None}) with q/k/v biases {qkv_bias!r}: the gate joins the fused "
                       "q/k/v GEMM, which has one bias flag (timm's gate is an nn.Linear with qkv_bias)")
    return dataclasses.replace(
        cfg, qkv_fused=fused, attn_type="eva" if isinstance(attn, EvaAttention) else "rope", qk_norm=qk_norm,
        inner_norm=inner, rotate_half=bool(getattr(attn, "rotate_half", False)),
        num_prefix_tokens=int(attn.num_prefix_tokens),
        num_kv_heads=int(getattr(attn, "num_kv_heads", attn.num_heads)),  # newer timm (Sapiens2) only
        gated=gate is not None)


def eva_like_config(block: nn.Module, *, num_heads: int, head_dim: int, qkv_bias: str, exact_gelu: bool = False,
                    post_norm: bool = False) -> EvaBlockConfig:
    """The settings an EVA-like timm block (EVA's, BEiT's) shares, read from ``block``: its norms,
    attention dropouts and projection, MLP, LayerScale and drop path; the attention's specifics
    as the simplest form (one fused q/k/v Linear, no RoPE, q/k norm, inner norm or gate), for the
    family's reader to replace.

    Raises:
        ValueError: a part of the block these blocks do not implement, named.
    """
    attn = block.attn
    if not isinstance(attn.attn_drop, nn.Dropout) or not isinstance(attn.proj_drop, nn.Dropout):
        _reject(block, "attention dropout modules other than nn.Dropout")
    norm, eps = resolve_norm(lambda d, **kw: _same_norm(block.norm1), block.norm1.weight.shape[0])
    n2, e2 = resolve_norm(lambda d, **kw: _same_norm(block.norm2), block.norm1.weight.shape[0])
    if (n2, e2) != (norm, eps):
        _reject(block, f"norm1 {norm}(eps={eps}) and norm2 {n2}(eps={e2}) that differ")
    # EvaBlockPostNorm has no norm before its MLP, and TE's LayerNormMLP always normalizes its input:
    # the MLP runs unfused (TE Linear fc1, the activation exactly: TE's gated kernel where it has an
    # exact one, else torch's, erf GELU included; TE Linear fc2).
    mlp = mlp_config_from_timm(block.mlp, exact_gelu=exact_gelu, block_norm=not post_norm)
    g1, g2 = getattr(block, "gamma_1", None), getattr(block, "gamma_2", None)
    dp = block.drop_path1.drop_prob if isinstance(block.drop_path1, DropPath) else 0.0
    return EvaBlockConfig(
        dim=block.norm1.weight.shape[0], num_heads=num_heads, head_dim=head_dim, qkv_bias=qkv_bias,
        qkv_fused=True, attn_type="beit", proj_bias=attn.proj.bias is not None, qk_norm=False, inner_norm=False,
        rotate_half=False, num_prefix_tokens=0, attn_drop=float(attn.attn_drop.p),
        proj_drop=float(attn.proj_drop.p), drop_path=float(dp), layer_scale=(g1 is not None, g2 is not None),
        norm=norm, norm_eps=eps, mlp=mlp, num_kv_heads=num_heads, gated=False, post_norm=post_norm)


def _same_norm(module: nn.Module) -> nn.Module:
    """``resolve_norm`` instantiates a constructor; hand it the built norm itself."""
    return module


def _check_norm(block, name: str, module: nn.Module, norm: str, eps: float) -> None:
    got = resolve_norm(lambda d, **kw: module, module.weight.shape[0])
    if got != (norm, eps):
        _reject(block, f"{name} {got[0]}(eps={got[1]}) unlike norm1 {norm}(eps={eps})")


def _ties(cfg: EvaBlockConfig) -> List[Tie]:
    """The weight layout (:mod:`fp8vit.blocks.weights`) of a ``TE_EvaBlock``: timm ``EvaBlock`` (or
    ``EvaBlockPostNorm``) tensors -> TE tensors, names relative to the block."""
    ln = cfg.norm == "LayerNorm"  # RMSNorm has no bias

    def norm(src: str, dst: str) -> List[Tie]:  # prefixes: "norm1." -> "qkv.layer_norm_" (TE's names)
        return [rename(f"{src}weight", f"{dst}weight")] + ([rename(f"{src}bias", f"{dst}bias")] if ln else [])

    if cfg.post_norm:  # norm1 and norm2 follow their branches: torch modules of their own
        ties = norm("norm1.", "post_norm1.") + norm("norm2.", "post_norm2.")
    else:  # norm1 fused into the q/k/v GEMM (norm2 into fc1: mlp_ties)
        ties = norm("norm1.", "qkv.layer_norm_")
    # The fused GEMM's rows: timm's q, k, v (one tensor, or separate ones: concatenated in that
    # order), then the gate's.
    A, KV = cfg.attn_dim, cfg.kv_dim
    if cfg.qkv_fused:
        rows = [("attn.qkv", 0, A + 2 * KV)]
    else:
        rows = [("attn.q_proj", 0, A), ("attn.k_proj", 0, KV), ("attn.v_proj", 0, KV)]
    gate = [("attn.gate", 0, A)] if cfg.gated else []
    ties.append(Tie("qkv.weight", tuple(Part(f"{n}.weight", s, l) for n, s, l in rows + gate)))
    if cfg.qkv_bias == "qkv":
        ties.append(Tie("qkv.bias", tuple(Part(f"{n}.bias", s, l) for n, s, l in rows + gate)))
    elif cfg.qkv_bias == "qv":  # the k third is held at zero (see the module docstring)
        q, v = ("attn.q_bias", "attn.v_bias") if cfg.qkv_fused else ("attn.q_proj.bias", "attn.v_proj.bias")
        ties.append(Tie("qkv.bias", (Part(q, 0, A), Part(None, 0, A), Part(v, 0, A))
                        + tuple(Part(f"{n}.bias", s, l) for n, s, l in gate)))
    if cfg.qk_norm:
        for t in ("q_norm", "k_norm"):
            ties += norm(f"attn.{t}.", f"{t}.")
    if cfg.fused_inner_norm:  # fused into proj (a LayerNormLinear)
        ties += norm("attn.norm.", "proj.layer_norm_")
    elif cfg.inner_norm:  # before the gate: a torch module
        ties += norm("attn.norm.", "gate_norm.")
    ties.append(rename("attn.proj.weight", "proj.weight"))
    if cfg.proj_bias:
        ties.append(rename("attn.proj.bias", "proj.bias"))
    ties += [rename(f"gamma_{i}", f"gamma_{i}") for i, on in enumerate(cfg.layer_scale, start=1) if on]
    return ties + mlp_ties(cfg.mlp, None if cfg.post_norm else cfg.norm)


def rope_angles(rope: torch.Tensor, num_tokens: int, num_prefix_tokens: int) -> Optional[torch.Tensor]:
    """timm's RoPE table -> TE's fused-RoPE angles ``[N, 1, 1, D]`` (fp32), or None if the table has
    another form (per head, per batch) that the kernel cannot take.

    Args:
        rope: ``[N_patch, 2 * D]``, ``cat(sin, cos)`` per patch token and channel (timm's
            ``apply_rot_embed_cat`` convention; interleaved or rotate-half is in the layout of the
            channels, which TE reads the same way per channel).
        num_tokens: ``N``, all tokens of the block input.
        num_prefix_tokens: leading tokens without RoPE: they get angle 0, which the kernel applies
            as ``x * 1 + rot(x) * 0 = x``, exactly.
    """
    if rope.dim() != 2 or rope.shape[0] + num_prefix_tokens != num_tokens:
        return None
    sin, cos = rope.float().chunk(2, dim=-1)
    angles = torch.atan2(sin, cos)  # [N_patch, D]
    if num_prefix_tokens:
        angles = torch.cat([angles.new_zeros(num_prefix_tokens, angles.shape[1]), angles])
    return angles[:, None, None, :].contiguous()


# timm's Eva hands one RoPE table to every block of a forward (often the same tensor every forward:
# RotaryEmbeddingCat's precomputed buffer), so its angles (atan2 + cat, [N, 1, 1, D]) are computed
# once and reused; at most one angles tensor is held, and none past its table.
_ANGLES = LastResult()


def forward_rope_angles(rope: torch.Tensor, num_tokens: int, num_prefix_tokens: int) -> Optional[torch.Tensor]:
    """:func:`rope_angles`, computed once per RoPE table: the blocks of one forward share its result.

    A table hits the cache while it is the same tensor object, unchanged (:class:`LastResult`: content
    version, device, dtype, shape, strides, storage), with the same token counts and inference mode.
    Computed afresh every call, uncached:

    * an inference tensor (a table made under ``torch.inference_mode``: mixed RoPE's table every
      inference forward, a buffer built there): it has no version counter (reading ``_version``
      raises), so an in-place change inside inference mode could not be seen;
    * a table that requires grad (mixed RoPE's learnable frequencies in training): cached angles
      would carry a graph that the first backward frees, and a second forward with the same table
      (gradient accumulation) would backpropagate through it again; uncached, the angles carry
      the gradient to the table every call;
    * a tensor subclass (``Parameter``, ``DTensor``, fake tensors): it may have no storage to key on;
    * while a CUDA graph is being captured, or ``torch.compile``/``torch.export`` traces: the graph
      must compute the angles from its own input (``make_graphed_blocks`` replays with each step's
      table copied into that input), not read a tensor of an eager forward whose memory the graph
      does not own, and capture must not leave a tensor of the graph's pool in the cache.
    """
    return _ANGLES.get(rope, lambda: rope_angles(rope, num_tokens, num_prefix_tokens), num_tokens, num_prefix_tokens)


class _ZeroKBiasGrad:
    """Tensor hook on the fused QKV bias ``[3A]`` (``[4A]`` with a gate): the k part's gradient,
    ``[A, 2A)``, is zero (EVA has no k bias). An object, not a closure, so that the module pickles."""

    def __init__(self, attn_dim: int):
        self.attn_dim = attn_dim

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[self.attn_dim: 2 * self.attn_dim] = 0
        return grad


class TE_EvaBlock(FP8Block):  # noqa: N801 - named like TE_Block
    """timm's ``EvaBlock`` on Transformer Engine, built from a timm block (:meth:`from_timm`).

    Same contract as ``TE_Block``: weights exact both ways (:meth:`from_timm` / :meth:`to_timm`),
    every option honoured or rejected by name, any batch under FP8 (token rows padded), activation
    checkpointing, MLP recompute, FP8 off per block, diagnostics and guards.

    Args:
        cfg: the block's settings (:func:`eva_config_from_timm`).
        timm_skeleton: the timm block on the meta device, kept to rebuild it in :meth:`to_timm`.
        device, dtype: where and how parameters are built.
        backend: ``"te"``, ``"reference"`` or None (automatic).
        fp32_residual: keep the residual stream in fp32 under autocast (timm's behaviour).
        q_norm, k_norm: timm's per-head q/k norm modules (moved in, not copied), if ``cfg.qk_norm``.

    Raises:
        TypeError: ``cfg`` is not an :class:`EvaBlockConfig`, ``timm_skeleton`` (or, with
            ``cfg.qk_norm``, ``q_norm``/``k_norm``) not a module, ``backend`` not a str,
            ``fp32_residual`` not a bool, ``device``/``dtype`` not a device/dtype; checked before
            anything is built.
        ValueError: an unknown ``backend``, a device string naming no device, a non-float ``dtype``.

    ``rope_kernel`` (``FP8Block``'s switch; default ``"auto"``) rotates q and k in one pass over
    the packed QKV buffer (:class:`RopeQKV`) where the RoPE table has one row per patch token;
    where that pass cannot run (q/k norm, a gate, grouped-query attention, another table form, no
    Triton, CPU tensors), TE's kernel runs: silently for ``"auto"``, said once for ``"triton"``.
    """

    def __init__(self, cfg: EvaBlockConfig, *, timm_skeleton: nn.Module, device=None,
                 dtype: Optional[torch.dtype] = None, backend: Optional[str] = None,
                 fp32_residual: bool = False, q_norm: Optional[nn.Module] = None,
                 k_norm: Optional[nn.Module] = None) -> None:
        m, dd, tdd = self._init_from_skeleton(cfg, EvaBlockConfig, "a fp8vit.eva.EvaBlockConfig (eva_config_from_timm)",
                                              timm_skeleton, device=device, dtype=dtype, backend=backend,
                                              fp32_residual=fp32_residual)
        for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
            check_type(type(self).__name__, name, norm, nn.Module, "the timm block's norm module",
                       none_ok=not cfg.qk_norm)
        A = cfg.attn_dim
        bias = cfg.qkv_bias != "none"
        if cfg.post_norm:  # EvaBlockPostNorm's attention reads the block input: no norm to fuse
            self.qkv = m.Linear(cfg.dim, cfg.qkv_width, bias=bias, **dd)
        else:
            self.qkv = m.LayerNormLinear(cfg.dim, cfg.qkv_width, eps=cfg.norm_eps, bias=bias,
                                         normalization=cfg.norm, **dd)
        self.q_norm = q_norm if cfg.qk_norm else nn.Identity()
        self.k_norm = k_norm if cfg.qk_norm else nn.Identity()
        # grouped-query attention: TE's num_gqa_groups (k/v heads), keyword passed only then
        gqa = {"num_gqa_groups": cfg.num_kv_heads} if cfg.num_kv_heads != cfg.num_heads else {}
        self.attn = m.DotProductAttention(cfg.num_heads, cfg.head_dim, attention_dropout=cfg.attn_drop,
                                          qkv_format="bshd", attn_mask_type="no_mask", **gqa)
        if cfg.gated:  # timm: proj(norm(o) * sigmoid(gate)); the norm cannot fuse into proj past the gate
            self.gate_norm = torch_norm(cfg.norm, cfg.norm_eps, A, **tdd) if cfg.inner_norm else nn.Identity()
        if cfg.fused_inner_norm:  # timm's attn.norm over H*D, fused into proj
            self.proj = m.LayerNormLinear(A, cfg.dim, eps=cfg.norm_eps, bias=cfg.proj_bias,
                                          normalization=cfg.norm, **dd)
        else:
            self.proj = m.Linear(A, cfg.dim, bias=cfg.proj_bias, **dd)
        self.proj_drop = nn.Dropout(cfg.proj_drop)
        if cfg.post_norm:  # timm's norm1 and norm2, after the attention and the MLP
            self.post_norm1 = torch_norm(cfg.norm, cfg.norm_eps, cfg.dim, **tdd)
            self.post_norm2 = torch_norm(cfg.norm, cfg.norm_eps, cfg.dim, **tdd)
        self.gamma_1 = nn.Parameter(torch.ones(cfg.dim, **tdd)) if cfg.layer_scale[0] else None
        self.drop_path1 = DropPath(cfg.drop_path) if cfg.drop_path > 0 else nn.Identity()
        built = build_mlp(cfg.mlp, None if cfg.post_norm else cfg.norm, cfg.norm_eps, m, dd, tdd)
        self.norm2 = built.norm  # None: norm2 is fused into fc1 (or follows the MLP: post_norm2)
        self.mlp = built.mlp
        self.gamma_2 = nn.Parameter(torch.ones(cfg.dim, **tdd)) if cfg.layer_scale[1] else None
        self.drop_path2 = DropPath(cfg.drop_path) if cfg.drop_path > 0 else nn.Identity()

    # ------------------------------------------------------------------ timm interop
    @classmethod
    def from_timm(cls, block: nn.Module, *, exact_gelu: bool = False, backend: Optional[str] = None,
                  fp32_residual: bool = False) -> "TE_EvaBlock":
        """A ``TE_EvaBlock`` with the settings, weights, device, dtype, ``requires_grad`` flags and
        mode of a timm ``EvaBlock``.

        Raises:
            ValueError: a part of ``block`` that TE_EvaBlock does not implement, named.
        """
        cfg = eva_config_from_timm(block, exact_gelu=exact_gelu)
        attn = block.attn
        qn = copy.deepcopy(attn.q_norm) if cfg.qk_norm else None
        kn = copy.deepcopy(attn.k_norm) if cfg.qk_norm else None
        return block_from_timm(cls, block, cfg, block.norm1.weight, backend=backend, fp32_residual=fp32_residual,
                               q_norm=qn, k_norm=kn)

    def load_timm_state_dict(self, sd) -> None:
        """Load a timm ``EvaBlock`` state dict (keys relative to the block) exactly.

        Raises:
            ValueError: keys that do not match this block's configuration, listed.
        """
        load_timm_state(self, sd)

    def to_timm(self) -> nn.Module:
        """The equivalent timm ``EvaBlock`` (same weights, device, dtype, ``requires_grad`` flags,
        mode). FP8 scaling state is dropped."""
        return timm_block_of(self, self.qkv.weight)

    # ------------------------------------------------------------------ forward
    # torch.compile(model) runs the block eagerly: its TE kernels are fused already, and dynamo,
    # breaking its graph at every TE module, made a compiled ViT-B step 15% slower (frames per
    # block, recompiled past its limit). The model around the blocks is compiled.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, rope: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        """Args:
            x: tokens ``[B, N, C]``.
            rope: timm's RoPE table for the patch tokens (``[N - prefix, 2 * D]`` from ``Eva``), or None.
            attn_mask: optional mask broadcastable to ``[B, H, N, N]``: boolean, True where a query
                may attend to a key (timm's convention), or an additive float padding mask (see
                ``TE_Block.forward``).
            is_causal: causal attention, as in timm.

        Returns:
            ``[B, N, C]``, in the autocast dtype under autocast unless ``fp32_residual``.
        """
        if x.dim() != 3 or x.shape[-1] != self.cfg.dim:
            raise ValueError(f"TE_EvaBlock expects x of shape [B, N, {self.cfg.dim}], got {tuple(x.shape)}")
        self._hook_k_bias()
        return self._dispatch(x, rope, self._bool_mask(attn_mask, is_causal), is_causal, None)

    def _hook_k_bias(self) -> None:
        # Checked on the parameter in use now, every call: .to() and load_state_dict keep the
        # parameter and its hook; deepcopy, pickling, to_empty() or a sharding wrapper give a new
        # parameter without hooks, which gets its hook here.
        bias = self.qkv.bias if self.cfg.qkv_bias == "qv" else None
        if bias is not None and bias.requires_grad and not any(
                isinstance(h, _ZeroKBiasGrad) for h in (bias._backward_hooks or {}).values()):
            bias.register_hook(_ZeroKBiasGrad(self.cfg.attn_dim))

    def _forward(self, x, rope, attn_mask, is_causal, bias, mult: int, gelu_gemm: bool):
        # bias: the attention logits' additive bias [1, H, N, N] (BEiT's relative position bias), or None
        x = self._stream(x)
        post = self.cfg.post_norm  # EvaBlockPostNorm: each branch's norm follows it
        a = self._attention(x, attn_mask, is_causal, mult, rope, bias)
        if post:
            a = norm_in_dtype(self.post_norm1, a)
        x = self._add_branch(x, a, self.gamma_1, self.drop_path1)
        h = x if self.norm2 is None else norm_in_dtype(self.norm2, x)  # GeGluMlp's first norm (lever 33)
        h = self._run_mlp(self.mlp, h, mult, gelu_gemm)
        if post:
            h = norm_in_dtype(self.post_norm2, h)
        return self._add_branch(x, h, self.gamma_2, self.drop_path2)

    def _split_qkv(self, qkv: torch.Tensor):
        """The fused GEMM's output ``[B, N, (H + 2 Hkv) * D (+ A)]`` -> q ``[B, N, H, D]``, k, v
        ``[B, N, Hkv, D]`` (views) and the gate's input ``[B, N, A]`` (None without a gate)."""
        c = self.cfg
        gate = None
        if c.gated:  # the gate's rows follow q, k, v; split's backward is one concatenation
            qkv, gate = qkv.split((c.attn_dim + 2 * c.kv_dim, c.attn_dim), dim=-1)
        if c.num_kv_heads == c.num_heads:
            q, k, v, _ = super()._split_qkv(qkv)
        else:  # grouped-query attention: parts of unequal widths, split as timm's q/k/v projections
            B, N, _ = qkv.shape
            heads = (c.num_heads, c.num_kv_heads, c.num_kv_heads)
            q, k, v = qkv.view(B, N, sum(heads), c.head_dim).split(heads, dim=2)
        return q, k, v, gate

    def _qkv_heads(self, qkv: torch.Tensor, rope: Optional[torch.Tensor]):
        """q, k, v for attention (see ``FP8Block._qkv_heads``); unless ``rope_kernel="te"``, RoPE
        in one pass over the packed QKV buffer (:class:`RopeQKV`) where it runs."""
        if rope is not None and self.rope_kernel != "te":
            if self.rope_kernel not in ROPE_KERNELS:
                raise ValueError(f"{type(self).__name__}.rope_kernel={self.rope_kernel!r}: expected one of {ROPE_KERNELS}")
            why = self._packed_rope_refusal(qkv, rope)
            if why is None:
                c = self.cfg
                B, N, _ = qkv.shape
                q, k, v = RopeQKV.apply(qkv.view(B, N, 3, c.num_heads, c.head_dim), rope, c.num_prefix_tokens,
                                        not c.rotate_half)
                return q, k, v, None
            if self.rope_kernel == "triton":  # asked for by name: say why it is not used
                warn_once(f"fp8vit: {type(self).__name__}.rope_kernel='triton' cannot run here ({why}); "
                          "TE's RoPE kernel runs instead", RuntimeWarning, stacklevel=2)
        return super()._qkv_heads(qkv, rope)

    def _packed_rope_refusal(self, qkv: torch.Tensor, rope: torch.Tensor) -> Optional[str]:
        """Why :class:`RopeQKV` cannot rotate this block's q and k (None: it can)."""
        c = self.cfg
        n_patch = qkv.shape[1] - c.num_prefix_tokens
        if c.qk_norm:
            return "q/k norm runs between the QKV GEMM and RoPE"
        if c.gated or c.num_kv_heads != c.num_heads:
            return "the QKV GEMM's output is not q, k, v of equal heads (a gate, or grouped-query attention)"
        if c.head_dim % 2:
            return f"head dim {c.head_dim} is odd"
        if tuple(rope.shape) != (n_patch, 2 * c.head_dim):
            return (f"a RoPE table of shape {tuple(rope.shape)}, not one row per patch token ({n_patch}, "
                    f"{2 * c.head_dim}): per head or per batch (mixed RoPE, patch dropout)")
        if rope.requires_grad:
            return "the RoPE table requires grad (learnable frequencies)"
        if not (qkv.is_cuda and rope.device == qkv.device):
            return "Triton kernels run on CUDA tensors"
        if qkv.dtype not in (torch.bfloat16, torch.float16):
            return f"qkv in {qkv.dtype}: the kernel takes bf16 or fp16 (autocast)"
        if not qkv.is_contiguous():
            return f"qkv of strides {qkv.stride()} is not contiguous"
        ok = rope_support(not c.rotate_half, qkv.dtype)
        return None if ok.ok else ok.reason

    def _rope(self, q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor):
        """RoPE on q and k ``[B, N, H, D]`` of the patch tokens, as timm's ``apply_rot_embed_cat``."""
        c = self.cfg
        angles = forward_rope_angles(rope, q.shape[1], c.num_prefix_tokens)
        if angles is not None:
            interleaved = not c.rotate_half
            return (self._impl.rope(q, angles, interleaved=interleaved),
                    self._impl.rope(k, angles, interleaved=interleaved))
        # Another table form (mixed RoPE per head, per batch after patch dropout): timm's own code,
        # on timm's [B, H, N, D] layout.
        npt = c.num_prefix_tokens

        def one(t):
            t = t.transpose(1, 2)
            t = torch.cat([t[:, :, :npt], apply_rot_embed_cat(t[:, :, npt:], rope, half=c.rotate_half)], dim=2)
            return t.transpose(1, 2).to(v_dtype).contiguous()

        v_dtype = q.dtype
        return one(q), one(k)

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"dim={c.dim}, heads={c.num_heads}x{c.head_dim}"
                + (f", kv_heads={c.num_kv_heads}" if c.num_kv_heads != c.num_heads else "")
                + f", attn={c.attn_type}, qkv_bias={c.qkv_bias}" + (", gated" if c.gated else "")
                + f", mlp={c.mlp.describe()}, norm={c.norm}(eps={c.norm_eps})" + (", post_norm" if c.post_norm else "")
                + f", backend={self.backend}")


class RopeQKV(torch.autograd.Function):
    """timm's RoPE on the packed QKV GEMM output in one Triton pass (``_te.rope_packed_qkv``).

    ``[B, N, 3, H, D]`` (contiguous) -> q, k, v ``[B, N, H, D]``, views of one new packed buffer
    with q and k rotated and v copied, which TE's attention reads in place (``bs3hd``). TE's kernel
    path instead writes new q and k, leaves v a strided view, and in backward rotates dq and dk
    apart and stacks the three. Backward here: the packed gradient (:func:`packed_gradient`: TE's
    buffer as it is) rotated back in place, v's part untouched.

    Args (of ``apply``):
        qkv: ``[B, N, 3, H, D]``, CUDA, contiguous, bf16 or fp16.
        table: timm's ``[N - prefix, 2 * D]`` sin | cos table (no gradient: it gets none).
        num_prefix_tokens: leading tokens left unrotated.
        interleaved: channel pairs (2j, 2j + 1); else timm's rotate-half.
    """

    @staticmethod
    def forward(ctx, qkv, table, num_prefix_tokens, interleaved):
        table = table.float().contiguous()
        out = rope_packed_qkv(qkv, table, num_prefix_tokens, interleaved)
        ctx.save_for_backward(table)
        ctx.args = (num_prefix_tokens, interleaved)
        ctx.packed_stride = out.stride()
        return out.unbind(2)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        (table,) = ctx.saved_tensors
        g = packed_gradient(dq, dk, dv, ctx.packed_stride).contiguous()
        return rope_packed_qkv(g, table, *ctx.args, backward=True), None, None, None


# A TE_EvaBlock is one leaf for timm's FX feature extraction (TE's modules cannot be traced).
register_notrace_module(TE_EvaBlock)
