"""GPU tiers' shared setting: eager steps run TE's FP8 bias gradients on the kernel the graphs
capture by default (``make_graphed_blocks(triton_dbias=True)``), add the classic ViT block's
residual in the FP8 GEMM as the graphs do (``residual_gemm=True``) and its gradient in the LayerNorm
backward (``norm_grad_add=True``), so that a graphed model and its
eager twin run the same kernels and the tests that hold them equal bit for bit can. A test that
wants TE's own kernel or add sets it (``fp8vit._te.bias_grad_kernel(False)``,
``fp8vit._te.residual_gemm(False)``, ``fp8vit._te.norm_grad_add(False)``); the settings are restored after each test."""

import pytest


@pytest.fixture(autouse=True)
def _eager_bias_grads_as_the_graphs():
    import torch

    import fp8vit._te as _te
    if not (torch.cuda.is_available() and _te.te_status()[0]):
        yield  # the test skips (tests/conftest.py says why)
        return
    with _te.bias_grad_kernel(True), _te.residual_gemm(True), _te.norm_grad_add(True):
        yield
