"""``set_patch_gemm`` on the GPU: the patch embedding as one GEMM against cuDNN's convolution.

Under bf16 autocast both round the images and the weight to bf16 and accumulate in fp32: each is
held against the fp32 convolution (TF32 off), and the GEMM's error may not exceed twice the
convolution's (plus bf16's own rounding of the output). ViT-B/16's patch embedding at 224 px, and
a Swin's (4 x 4 patches), forward and weight gradient.
"""

import pytest
import torch
from torch import nn

from fp8vit.blocks.patch_embed import PatchGemmConv2d

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("cin, cout, patch, size", [(3, 768, 16, 224), (3, 128, 4, 224), (3, 1024, 14, 336)])
def test_gemm_against_the_convolution(cin, cout, patch, size, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, patch, patch).cuda()
    x = torch.randn(8, cin, size, size, device="cuda")
    exact = conv(x)
    exact.square().sum().backward()
    g_exact = conv.weight.grad.clone()
    errs = {}
    for cls in (nn.Conv2d, PatchGemmConv2d):
        conv.weight.grad = conv.bias.grad = None
        conv.__class__ = cls
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = conv(x)
        assert y.shape == exact.shape and y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        errs[cls.__name__] = (_rel(y, exact), _rel(conv.weight.grad, g_exact))
    print(errs)
    (cy, cg), (gy, gg) = errs["Conv2d"], errs["PatchGemmConv2d"]
    assert gy <= 2 * cy + 4e-3 and gg <= 2 * cg + 4e-3, errs
