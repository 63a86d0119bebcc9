"""TE_ConvNeXtBlock on the GPU: the depthwise convolution in torch, the norm and Linear MLP as one TE
LayerNormMLP, against timm with FP8 off (tight), FP8 against bf16 by SNR, any batch under FP8,
graphs on the stages' blocks (convert_to_te(cuda_graphs=True)).

Tolerances as in test_beit_gpu.py (fp32: different kernels, 2e-3 of the output's max; logits >= 20
dB and weight gradients >= 12 dB under FP8).
"""

import pytest
import timm
import torch

import fp8vit
from fp8vit.blocks.convnext import TE_ConvNeXtBlock
from helpers import GRAD_DB, LOGITS_DB, assert_stage_graphs_train_like_eager, fp8_snrs, max_rel_err, rel_l2_err

pytestmark = pytest.mark.gpu

# ConvNeXt-T's widths with one block per stage but two in the first: 56 x 56 tokens of 96 channels,
# then 28, 14, 7 (192, 384, 768)
KW = dict(depths=(2, 1, 1, 1), num_classes=100)


def _model():
    torch.manual_seed(0)
    m = timm.create_model("convnext_tiny", pretrained=False, **KW)
    with torch.no_grad():  # gamma away from its 1e-6, so that the MLP's gradients count
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return m.cuda()


def _convert(model, **kw):
    fp8vit.convert_to_te(model, exact_gelu=True, **kw)  # timm's GELU is erf
    assert {type(b) for s in model.stages for b in s.blocks} == {TE_ConvNeXtBlock}
    return model


def test_fp32_logits_and_grads_match_timm():
    model = _model().eval()
    x = torch.randn(2, 3, 224, 224, device="cuda", requires_grad=True)

    def run(net):
        x.grad = None
        out = net(x)
        out.square().sum().backward()
        return out.detach(), x.grad.clone()

    ref, dx_ref = run(model)
    te = _convert(model)
    te.zero_grad(set_to_none=True)
    out, dx = run(te)
    print(f"convnext: fp32 logits max rel err {max_rel_err(ref, out):.2e}, dx rel L2 {rel_l2_err(dx_ref, dx):.2e}")
    assert max_rel_err(ref, out) < 2e-3 and rel_l2_err(dx_ref, dx) < 2e-3


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("batch", [16, 3])  # 3 x 49 tokens in the last stage: padded to 16 rows
def test_fp8_snr_vs_bf16(recipe, batch):
    model = _convert(_model()).train()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    snrs, worst, _, _ = fp8_snrs(model, x, recipe)
    print(f"convnext {recipe} batch {batch}: logits {snrs['logits']:.1f} dB, worst {worst} {snrs[worst]:.1f} dB")
    assert snrs["logits"] >= LOGITS_DB and snrs[worst] >= GRAD_DB


def test_stage_graphs_train_like_eager():
    # convert_to_te(cuda_graphs=True): no model.blocks, so each stage's blocks (an nn.Sequential of
    # 4-D blocks) get a graph cache
    assert_stage_graphs_train_like_eager(_model, _convert, stages=4)
