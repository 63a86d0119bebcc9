"""Every public entry of fp8vit refuses a bad argument at the call, naming the value and what it takes.

One table: a row is an entry, one of its arguments, a bad value for it, the call with that value
(everything else valid), the exception expected (``TypeError`` for a wrong type, ``ValueError``
for a wrong choice or range) and the words the message must hold: the argument with the bad
value's repr, and at least one accepted value or the fix. The table is checked for completeness
against ``fp8vit.__all__`` and each entry's signature, so a new public entry, or a new argument,
without a row fails here. Everything runs on the CPU: the checks come before any GPU or TE work.
"""

import dataclasses
import functools
import inspect
import math
import os
import tempfile
import warnings
from typing import Any, Callable, NamedTuple, Optional, Tuple

import pytest
import torch
from timm.models.beit import Block as BeitBlock
from timm.models.swin_transformer import SwinTransformerBlock
from timm.models.convnext import ConvNeXtBlock
from timm.models.eva import EvaBlock
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

import fp8vit
from fp8vit.blocks.beit import beit_config_from_timm
from fp8vit.blocks.swin import swin_config_from_timm, swinv2_config_from_timm
from fp8vit.blocks.convnext import convnext_config_from_timm
from fp8vit.blocks.eva import eva_config_from_timm


def _vit() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=1, num_heads=2, num_classes=10)


def _converted() -> VisionTransformer:
    return fp8vit.convert_to_te(_vit(), backend="reference")


def _opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _ckpt() -> str:
    return os.path.join(tempfile.mkdtemp(), "ckpt")  # never written: the calls are refused first


@functools.lru_cache(maxsize=None)
def _block_config() -> fp8vit.BlockConfig:
    return fp8vit.BlockConfig.from_timm_kwargs(dim=64, num_heads=4, exact_gelu=True)


