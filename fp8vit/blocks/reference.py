"""Pure-PyTorch stand-ins for the four TE modules fp8vit's blocks are built from.

Same constructor arguments (the subset fp8vit uses), same parameter names, same semantics
(including TE's conventions: ``bshd`` attention layout, boolean masks where True means
*masked out*, TE's activation kernels, gated ones included: the activation applies to the FIRST
half of fc1's output, times the second; zero-initialised biases; ``init_method``). They let a
block run, train and convert weights where TE cannot run (no GPU, no TE), and let CPU tests
check everything but the kernels. No FP8 here: FP8 needs TE on an FP8-capable GPU.
"""

from __future__ import annotations

import functools
import math
import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LayerNormLinear", "Linear", "LayerNormMLP", "DotProductAttention", "ACTIVATIONS",
           "GATED_ACTIVATIONS", "rope", "modules", "FP8Linear"]


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")  # TE's "gelu" is the tanh approximation


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return F.relu(x).square()


def _gated(x, act):
    """TE's gated kernel for ``act``: fc1's output ``x`` ``[..., 2F]`` -> ``act(first F) * (second F)``."""
    a, b = x.chunk(2, dim=-1)
    return act(a) * b


# TE activation kernel name -> the same function in PyTorch (TE 2.20's LayerNormMLP list, less
# clamped_swiglu, which takes parameters fp8vit does not use).
ACTIVATIONS = {"gelu": _gelu_tanh, "qgelu": _qgelu, "relu": F.relu, "srelu": _srelu, "silu": F.silu}
GATED_ACTIVATIONS = {"geglu": _gelu_tanh, "qgeglu": _qgelu, "reglu": F.relu, "sreglu": _srelu,
                     "swiglu": F.silu, "glu": torch.sigmoid}
# Partials of a module-level function, not closures: the unfused MLP keeps its gated activation as
# an attribute (``UnfusedMlp.gated_act``), and a closure there made ``torch.save(model)`` and
# ``pickle.dumps(model)`` of every model with an unfused gated MLP (EVA02's SwiGLU) fail.
ACTIVATIONS.update({name: functools.partial(_gated, act=act) for name, act in GATED_ACTIVATIONS.items()})


def _norm(x, weight, bias, normalization: str, eps: float):
    if normalization == "LayerNorm":
        return F.layer_norm(x, weight.shape, weight, bias, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def _linear_params(module: nn.Module, prefix: str, out_f: int, in_f: int, bias: bool, dd: dict):
    module.register_parameter(f"{prefix}weight", nn.Parameter(torch.empty(out_f, in_f, **dd)))
    if bias:
        module.register_parameter(f"{prefix}bias", nn.Parameter(torch.empty(out_f, **dd)))


def _reset_linear(weight: torch.Tensor, bias: Optional[torch.Tensor], init_method=None) -> None:
    """``init_method(weight)`` (default: nn.Linear's weight init); biases zero, as TE does."""
    with torch.no_grad():
        if init_method is None:
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            init_method(weight)
        if bias is not None:
            nn.init.zeros_(bias)


class _NormParams(nn.Module):
    def _init_norm(self, features: int, normalization: str, eps: float, dd: dict) -> None:
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
        self.normalization, self.eps = normalization, eps
        self.layer_norm_weight = nn.Parameter(torch.ones(features, **dd))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.zeros(features, **dd))
        else:
            self.layer_norm_bias = None

    def _ln(self, x):
        return _norm(x, self.layer_norm_weight, self.layer_norm_bias, self.normalization, self.eps)


def _dd(device, params_dtype) -> dict:
    return {"device": device, "dtype": params_dtype}


class Linear(nn.Module):
    """``te.Linear``: ``weight [out, in]``, optional ``bias [out]``."""

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cpu",
                 init_method=None):
        super().__init__()
        _linear_params(self, "", out_features, in_features, bias, _dd(device, params_dtype))
        if not bias:
            self.bias = None
        self.init_method = init_method
        self.reset_parameters()

    def reset_parameters(self):
        _reset_linear(self.weight, self.bias, self.init_method)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class LayerNormLinear(_NormParams, Linear):
    """``te.LayerNormLinear``: norm (``layer_norm_weight/bias``) then ``weight``/``bias``."""

    def __init__(self, in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm",
                 params_dtype=None, device="cpu", init_method=None):
        Linear.__init__(self, in_features, out_features, bias, params_dtype, device, init_method)
        self._init_norm(in_features, normalization, eps, _dd(device, params_dtype))

    def forward(self, x):
        return F.linear(self._ln(x), self.weight, self.bias)


