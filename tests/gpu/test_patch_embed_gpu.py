"""``set_patch_gemm`` on the GPU: the patch embedding as one GEMM against cuDNN's convolution.

Under bf16 autocast both round the images and the weight to bf16 and accumulate in fp32: each is
held against the fp32 convolution (TF32 off), and the GEMM's error may not exceed twice the
convolution's (plus bf16's own rounding of the output). ViT-B/16's patch embedding at 224 px, and
a Swin's (4 x 4 patches), forward and weight gradient.
"""

import pytest
import torch
from torch import nn

from helpers import patch_gemm_errors

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cin, cout, patch, size", [(3, 768, 16, 224), (3, 128, 4, 224), (3, 1024, 14, 336)])
def test_gemm_against_the_convolution(cin, cout, patch, size, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, patch, patch).cuda()
    errs = patch_gemm_errors(conv, torch.randn(8, cin, size, size, device="cuda"))
    print(errs)
    (cy, cg), (gy, gg) = errs["Conv2d"], errs["PatchGemmConv2d"]
    assert gy <= 2 * cy + 4e-3 and gg <= 2 * cg + 4e-3, errs
