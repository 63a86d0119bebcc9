"""Same seed, same weights on Transformer Engine (issue 32): ``VisionTransformer(block_fn=TE_Block)``
with TE's modules holds timm's own weights bit for bit after the same ``torch.manual_seed``, and leaves
the CPU and CUDA RNGs where timm's model leaves them (tests/test_init_rng.py checks the reference
backend on the CPU, with more block options)."""

import functools

import pytest
import torch
from timm.layers import GluMlp, SwiGLU
from timm.models.vision_transformer import VisionTransformer
from timm.models.vitamin import GeGluMlp

import fp8vit

pytestmark = pytest.mark.gpu

_PAD = 170 / 64  # hidden 170 at dim 64: padded to 176

CASES = {
    "plain": dict(qkv_bias=True),                                                   # fused LayerNormMLP
    "layerscale_qknorm": dict(qkv_bias=True, qk_norm=True, init_values=1e-3),
    "exact_gelu_unfused": dict(qkv_bias=True, mlp_ratio=_PAD),                       # padded, erf GELU: unfused
    "swiglu_padded_norm": dict(mlp_layer=SwiGLU, act_layer="silu", mlp_ratio=_PAD, scale_mlp_norm=True),
    "glu_padded": dict(mlp_layer=GluMlp, act_layer="sigmoid", mlp_ratio=2 * _PAD),   # TE's glu kernel
    "geglu": dict(mlp_layer=GeGluMlp, act_layer="gelu_tanh", mlp_ratio=2.0),
}
MODES = [("", False), ("jax", False), ("moco", False), ("", True)]


def _pair(case, mode, fix_init, **extra):
    kw = dict(img_size=32, patch_size=16, embed_dim=64, depth=3, num_heads=4, num_classes=5,
              weight_init=mode, fix_init=fix_init and case != "geglu", **CASES[case], **extra)
    block_fn = functools.partial(fp8vit.TE_Block, backend="te", exact_gelu=case == "exact_gelu_unfused")
    torch.manual_seed(0)  # seeds every GPU too
    ref = VisionTransformer(**kw)
    ref_next = torch.rand(8), torch.rand(8, device="cuda")
    torch.manual_seed(0)
    te = VisionTransformer(block_fn=block_fn, **kw)
    te_next = torch.rand(8), torch.rand(8, device="cuda")
    return ref, te, ref_next, te_next


def _check(ref, te, ref_next, te_next, what, rescaled_on_the_gpu=False):
    assert all(isinstance(b, fp8vit.TE_Block) and b.backend == "te" for b in te.blocks)
    assert torch.equal(te_next[0], ref_next[0]), f"{what}: the CPU RNG is out of step"
    assert torch.equal(te_next[1], ref_next[1]), f"{what}: the CUDA RNG is out of step (TE's init drew)"
    fp8vit.convert_from_te(te)
    a, b = ref.state_dict(), te.state_dict()
    assert list(a) == list(b), what
    differ = [k for k in a if not torch.equal(a[k].cpu(), b[k].cpu())]
    if rescaled_on_the_gpu:
        # fix_init: timm's fix_init_weight divides attn.proj and mlp.fc2 of block i by sqrt(2 (i + 1))
        # where each model's weights are: on the CPU for timm's, on the GPU for TE's, whose division
        # by a scalar multiplies by its reciprocal (one ulp apart, up to 2^-22 relative). The draws are timm's: a divisor
        # that is a power of two (block 1: 2) gives the same bits, the others stay within one ulp.
        rescaled = [k for k in differ if k.endswith(("attn.proj.weight", "mlp.fc2.weight"))]
        assert not [k for k in rescaled if k.startswith("blocks.1.")], what
        for k in rescaled:
            torch.testing.assert_close(b[k].cpu(), a[k], rtol=2 ** -22, atol=0)
        differ = [k for k in differ if k not in rescaled]
    assert not differ, f"{what}: {len(differ)} of {len(a)} tensors differ, first {differ[:4]}"


@pytest.mark.parametrize("mode,fix_init", MODES, ids=[f"{m or 'timm'}{'-fix_init' if f else ''}" for m, f in MODES])
@pytest.mark.parametrize("case", list(CASES))
def test_te_blocks_on_the_gpu_draw_timms_weights_on_the_cpu(case, mode, fix_init):
    # timm builds its model on the CPU (device=None); TE_Block's TE modules go to the GPU, and the
    # weights are drawn where timm's are, then copied there.
    ref, te, ref_next, te_next = _pair(case, mode, fix_init)
    assert te.blocks[0].qkv.weight.is_cuda and not ref.blocks[0].attn.qkv.weight.is_cuda
    _check(ref, te, ref_next, te_next, f"{case}/{mode or 'timm'}/fix_init={fix_init}", rescaled_on_the_gpu=fix_init)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "swiglu_padded_norm"])
def test_both_models_built_on_the_gpu(case, dtype):
    # device="cuda": both draw from the CUDA RNG, in the model's dtype.
    ref, te, ref_next, te_next = _pair(case, "jax", True, device="cuda", dtype=dtype)
    assert ref.blocks[0].attn.qkv.weight.is_cuda and te.blocks[0].qkv.weight.dtype == dtype
    _check(ref, te, ref_next, te_next, f"{case}/cuda/{dtype}")


def test_building_te_modules_draws_nothing():
    torch.manual_seed(0)
    fp8vit.TE_Block(64, 4, mlp_ratio=_PAD, backend="te", device="cuda")  # draws on the CUDA RNG, like timm's Block(device="cuda")
    after = torch.rand(8, device="cuda")
    torch.manual_seed(0)
    from timm.models.vision_transformer import Block
    Block(64, 4, mlp_ratio=_PAD, device="cuda")
    assert torch.equal(after, torch.rand(8, device="cuda"))
