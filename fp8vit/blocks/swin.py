"""``TE_SwinBlock``: timm's Swin Transformer block (``timm.models.swin_transformer.SwinTransformerBlock``:
Swin, and the models built from its stages) built from Transformer Engine modules.

    x [B, H, W, C] -> cyclic shift + window partition, one gather -> [nW * B, Wh*Ww, C] (window-major)
      --+-- qkv: norm1 + Linear (fused) -> attention per mask kind, with the relative position
        |   bias [1, H, N, N] (+ the shift mask of that kind): torch's SDPA by default, or TE's
        |   DotProductAttention with it as post_scale_bias (``bias_attention``)
        |   -> proj -> drop_path1 (per image)
        +-- (+) -> mlp: norm2 fused into fc1, GELU, fc2 -> drop_path2 (per image) -> (+)
      -> windows back + reverse shift, one gather -> [B, H, W, C]

Why the whole block runs on windows: timm applies norm1 before the partition and the MLP after the
reverse, but norms, MLP, drop path and the residual adds all act per token (per image for drop
path), so they commute with moving tokens around. The block therefore is EVA's layout (one fused
norm1 + q/k/v GEMM, TE attention with a bias, proj, a fused LayerNormMLP: ``TE_EvaBlock``) on the
windows as a batch, between two gathers; timm's roll, pad, partition, reverse and roll are five
copies, here two.

The shift mask. A shifted block masks attention between tokens that came from different image
regions (timm: -100 added to those logits). The mask differs per window, which one bias with its
gradient cannot take (cuDNN returns the gradient of one ``[1, H, N, N]`` bias only; SDPA's bias
broadcast over the windows is one such bias too). But
only a few kinds of window exist (unshifted interior, right column, bottom row, corner): the
windows are ordered by kind, so each kind is one slice of the batch, and attention runs once per
kind with ``relative position bias + that kind's mask``. Unshifted blocks: one call.

Maps the window does not divide: timm pads the map with zeros *after* norm1, so a padded token's
q, k, v are the qkv bias alone. Here the gather reads zeros for them and their rows of the fused
GEMM's output are set to the bias (the fused norm would give the norm's bias instead); they pass
through proj and the MLP like timm's cropped tokens do not, and never reach the output.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from typing import Dict, List, Optional, Tuple

import torch
from timm.layers import DropPath, resize_rel_pos_bias_table
from timm.models.swin_transformer import SwinTransformerBlock, WindowAttention, get_relative_position_index
import torch.nn.functional as F
from torch import nn

from .._validate import check_type
from .base import aligned_rows
from .eva import EvaBlockConfig, TE_EvaBlock, eva_like_config
from .timm_layers import register_notrace_module, require_timm_class
from .weights import Tie, block_from_timm, rename

__all__ = ["TE_SwinBlock", "SwinBlockConfig", "swin_config_from_timm", "TE_SwinV2Block", "SwinV2BlockConfig",
           "swinv2_config_from_timm", "shift_mask", "window_plan"]

# timm's additive value for logits between tokens of different regions in a shifted window
_MASKED = -100.0


@dataclasses.dataclass(frozen=True)
class SwinBlockConfig(EvaBlockConfig):
    """A timm ``SwinTransformerBlock``'s settings: :class:`~fp8vit.blocks.eva.EvaBlockConfig`'s (no
    LayerScale, no RoPE) and its windows.

    Attributes:
        window_size: ``(Wh, Ww)`` tokens per window (timm's, after it clipped the window to a
            small feature map).
        shift_size: ``(Sh, Sw)`` cyclic shift before the partition (``(0, 0)``: none).
    """

    window_size: Tuple[int, int] = (7, 7)
    shift_size: Tuple[int, int] = (0, 0)

    @property
    def window_area(self) -> int:
        return self.window_size[0] * self.window_size[1]

    def ties(self) -> List[Tie]:
        """The weight layout: EVA's, and the relative position bias table under its timm name."""
        return super().ties() + [rename("attn.relative_position_bias_table", "relative_position_bias_table")]


