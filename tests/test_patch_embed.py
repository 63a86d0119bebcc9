"""set_patch_gemm / PatchGemmConv2d on the CPU: the patch embedding's convolution as one GEMM,
and convert_to_te's ``patch_gemm`` (on by default where it fuses blocks) and its undoing.

CPU autocast runs bf16 as the GPU's does, so the numerics are checked here against the fp32
convolution; the speed is a GPU measurement (docs/performance.md).
"""

import copy

import pytest
import timm
import torch
from torch import nn

import fp8vit
from fp8vit.blocks.patch_embed import PatchGemmConv2d, patchifies
from helpers import patch_gemm_errors, rel_l2_err


def _pair(name="vit_tiny_patch16_224", **kw):
    torch.manual_seed(0)
    ref = timm.create_model(name, num_classes=10, **kw)
    model = copy.deepcopy(ref)
    return ref, model


def test_bf16_gemm_is_as_close_to_fp32_as_the_bf16_convolution():
    # The conv's output and weight gradient under bf16 autocast, each against fp32: the GEMM's
    # error is of the same size as the convolution's (both round their inputs to bf16 and
    # accumulate in fp32); a patch cut in the wrong order is ~100% off.
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 64, 16, 16)
    x = torch.randn(4, 3, 64, 96)
    errs = patch_gemm_errors(conv, x)
    (conv_y, conv_g), (gemm_y, gemm_g) = errs["Conv2d"], errs["PatchGemmConv2d"]
    assert gemm_y < 2 * conv_y + 1e-3 and gemm_y < 1e-2, errs
    assert gemm_g < 2 * conv_g + 1e-3 and gemm_g < 2e-2, errs


def test_switched_vit_matches_timm_and_keeps_its_state():
    ref, model = _pair()
    conv, weight = model.patch_embed.proj, model.patch_embed.proj.weight
    assert fp8vit.set_patch_gemm(model) == ["patch_embed.proj"]
    proj = model.patch_embed.proj
    assert type(proj) is PatchGemmConv2d and proj is conv and proj.weight is weight  # in place
    assert list(model.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 3, 224, 224)
    # fp32: the convolution itself, bit for bit
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    # bf16 autocast: the GEMM, within bf16 rounding of timm's bf16 step
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(x), ref(x)
        tokens = model.patch_embed(x)
    assert tokens.is_contiguous()  # [B, N, D]: timm's flatten/transpose of the channels-last view
    assert rel_l2_err(want.float(), got.float()) < 2e-2
    fp8vit.set_patch_gemm(model, False)
    assert type(model.patch_embed.proj) is nn.Conv2d


def test_image_not_a_whole_number_of_patches_runs_the_convolution():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 4, 4)
    x = torch.randn(1, 3, 18, 16)  # 18 = 4 * 4 + 2: the conv drops the last 2 rows
    want = conv(x)
    conv.__class__ = PatchGemmConv2d
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv._gemm_dtype(x) is None
        got = conv(x)
    assert got.shape == want.shape == (1, 8, 4, 4)


def test_which_convolutions_patchify():
    assert patchifies(nn.Conv2d(3, 8, 16, 16)) and patchifies(nn.Conv2d(3, 8, (4, 2), (4, 2)))
    assert not patchifies(nn.Conv2d(3, 8, 16, 8))  # overlapping
    assert not patchifies(nn.Conv2d(3, 8, 3, 3, padding=1))
    assert not patchifies(nn.Conv2d(4, 8, 2, 2, groups=2))
    assert not patchifies(nn.Linear(3, 8)) and not patchifies(None)


def test_set_patch_gemm_on_swin_and_on_a_model_without_patch_embedding():
    _, swin = _pair("swin_tiny_patch4_window7_224")
    assert fp8vit.set_patch_gemm(swin) == ["patch_embed.proj"]
    with pytest.raises(ValueError, match=r"holds no timm PatchEmbed.*ResNet|ResNet.*holds no timm PatchEmbed"):
        fp8vit.set_patch_gemm(timm.create_model("resnet18"))
    assert fp8vit.set_patch_gemm(timm.create_model("resnet18"), False) == []  # nothing to undo
    with pytest.raises(TypeError, match="enable"):
        fp8vit.set_patch_gemm(swin, enable="yes")
    with pytest.raises(TypeError):
        fp8vit.set_patch_gemm("model")


def test_gemm_path_traces_whole_under_torch_compile():
    # convert_to_te(compile=True) and the bench's -compile variants trace it: no graph break
    # (fullgraph=True raises on one), the same result as eager.
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, 8, 8)
    conv.__class__ = PatchGemmConv2d
    compiled = torch.compile(conv, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(compiled(x), conv(x), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_convert_to_te_runs_the_patch_gemm_where_it_fuses_blocks():
    ref, model = _pair()
    conv = model.patch_embed.proj
    fp8vit.convert_to_te(model, backend="reference")
    assert type(model.patch_embed.proj) is PatchGemmConv2d and model.patch_embed.proj is conv
    summary = fp8vit.conversion_summary(model)
    assert summary.patch_gemm == ("patch_embed.proj",) and "patch embedding as one GEMM" in summary.short()
    assert "patch embedding as one GEMM under autocast: patch_embed.proj" in summary.table()
    x = torch.randn(2, 3, 224, 224)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_tokens, tokens = ref.patch_embed(x), model.patch_embed(x)
    assert rel_l2_err(ref_tokens.float(), tokens.float()) < 1e-2
    # back to timm's class: its state dict loads into timm's model, the conv is nn.Conv2d again
    fp8vit.convert_from_te(model)
    assert type(model.patch_embed.proj) is nn.Conv2d and model.patch_embed.proj is conv
    ref.load_state_dict(model.state_dict())
    # patch_gemm=False leaves the conv; a model fp8vit fuses nothing of keeps its conv too (CaiT:
    # a timm PatchEmbed, blocks of no family)
    _, off = _pair()
    fp8vit.convert_to_te(off, backend="reference", patch_gemm=False)
    assert type(off.patch_embed.proj) is nn.Conv2d and fp8vit.conversion_summary(off).patch_gemm == ()
    _, cait = _pair("cait_xxs24_224")
    fp8vit.convert_to_te(cait, backend="reference")
    assert type(cait.patch_embed.proj) is nn.Conv2d
