"""Parameter names of one block: timm ``Block`` <-> ``TE_Block``.

``TE_Block`` keeps timm's QKV row order, ``(3, heads, head_dim)``: it composes TE's modules
itself and splits q, k, v the way timm does, so no weight is permuted and a conversion
is a pure renaming (exact, bit for bit). TE's ``TransformerLayer``, by contrast, interleaves
QKV as ``(heads, 3, head_dim)`` by default.

The norms are fused into the GEMM that follows them: timm's ``norm1`` becomes
``qkv.layer_norm_*`` and ``norm2`` the MLP's ``layer_norm_*``.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

import torch

from .config import BlockConfig

__all__ = ["name_pairs", "timm_to_te", "te_to_timm"]

_EXTRA = "_extra_state"


def name_pairs(cfg: BlockConfig) -> List[Tuple[str, str]]:
    """``(timm name, TE_Block name)`` for every tensor of a block with config ``cfg``."""
    pairs = [("norm1.weight", "qkv.layer_norm_weight"), ("attn.qkv.weight", "qkv.weight"),
             ("attn.proj.weight", "proj.weight")]
    if cfg.fused_mlp:  # one te.LayerNormMLP
        pairs += [("norm2.weight", "mlp.layer_norm_weight"), ("mlp.fc1.weight", "mlp.fc1_weight"),
                  ("mlp.fc2.weight", "mlp.fc2_weight")]
        mlp_biases = [("mlp.fc1.bias", "mlp.fc1_bias"), ("mlp.fc2.bias", "mlp.fc2_bias")]
        norm2_bias = ("norm2.bias", "mlp.layer_norm_bias")
    else:  # te.LayerNormLinear -> torch activation -> te.Linear
        pairs += [("norm2.weight", "mlp.fc1.layer_norm_weight"), ("mlp.fc1.weight", "mlp.fc1.weight"),
                  ("mlp.fc2.weight", "mlp.fc2.weight")]
        mlp_biases = [("mlp.fc1.bias", "mlp.fc1.bias"), ("mlp.fc2.bias", "mlp.fc2.bias")]
        norm2_bias = ("norm2.bias", "mlp.fc1.layer_norm_bias")
    if cfg.norm == "LayerNorm":
        pairs += [("norm1.bias", "qkv.layer_norm_bias"), norm2_bias]
    if cfg.qkv_bias:
        pairs.append(("attn.qkv.bias", "qkv.bias"))
    if cfg.proj_bias:
        pairs += [("attn.proj.bias", "proj.bias")] + mlp_biases
    if cfg.qk_norm:
        for t in ("q_norm", "k_norm"):
            pairs.append((f"attn.{t}.weight", f"{t}.weight"))
            if cfg.norm == "LayerNorm":
                pairs.append((f"attn.{t}.bias", f"{t}.bias"))
    if cfg.init_values is not None:
        pairs += [("ls1.gamma", "ls1.gamma"), ("ls2.gamma", "ls2.gamma")]
    return pairs


def _rename(sd: Mapping[str, torch.Tensor], mapping: Dict[str, str], what: str) -> Dict[str, torch.Tensor]:
    keys = {k for k in sd if not k.endswith(_EXTRA)}
    missing = sorted(set(mapping) - keys)
    unexpected = sorted(keys - set(mapping))
    if missing or unexpected:
        raise ValueError(f"{what}: state dict does not match the block config: missing {missing}, "
                       f"unexpected {unexpected}")
    return {mapping[k]: sd[k] for k in mapping}


def timm_to_te(sd: Mapping[str, torch.Tensor], cfg: BlockConfig) -> Dict[str, torch.Tensor]:
    """A timm ``Block`` state dict (keys relative to the block) -> ``TE_Block`` names.

    Raises:
        ValueError: keys missing or left over for ``cfg``, listed.
    """
    return _rename(sd, dict(name_pairs(cfg)), "timm -> TE")


def te_to_timm(sd: Mapping[str, torch.Tensor], cfg: BlockConfig) -> Dict[str, torch.Tensor]:
    """A ``TE_Block`` state dict -> timm ``Block`` names. FP8 scaling state (``*._extra_state``)
    has no timm counterpart and is not carried over.

    Raises:
        ValueError: keys missing or left over for ``cfg``, listed.
    """
    return _rename(sd, {te: timm for timm, te in name_pairs(cfg)}, "TE -> timm")
