"""Every timm MLP kind with Transformer Engine's kernels: FP8 off against timm, FP8 against bf16.

FP8 off: the tolerances of tests/gpu/test_block_gpu.py (its module docstring gives the reasons):
fp32 output within 2e-3 of timm relative to its max, the input gradient within 1e-3 in relative L2
(with ReLU, whose kink flips, 2x what 1e-4 weight noise does to timm's own block), weight gradients within 2e-3 in relative L2 with a floor at 1%
of the block's largest gradient norm (2.5e-2 with ReLU). bf16: TE no further from fp32 timm than
2x timm's own bf16 result (plus 1e-3).

FP8: the floors of tests/gpu/test_fp8_gpu.py: logits >= 20 dB and every block weight gradient
>= 12 dB against the same model in bf16, on the third step (delayed scaling fills its amax
history first). The gated kernels (swiglu, glu, geglu) have no fused dbias-dact backward under
delayed scaling (TE 2.20): a separate kernel, the same maths.

The padded cases (hidden widths that are not multiples of 16, EVA02-L's 2730) must train under
FP8 with the padded units exactly zero, parameters and gradients.
"""

import pytest
import timm
import torch
from timm.layers import SwiGLU
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import fp8vit
from fp8vit.blocks.weights import te_to_timm
from helpers import (GRAD_DB, LOGITS_DB, MLP_CASES, block_pair, block_weight, fp32_against_timm, fp8_snrs, fp8_step,
                     max_rel_err, need_recipe, padded_masks, step_snrs)

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:fp8vit. timm's exact")]

_KINKED = {"glu_relu_norm"}  # ReLU: a pre-activation within rounding of 0 flips (test_block_gpu.py)


def _pair(case, dim=128, heads=4):
    return block_pair(MLP_CASES[case], backend="te", dim=dim, num_heads=heads, device="cuda")


@pytest.mark.parametrize("case", list(MLP_CASES))
def test_te_parameters_match_reference_backend(case):
    block, te = _pair(case)
    ref = fp8vit.TE_Block.from_timm(block.cpu(), exact_gelu=MLP_CASES[case].get("exact_gelu", False),
                                    backend="reference")
    te_sd = {k: v for k, v in te.state_dict().items() if not k.endswith("_extra_state")}
    assert {k: tuple(v.shape) for k, v in te_sd.items()} == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert te.cfg.fused_mlp == (type(te.mlp).__name__ == "LayerNormMLP")


@pytest.mark.parametrize("case", list(MLP_CASES))
def test_fp32_forward_and_grads_match_timm(case):
    block, te = _pair(case)
    e = fp32_against_timm(block, te, torch.randn(4, 197, 128, device="cuda"))
    worst = max(e["grads"], key=e["grads"].get)
    print(f"{case}: fp32 max rel err out {e['out']:.2e}, rel L2 err dx {e['dx']:.2e} "
          f"(kink sensitivity {e['kink_dx']:.2e}), worst weight-grad {worst} {e['grads'][worst]:.2e}")
    kinked = case in _KINKED
    assert e["out"] < 2e-3 and e["dx"] < (max(1e-3, 2 * e["kink_dx"]) if kinked else 1e-3)
    assert e["grads"][worst] < (2.5e-2 if kinked else 2e-3), worst


@pytest.mark.parametrize("case", ["swiglu", "glu_sigmoid", "glu_silu_packed", "geglu_mlp", "beit3",
                                  "swiglu_norm_padded", "glu_sigmoid_padded"])