def swin_config_from_timm(block: nn.Module, *, exact_gelu: bool = False) -> SwinBlockConfig:
    """Read the settings of a built timm ``SwinTransformerBlock``.

    Raises:
        ValueError: a part of the block TE_SwinBlock does not implement, named.
    """
    require_timm_class(block, (SwinTransformerBlock,), "TE_SwinBlock")
    require_timm_class(block, (WindowAttention,), "TE_SwinBlock", "attn")
    attn = block.attn
    H = attn.num_heads
    D = attn.qkv.weight.shape[0] // (3 * H)
    if abs(attn.scale - D ** -0.5) > 1e-12:  # TE scales the logits by D^-0.5
        raise ValueError(f"SwinTransformerBlock whose attention scale {attn.scale} is not head_dim ** -0.5 "
                         f"({D ** -0.5}) cannot be converted to TE_SwinBlock")
    return _windowed_config(SwinBlockConfig, "swin", block, H, D, "qkv" if attn.qkv.bias is not None else "none",
                            exact_gelu=exact_gelu)


def _windowed_config(cfg_cls: type, attn_type: str, block: nn.Module, heads: int, head_dim: int, qkv_bias: str, *,
                     exact_gelu: bool, post_norm: bool = False):
    """What Swin's blocks (V1, V2) share, read from ``block``: EVA's settings (:func:`eva_like_config`),
    the window and the shift; drop path as timm's ``DropPath`` with ``scale_by_keep``."""
    for dp in (block.drop_path1, block.drop_path2):
        if isinstance(dp, DropPath) and not dp.scale_by_keep:
            raise ValueError(f"{type(block).__name__} with DropPath(scale_by_keep=False) cannot be converted")
    eva = eva_like_config(block, num_heads=heads, head_dim=head_dim, qkv_bias=qkv_bias, exact_gelu=exact_gelu,
                          post_norm=post_norm)
    fields = {f.name: getattr(eva, f.name) for f in dataclasses.fields(eva)}
    fields["attn_type"] = attn_type
    return cfg_cls(**fields, window_size=tuple(int(w) for w in block.window_size),
                   shift_size=tuple(int(v) for v in block.shift_size))


def shift_mask(height: int, width: int, window: Tuple[int, int], shift: Tuple[int, int]) -> Optional[torch.Tensor]:
    """timm's ``SwinTransformerBlock.get_attn_mask`` for a ``height x width`` map the window divides:
    ``[nW, N, N]``, 0 where two tokens of a window came from the same region, -100 where not; None
    without a shift. Windows in timm's order (row-major over the shifted map)."""
    if not any(shift):
        return None
    img = torch.zeros(height, width)
    cnt = 0
    for h in ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None)):  # timm's slices, as written there
        for w in ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None)):
            img[h[0]:h[1], w[0]:w[1]] = cnt
            cnt += 1
    nh, nw = height // window[0], width // window[1]
    win = img.view(nh, window[0], nw, window[1]).permute(0, 2, 1, 3).reshape(nh * nw, -1)  # [nW, N]
    diff = win.unsqueeze(1) - win.unsqueeze(2)
    return torch.zeros_like(diff).masked_fill(diff != 0, _MASKED)


