"""TE_Block takes timm Block's keywords and honours or rejects each one."""

import functools
import inspect

import pytest
import torch
from timm.layers import GatedMlp, LayerNorm2d, Mlp, RmsNorm, SwiGLU
from timm.models.vision_transformer import Block
from torch import nn

import fp8vit
from fp8vit.blocks.config import BlockConfig
from fp8vit.blocks.timm_layers import resolve_activation, resolve_norm


def test_every_timm_block_keyword_is_accepted():
    # Every keyword of the installed timm's Block, at timm's default value, builds a TE_Block
    # equal in config to the one timm's defaults imply.
    params = inspect.signature(Block.__init__).parameters
    kwargs = {k: p.default for k, p in params.items()
              if k != "self" and p.default is not inspect.Parameter.empty}
    te = fp8vit.TE_Block(64, 4, backend="reference", **kwargs)
    assert te.cfg == fp8vit.TE_Block(64, 4, backend="reference").cfg
    assert te.cfg.qkv_bias is False and te.cfg.mlp_hidden == 256


def test_timm_defaults_resolve_like_timm():
    cfg = BlockConfig.from_timm_kwargs(dim=768, num_heads=12, qkv_bias=True,
                                       norm_layer=functools.partial(nn.LayerNorm, eps=1e-6))
    assert (cfg.mlp_hidden, cfg.head_dim, cfg.norm, cfg.norm_eps) == (3072, 64, "LayerNorm", 1e-6)
    assert cfg.fused_mlp and cfg.te_activation == "gelu"


def test_unknown_keyword_is_named():
    # timm 0.6's ``drop`` is not a keyword of any timm fp8vit supports (>= 0.9): it is named.
    with pytest.raises(TypeError, match="drop"):
        BlockConfig.from_timm_kwargs(dim=64, num_heads=4, drop=0.1)


@pytest.mark.parametrize("kw, match", [
    (dict(attn_layer="diff"), "attn_layer='diff'"),
    (dict(mlp_layer=GatedMlp), "mlp_layer='GatedMlp'.*not supported"),
    (dict(mlp_layer=SwiGLU, norm_layer=nn.BatchNorm1d, scale_mlp_norm=True), "BatchNorm1d"),
    (dict(norm_layer=nn.BatchNorm1d), "BatchNorm1d"),
    (dict(norm_layer=LayerNorm2d), "LayerNorm2d"),
    (dict(norm_layer=functools.partial(nn.LayerNorm, elementwise_affine=False)), "elementwise_affine"),
    (dict(num_heads=5), "dim=64 is not divisible by num_heads=5"),
    (dict(drop_path=1.0), r"drop_path=1.0\): must be in \[0, 1\)"),
])
def test_unsupported_settings_raise_naming_them(kw, match):
    args = dict(dim=64, num_heads=4)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        BlockConfig.from_timm_kwargs(**args)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="not_a_timm_kwarg"):
        fp8vit.TE_Block(64, 4, not_a_timm_kwarg=1, backend="reference")


def test_mlp_dropout_forces_unfused_mlp():
    # Unfused anyway: the torch activation runs, so timm's erf GELU stays exact and nothing warns.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = BlockConfig.from_timm_kwargs(dim=64, num_heads=4, proj_drop=0.1, mlp_layer=Mlp)
    assert cfg.te_activation is None and not cfg.fused_mlp and cfg.act_layer is nn.GELU


@pytest.mark.parametrize("act, exact, expected, gated", [
    (functools.partial(nn.GELU, approximate="tanh"), False, "gelu", "geglu"),
    (nn.GELU, True, None, None),
    (nn.ReLU, False, "relu", "reglu"),
    (nn.SiLU, False, "silu", "swiglu"),
    ("swish", False, "silu", "swiglu"),
    ("quick_gelu", False, "qgelu", "qgeglu"),
    (nn.Sigmoid, False, None, "glu"),  # TE has sigmoid only as a gate
    (nn.Mish, False, None, None),
])
def test_activation_mapping(act, exact, expected, gated):
    assert resolve_activation(act, exact)[1] == expected
    assert resolve_activation(act, exact, gated=True)[1] == gated


def test_scale_norms_and_glu_mlps_are_accepted():
    cfg = BlockConfig.from_timm_kwargs(64, 4, scale_attn_norm=True, scale_mlp_norm=True, mlp_layer=SwiGLU)
    assert cfg.scale_attn_norm and cfg.mlp.norm == ("LayerNorm", 1e-6) and cfg.mlp.kind == "SwiGLU"
    kw = cfg.timm_kwargs()
    assert kw["mlp_layer"] is SwiGLU and kw["scale_mlp_norm"] and kw["scale_attn_norm"]


def test_exact_gelu_mapped_to_tanh_warns_once():
    import warnings

    from fp8vit import _warn
    _warn._seen.clear()
    with pytest.warns(UserWarning, match="tanh-approximate"):
        assert resolve_activation(nn.GELU, False)[1] == "gelu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_activation(nn.GELU, False)[1] == "gelu"  # once per process


def test_gelu_tanh_error_bound_stated_in_the_warning():
    # GELU_TANH_NOTE promises at most 5e-4; check it over a dense grid.
    x = torch.linspace(-10, 10, 200001, dtype=torch.float64)
    diff = (nn.functional.gelu(x) - nn.functional.gelu(x, approximate="tanh")).abs().max()
    assert 1e-4 < diff < 5e-4


def test_norm_resolution():
    assert resolve_norm(functools.partial(nn.LayerNorm, eps=1e-6), 32) == ("LayerNorm", 1e-6)
    assert resolve_norm(functools.partial(RmsNorm, eps=1e-5), 32) == ("RMSNorm", 1e-5)