class LayerNormMLP(_NormParams):
    """``te.LayerNormMLP``: norm, ``fc1_weight/bias``, activation kernel, ``fc2_weight/bias``.

    Gated activations (``swiglu``, ``glu``, ``geglu``, ...): fc1 has ``2 * ffn_hidden_size`` rows,
    the first half activated, as in TE.
    """

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, bias=True, normalization="LayerNorm",
                 activation="gelu", params_dtype=None, device="cpu", init_method=None,
                 output_layer_init_method=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} not in {sorted(ACTIVATIONS)}")
        dd = _dd(device, params_dtype)
        self.activation = activation
        self.init_method, self.output_layer_init_method = init_method, output_layer_init_method
        self._init_norm(hidden_size, normalization, eps, dd)
        fc1_rows = 2 * ffn_hidden_size if activation in GATED_ACTIVATIONS else ffn_hidden_size
        _linear_params(self, "fc1_", fc1_rows, hidden_size, bias, dd)
        _linear_params(self, "fc2_", hidden_size, ffn_hidden_size, bias, dd)
        if not bias:
            self.fc1_bias = self.fc2_bias = None
        self.reset_parameters()

    def reset_parameters(self):
        _reset_linear(self.fc1_weight, self.fc1_bias, self.init_method)
        _reset_linear(self.fc2_weight, self.fc2_bias, self.output_layer_init_method)

    def forward(self, x):
        h = ACTIVATIONS[self.activation](F.linear(self._ln(x), self.fc1_weight, self.fc1_bias))
        return F.linear(h, self.fc2_weight, self.fc2_bias)


class DotProductAttention(nn.Module):
    """``te.DotProductAttention`` for ``qkv_format="bshd"``: q ``[B, N, H, D]``, k, v ``[B, N, G, D]``
    -> ``[B, N, H*D]``; ``G = num_gqa_groups`` k/v heads (default ``H``), query head ``h`` attending
    with k/v head ``h // (H / G)``, as TE's grouped-query attention; an additive bias of the scaled
    logits as TE's ``post_scale_bias``."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="bshd", attn_mask_type="no_mask", softmax_scale=None):
        super().__init__()
        if qkv_format != "bshd":
            raise ValueError(f"only qkv_format='bshd' is mirrored here, got {qkv_format!r}")
        groups = num_gqa_groups or num_attention_heads
        if num_attention_heads % groups:
            raise ValueError(f"num_gqa_groups={num_gqa_groups} must divide num_attention_heads={num_attention_heads}")
        self.heads_per_group = num_attention_heads // groups
        self.attention_dropout = attention_dropout
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale

    def forward(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None,
                attn_mask_type=None, qkv_layer=None, qkv_interleave_dim=-3, core_attention_bias_type="no_bias",
                core_attention_bias=None):
        if core_attention_bias_type not in ("no_bias", "post_scale_bias"):
            raise ValueError(f"only core_attention_bias_type 'no_bias' and 'post_scale_bias' are mirrored here, "
                             f"got {core_attention_bias_type!r}")
        mask_type = attn_mask_type or self.attn_mask_type
        if qkv_layer is not None:  # packed [B, N, 3, H, D]
            query_layer, key_layer, value_layer = qkv_layer.unbind(qkv_interleave_dim)
        q, k, v = (t.transpose(1, 2) for t in (query_layer, key_layer, value_layer))  # [B, H or G, N, D]
        if self.heads_per_group > 1:
            k, v = (t.repeat_interleave(self.heads_per_group, dim=1) for t in (k, v))
        keep = None if attention_mask is None else ~attention_mask  # TE: True = masked out
        if core_attention_bias_type == "post_scale_bias":  # added to the scaled logits, as TE's
            bias = core_attention_bias.to(q.dtype)
            keep = bias if keep is None else bias.masked_fill(~keep, float("-inf"))
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, is_causal=mask_type == "causal",
            dropout_p=self.attention_dropout if self.training else 0.0, scale=self.softmax_scale)
        B, H, N, D = o.shape
        return o.transpose(1, 2).reshape(B, N, H * D)


def rope(t: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """TE's fused RoPE (``_te.fused_rope``): ``t`` ``[B, N, H, D]``, ``angles`` ``[N, 1, 1, D]``.

    ``t * cos + rot(t) * sin`` in fp32, cast back to ``t``'s dtype; ``rot`` maps channel pairs
    ``(2i, 2i+1)`` (interleaved) or ``(i, i + D/2)`` to ``(-second, first)``.
    """
    a = angles[:, 0, 0, :]  # [N, D] -> broadcast over [B, N, H, D] as [N, 1, D]
    cos, sin = torch.cos(a)[:, None, :], torch.sin(a)[:, None, :]
    if interleaved:
        rot = torch.stack([-t[..., 1::2], t[..., ::2]], dim=-1).reshape(t.shape)
    else:
        t1, t2 = t.chunk(2, dim=-1)
        rot = torch.cat([-t2, t1], dim=-1)
    return (t.float() * cos + rot.float() * sin).to(t.dtype)


def modules() -> types.SimpleNamespace:
    """The stand-ins, in the shape of ``_te.modules()``."""
    return types.SimpleNamespace(LayerNormLinear=LayerNormLinear, Linear=Linear,
                                 LayerNormMLP=LayerNormMLP, DotProductAttention=DotProductAttention,
                                 gated_activation=ACTIVATIONS.__getitem__)


class FP8Linear(Linear):
    """Twin of the TE ``FP8Linear`` swapped in for a model's ``nn.Linear`` (``fp8vit._te.SwappedLinear``):
    ``nn.Linear``'s maths and state dict, any leading dims, and its ``fp8_enabled`` switch (no FP8 here)."""

    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cpu"):
        super().__init__(in_features, out_features, bias, params_dtype, device)
        self.in_features, self.out_features = in_features, out_features  # nn.Linear's (and te.Linear's)
        self.fp8_enabled = True
        self.restore_owner = {}  # owner settings fp8vit.blocks.linear.switch_owner changed, for convert_from_te

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