@dataclasses.dataclass(frozen=True)
class _Windows:
    """How one block moves a ``height x width`` map into windows and back (:meth:`TE_SwinBlock._windows`).

    Attributes:
        pos: ``[nW, N]`` flat positions (``h * W + w`` in the unshifted map) of each window's tokens,
            windows in this block's order (grouped by mask kind); ``H * W`` for a padded token.
        padded: ``[nW, 1, N, 1]`` True at padded tokens, or None (the window divides the map).
        inv_window, inv_token: ``[H * W]``: where each position went (window slot, token).
        sizes: windows per mask kind, in that order.
        masks: the additive ``[N, N]`` mask of each kind (None: none).
    """

    pos: torch.Tensor
    padded: Optional[torch.Tensor]
    inv_window: torch.Tensor
    inv_token: torch.Tensor
    sizes: Tuple[int, ...]
    masks: Tuple[Optional[torch.Tensor], ...]
    rows: Dict[int, tuple] = dataclasses.field(default_factory=dict)

    def row_indices(self, batch: int) -> tuple:
        """For ``batch`` images: ``(to_windows, to_map, pad)``. ``to_windows`` [nW * B * N]: the
        row of ``x`` [B * H * W, C] each window-major token reads (0 for a padded one);
        ``to_map`` [B * H * W]: the window-major row each map position comes back from; ``pad``
        [nW * B * N, 1]: True at padded tokens, or an empty tensor (none). Cached per batch size."""
        got = self.rows.get(batch)
        if got is None:
            nw, n = self.pos.shape
            hw = self.inv_window.shape[0]
            images = torch.arange(batch, device=self.pos.device)
            pos = self.pos.clamp(max=hw - 1) if self.padded is not None else self.pos  # padded: any real row
            to_windows = (images.view(1, batch, 1) * hw + pos.view(nw, 1, n)).reshape(-1)
            to_map = ((self.inv_window.view(1, hw) * batch + images.view(batch, 1)) * n
                      + self.inv_token.view(1, hw)).reshape(-1)
            pad = (self.padded.expand(nw, batch, n, 1).reshape(-1, 1) if self.padded is not None
                   else torch.zeros(0, 1, dtype=torch.bool, device=self.pos.device))
            got = self.rows[batch] = (to_windows, to_map, pad)
        return got