def test_bf16_error_is_bf16_rounding_only(case):
    block, te = _pair(case)
    te.fp32_residual = True  # timm's choice, so that only the kernels differ
    x = torch.randn(8, 197, 128, device="cuda")
    truth = block(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        e_timm, e_te = max_rel_err(truth, block(x)), max_rel_err(truth, te(x))
    print(f"{case}: bf16 rel err timm {e_timm:.2e}, TE {e_te:.2e}")
    assert e_te <= 2 * e_timm + 1e-3


def test_norm_before_geglu_mlp_runs_in_bf16_under_autocast():
    # ViTamin: the block's norm2 runs in torch before GeGluMlp's own norm (fused into TE's MLP).
    # CUDA autocast runs torch's norms in fp32; fp8vit keeps the stream's bf16 in and out
    # (mlp.norm_in_dtype; docs/performance.md, lever 33), within bf16 rounding of timm.
    block, te = _pair("geglu_mlp")
    seen = []
    te.mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    x = torch.randn(8, 197, 128, device="cuda")
    truth = block(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        e_timm, e_te = max_rel_err(truth, block(x)), max_rel_err(truth, te(x))
    print(f"geglu_mlp, bf16 stream: MLP input {seen}, bf16 rel err timm {e_timm:.2e}, TE {e_te:.2e}")
    assert seen == [torch.bfloat16]
    # test_block_gpu.py's bound for the bf16 stream: three roundings (the input and the two sums),
    # each at most 2^-9 of the largest element. norm2's output was rounded to bf16 before too (TE
    # casts its input); its weight's rounding is renormalized by GeGluMlp's own norm.
    assert e_te <= 2 * e_timm + 3 * 2.0 ** -9


# ----------------------------------------------------------------------------- FP8
def _eva02_large_like(depth=2):
    """EVA02-L's MLP on a classic Block: SwiGLU, hidden 2730 (padded to 2736), LayerNorm before fc2."""
    return VisionTransformer(img_size=224, patch_size=14, embed_dim=1024, depth=depth, num_heads=16,
                             mlp_ratio=2730 / 1024, mlp_layer=SwiGLU, act_layer=nn.SiLU, scale_mlp_norm=True,
                             num_classes=100)


_MODELS = {
    "aimv2": lambda: timm.create_model("aimv2_large_patch14_224", depth=2, num_classes=100),      # SwiGLU, fused
    "dinov2_giant": lambda: timm.create_model("vit_giant_patch14_dinov2", depth=2, num_classes=100,
                                              img_size=224),                                   # SwiGLUPacked
    "beit3": lambda: timm.create_model("beit3_base_patch16_224", depth=2, num_classes=100),      # norms, unfused
    "vitamin": lambda: timm.create_model("vitamin_base_224", depth=2, num_classes=100),          # GeGluMlp
    "eva02_large_mlp": _eva02_large_like,                                                        # padded
}


def _model(name):
    torch.manual_seed(0)
    return fp8vit.convert_to_te(_MODELS[name]().cuda()).train()




def _nonzero_block_weight(name, grad):
    return block_weight(name) and float(grad.norm()) > 0


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("name", list(_MODELS))
@pytest.mark.parametrize("batch", [8, 3])  # 3: token rows padded to 16 too
def test_fp8_step_snr_vs_bf16(name, recipe, batch):
    need_recipe(recipe)
    model = _model(name)
    x = torch.randn(batch, 3, 224, 224, device="cuda")  # every model above at 224 px
    snrs, worst, _, _ = fp8_snrs(model, x, recipe, _nonzero_block_weight)
    print(f"{name} {recipe} batch {batch} ({model.blocks[0].cfg.mlp.describe()}): logits "
          f"{snrs['logits']:.1f} dB, worst {worst} {snrs[worst]:.1f} dB")
    assert snrs["logits"] >= LOGITS_DB and snrs[worst] >= GRAD_DB, worst




@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("name", ["eva02_large_mlp", "fused_padded"])
def test_padded_mlp_trains_under_fp8_with_padding_exactly_zero(name, recipe):
    # The unfused EVA02-L MLP (norm before fc2) and a fused padded SwiGLU (LayerNormMLP("swiglu")).
    need_recipe(recipe)
    torch.manual_seed(0)
    if name == "fused_padded":
        timm_model = VisionTransformer(img_size=224, patch_size=16, embed_dim=768, depth=2, num_heads=12,
                                       mlp_ratio=2050 / 768, mlp_layer=SwiGLU, act_layer=nn.SiLU, num_classes=100)
        model = fp8vit.convert_to_te(timm_model.cuda()).train()
        assert model.blocks[0].cfg.fused_mlp and model.blocks[0].cfg.mlp.pad == 14
    else:
        model = _model(name)
        assert model.blocks[0].cfg.mlp.hidden_padded == 2736 and not model.blocks[0].cfg.fused_mlp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    x = torch.randn(8, 3, 224, 224, device="cuda")
    y = torch.randint(0, 100, (8,), device="cuda")
    losses = []
    for _ in range(5):
        with fp8vit.fp8_context(recipe) as state:
            loss = nn.functional.cross_entropy(model(x), y)
        assert state.fp8
        loss.backward()
        for b in model.blocks:
            params = dict(b.mlp.named_parameters())
            for k, m in padded_masks(b).items():
                assert torch.count_nonzero(params[k].grad[m]) == 0, k
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    for b in model.blocks:
        params = dict(b.mlp.named_parameters())
        for k, m in padded_masks(b).items():
            assert torch.count_nonzero(params[k][m]) == 0, k
        te_to_timm(b.state_dict(), b.cfg)  # converts back: the padding is zero
    print(f"{name} {recipe}: losses {[round(v, 3) for v in losses]}")
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_padded_mlp_under_mxfp8_runs_without_fp8_and_says_so():
    need_recipe("mxfp8")
    from fp8vit import _warn
    _warn._seen.clear()
    model = _model("eva02_large_mlp")
    x = torch.randn(4, 3, 224, 224, device="cuda")
    with pytest.warns(RuntimeWarning, match="not multiples of 32"):
        fp8_step(model, x, "mxfp8")


@pytest.mark.parametrize("case", ["swiglu", "swiglu_norm_padded"])
def test_mlp_recompute_of_glu_mlps_keeps_the_step(case):
    # Fused (TE's own recompute inside LayerNormMLP) and unfused (activation checkpointing).
    need_recipe("delayed")
    runs = []
    for recompute in (False, True):
        torch.manual_seed(0)
        kw = dict(MLP_CASES[case])  # hidden 2040 when padded (not a multiple of 16)
        m = VisionTransformer(img_size=224, patch_size=16, embed_dim=768, depth=2, num_heads=12, num_classes=100,
                              **kw)
        m = fp8vit.convert_to_te(m.cuda()).train()
        x = torch.randn(16, 3, 224, 224, device="cuda")
        fp8_step(m, x, "delayed")
        if recompute:
            fp8vit.set_mlp_recompute(m)
        runs.append(fp8_step(m, x, "delayed"))
    snrs = step_snrs(*runs, _nonzero_block_weight)
    worst = min(snrs, key=snrs.get)
    print(f"{case}: MLP recompute vs not, worst {worst} {snrs[worst]:.1f} dB")
    assert snrs[worst] >= 40


def test_naflexvit_float_mask_with_te_kernels():
    torch.manual_seed(0)
    model = timm.create_model("naflexvit_base_patch16_gap", depth=2, num_classes=7).cuda().eval()
    patches = torch.randn(2, 64, 16 * 16 * 3, device="cuda")
    coord = torch.stack(torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij"), -1).reshape(1, 64, 2)
    valid = torch.ones(2, 64, dtype=torch.bool, device="cuda")
    valid[0, 40:] = False
    kw = dict(patch_coord=coord.expand(2, -1, -1).cuda(), patch_valid=valid)
    with torch.no_grad():
        truth = model(patches, **kw)
        fp8vit.convert_to_te(model, exact_gelu=True, fp32_residual=True)
        err = max_rel_err(truth, model(patches, **kw))
    print(f"NaFlexViT logits with a padding mask: max rel err {err:.2e}")
    assert err < 5e-3
