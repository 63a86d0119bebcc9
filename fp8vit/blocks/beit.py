"""``TE_BeitBlock``: timm's BEiT block (``timm.models.beit.Block``: BEiT, BEiT v2) built from
Transformer Engine modules.

    x [B, N, C] --+-- qkv: norm1 + Linear (fused), q and v biases -> [B, N, 3 * H * D]
                  |   -> DotProductAttention (bshd) with the relative position bias [1, H, N, N]
                  |      added to the scaled logits (TE's post_scale_bias; cuDNN returns its gradient)
                  |   -> proj -> gamma_1 -> drop_path1
                  +-- (+) -> mlp: norm2 fused into fc1; GELU or SwiGLU (scale_mlp: a norm before fc2)
                  |   -> gamma_2 -> drop_path2 -> (+)

The block is EVA's layout without RoPE (q and v biases with the k third held at zero, LayerScale
``gamma_1``/``gamma_2``, timm's ``Mlp``/``SwiGLU``): :class:`TE_BeitBlock` is a ``TE_EvaBlock`` plus
BEiT's relative position bias. The bias is timm's ``relative_position_bias_table`` gathered by
``relative_position_index`` (``[N, N]`` indices into ``[(2 Wh - 1)(2 Ww - 1) + 3, H]`` rows; the
class token has three rows of its own), plus the model's shared bias where it has one
(``use_shared_rel_pos_bias``: ``Beit.rel_pos_bias`` hands every block the same ``[H, N, N]``). The
gather and its backward (a scatter-add into the table) run in torch, once per block and step: at
ViT-B size 12 heads x 197 x 197 values.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch
from timm.models.beit import Attention as BeitAttention
from timm.models.beit import Block as BeitBlock
from timm.models.beit import gen_relative_position_index
from timm.layers import resize_rel_pos_bias_table, to_2tuple
from torch import nn

from .._validate import check_type
from .eva import EvaBlockConfig, TE_EvaBlock, eva_like_config
from .timm_layers import register_notrace_module, require_timm_class
from .weights import Tie, block_from_timm, rename

__all__ = ["TE_BeitBlock", "BeitBlockConfig", "beit_config_from_timm"]


@dataclasses.dataclass(frozen=True)
class BeitBlockConfig(EvaBlockConfig):
    """A timm BEiT ``Block``'s settings: :class:`~fp8vit.blocks.eva.EvaBlockConfig`'s (no RoPE, no
    q/k norm, no inner norm) and the relative position bias's window.

    Attributes:
        window_size: ``(Wh, Ww)`` patches of the block's own relative position bias table, or
            None where it has none (no bias, or only the model's shared one).
    """

    window_size: Optional[Tuple[int, int]] = None

    @property
    def num_relative_distance(self) -> int:
        """Rows of the table: every (dy, dx) between two patches, and three for the class token."""
        wh, ww = self.window_size
        return (2 * wh - 1) * (2 * ww - 1) + 3

    def ties(self) -> List[Tie]:
        """The weight layout: EVA's, and the relative position bias table under its timm name."""
        ties = super().ties()
        if self.window_size is not None:
            ties.append(rename("attn.relative_position_bias_table", "relative_position_bias_table"))
        return ties


def beit_config_from_timm(block: nn.Module, *, exact_gelu: bool = False) -> BeitBlockConfig:
    """Read the settings of a built timm BEiT ``Block``.

    Raises:
        ValueError: a part of the block TE_BeitBlock does not implement, named.
    """
    require_timm_class(block, (BeitBlock,), "TE_BeitBlock")
    require_timm_class(block, (BeitAttention,), "TE_BeitBlock", "attn")
    attn = block.attn
    if attn.qkv.bias is not None:
        raise ValueError("BEiT Block whose attn.qkv Linear has a bias of its own cannot be converted to TE_BeitBlock")
    H = attn.num_heads
    D = attn.qkv.weight.shape[0] // (3 * H)
    eva = eva_like_config(block, num_heads=H, head_dim=D, qkv_bias="none" if attn.q_bias is None else "qv",
                          exact_gelu=exact_gelu)
    window = tuple(int(w) for w in attn.window_size) if attn.relative_position_bias_table is not None else None
    return BeitBlockConfig(**{f.name: getattr(eva, f.name) for f in dataclasses.fields(eva)}, window_size=window)


class TE_BeitBlock(TE_EvaBlock):  # noqa: N801 - named like TE_Block
    """timm's BEiT ``Block`` on Transformer Engine, built from a timm block (:meth:`from_timm`).

    Same contract as ``TE_Block`` and ``TE_EvaBlock``: weights exact both ways (:meth:`from_timm` /
    :meth:`to_timm`), every option honoured or rejected by name, any batch under FP8, activation
    checkpointing, MLP recompute, FP8 off per block, CUDA graphs, diagnostics and guards.

    Args:
        cfg: the block's settings (:func:`beit_config_from_timm`).
        timm_skeleton, device, dtype, backend, fp32_residual: as ``TE_EvaBlock``'s.

    Raises:
        TypeError: ``cfg`` is not a :class:`BeitBlockConfig`; the rest as ``TE_EvaBlock``.
    """

    def __init__(self, cfg: BeitBlockConfig, *, timm_skeleton: nn.Module, device=None,
                 dtype: Optional[torch.dtype] = None, backend: Optional[str] = None,
                 fp32_residual: bool = False) -> None:
        check_type(type(self).__name__, "cfg", cfg, BeitBlockConfig, "a fp8vit BeitBlockConfig (beit_config_from_timm)")
        super().__init__(cfg, timm_skeleton=timm_skeleton, device=device, dtype=dtype, backend=backend,
                         fp32_residual=fp32_residual)
        ref = self.qkv.weight
        if cfg.window_size is None:
            self.relative_position_bias_table = None
            self.relative_position_index = None
        else:
            self.relative_position_bias_table = nn.Parameter(
                torch.zeros(cfg.num_relative_distance, cfg.num_heads, device=ref.device, dtype=dtype))
            # [N, N] rows of the table per (query, key) token pair; rebuilt, not saved (as timm's)
            self.register_buffer("relative_position_index",
                                 gen_relative_position_index(cfg.window_size, device=ref.device), persistent=False)
        # timm's Beit.set_input_size calls blk.attn.set_window_size on every block: here attn is TE's
        # attention module, so it gets the block's (a bound method: deep copies and pickles rebind it)
        object.__setattr__(self.attn, "set_window_size", self.set_window_size)

    @classmethod
    def from_timm(cls, block: nn.Module, *, exact_gelu: bool = False, backend: Optional[str] = None,
                  fp32_residual: bool = False) -> "TE_BeitBlock":
        """A ``TE_BeitBlock`` with the settings, weights, device, dtype, ``requires_grad`` flags and
        mode of a timm BEiT ``Block``.

        Raises:
            ValueError: a part of ``block`` that TE_BeitBlock does not implement, named.
        """
        cfg = beit_config_from_timm(block, exact_gelu=exact_gelu)
        return block_from_timm(cls, block, cfg, block.norm1.weight, backend=backend, fp32_residual=fp32_residual)

    @property
    def window_size(self) -> Optional[Tuple[int, int]]:
        """The table's window (timm's ``Attention.window_size``, which ``beit.checkpoint_filter_fn``
        reads on the module that holds a table)."""
        return self.cfg.window_size

    def set_window_size(self, window_size) -> None:
        """Resize the relative position bias table to a new window of patches (timm's
        ``Attention.set_window_size``: the table resampled, the index rebuilt), for another input
        size (``Beit.set_input_size``). No table: nothing to do."""
        window = tuple(int(w) for w in to_2tuple(window_size))
        old = self.relative_position_bias_table
        if old is None or window == self.cfg.window_size:
            return
        cfg = dataclasses.replace(self.cfg, window_size=window)
        with torch.no_grad():
            table = resize_rel_pos_bias_table(old, new_window_size=window, old_window_size=self.cfg.window_size,
                                              new_bias_shape=(cfg.num_relative_distance, cfg.num_heads))
        self.relative_position_bias_table = nn.Parameter(table, requires_grad=old.requires_grad)
        self.register_buffer("relative_position_index", gen_relative_position_index(window, device=old.device),
                             persistent=False)
        self.cfg = cfg
        self._timm_skeleton.attn.set_window_size(window)  # to_timm builds the block at this window

    # ------------------------------------------------------------------ forward
    @torch.compiler.disable  # as TE_Block.forward: the blocks run outside dynamo
    def forward(self, x: torch.Tensor, shared_rel_pos_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Args:
            x: tokens ``[B, N, C]``, the class token first.
            shared_rel_pos_bias: the model's shared relative position bias ``[H, N, N]`` (timm's
                ``Beit.rel_pos_bias()``), added to the block's own; or None.

        Returns:
            ``[B, N, C]``, in the autocast dtype under autocast unless ``fp32_residual``.

        Raises:
            ValueError: a wrong ``x`` shape, or ``N`` tokens other than the bias table's window
                (``Wh * Ww + 1``) or the shared bias's.
        """
        if x.dim() != 3 or x.shape[-1] != self.cfg.dim:
            raise ValueError(f"TE_BeitBlock expects x of shape [B, N, {self.cfg.dim}], got {tuple(x.shape)}")
        self._hook_k_bias()
        return self._dispatch(x, None, None, False, self._relative_bias(x.shape[1], shared_rel_pos_bias))

    def _relative_bias(self, n: int, shared: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The attention logits' additive bias ``[1, H, N, N]`` (timm's ``Attention`` adds the
        block's own and the shared one), or None."""
        bias = None
        if self.relative_position_bias_table is not None:
            idx = self.relative_position_index
            if idx.shape[0] != n:
                raise ValueError(f"TE_BeitBlock: x has {n} tokens, its relative position bias table covers "
                                 f"{idx.shape[0]} (window {self.cfg.window_size} + the class token); for another input "
                                 "size, model.set_input_size(img_size=...) resizes the tables (timm's Beit)")
            # [N*N, H] rows -> [1, H, N, N]
            bias = self.relative_position_bias_table[idx.view(-1)].view(n, n, -1).permute(2, 0, 1).unsqueeze(0)
        if shared is not None:
            if shared.shape[-2:] != (n, n):
                raise ValueError(f"TE_BeitBlock: shared_rel_pos_bias of shape {tuple(shared.shape)} for x with {n} tokens")
            shared = shared.reshape(1, -1, n, n)
            bias = shared if bias is None else bias + shared
        return bias

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", rel_pos_window={self.cfg.window_size}" if self.cfg.window_size else "")


# A TE_BeitBlock is one leaf for timm's FX feature extraction (TE's modules cannot be traced).
register_notrace_module(TE_BeitBlock)
