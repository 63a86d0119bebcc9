"""TE_ConvNeXtBlock against timm's ``ConvNeXtBlock`` on the reference backend (CPU, fp32): output and
every gradient, train mode with drop path on the same random draws, a whole ConvNeXt, exact
weights both ways, channels-last outputs, checkpointing, MLP recompute, pickling, the refusals."""

import copy
import pickle

import pytest
import timm
import torch
from timm.models.convnext import ConvNeXtBlock

import fp8vit
from fp8vit.blocks.convnext import TE_ConvNeXtBlock
from fp8vit.blocks.weights import te_to_timm
from helpers import assert_model_matches_timm, max_rel_err, perturbed


def _block(drop_path=0.0, ls_init_value=1e-6, conv_bias=True):
    torch.manual_seed(0)
    block = ConvNeXtBlock(32, drop_path=drop_path, ls_init_value=ls_init_value, conv_bias=conv_bias).eval()
    with torch.no_grad():  # every tensor away from its init value (gamma's 1e-6 too)
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return block


def _te(block):
    return TE_ConvNeXtBlock.from_timm(block, backend="reference", exact_gelu=True)  # timm's GELU is erf


@pytest.mark.parametrize("kw", [{}, dict(ls_init_value=None, conv_bias=False), dict(drop_path=0.5)],
                         ids=["convnext", "no_gamma_no_conv_bias", "train_drop_path"])
def test_block_matches_timm(kw):
    block = _block(**kw)
    te = _te(block)
    train = "drop_path" in kw
    block.train(train), te.train(train)
    x = torch.randn(3, 32, 6, 5, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    torch.manual_seed(7)
    y = block(x)
    torch.manual_seed(7)  # the same drop-path draws (one per image, as timm's)
    y2 = te(x2)
    assert y2.shape == y.shape and y2.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g), y2.backward(g)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)
    grads = te_to_timm({k: p.grad for k, p in te.named_parameters()}, te.cfg)
    assert grads.keys() == dict(block.named_parameters()).keys() and len(grads) >= 7
    for k, p in block.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-5, msg=k)


def test_depthwise_conv_gets_channels_last_input():
    # NCHW input (a stage's first block) goes channels-last before the depthwise conv: on NCHW bf16,
    # torch's CUDA depthwise conv is its generic kernel, ~7x slower than cuDNN's NHWC one (H200)
    te = _te(_block())
    seen = []
    te.conv_dw.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    x = torch.randn(2, 32, 6, 5)
    assert x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    y = te(x)
    assert seen == [True]
    torch.testing.assert_close(te(x.contiguous(memory_format=torch.channels_last)), y, rtol=0, atol=0)


def test_weights_round_trip_bit_exact():
    block = _block()
    back = _te(block).to_timm()
    assert type(back) is ConvNeXtBlock
    want, got = block.state_dict(), back.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def _convnext(drop_path_rate=0.0):
    torch.manual_seed(0)
    return perturbed(timm.create_model("convnext_tiny", pretrained=False, depths=(2, 1, 1, 1), dims=(32, 48, 64, 80),
                                       num_classes=5, drop_path_rate=drop_path_rate))


def _convert(model, **kw):
    return fp8vit.convert_to_te(model, backend="reference", exact_gelu=True, **kw)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train_drop_path"])
def test_convnext_model_matches_timm(train):
    ref = _convnext(drop_path_rate=0.3)
    model = _convert(copy.deepcopy(ref))
    assert fp8vit.conversion_summary(model).fused == (
        ("TE_ConvNeXtBlock", ("stages.0.blocks.0", "stages.0.blocks.1", "stages.1.blocks.0", "stages.2.blocks.0",
                              "stages.3.blocks.0")),)
    assert_model_matches_timm(ref, model, torch.randn(2, 3, 64, 64), train)


def test_round_trip_pickles_and_features():
    ref = _convnext()
    model = _convert(copy.deepcopy(ref))
    x = torch.randn(2, 3, 64, 64)
    out = model(x)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(copied(x), out)
    feats, ref_feats = model.forward_intermediates(x)[1], ref.forward_intermediates(x)[1]
    assert all(max_rel_err(a, b) < 1e-5 for a, b in zip(ref_feats, feats))
    back = fp8vit.convert_from_te(model)
    assert all(type(b) is ConvNeXtBlock for s in back.stages for b in s.blocks)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ref.state_dict().values()))


@pytest.mark.parametrize("how", ["grad_checkpointing", "mlp_recompute"])
def test_recompute_gives_the_same_gradients(how):
    plain, model = _convert(_convnext()), _convert(_convnext())
    if how == "grad_checkpointing":
        model.set_grad_checkpointing(True)
        assert all(b.grad_checkpointing for s in model.stages for b in s.blocks)
    else:
        fp8vit.set_mlp_recompute(model)
    x = torch.randn(2, 3, 64, 64)
    for m in (plain, model):
        m.train()(x).square().sum().backward()
    for (n, p), q in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_refusals_are_named():
    with pytest.raises(ValueError, match=r"conv_mlp=True \(1x1-convolution MLP"):
        _te(ConvNeXtBlock(32, conv_mlp=True))
    with pytest.raises(ValueError, match=r"Downsample shortcut"):
        _te(ConvNeXtBlock(32, out_chs=64))
    with pytest.raises(ValueError, match=r"GlobalResponseNormMlp"):
        _te(ConvNeXtBlock(32, use_grn=True))
    model = timm.create_model("convnext_nano", pretrained=False, num_classes=5)  # conv_mlp=True: kept
    with pytest.warns(UserWarning, match="holds nothing fp8vit can convert"):
        _convert(model)
    with pytest.raises(ValueError, match=r"blocks sit in stages: convert_to_te\(model, cuda_graphs=True\)"):
        fp8vit.make_graphed_blocks(_convert(_convnext()), 2)
    te = _te(_block())
    with pytest.raises(ValueError, match=r"expects x of shape \[B, 32, H, W\], got \(2, 16, 32\)"):
        te(torch.randn(2, 16, 32))
