"""fp8vit.blocks.depthwise (lever 47) on the CPU: the shifted-product depthwise convolution against
``F.conv2d`` (fp32 and bf16 autocast, values and gradients), that ``torch.compile`` traces it in
place of the convolution, that eager calls keep the convolution, and which convolutions switch.
The GPU timing is ``docs/perf/depthwise_conv_bench.py``'s ``nhwc-shifted-compile`` path."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from fp8vit.blocks.depthwise import (ShiftedDepthwiseConv2d, depthwise_convs, depthwise_shifted,
                                     set_depthwise_shifts)

CASES = [  # (channels, size, kernel, stride, padding): ViTamin's 3x3 at both strides, odd shapes
    (16, 14, 3, 1, 1), (16, 14, 3, 2, 1), (8, 9, 3, 2, 1), (8, 7, (1, 3), 1, (0, 1)), (4, 6, 3, 1, 0),
]


def _conv(c, k, stride, padding, bias=True):
    torch.manual_seed(0)
    return nn.Conv2d(c, c, k, stride=stride, padding=padding, groups=c, bias=bias)


@pytest.mark.parametrize("c,size,k,stride,padding", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_equals_the_convolution_and_its_gradients_in_fp32(c, size, k, stride, padding, bias):
    conv = _conv(c, k, stride, padding, bias)
    x = torch.randn(2, c, size, size + 1).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    ref = conv(x)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, [x] + list(conv.parameters()), g)
    out = depthwise_shifted(x, conv.weight, conv.bias, conv.stride, conv.padding)
    grads = torch.autograd.grad(out, [x] + list(conv.parameters()), g)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("c,size,k,stride,padding", CASES[:3])
def test_under_bf16_autocast_it_computes_as_autocasts_convolution(c, size, k, stride, padding):
    # autocast rounds input and weight to bf16 and returns bf16; the products sum in fp32 in both
    conv = _conv(c, k, stride, padding)
    x = torch.randn(2, c, size, size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = conv(x)
        out = depthwise_shifted(x, conv.weight, conv.bias, conv.stride, conv.padding)
    assert ref.dtype == out.dtype == torch.bfloat16
    # one bf16 rounding of fp32 sums taken in another order: at most one bf16 step apart
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-6)


def test_compile_traces_the_shifted_products_and_eager_keeps_the_convolution():
    conv = _conv(16, 3, 2, 1)
    shifted = copy.deepcopy(conv)
    assert set_depthwise_shifts(nn.Sequential(shifted)) == ["0"] and type(shifted) is ShiftedDepthwiseConv2d
    ops = []

    def backend(gm, example_inputs):  # the ops dynamo hands to the compiler
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    x = torch.randn(2, 16, 14, 14, requires_grad=True)
    out = torch.compile(shifted, backend=backend, fullgraph=True)(x)
    assert ops and not any("conv" in op for op in ops), ops
    torch.testing.assert_close(out, conv(x), rtol=1e-5, atol=1e-5)
    ops.clear()
    torch.compile(conv, backend=backend, fullgraph=True)(x)
    assert any("conv2d" in op for op in ops), ops  # the check above can fail: a plain Conv2d shows
    # eager: the convolution itself (one kernel), bit for bit
    torch.testing.assert_close(shifted(x), conv(x), rtol=0, atol=0)


def test_compiled_model_trains_like_timm():
    torch.manual_seed(0)
    model = timm.create_model("vitamin_small_224", img_size=64, num_classes=10).train()
    switched = copy.deepcopy(model)
    names = set_depthwise_shifts(switched)
    assert len(names) == 6 and all(n.endswith("conv2_kxk") for n in names)
    x = torch.randn(2, 3, 64, 64)
    ref = model.patch_embed(x)
    out = torch.compile(switched.patch_embed, backend="aot_eager")(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, p), q in zip(model.patch_embed.named_parameters(), switched.patch_embed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-5, msg=name)
    assert set(switched.state_dict()) == set(model.state_dict())


def test_which_convolutions_switch_and_back():
    model = nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1, groups=8),             # depthwise 3x3: switches
        nn.Conv2d(8, 8, 7, padding=3, groups=8),             # 49 taps: larger than measured
        nn.Conv2d(8, 16, 3, padding=1, groups=8),            # channel multiplier 2
        nn.Conv2d(8, 8, 3, padding=1),                       # dense
        nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8),  # dilated
        nn.Conv2d(8, 8, 3, padding="same", groups=8),        # padding given as a string
        nn.Conv2d(8, 8, 3, padding=1, groups=8, padding_mode="reflect"),
    )
    assert depthwise_convs(model) == ["0"]
    assert set_depthwise_shifts(model) == ["0"] and type(model[0]) is ShiftedDepthwiseConv2d
    assert set_depthwise_shifts(model, False) == ["0"] and type(model[0]) is nn.Conv2d
    assert all(type(m) is nn.Conv2d for m in model)