def _family_block(cls, timm_block, read_config, **bad):
    """``cls`` (a block family's class) built from ``timm_block``'s config, with ``bad`` arguments."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tanh-GELU note
        cfg = read_config(timm_block)
    kw = dict(cfg=cfg, timm_skeleton=timm_block, backend="reference")
    kw.update(bad)
    return cls(kw.pop("cfg"), **kw)


def _eva_block(**bad) -> fp8vit.TE_EvaBlock:
    return _family_block(fp8vit.TE_EvaBlock, EvaBlock(64, 2), eva_config_from_timm, **bad)


def _beit_block(**bad) -> fp8vit.TE_BeitBlock:
    return _family_block(fp8vit.TE_BeitBlock, BeitBlock(64, 2, qkv_bias=True, window_size=(2, 2)),
                         beit_config_from_timm, **bad)


def _swin_block(**bad) -> fp8vit.TE_SwinBlock:
    return _family_block(fp8vit.TE_SwinBlock, SwinTransformerBlock(64, (4, 4), num_heads=2, window_size=2, shift_size=1),
                         swin_config_from_timm, **bad)


def _swinv2_block(**bad) -> fp8vit.TE_SwinV2Block:
    from timm.models.swin_transformer_v2 import SwinTransformerV2Block
    return _family_block(fp8vit.TE_SwinV2Block, SwinTransformerV2Block(64, (4, 4), num_heads=2, window_size=2,
                                                                       shift_size=1), swinv2_config_from_timm, **bad)


def _convnext_block(**bad) -> fp8vit.TE_ConvNeXtBlock:
    return _family_block(fp8vit.TE_ConvNeXtBlock, ConvNeXtBlock(64), convnext_config_from_timm, **bad)


class Row(NamedTuple):
    entry: str  # as in fp8vit.__all__ (or "Class.method")
    arg: str
    bad: Any
    call: Callable[[Any], Any]  # call(bad): the entry with that one argument bad
    error: type
    accepted: Tuple[str, ...]  # each must be in the message
    shown: Optional[str] = None  # what names the bad value in the message; default f"{arg}={bad!r}"
    optional: bool = False  # skip where there is no such entry or parameter (one being added)


def row(entry, arg, bad, call, error, *accepted, shown=None, optional=False) -> Row:
    return Row(entry, arg, bad, call, error, accepted, shown, optional)


BOOL = "True or False"
MODULE = "torch.nn.Module"
INT1 = "an integer >= 1"
INT0 = "an integer >= 0"
BACKEND = ("'te'", "'reference'", "or None")
RECIPES = ("'delayed'", "'mxfp8'")
_PG = "torch.distributed.ProcessGroup"

ROWS = [
    # ----------------------------------------------------------------- conversion
    row("convert_to_te", "model", 42, lambda v: fp8vit.convert_to_te(v), TypeError, MODULE),
    row("convert_to_te", "module_filter_fn", "blocks.0",
        lambda v: fp8vit.convert_to_te(_vit(), module_filter_fn=v), TypeError, "fn(module, fqn)"),
    row("convert_to_te", "exact_gelu", 1, lambda v: fp8vit.convert_to_te(_vit(), exact_gelu=v), TypeError, BOOL),
    row("convert_to_te", "backend", "bogus", lambda v: fp8vit.convert_to_te(_vit(), backend=v), ValueError, *BACKEND),
    row("convert_to_te", "backend", "cuda", lambda v: fp8vit.convert_to_te(_vit(), backend=v), ValueError, *BACKEND),
    row("convert_to_te", "backend", True, lambda v: fp8vit.convert_to_te(_vit(), backend=v), TypeError, *BACKEND),
    row("convert_to_te", "fp32_residual", "yes",
        lambda v: fp8vit.convert_to_te(_vit(), fp32_residual=v), TypeError, BOOL),
    row("convert_to_te", "fallback", "lin", lambda v: fp8vit.convert_to_te(_vit(), fallback=v), ValueError,
        "'linear'", "'keep'", "'error'", "'compile'"),
    row("convert_to_te", "fallback", "compiled", lambda v: fp8vit.convert_to_te(_vit(), fallback=v), ValueError,
        "'compile'"),
    row("convert_to_te", "fallback", None, lambda v: fp8vit.convert_to_te(_vit(), fallback=v), TypeError, "'keep'"),
    row("convert_to_te", "autocast", "yes", lambda v: fp8vit.convert_to_te(_vit(), autocast=v), TypeError, BOOL),
    row("convert_to_te", "cuda_graphs", 1, lambda v: fp8vit.convert_to_te(_vit(), cuda_graphs=v), TypeError, BOOL),
    row("convert_to_te", "compile", 1, lambda v: fp8vit.convert_to_te(_vit(), compile=v), TypeError, BOOL),
    row("convert_to_te", "patch_gemm", "no", lambda v: fp8vit.convert_to_te(_vit(), patch_gemm=v), TypeError, BOOL),
    row("convert_from_te", "model", "model", lambda v: fp8vit.convert_from_te(v), TypeError, MODULE),
    row("conversion_summary", "model", None, lambda v: fp8vit.conversion_summary(v), TypeError, MODULE),
    row("set_block_fp8", "model", None, lambda v: fp8vit.set_block_fp8(v, "blocks.0", False), TypeError, MODULE),
    row("set_block_fp8", "names", 3, lambda v: fp8vit.set_block_fp8(_converted(), v, False), TypeError,
        "module names (str)"),
    row("set_block_fp8", "names", ["blocks.0", 1], lambda v: fp8vit.set_block_fp8(_converted(), v, False),
        TypeError, "module names (str)", shown="names[1]=1"),
    row("set_block_fp8", "enabled", "no", lambda v: fp8vit.set_block_fp8(_converted(), "blocks.0", v),
        TypeError, BOOL),
    row("set_grad_checkpointing", "model", None, lambda v: fp8vit.set_grad_checkpointing(v), TypeError, MODULE),
    row("set_grad_checkpointing", "enable", 1, lambda v: fp8vit.set_grad_checkpointing(_converted(), v),
        TypeError, BOOL),
    row("set_patch_gemm", "model", None, lambda v: fp8vit.set_patch_gemm(v), TypeError, MODULE),
    row("set_patch_gemm", "enable", 1, lambda v: fp8vit.set_patch_gemm(_vit(), v), TypeError, BOOL),
    row("set_mlp_recompute", "model", None, lambda v: fp8vit.set_mlp_recompute(v), TypeError, MODULE),
    row("set_mlp_recompute", "enable", None, lambda v: fp8vit.set_mlp_recompute(_converted(), v), TypeError, BOOL),
    row("set_mlp_recompute", "every", 0, lambda v: fp8vit.set_mlp_recompute(_converted(), every=v),
        ValueError, INT1),
    row("set_mlp_recompute", "every", 1.5, lambda v: fp8vit.set_mlp_recompute(_converted(), every=v),
        TypeError, INT1),
    row("set_mlp_recompute", "every", True, lambda v: fp8vit.set_mlp_recompute(_converted(), every=v),
        TypeError, INT1),
    row("set_mlp_recompute", "module_filter_fn", True,
        lambda v: fp8vit.set_mlp_recompute(_converted(), module_filter_fn=v), TypeError, "fn(module, fqn)"),
    # ----------------------------------------------------------------- blocks
    row("TE_Block", "dim", 64.5, lambda v: fp8vit.TE_Block(v, 4, backend="reference"), TypeError, "an integer"),
    row("TE_Block", "num_heads", 0, lambda v: fp8vit.TE_Block(64, v, backend="reference"), ValueError, INT1),
    row("TE_Block", "device", "gpu", lambda v: fp8vit.TE_Block(64, 4, device=v, backend="reference"),
        ValueError, "'cuda'"),
    row("TE_Block", "device", 1.0, lambda v: fp8vit.TE_Block(64, 4, device=v, backend="reference"),
        TypeError, "torch.device"),
    row("TE_Block", "dtype", "float32", lambda v: fp8vit.TE_Block(64, 4, dtype=v, backend="reference"),
        TypeError, "torch.dtype"),
    row("TE_Block", "dtype", torch.int32, lambda v: fp8vit.TE_Block(64, 4, dtype=v, backend="reference"),
        ValueError, "floating-point"),
    row("TE_Block", "exact_gelu", "no", lambda v: fp8vit.TE_Block(64, 4, exact_gelu=v, backend="reference"),
        TypeError, BOOL),
    row("TE_Block", "backend", "cuda", lambda v: fp8vit.TE_Block(64, 4, backend=v), ValueError, *BACKEND),
    row("TE_Block", "fp32_residual", 1, lambda v: fp8vit.TE_Block(64, 4, fp32_residual=v, backend="reference"),
        TypeError, BOOL),
    row("TE_Block", "config", "cfg", lambda v: fp8vit.TE_Block(64, 4, config=v, backend="reference"),
        TypeError, "BlockConfig"),
    row("TE_EvaBlock", "cfg", "cfg", lambda v: _eva_block(cfg=v), TypeError, "EvaBlockConfig"),
    row("TE_EvaBlock", "timm_skeleton", None, lambda v: _eva_block(timm_skeleton=v), TypeError, "timm block"),
    row("TE_EvaBlock", "device", "gpu", lambda v: _eva_block(device=v), ValueError, "'cuda'"),
    row("TE_EvaBlock", "dtype", torch.int64, lambda v: _eva_block(dtype=v), ValueError, "floating-point"),
    row("TE_EvaBlock", "backend", "bogus", lambda v: _eva_block(backend=v), ValueError, *BACKEND),
    row("TE_EvaBlock", "fp32_residual", 1, lambda v: _eva_block(fp32_residual=v), TypeError, BOOL),
    row("TE_EvaBlock", "q_norm", "x", lambda v: _eva_block(q_norm=v), TypeError, "norm module"),
    row("TE_EvaBlock", "k_norm", 0, lambda v: _eva_block(k_norm=v), TypeError, "norm module"),
    row("TE_BeitBlock", "cfg", _eva_block().cfg, lambda v: _beit_block(cfg=v), TypeError, "BeitBlockConfig",
        shown="got EvaBlockConfig"),
    row("TE_BeitBlock", "timm_skeleton", None, lambda v: _beit_block(timm_skeleton=v), TypeError, "timm block"),
    row("TE_BeitBlock", "device", "gpu", lambda v: _beit_block(device=v), ValueError, "'cuda'"),
    row("TE_BeitBlock", "dtype", torch.int64, lambda v: _beit_block(dtype=v), ValueError, "floating-point"),
    row("TE_BeitBlock", "backend", "bogus", lambda v: _beit_block(backend=v), ValueError, *BACKEND),
    row("TE_BeitBlock", "fp32_residual", 1, lambda v: _beit_block(fp32_residual=v), TypeError, BOOL),
    row("TE_SwinBlock", "cfg", _eva_block().cfg, lambda v: _swin_block(cfg=v), TypeError, "SwinBlockConfig",
        shown="got EvaBlockConfig"),
    row("TE_SwinBlock", "timm_skeleton", None, lambda v: _swin_block(timm_skeleton=v), TypeError, "timm block"),
    row("TE_SwinBlock", "device", "gpu", lambda v: _swin_block(device=v), ValueError, "'cuda'"),
    row("TE_SwinBlock", "dtype", torch.int64, lambda v: _swin_block(dtype=v), ValueError, "floating-point"),
    row("TE_SwinBlock", "backend", "bogus", lambda v: _swin_block(backend=v), ValueError, *BACKEND),
    row("TE_SwinBlock", "fp32_residual", 1, lambda v: _swin_block(fp32_residual=v), TypeError, BOOL),
    row("TE_SwinV2Block", "cfg", _swin_block().cfg, lambda v: _swinv2_block(cfg=v), TypeError, "SwinV2BlockConfig",
        shown="got SwinBlockConfig"),
    row("TE_SwinV2Block", "timm_skeleton", None, lambda v: _swinv2_block(timm_skeleton=v), TypeError, "timm block"),
    row("TE_SwinV2Block", "device", "gpu", lambda v: _swinv2_block(device=v), ValueError, "'cuda'"),
    row("TE_SwinV2Block", "dtype", torch.int64, lambda v: _swinv2_block(dtype=v), ValueError, "floating-point"),
    row("TE_SwinV2Block", "backend", "bogus", lambda v: _swinv2_block(backend=v), ValueError, *BACKEND),
    row("TE_SwinV2Block", "fp32_residual", 1, lambda v: _swinv2_block(fp32_residual=v), TypeError, BOOL),
    row("TE_ConvNeXtBlock", "cfg", _eva_block().cfg, lambda v: _convnext_block(cfg=v), TypeError,
        "ConvNeXtBlockConfig", shown="got EvaBlockConfig"),
    row("TE_ConvNeXtBlock", "timm_skeleton", None, lambda v: _convnext_block(timm_skeleton=v), TypeError, "timm block"),
    row("TE_ConvNeXtBlock", "device", "gpu", lambda v: _convnext_block(device=v), ValueError, "'cuda'"),
    row("TE_ConvNeXtBlock", "dtype", torch.int64, lambda v: _convnext_block(dtype=v), ValueError, "floating-point"),
    row("TE_ConvNeXtBlock", "backend", "bogus", lambda v: _convnext_block(backend=v), ValueError, *BACKEND),
    row("TE_ConvNeXtBlock", "fp32_residual", 1, lambda v: _convnext_block(fp32_residual=v), TypeError, BOOL),
    # BlockConfig itself (a frozen dataclass: every field checked in __post_init__) ...
    *[row("BlockConfig", field, bad, lambda v, f=field: dataclasses.replace(_block_config(), **{f: v}), err, *acc)
      for field, bad, err, acc in [
          ("dim", 0, ValueError, (INT1,)),
          ("num_heads", 5, ValueError, ("not divisible",)),
          ("mlp", None, TypeError, ("MlpConfig",)),
          ("qkv_bias", 1, TypeError, (BOOL,)),
          ("proj_bias", None, TypeError, (BOOL,)),
          ("qk_norm", "yes", TypeError, (BOOL,)),
          ("scale_attn_norm", 0, TypeError, (BOOL,)),
          ("scale_mlp_norm", 1, TypeError, (BOOL,)),
          ("proj_drop", 1.0, ValueError, ("[0, 1)",)),
          ("attn_drop", -0.1, ValueError, ("[0, 1)",)),
          ("init_values", "1e-5", TypeError, ("a number",)),
          ("drop_path", math.nan, ValueError, ("not NaN",)),
          ("norm", "BatchNorm", ValueError, ("'LayerNorm'", "'RMSNorm'")),
          ("norm_eps", 0.0, ValueError, ("> 0",)),
          ("norm_layer", "layernorm", TypeError, ("norm constructor",)),
      ]],
    # ... and its constructor from timm's keywords (TE_Block's **kwargs)
    *[row("BlockConfig.from_timm_kwargs", kw, bad,
          lambda v, k=kw: fp8vit.BlockConfig.from_timm_kwargs(**{"dim": 64, "num_heads": 4, k: v}), err, *acc)
      for kw, bad, err, acc in [
          ("dim", 64.0, TypeError, ("an integer",)),
          ("num_heads", 0, ValueError, (INT1,)),
          ("mlp_ratio", 0, ValueError, ("> 0",)),
          ("qkv_bias", "yes", TypeError, (BOOL,)),
          ("qk_norm", 1, TypeError, (BOOL,)),
          ("scale_attn_norm", None, TypeError, (BOOL,)),
          ("scale_mlp_norm", 0, TypeError, (BOOL,)),
          ("proj_bias", 1, TypeError, (BOOL,)),
          ("proj_drop", 1.5, ValueError, ("[0, 1)",)),
          ("attn_drop", "0.1", TypeError, ("a number",)),
          ("init_values", "1e-5", TypeError, ("a number",)),
          ("drop_path", 1.0, ValueError, ("[0, 1)",)),
          ("act_layer", 3, TypeError, ("activation constructor",)),
          ("norm_layer", "layernorm", TypeError, ("norm constructor",)),
          ("mlp_layer", "Mlp", TypeError, ("MLP constructor",)),
          ("attn_layer", "diff", ValueError, ("standard Attention",)),
          ("depth", -1, ValueError, (INT0,)),
          ("exact_gelu", 1, TypeError, (BOOL,)),
      ]],
    # ----------------------------------------------------------------- FP8 execution
    row("fp8_context", "recipe", "dealyed", lambda v: fp8vit.fp8_context(v), ValueError, *RECIPES),
    row("fp8_context", "recipe", 3, lambda v: fp8vit.fp8_context(v), TypeError, *RECIPES),
    row("fp8_context", "enabled", "yes", lambda v: fp8vit.fp8_context(enabled=v), TypeError, BOOL),
    row("fp8_context", "dtype", torch.float32, lambda v: fp8vit.fp8_context(dtype=v), ValueError, "torch.bfloat16"),
    row("fp8_context", "dtype", "bf16", lambda v: fp8vit.fp8_context(dtype=v), TypeError, "torch.bfloat16"),
    row("fp8_context", "strict", 1, lambda v: fp8vit.fp8_context(strict=v), TypeError, BOOL),
    row("fp8_context", "amax_reduction_group", "world", lambda v: fp8vit.fp8_context(amax_reduction_group=v),
        TypeError, _PG),
    row("set_fp8_autocast", "model", None, lambda v: fp8vit.set_fp8_autocast(v), TypeError, MODULE),
    row("set_fp8_autocast", "enabled", 1, lambda v: fp8vit.set_fp8_autocast(_converted(), v), TypeError, BOOL),
    row("set_fp8_autocast", "recipe", "dealyed", lambda v: fp8vit.set_fp8_autocast(_converted(), recipe=v),
        ValueError, *RECIPES),
    row("set_fp8_autocast", "recipe", 3, lambda v: fp8vit.set_fp8_autocast(_converted(), recipe=v), TypeError,
        *RECIPES),
    row("set_fp8_autocast", "dtype", torch.float32, lambda v: fp8vit.set_fp8_autocast(_converted(), dtype=v),
        ValueError, "torch.bfloat16"),
    row("set_fp8_autocast", "dtype", None, lambda v: fp8vit.set_fp8_autocast(_converted(), dtype=v),
        TypeError, "torch.bfloat16"),
    row("set_fp8_autocast", "amax_reduction_group", "world",
        lambda v: fp8vit.set_fp8_autocast(_converted(), amax_reduction_group=v), TypeError, _PG),
    row("make_recipe", "name", "bogus", lambda v: fp8vit.make_recipe(v), ValueError, *RECIPES),
    row("make_recipe", "name", None, lambda v: fp8vit.make_recipe(v), TypeError, *RECIPES),
    row("make_recipe", "fp8_attention", 1, lambda v: fp8vit.make_recipe("delayed", fp8_attention=v), TypeError, BOOL),
    row("make_recipe", "fp8_attention", True, lambda v: fp8vit.make_recipe("block", fp8_attention=v), ValueError,
        "'delayed'", "'current'", "'mxfp8'", shown="make_recipe('block', fp8_attention=True)"),
    row("set_cudnn_layernorm", "enabled", 1, lambda v: fp8vit.set_cudnn_layernorm(v), TypeError, BOOL),
    row("set_bias_grad_kernel", "enabled", 1, lambda v: fp8vit.set_bias_grad_kernel(v), TypeError, BOOL),
    row("set_residual_gemm", "enabled", 1, lambda v: fp8vit.set_residual_gemm(v), TypeError, BOOL),
    row("set_norm_grad_add", "enabled", 1, lambda v: fp8vit.set_norm_grad_add(v), TypeError, BOOL),
    row("make_graphed_blocks", "model", None, lambda v: fp8vit.make_graphed_blocks(v, 8), TypeError, MODULE),
    row("make_graphed_blocks", "batch_size", 0, lambda v: fp8vit.make_graphed_blocks(_vit(), v), ValueError, INT1),
    row("make_graphed_blocks", "batch_size", 8.0, lambda v: fp8vit.make_graphed_blocks(_vit(), v), TypeError, INT1),
    row("make_graphed_blocks", "tokens", 0, lambda v: fp8vit.make_graphed_blocks(_vit(), 8, tokens=v),
        ValueError, INT1),
    row("make_graphed_blocks", "recipe", "dealyed", lambda v: fp8vit.make_graphed_blocks(_vit(), 8, recipe=v),
        ValueError, *RECIPES),
    row("make_graphed_blocks", "fp8", "yes", lambda v: fp8vit.make_graphed_blocks(_vit(), 8, fp8=v), TypeError, BOOL),
    row("make_graphed_blocks", "triton_dbias", "on", lambda v: fp8vit.make_graphed_blocks(_vit(), 8, triton_dbias=v),
        TypeError, BOOL),
    row("make_graphed_blocks", "stem", "on", lambda v: fp8vit.make_graphed_blocks(_vit(), 8, stem=v), TypeError, BOOL),
    row("make_graphed_blocks", "residual_gemm", 1, lambda v: fp8vit.make_graphed_blocks(_vit(), 8, residual_gemm=v),
        TypeError, BOOL),
    row("make_graphed_blocks", "norm_grad_add", "yes", lambda v: fp8vit.make_graphed_blocks(_vit(), 8, norm_grad_add=v),
        TypeError, BOOL),
    row("make_graphed_blocks", "dtype", torch.float32, lambda v: fp8vit.make_graphed_blocks(_vit(), 8, dtype=v),
        ValueError, "torch.bfloat16"),
    row("make_graphed_blocks", "num_warmup_iters", -1,
        lambda v: fp8vit.make_graphed_blocks(_vit(), 8, num_warmup_iters=v), ValueError, INT0),
    row("make_graphed_blocks", "cudnn_layernorm", 1,
        lambda v: fp8vit.make_graphed_blocks(_vit(), 8, cudnn_layernorm=v), TypeError, BOOL),
    row("make_graphed_blocks", "fused_wgrad", None,
        lambda v: fp8vit.make_graphed_blocks(_vit(), 8, fused_wgrad=v), TypeError, BOOL),
    row("make_graphed_blocks", "amax_reduction_group", "world",
        lambda v: fp8vit.make_graphed_blocks(_vit(), 8, amax_reduction_group=v), TypeError, _PG),
    row("make_graphed_blocks", "max_shapes", 0, lambda v: fp8vit.make_graphed_blocks(_vit(), max_shapes=v),
        ValueError, INT1),
    row("make_graphed_blocks", "max_shapes", 2.5, lambda v: fp8vit.make_graphed_blocks(_vit(), max_shapes=v),
        TypeError, INT1),
    # ----------------------------------------------------------------- several GPUs
    row("shard_model", "model", "model", lambda v: fp8vit.shard_model(v), TypeError, MODULE),
    row("shard_model", "mesh", "cuda", lambda v: fp8vit.shard_model(_converted(), mesh=v), TypeError, "DeviceMesh"),
    row("shard_model", "reshard_after_forward", 1,
        lambda v: fp8vit.shard_model(_converted(), reshard_after_forward=v), TypeError, BOOL),
    row("shard_model", "mp_policy", "bf16", lambda v: fp8vit.shard_model(_converted(), mp_policy=v),
        TypeError, "MixedPrecisionPolicy"),
    row("shard_model", "units", nn.Identity(), lambda v: fp8vit.shard_model(_converted(), units=v),
        TypeError, "a list of torch.nn.Module", shown="units=Identity()"),
    row("shard_model", "units", [nn.Identity(), "blocks.0"], lambda v: fp8vit.shard_model(_converted(), units=v),
        TypeError, MODULE, shown="units[1]='blocks.0'"),
    row("fp8_weight_init", "recipe", "dealyed", lambda v: fp8vit.fp8_weight_init(v), ValueError, *RECIPES),
    row("fp8_weight_init", "recipe", "mxfp8", lambda v: fp8vit.fp8_weight_init(v), ValueError, "'current'",
        shown="fp8_weight_init('mxfp8')"),
    row("fp8_weight_init", "recipe", 3, lambda v: fp8vit.fp8_weight_init(v), TypeError, *RECIPES),
    row("fp8_weight_optimizer", "params", torch.zeros(3), lambda v: fp8vit.fp8_weight_optimizer(v), TypeError,
        "model.parameters()", shown="params=tensor([0., 0., 0.])"),
    row("fp8_weight_optimizer", "lr", -1e-3, lambda v: fp8vit.fp8_weight_optimizer([nn.Parameter(torch.zeros(2))], v),
        ValueError, ">= 0"),
    row("fp8_weight_optimizer", "lr", "1e-3",
        lambda v: fp8vit.fp8_weight_optimizer([nn.Parameter(torch.zeros(2))], v), TypeError, "a number"),
    row("save_checkpoint", "checkpoint_id", 3, lambda v: fp8vit.save_checkpoint(v, _vit()), TypeError, "os.PathLike"),
    row("save_checkpoint", "model", "model", lambda v: fp8vit.save_checkpoint(_ckpt(), v), TypeError, MODULE),
    row("save_checkpoint", "optimizer", "adam", lambda v: fp8vit.save_checkpoint(_ckpt(), _vit(), v),
        TypeError, "torch.optim.Optimizer"),
    row("save_checkpoint", "extra", [("step", 1)], lambda v: fp8vit.save_checkpoint(_ckpt(), _vit(), extra=v),
        TypeError, "a dict"),
    row("save_checkpoint", "keep", 0, lambda v: fp8vit.save_checkpoint(_ckpt(), _vit(), keep=v), ValueError,
        "1 or more", optional=True),
    row("latest_checkpoint", "checkpoint_id", 3, lambda v: fp8vit.latest_checkpoint(v), TypeError, "os.PathLike",
        optional=True),
    row("load_checkpoint", "checkpoint_id", None, lambda v: fp8vit.load_checkpoint(v, _vit()), TypeError,
        "os.PathLike"),
    row("load_checkpoint", "model", "model", lambda v: fp8vit.load_checkpoint(_ckpt(), v), TypeError, MODULE),
    row("load_checkpoint", "optimizer", "adam", lambda v: fp8vit.load_checkpoint(_ckpt(), _vit(), v),
        TypeError, "torch.optim.Optimizer"),
    # ----------------------------------------------------------------- FP8 safety
    row("diagnose", "model", "model", lambda v: fp8vit.diagnose(v, torch.randn(2, 3, 32, 32)), TypeError, MODULE),
    row("diagnose", "batch", [1, 2], lambda v: fp8vit.diagnose(_converted(), v), TypeError, "torch.Tensor"),
    row("diagnose", "target", [0, 1], lambda v: fp8vit.diagnose(_converted(), torch.randn(2, 3, 32, 32), target=v),
        TypeError, "torch.Tensor"),
    row("diagnose", "loss_fn", "mse", lambda v: fp8vit.diagnose(_converted(), torch.randn(2, 3, 32, 32), loss_fn=v),
        TypeError, "loss_fn(output, target)"),
    row("diagnose", "recipe", "dealyed", lambda v: fp8vit.diagnose(_converted(), torch.randn(2, 3, 32, 32), recipe=v),
        ValueError, *RECIPES),
    row("diagnose", "threshold_db", "20",
        lambda v: fp8vit.diagnose(_converted(), torch.randn(2, 3, 32, 32), threshold_db=v), TypeError, "a number"),
    row("diagnose", "grad_threshold_db", math.nan,
        lambda v: fp8vit.diagnose(_converted(), torch.randn(2, 3, 32, 32), grad_threshold_db=v),
        ValueError, "not NaN"),
    row("diagnose", "warmup", -1, lambda v: fp8vit.diagnose(_converted(), torch.randn(2, 3, 32, 32), warmup=v),
        ValueError, INT0),
    row("NonFiniteGuard", "model", None, lambda v: fp8vit.NonFiniteGuard(v, _opt(_vit())), TypeError, MODULE),
    row("NonFiniteGuard", "optimizer", "sgd", lambda v: fp8vit.NonFiniteGuard(_vit(), v), TypeError,
        "torch.optim.Optimizer"),
    row("NonFiniteGuard", "blocks", ["blocks.0"], lambda v: fp8vit.NonFiniteGuard(_vit(), _opt(_vit()), blocks=v),
        TypeError, "{name: module}"),
    row("NonFiniteGuard", "blocks", {"blocks.0": "b"},
        lambda v: fp8vit.NonFiniteGuard(_vit(), _opt(_vit()), blocks=v), TypeError, MODULE,
        shown="blocks['blocks.0']='b'"),
    row("NonFiniteGuard", "max_consecutive", -1,
        lambda v: fp8vit.NonFiniteGuard(_vit(), _opt(_vit()), max_consecutive=v), ValueError, INT0),
    row("NonFiniteGuard", "max_consecutive", 2.5,
        lambda v: fp8vit.NonFiniteGuard(_vit(), _opt(_vit()), max_consecutive=v), TypeError, INT0),
    row("NonFiniteGuard", "repair_fp8_state", 0,
        lambda v: fp8vit.NonFiniteGuard(_vit(), _opt(_vit()), repair_fp8_state=v), TypeError, BOOL),
    row("snr_db", "ref", [1.0], lambda v: fp8vit.snr_db(v, torch.zeros(1)), TypeError, "torch.Tensor"),
    row("snr_db", "test", 0.5, lambda v: fp8vit.snr_db(torch.zeros(1), v), TypeError, "torch.Tensor"),
    row("snr_db", "test", torch.zeros(2), lambda v: fp8vit.snr_db(torch.zeros(3), v), ValueError, "one shape",
        shown="ref is [3] and test [2]"),
]

# Public callables with no row, and why. Anything else in fp8vit.__all__ that can be called needs one.
EXEMPT = {
    "RecipeName": "an enum: its members are the constants RECIPE_NAMES lists; recipe names are checked "
                  "where they are passed (fp8_context, make_recipe, ...)",
    "FP8State": "a record fp8_context yields; read, not built",
    "ConversionSummary": "a record convert_to_te leaves on the model; read, not built",
    "GraphedBlocks": "the handle make_graphed_blocks returns; read and released, not built",
    "DiagnosisReport": "a record diagnose returns (DiagnosisReport.from_dict checks its schema version)",
    "BlockStats": "a record inside a DiagnosisReport",
    "NonFiniteEvent": "a record NonFiniteGuard keeps",
    "GPUInfo": "a record gpu_info returns",
    "Check": "a (ok, reason) record capability probes return",
    "TEUnavailableError": "an exception class",
    "FP8UnavailableError": "an exception class",
    "ConversionError": "an exception class",
    "fp8_support": "takes no arguments",
    "gpu_info": "takes no arguments",
    "default_mp_policy": "takes no arguments",
}

# Entries checked beyond fp8vit.__all__: public methods through which users build a public class.
EXTRA_ENTRIES = {"BlockConfig.from_timm_kwargs": fp8vit.BlockConfig.from_timm_kwargs}


def _entry(name: str):
    return EXTRA_ENTRIES.get(name) or getattr(fp8vit, name)


def _parameters(obj) -> dict:
    """The public parameters of a function, or of a class's constructor (``*args``, ``**kwargs``,
    ``self`` and private ``_name`` keywords, which fp8vit passes to itself, left out)."""
    params = inspect.signature(obj).parameters
    return {n: p for n, p in params.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n != "self" and not n.startswith("_")}


def _exists(r: Row) -> bool:
    return (r.entry in EXTRA_ENTRIES or hasattr(fp8vit, r.entry)) and r.arg in _parameters(_entry(r.entry))


def _id(r: Row) -> str:
    bad = r.bad if isinstance(r.bad, (str, int, float, type(None))) else type(r.bad).__name__
    return f"{r.entry}-{r.arg}={bad}"


@pytest.mark.parametrize("r", ROWS, ids=[_id(r) for r in ROWS])
def test_a_bad_argument_is_refused_at_the_call_naming_value_and_accepted_ones(r: Row):
    if r.optional and not _exists(r):
        pytest.skip(f"no {r.entry}({r.arg}=...) in this tree")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallback notes (no TE here), GELU note: not the subject
        with pytest.raises(r.error) as info:
            r.call(r.bad)
    message = str(info.value)
    shown = r.shown or f"{r.arg}={r.bad!r}"
    assert shown in message, f"the message does not show the bad value ({shown}): {message}"
    for accepted in r.accepted:
        assert accepted in message, f"the message does not say {accepted!r}: {message}"


def test_convert_to_te_refuses_an_unknown_backend_on_a_timm_vit():
    """The issue's case: backend='bogus' raised inside each block's construction, which the
    conversion took for "this block cannot be fused", kept the block and returned normally."""
    model = _vit()
    with pytest.raises(ValueError, match=r"convert_to_te\(backend='bogus'\): use one of \['te', 'reference'\]"):
        fp8vit.convert_to_te(model, backend="bogus")


def _snapshot(model: nn.Module) -> tuple:
    return ([(n, type(m)) for n, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()},
            sorted(vars(model)))


@pytest.mark.parametrize("bad", [dict(backend="bogus"), dict(backend="cuda"), dict(fallback="lin"),
                                 dict(exact_gelu=1), dict(fp32_residual="yes"),
                                 dict(module_filter_fn="blocks.0"), dict(autocast=1),
                                 dict(cuda_graphs="yes"), dict(compile="yes"),
                                 dict(compile=True, fallback="compile")], ids=str)
def test_a_refused_conversion_leaves_the_model_unchanged(bad):
    model = _vit()
    modules, state, attrs = _snapshot(model)
    with pytest.raises((TypeError, ValueError)):
        fp8vit.convert_to_te(model, **bad)
    after_modules, after_state, after_attrs = _snapshot(model)
    assert after_modules == modules and all(type(m) is not fp8vit.TE_Block for m in model.modules())
    assert after_state.keys() == state.keys() and all(torch.equal(after_state[k], state[k]) for k in state)
    assert after_attrs == attrs  # no summary, no rerouted set_grad_checkpointing
    with pytest.raises(ValueError, match="was not converted"):
        fp8vit.conversion_summary(model)


@pytest.mark.parametrize("call", [
    lambda m: fp8vit.set_block_fp8(m, "blocks.0", "no"),
    lambda m: fp8vit.set_mlp_recompute(m, 1),
    lambda m: fp8vit.set_grad_checkpointing(m, "yes"),
], ids=["set_block_fp8", "set_mlp_recompute", "set_grad_checkpointing"])
def test_a_refused_switch_leaves_the_blocks_as_they_were(call):
    model = _converted()
    switches = [(b.fp8_enabled, b.recompute_mlp, b.grad_checkpointing) for b in model.blocks]
    with pytest.raises(TypeError, match="True or False"):
        call(model)
    assert [(b.fp8_enabled, b.recompute_mlp, b.grad_checkpointing) for b in model.blocks] == switches


def test_every_public_entry_has_a_row():
    """A public callable in fp8vit.__all__ without a row (and not exempted, with a reason) fails here."""
    covered = {r.entry for r in ROWS}
    missing = [n for n in fp8vit.__all__ if callable(getattr(fp8vit, n)) and n not in covered and n not in EXEMPT]
    assert not missing, f"public entries without a bad-argument row in tests/test_arguments.py: {missing}"
    assert set(EXEMPT) <= set(fp8vit.__all__), f"stale exemptions: {set(EXEMPT) - set(fp8vit.__all__)}"
    assert not covered & set(EXEMPT)
    for n, why in EXEMPT.items():
        if why == "takes no arguments":
            assert not _parameters(getattr(fp8vit, n)), f"{n} takes arguments now: give them rows"
        elif why == "an exception class":
            assert issubclass(getattr(fp8vit, n), Exception)
    stale = [r.entry for r in ROWS if r.entry not in fp8vit.__all__ and r.entry not in EXTRA_ENTRIES
             and not (r.optional and not _exists(r))]
    assert not stale, f"rows for entries that are not public: {stale}"


def test_every_argument_of_every_entry_has_a_row():
    """A new argument of a public entry without a row fails here (``*args``/``**kwargs`` aside:
    TE_Block's are BlockConfig.from_timm_kwargs's, which has rows of its own; fp8_weight_optimizer's
    go to TE's FusedAdam)."""
    rows_by_entry: dict = {}
    for r in ROWS:
        if r.optional and not _exists(r):
            continue
        rows_by_entry.setdefault(r.entry, set()).add(r.arg)
    missing = {e: sorted(set(_parameters(_entry(e))) - args) for e, args in rows_by_entry.items()}
    missing = {e: m for e, m in missing.items() if m}
    assert not missing, f"arguments without a bad-value row: {missing}"
    unknown = {r.entry: r.arg for r in ROWS if not r.optional and not _exists(r)}
    assert not unknown, f"rows for arguments the entry does not have: {unknown}"


def test_good_values_still_pass():
    """The checks refuse only what the table refuses: values the library's own callers pass work."""
    model = _converted()
    assert fp8vit.set_block_fp8(model, ("blocks.0",), False) == ["blocks.0"]
    fp8vit.set_mlp_recompute(model, True, every=1, module_filter_fn=lambda m, fqn: True)
    fp8vit.set_grad_checkpointing(model, False)
    assert fp8vit.snr_db(torch.ones(3), torch.ones(3)) == math.inf
    cfg = dataclasses.replace(_block_config(), init_values=1e-5, drop_path=0.1, norm_eps=1e-5)
    assert fp8vit.TE_Block.from_config(cfg, backend="reference", device=torch.device("cpu"),
                                       dtype=torch.float64).cfg == cfg
    guard = fp8vit.NonFiniteGuard(model, _opt(model), blocks={"blocks.0": model.blocks[0]}, max_consecutive=0)
    guard.remove()
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    with fp8vit.fp8_context(fp8vit.RecipeName.DELAYED, enabled=False, dtype=None, amax_reduction_group=group):
        pass
    assert fp8vit.set_fp8_autocast(model, True, recipe=fp8vit.RecipeName.CURRENT, dtype=torch.float16,
                                   amax_reduction_group=group) is model
    fp8vit.set_fp8_autocast(model, False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the backend fallback note (no TE here)
        timm_block = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=1, num_heads=2,
                                       block_fn=fp8vit.TE_Block, drop_path_rate=0.1, init_values=1e-5).blocks[0]
    assert isinstance(timm_block, fp8vit.TE_Block) and not isinstance(timm_block, Block)