@functools.lru_cache(maxsize=None)
def window_plan(height: int, width: int, window: Tuple[int, int], shift: Tuple[int, int], device: str) -> _Windows:
    """How a ``height x width`` map moves into ``window`` windows shifted by ``shift`` and back.

    One per map size, window, shift and device, shared by every block that has them (Swin-B's 24
    blocks have 8), and never dropped: a captured CUDA graph reads the plan's index tensors."""
    (wh, ww), (sh, sw) = window, shift
    nh, nw = -(-height // wh), -(-width // ww)  # timm pads the shifted map to whole windows
    # token (i, j) of window (wy, wx) of the shifted, padded map: ((h + sh) % H, (w + sw) % W) of
    # the input for h = wy*wh + i < H and w = wx*ww + j < W, else padding
    h = torch.arange(nh).view(nh, 1) * wh + torch.arange(wh)  # [nh, wh]
    w = torch.arange(nw).view(nw, 1) * ww + torch.arange(ww)  # [nw, ww]
    inside = (h < height).view(nh, 1, wh, 1) & (w < width).view(1, nw, 1, ww)
    pos = ((h + sh) % height).view(nh, 1, wh, 1) * width + ((w + sw) % width).view(1, nw, 1, ww)
    pos = torch.where(inside, pos, height * width).reshape(nh * nw, wh * ww)
    mask = shift_mask(nh * wh, nw * ww, window, shift)
    if mask is None:
        order, sizes, masks = torch.arange(nh * nw), (nh * nw,), (None,)
    else:  # windows of one mask kind next to each other: one attention call per kind
        kinds, kind = torch.unique(mask.view(nh * nw, -1), dim=0, return_inverse=True)
        order = torch.argsort(kind, stable=True)
        sizes = tuple(int(n) for n in torch.bincount(kind, minlength=kinds.shape[0]))
        masks = tuple(k.view(wh * ww, wh * ww).to(device) for k in kinds)
    pos = pos[order]
    flat = pos.reshape(-1)
    real = flat < height * width
    inv_window = torch.empty(height * width, dtype=torch.long)
    inv_token = torch.empty(height * width, dtype=torch.long)
    inv_window[flat[real]] = torch.arange(pos.shape[0]).repeat_interleave(wh * ww)[real]
    inv_token[flat[real]] = torch.arange(wh * ww).repeat(pos.shape[0])[real]
    padded = None if bool(real.all()) else (~real).view(pos.shape[0], 1, wh * ww, 1).to(device)
    return _Windows(pos.to(device), padded, inv_window.to(device), inv_token.to(device), sizes, masks)


class _MoveRows(torch.autograd.Function):
    """``out = src[index]`` over rows (``[R, C]`` -> ``[M, C]``) where every row of ``src`` that
    matters lands in exactly one row of ``out``, so the gradient is a gather too:
    ``grad_src = grad_out[inverse]``. Autograd's own backward of an index is a scatter-add
    (``index_put_`` with accumulate, which sorts its indices on CUDA) for what is a permutation.

    ``zero_out`` ``[M, 1]``: rows of ``out`` set to zero (padded tokens, for which ``index`` points
    at any row); ``zero_grad`` ``[R, 1]``: rows of ``grad_src`` set to zero (padded tokens on the
    way back to the map: they never reach the output). Empty or None: none.
    """

    @staticmethod
    def forward(ctx, src, index, inverse, zero_out, zero_grad):
        ctx.save_for_backward(inverse, zero_grad)
        out = src.index_select(0, index)
        return out if zero_out is None else out.masked_fill_(zero_out, 0)

    @staticmethod
    def backward(ctx, grad):
        inverse, zero_grad = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        return (grad.masked_fill_(zero_grad, 0) if zero_grad.numel() else grad), None, None, None, None


class WindowDropPath(DropPath):
    """timm's ``DropPath`` (per image) on window-major tokens ``[nW * B, N, C]``: one draw per
    image (as timm's, in the same order), applied to its ``nW`` windows. ``windows`` is set by the
    block before each call."""

    windows: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.row_mask(x)
        return x if mask is None else x * mask

    def row_mask(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The draw for ``x`` ``[nW * B, N, C]`` as a per-row mask ``[nW * B, 1, 1]`` (None: nothing
        dropped): one draw per image ``[B, 1, 1]`` as timm draws it, repeated for each window."""
        if self.drop_prob == 0.0 or not self.training:
            return None
        keep = 1 - self.drop_prob
        mask = x.new_empty((x.shape[0] // self.windows, 1, 1)).bernoulli_(keep)  # [B, 1, 1]
        if keep > 0.0 and self.scale_by_keep:
            mask.div_(keep)
        return mask.repeat(self.windows, 1, 1)  # window-major rows: row w * B + b gets image b's


class TE_SwinBlock(TE_EvaBlock):  # noqa: N801 - named like TE_Block
    """timm's ``SwinTransformerBlock`` on Transformer Engine, built from a timm block (:meth:`from_timm`).

    Same contract as the other fp8vit blocks: weights exact both ways (:meth:`from_timm` /
    :meth:`to_timm`), every option honoured or rejected by name, any batch under FP8, activation
    checkpointing, MLP recompute, FP8 off per block. Input and output ``[B, H, W, C]``, as timm's.

    Args:
        cfg: the block's settings (:func:`swin_config_from_timm`).
        timm_skeleton, device, dtype, backend, fp32_residual: as ``TE_EvaBlock``'s.

    Raises:
        TypeError: ``cfg`` is not a :class:`SwinBlockConfig`; the rest as ``TE_EvaBlock``.
    """

    # torch's SDPA for the biased window attention: at 49 tokens per window TE/cuDNN's biased
    # attention is 2.3-6.5x slower per call (H200, Swin-B b128: 116.5 -> 69.4 ms/step graphed; per-stage
    # microbench in docs/performance.md). BEiT (197 tokens) keeps TE's: there TE is faster.
    bias_attention = "torch"

    def __init__(self, cfg: SwinBlockConfig, *, timm_skeleton: nn.Module, device=None,
                 dtype: Optional[torch.dtype] = None, backend: Optional[str] = None,
                 fp32_residual: bool = False) -> None:
        check_type(type(self).__name__, "cfg", cfg, SwinBlockConfig, "a fp8vit SwinBlockConfig (swin_config_from_timm)")
        super().__init__(cfg, timm_skeleton=timm_skeleton, device=device, dtype=dtype, backend=backend,
                         fp32_residual=fp32_residual)
        self._init_position_bias(dtype)
        self.init_non_persistent_buffers()
        if cfg.drop_path > 0:  # per image, on window-major tokens
            self.drop_path1 = WindowDropPath(cfg.drop_path)
            self.drop_path2 = WindowDropPath(cfg.drop_path)

    @classmethod
    def from_timm(cls, block: nn.Module, *, exact_gelu: bool = False, backend: Optional[str] = None,
                  fp32_residual: bool = False) -> "TE_SwinBlock":
        """A ``TE_SwinBlock`` with the settings, weights, device, dtype, ``requires_grad`` flags and
        mode of a timm ``SwinTransformerBlock``.

        Raises:
            ValueError: a part of ``block`` that TE_SwinBlock does not implement, named.
        """
        cfg = swin_config_from_timm(block, exact_gelu=exact_gelu)
        return block_from_timm(cls, block, cfg, block.norm1.weight, backend=backend, fp32_residual=fp32_residual)

    def set_input_size(self, feat_size: Tuple[int, int], window_size: Tuple[int, int],
                       always_partition: Optional[bool] = None) -> None:
        """timm's ``SwinTransformer.set_input_size`` calls it on every block: the window and shift
        for the new feature map as timm's block computes them, the relative position bias table
        resampled as timm's (``resize_rel_pos_bias_table``) where the window changes."""
        trial = copy.deepcopy(self._timm_skeleton)  # on the meta device: timm's own arithmetic, no data
        trial.set_input_size(feat_size, window_size, always_partition)
        window = tuple(int(w) for w in trial.window_size)
        shift = tuple(int(v) for v in trial.shift_size)
        c = self.cfg
        if window != c.window_size:
            self._resize_position_bias(c.window_size, window)
        self.cfg = dataclasses.replace(c, window_size=window, shift_size=shift)
        object.__setattr__(self, "_timm_skeleton", trial)  # to_timm builds the block at this size
        self.init_non_persistent_buffers()

    # ------------------------------------------------------------------ the relative position bias
    # (hooks: TE_SwinV2Block computes its bias with a small MLP instead of a table)
    def _init_position_bias(self, dtype: Optional[torch.dtype]) -> None:
        """The relative position bias table ``[(2 Wh - 1)(2 Ww - 1), H]`` (timm's)."""
        wh, ww = self.cfg.window_size
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * wh - 1) * (2 * ww - 1), self.cfg.num_heads, device=self.qkv.weight.device, dtype=dtype))

    def _resize_position_bias(self, old: Tuple[int, int], new: Tuple[int, int]) -> None:
        """The table resampled from ``old`` to ``new`` windows, as timm's ``set_window_size``."""
        table = self.relative_position_bias_table
        with torch.no_grad():
            resized = resize_rel_pos_bias_table(table, new_window_size=new, old_window_size=old,
                                                new_bias_shape=((2 * new[0] - 1) * (2 * new[1] - 1), self.cfg.num_heads))
        self.relative_position_bias_table = nn.Parameter(resized, requires_grad=table.requires_grad)

    def _position_bias(self) -> torch.Tensor:
        """``[H, N, N]``: the table gathered by the index (timm's ``_get_rel_pos_bias``)."""
        n = self.cfg.window_area
        return self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1)

    def _qk(self, q: torch.Tensor, k: torch.Tensor):
        """Hook on q and k ``[rows, N, H, D]`` before attention (TE_SwinV2Block: cosine attention)."""
        return q, k

    # timm's SwinTransformerBlock attributes that its model code and users read
    @property
    def input_resolution(self) -> Tuple[int, int]:
        return self._timm_skeleton.input_resolution

    @property
    def window_size(self) -> Tuple[int, int]:
        return self.cfg.window_size

    @property
    def shift_size(self) -> Tuple[int, int]:
        return self.cfg.shift_size

    @property
    def window_area(self) -> int:
        return self.cfg.window_area

    @property
    def always_partition(self) -> bool:
        return self._timm_skeleton.always_partition

    @property
    def dynamic_mask(self) -> bool:
        return self._timm_skeleton.dynamic_mask

    @property
    def attn_mask(self) -> Optional[torch.Tensor]:
        """timm's shift mask ``[nW, N, N]`` for the block's input resolution (None: no shift); the
        block itself uses it grouped by kind (module docstring)."""
        (wh, ww), (h, w) = self.cfg.window_size, self.input_resolution
        return shift_mask(-(-h // wh) * wh, -(-w // ww) * ww, self.cfg.window_size, self.cfg.shift_size)

    def init_non_persistent_buffers(self) -> None:
        """(Re)build the relative position index for the block's window: ``[N, N]`` rows of the
        table per (query, key) token pair, not saved (as timm's; its
        ``reinit_non_persistent_buffers`` after ``to_empty`` calls this)."""
        wh, ww = self.cfg.window_size
        dev = self.relative_position_bias_table.device
        self.register_buffer("relative_position_index", get_relative_position_index(wh, ww).to(dev), persistent=False)

    # ------------------------------------------------------------------ forward
    @torch.compiler.disable  # as TE_Block.forward: the blocks run outside dynamo
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args:
            x: tokens ``[B, H, W, C]``, as timm's block takes them.

        Returns:
            ``[B, H, W, C]``, in the autocast dtype under autocast unless ``fp32_residual``.

        Raises:
            ValueError: a wrong ``x`` shape.
        """
        c = self.cfg
        if x.dim() != 4 or x.shape[-1] != c.dim:
            raise ValueError(f"TE_SwinBlock expects x of shape [B, H, W, {c.dim}], got {tuple(x.shape)}")
        B, H, W, C = x.shape
        self._hook_k_bias()  # Swin V2's q and v biases: the k third of the fused bias held at zero
        plan = self._windows(H, W, x.device)
        nw = plan.pos.shape[0]
        for dp in (self.drop_path1, self.drop_path2):
            if isinstance(dp, WindowDropPath):
                dp.windows = nw
        to_windows, to_map, pad = plan.row_indices(B)
        padded = pad if pad.numel() else None
        # [B*H*W, C] -> [nW*B*N, C] window-major: the cyclic shift, the partition (zeros where timm
        # pads) and the window order in one gather, whose gradient is one gather back
        xw = _MoveRows.apply(x.reshape(B * H * W, C), to_windows, to_map, padded, pad[:0])
        biases = self._biases(plan)
        out = self._dispatch(xw.view(nw * B, c.window_area, C), None, None, False,
                             (tuple(n * B for n in plan.sizes), biases, plan.padded))
        # back to the map; padded tokens dropped (and their gradient zero)
        out = _MoveRows.apply(out.reshape(-1, C), to_map, to_windows, None, pad)
        return out.view(B, H, W, C)

    def _windows(self, height: int, width: int, device: torch.device) -> _Windows:
        """The window plan of a ``height x width`` map for this block's window and shift."""
        return window_plan(height, width, self.cfg.window_size, self.cfg.shift_size, str(device))

    def _biases(self, plan: _Windows) -> Tuple[torch.Tensor, ...]:
        """Per mask kind, the attention logits' additive bias ``[1, H, N, N]``: the relative
        position bias (:meth:`_position_bias`), plus the kind's shift mask."""
        rel = self._position_bias()
        return tuple((rel if m is None else rel + m).unsqueeze(0) for m in plan.masks)

    def _attention(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool, mult: int,
                   rope: Optional[torch.Tensor] = None, bias=None) -> torch.Tensor:
        """The attention branch on window-major tokens ``x`` [nW * B, N, C]: one q/k/v GEMM, then
        one attention call per mask kind (``bias``: the kinds' row counts and biases), then proj.

        The q/k/v buffer is split into the kinds' slices with ``split`` (its backward is one
        concatenation, where slicing would zero-fill a whole-buffer gradient per slice)."""
        sizes, biases, padded = bias
        qkv = aligned_rows(self.qkv, x, mult)
        if padded is not None:  # timm's padded tokens are zeros after norm1: their q, k, v are the bias
            # (TE's Linear without a bias holds an empty tensor there, not None: read the config)
            pad_value = qkv.new_zeros(()) if self.cfg.qkv_bias == "none" else self.qkv.bias.to(qkv.dtype)
            rows = qkv.view(padded.shape[0], -1, *qkv.shape[1:])  # [nW, B, N, 3A]
            qkv = torch.where(padded, pad_value, rows).view_as(qkv)
        parts = qkv.split(sizes, dim=0) if len(sizes) > 1 else (qkv,)
        outs = []
        for part, b in zip(parts, biases):
            q, k, v, _ = self._split_qkv(part)
            q, k = self._qk(q, k)
            outs.append(self._biased_attention(q, k, v, b))  # [rows, N, H*D]
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.proj_drop(aligned_rows(self.proj, o, mult))

    def extra_repr(self) -> str:
        c = self.cfg
        return super().extra_repr() + f", window={c.window_size}, shift={c.shift_size}"


@dataclasses.dataclass(frozen=True)
class SwinV2BlockConfig(SwinBlockConfig):
    """A timm ``SwinTransformerV2Block``'s settings: :class:`SwinBlockConfig`'s with post-norm
    branches, cosine attention and the continuous position bias (no table)."""

    def ties(self) -> List[Tie]:
        """EVA's post-norm layout (q and v biases), the per-head logit scale and the bias MLP."""
        return EvaBlockConfig.ties(self) + [rename("attn.logit_scale", "logit_scale"),
                                            rename("attn.cpb_mlp.0.weight", "cpb_mlp.0.weight"),
                                            rename("attn.cpb_mlp.0.bias", "cpb_mlp.0.bias"),
                                            rename("attn.cpb_mlp.2.weight", "cpb_mlp.2.weight")]


def swinv2_config_from_timm(block: nn.Module, *, exact_gelu: bool = False) -> SwinV2BlockConfig:
    """Read the settings of a built timm ``SwinTransformerV2Block``.

    Raises:
        ValueError: a part of the block TE_SwinV2Block does not implement, named.
    """
    from timm.models.swin_transformer_v2 import SwinTransformerV2Block, WindowAttention as V2Attention
    require_timm_class(block, (SwinTransformerV2Block,), "TE_SwinV2Block")
    require_timm_class(block, (V2Attention,), "TE_SwinV2Block", "attn")
    attn = block.attn
    if attn.qkv.bias is not None:
        raise ValueError("SwinTransformerV2Block whose attn.qkv Linear has a bias of its own cannot be converted "
                         "to TE_SwinV2Block (timm's has q and v biases beside it)")
    H = attn.num_heads
    return _windowed_config(SwinV2BlockConfig, "swinv2", block, H, attn.qkv.weight.shape[0] // (3 * H),
                            "none" if attn.q_bias is None else "qv", exact_gelu=exact_gelu, post_norm=True)


class TE_SwinV2Block(TE_SwinBlock):  # noqa: N801 - named like TE_Block
    """timm's ``SwinTransformerV2Block`` on Transformer Engine: :class:`TE_SwinBlock`'s windows with
    Swin V2's post-norm branches (``x + norm1(attn(x))``), cosine attention (q and k normalized per
    head, the logits scaled by ``exp(min(logit_scale, log 100))`` per head, no ``D^-0.5``) and the
    continuous position bias ``16 sigmoid(cpb_mlp(coords))`` as the attention's bias.

    Args and Raises: as :class:`TE_SwinBlock`'s, with a :class:`SwinV2BlockConfig`.
    """

    def __init__(self, cfg: SwinV2BlockConfig, *, timm_skeleton: nn.Module, device=None,
                 dtype: Optional[torch.dtype] = None, backend: Optional[str] = None,
                 fp32_residual: bool = False) -> None:
        check_type(type(self).__name__, "cfg", cfg, SwinV2BlockConfig, "a fp8vit SwinV2BlockConfig (swinv2_config_from_timm)")
        super().__init__(cfg, timm_skeleton=timm_skeleton, device=device, dtype=dtype, backend=backend,
                         fp32_residual=fp32_residual)
        # cosine attention: the scale is in q (logit_scale), none in the softmax
        self.attn = self._impl.modules.DotProductAttention(cfg.num_heads, cfg.head_dim, attention_dropout=cfg.attn_drop,
                                                           qkv_format="bshd", attn_mask_type="no_mask",
                                                           softmax_scale=1.0)

    @classmethod
    def from_timm(cls, block: nn.Module, *, exact_gelu: bool = False, backend: Optional[str] = None,
                  fp32_residual: bool = False) -> "TE_SwinV2Block":
        """A ``TE_SwinV2Block`` with the settings, weights, device, dtype, ``requires_grad`` flags
        and mode of a timm ``SwinTransformerV2Block``.

        Raises:
            ValueError: a part of ``block`` that TE_SwinV2Block does not implement, named.
        """
        cfg = swinv2_config_from_timm(block, exact_gelu=exact_gelu)
        return block_from_timm(cls, block, cfg, block.attn.qkv.weight, backend=backend, fp32_residual=fp32_residual)

    def _init_position_bias(self, dtype: Optional[torch.dtype]) -> None:
        ref = self.qkv.weight
        attn = self._timm_skeleton.attn
        self.logit_scale = nn.Parameter(torch.empty(self.cfg.num_heads, 1, 1, device=ref.device, dtype=dtype))
        self.cpb_mlp = copy.deepcopy(attn.cpb_mlp).to_empty(device=ref.device)
        if dtype is not None:
            self.cpb_mlp.to(dtype)

    def _resize_position_bias(self, old: Tuple[int, int], new: Tuple[int, int]) -> None:
        """Nothing to resample: the bias MLP takes the new window's coordinates (rebuilt with the
        buffers)."""

    def init_non_persistent_buffers(self) -> None:
        """(Re)build the coordinates the bias MLP reads and the index of its output per token pair,
        by timm's own code for the block's window (and pretraining window)."""
        dev = self.logit_scale.device
        table, index = self._timm_skeleton.attn._make_pair_wise_relative_positions(device=dev, dtype=torch.float32)
        self.register_buffer("relative_coords_table", table, persistent=False)
        self.register_buffer("relative_position_index", index, persistent=False)

    def _position_bias(self) -> torch.Tensor:
        """``[H, N, N]``: ``16 sigmoid(cpb_mlp(coords))`` gathered by the index (timm's)."""
        n = self.cfg.window_area
        table = self.cpb_mlp(self.relative_coords_table.to(self.cpb_mlp[0].weight.dtype)).view(-1, self.cfg.num_heads)
        return 16 * torch.sigmoid(table[self.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1))

    def _qk(self, q: torch.Tensor, k: torch.Tensor):
        """Cosine attention: q and k ``[rows, N, H, D]`` normalized per head, q times the head's
        clamped logit scale (timm multiplies the logits by it)."""
        scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp().view(1, 1, -1, 1)
        return (F.normalize(q, dim=-1) * scale).to(q.dtype), F.normalize(k, dim=-1).to(k.dtype)


# A TE_SwinBlock is one leaf for timm's FX feature extraction (TE's modules cannot be traced).
register_notrace_module(TE_SwinBlock)
register_notrace_module(TE_SwinV2Block)
