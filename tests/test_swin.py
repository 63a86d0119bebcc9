"""TE_SwinBlock against timm's ``SwinTransformerBlock`` on the reference backend (CPU, fp32): output
and every gradient (the relative position bias tables' included) for shifted and unshifted
windows, train mode with drop path on the same random draws, a whole Swin model, exact weights
both ways, checkpointing, MLP recompute, pickling, and the refusals."""

import copy
import io
import pickle

import pytest
import timm
import torch
from timm.models.swin_transformer import SwinTransformerBlock

import fp8vit
from fp8vit.blocks.swin import TE_SwinBlock, shift_mask
from fp8vit.blocks.weights import te_to_timm
from helpers import assert_model_matches_timm, max_rel_err, perturbed

# (input resolution, window, shift): a 8 x 8 map in 4 x 4 windows shifted by 2 (4 windows, each its
# own mask kind), the same unshifted, a 12 x 8 map (6 windows: 4 kinds), one window (no shift), and
# maps the window does not divide (timm pads them after norm1), shifted and not.
CASES = {
    "shifted": ((8, 8), 4, 2),
    "unshifted": ((8, 8), 4, 0),
    "shifted_12x8": ((12, 8), 4, 2),
    "one_window": ((4, 4), 4, 0),
    "padded_shifted": ((10, 7), 4, 2),
    "padded": ((10, 7), 4, 0),
}


def _block(res, window, shift, drop_path=0.0, qkv_bias=True):
    torch.manual_seed(0)
    block = SwinTransformerBlock(32, res, num_heads=2, window_size=window, shift_size=shift,
                                 drop_path=drop_path, qkv_bias=qkv_bias).eval()
    with torch.no_grad():  # every tensor away from its init value, so that a tensor mapped wrong shows
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return block


def _te(block):
    return TE_SwinBlock.from_timm(block, backend="reference", exact_gelu=True)  # Swin's GELU is erf


def _assert_block_matches(block, te, train=False, dtype=torch.float32):
    res = block.input_resolution
    block.to(dtype), te.to(dtype)
    x = torch.randn(3, *res, 32, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    block.train(train), te.train(train)
    torch.manual_seed(7)
    y = block(x)
    torch.manual_seed(7)  # the same drop-path draws
    y2 = te(x2)
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g), y2.backward(g)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)
    grads = te_to_timm({k: p.grad for k, p in te.named_parameters()}, te.cfg)
    assert grads.keys() == dict(block.named_parameters()).keys()
    for k, p in block.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("kernel", ["te", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_block_matches_timm(case, kernel):
    # bias_attention "torch": torch's SDPA with the per-kind bias broadcast over the windows (its
    # gradient summed by autograd) instead of TE's post_scale_bias
    block = _block(*CASES[case])
    te = _te(block)
    te.bias_attention = kernel
    _assert_block_matches(block, te)


@pytest.mark.parametrize("kernel", ["torch", "te"])
def test_v2_block_with_the_torch_bias_kernel_matches_timm(kernel):
    block = _v2_block(*CASES["padded_shifted"], drop_path=0.5)
    te = fp8vit.TE_SwinV2Block.from_timm(block, backend="reference", exact_gelu=True)
    te.bias_attention = kernel
    _assert_block_matches(block, te, train=True, dtype=torch.float64)


@pytest.mark.parametrize("case", ["unshifted", "shifted"])
def test_torch_bias_kernel_gets_a_bias_it_reads_in_place(case, monkeypatch):
    # SDPA pads (copies) a bias whose strides are not multiples of 8, and given the batch-expanded
    # bias that is the whole [B, H, N, M8] per call; a permuted (non-contiguous) bias sends CUDA's
    # SDPA to its fp32 math kernel (H200 Swin-B: 116 ms/step, 69 with a contiguous bias). The block
    # hands it one [1, H, N, M] view with aligned strides; the block still matches timm
    # (test_block_matches_timm[torch]).
    import fp8vit.blocks.base as base
    masks, sdpa = [], base.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        masks.append(attn_mask)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(base.F, "scaled_dot_product_attention", spy)
    te = _te(_block(*CASES[case]))
    te.bias_attention = "torch"
    te(torch.randn(2, 8, 8, 32)).sum().backward()
    assert masks, "SDPA was not called"
    for m in masks:
        assert m.shape[0] == 1 and m.stride(-1) == 1, (m.shape, m.stride())
        assert all(s % 16 == 0 for s in m.stride()[:-1]), m.stride()
    assert te.relative_position_bias_table.grad is not None and te.relative_position_bias_table.grad.abs().sum() > 0


def test_unknown_bias_attention_is_named():
    te = _te(_block(*CASES["shifted"]))
    te.bias_attention = "cudnn"
    with pytest.raises(ValueError, match="TE_SwinBlock.bias_attention='cudnn': expected 'te' or 'torch'"):
        te(torch.randn(1, 8, 8, 32))


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_block_in_train_mode_with_drop_path_matches_timm(qkv_bias):
    # one draw per image, as timm's, on window-major tokens: the same images dropped
    block = _block(*CASES["shifted"], drop_path=0.5, qkv_bias=qkv_bias)
    _assert_block_matches(block, _te(block), train=True)


def test_windows_of_one_mask_kind_share_one_attention_call():
    te = _te(_block(*CASES["shifted_12x8"]))
    plan = te._windows(12, 8, torch.device("cpu"))
    mask = shift_mask(12, 8, (4, 4), (2, 2))  # [6, 16, 16], timm's windows in timm's order
    # 3 x 2 windows, 4 kinds: interior (2), right column (2), bottom row (1), corner (1)
    assert sorted(plan.sizes) == [1, 1, 2, 2] and len(plan.masks) == 4
    # every window slot's mask is its kind's, and every position is in exactly one window slot
    kind = torch.repeat_interleave(torch.arange(4), torch.tensor(plan.sizes))
    rows, cols = plan.pos // 8, plan.pos % 8
    for slot in range(6):  # its first token sits at the window's corner of the shifted map
        timm_window = ((rows[slot, 0] - 2) % 12 // 4) * 2 + (cols[slot, 0] - 2) % 8 // 4
        assert torch.equal(plan.masks[kind[slot]], mask[timm_window]), slot
    assert torch.equal(torch.sort(plan.pos.reshape(-1)).values, torch.arange(96))
    assert torch.equal(plan.pos[plan.inv_window, plan.inv_token], torch.arange(96))
    assert _te(_block(*CASES["unshifted"]))._windows(8, 8, torch.device("cpu")).sizes == (4,)
    # one plan per map, window, shift and device, shared by the blocks that have them
    assert _te(_block(*CASES["shifted_12x8"]))._windows(12, 8, torch.device("cpu")) is plan


@pytest.mark.parametrize("case", list(CASES))
def test_weights_round_trip_bit_exact(case):
    block = _block(*CASES[case])
    back = _te(block).to_timm()
    assert type(back) is SwinTransformerBlock
    want, got = block.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    # not saved: rebuilt as timm builds them
    assert torch.equal(block.attn.relative_position_index, back.attn.relative_position_index)
    assert (block.attn_mask is None and back.attn_mask is None) or torch.equal(block.attn_mask, back.attn_mask)


def _swin(drop_path_rate=0.0):
    torch.manual_seed(0)
    return perturbed(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, patch_size=4,
                                       window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=5,
                                       drop_path_rate=drop_path_rate))


def _convert(model, **kw):
    return fp8vit.convert_to_te(model, backend="reference", exact_gelu=True, **kw)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train_drop_path"])
def test_swin_model_matches_timm(train):
    ref = _swin(drop_path_rate=0.3)
    model = _convert(copy.deepcopy(ref))
    summary = fp8vit.conversion_summary(model)
    assert summary.fused == (("TE_SwinBlock", ("layers.0.blocks.0", "layers.0.blocks.1", "layers.1.blocks.0",
                                               "layers.1.blocks.1")),)
    assert model.layers[0].blocks[1].cfg.shift_size == (2, 2) and model.layers[1].blocks[1].cfg.shift_size == (0, 0)
    assert_model_matches_timm(ref, model, torch.randn(2, 3, 32, 32), train)


def test_convert_round_trip_and_pickles_keep_the_model():
    ref = _swin()
    model = _convert(copy.deepcopy(ref))
    x = torch.randn(2, 3, 32, 32)
    out = model(x)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(copied(x), out)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    fresh = _convert(copy.deepcopy(ref))
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert torch.equal(fresh(x), out)
    back = fp8vit.convert_from_te(model)
    assert all(type(b) is SwinTransformerBlock for s in back.layers for b in s.blocks)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ref.state_dict().values()))
    torch.testing.assert_close(back(x), ref(x), rtol=0, atol=0)


@pytest.mark.parametrize("how", ["grad_checkpointing", "mlp_recompute"])
def test_recompute_gives_the_same_gradients(how):
    plain, model = _convert(_swin()), _convert(_swin())
    if how == "grad_checkpointing":
        model.set_grad_checkpointing(True)
        assert all(b.grad_checkpointing for s in model.layers for b in s.blocks)
        assert not any(s.grad_checkpointing for s in model.layers)  # timm's checkpoint_seq stays off
    else:
        fp8vit.set_mlp_recompute(model)
        assert all(b.recompute_mlp for s in model.layers for b in s.blocks)
    x = torch.randn(2, 3, 32, 32)
    for m in (plain, model):
        m.train()(x).square().sum().backward()
    for (n, p), q in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_set_block_fp8_by_stage():
    model = _convert(_swin())
    assert fp8vit.set_block_fp8(model, "layers.1", False) == ["layers.1"]
    assert [b.fp8_enabled for s in model.layers for b in s.blocks] == [True, True, False, False]


def test_padded_maps_match_timm_in_a_model():
    # 48 px in 8 x 8 windows: stage 1's 12 x 12 map padded to 16 x 16 (shifted by 4 in its second
    # block), stage 2's 6 x 6 in one clipped window
    torch.manual_seed(0)
    ref = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=48, patch_size=4,
                            window_size=8, embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=5).eval()
    model = _convert(copy.deepcopy(ref))
    assert fp8vit.conversion_summary(model).num_fused == 4
    assert model.layers[0].blocks[0]._windows(12, 12, torch.device("cpu")).padded is not None
    assert_model_matches_timm(ref, model, torch.randn(2, 3, 48, 48), train=False)


def test_bad_input_is_refused_with_the_shape():
    te = _te(_block(*CASES["shifted"]))
    with pytest.raises(ValueError, match=r"expects x of shape \[B, H, W, 32\], got \(1, 64, 32\)"):
        te(torch.randn(1, 64, 32))
    block = _block(*CASES["shifted"])
    block.attn.scale = 0.5
    with pytest.raises(ValueError, match=r"attention scale 0.5 is not head_dim \*\* -0.5"):
        _te(block)


def test_set_input_size_resizes_as_timm_and_refuses_a_map_the_window_does_not_divide():
    # 48 px: timm picks 6 x 6 windows for the 12 x 12 and 6 x 6 maps (shift 3, then none) and
    # resamples the tables; the converted model follows and converts back at the new size
    ref = _swin()
    model = _convert(copy.deepcopy(ref))
    ref.set_input_size(img_size=(48, 48)), model.set_input_size(img_size=(48, 48))
    blk = model.layers[0].blocks[1]
    assert blk.cfg.window_size == (6, 6) and blk.cfg.shift_size == (3, 3)
    assert blk.relative_position_bias_table.shape == ref.layers[0].blocks[1].attn.relative_position_bias_table.shape
    x = torch.randn(2, 3, 48, 48)
    assert max_rel_err(ref(x), model(x)) < 1e-5
    back = fp8vit.convert_from_te(model)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ref.state_dict().values()))
    # 4 x 4 windows on 40 px (10 x 10, then 5 x 5 maps): padded as timm pads
    ref, model = _swin(), _convert(_swin())
    ref.set_input_size(img_size=(40, 40), window_size=4), model.set_input_size(img_size=(40, 40), window_size=4)
    x = torch.randn(2, 3, 40, 40)
    assert model.layers[0].blocks[0].input_resolution == (10, 10)
    assert max_rel_err(ref(x), model(x)) < 1e-5


# ------------------------------------------------------------------ Swin V2: TE_SwinV2Block
def _v2_block(res, window, shift, drop_path=0.0, qkv_bias=True):
    from timm.models.swin_transformer_v2 import SwinTransformerV2Block
    torch.manual_seed(0)
    return perturbed(SwinTransformerV2Block(32, res, num_heads=2, window_size=window, shift_size=shift,
                                            drop_path=drop_path, qkv_bias=qkv_bias))


@pytest.mark.parametrize("case", list(CASES))
def test_v2_block_matches_timm(case):
    # post-norm branches, cosine attention with the per-head logit scale, the bias MLP's
    # 16 sigmoid(cpb_mlp(coords)) and its gradient, the shift masks and padding as Swin V1's
    # In float64: in fp32 the two orders of summation differ by up to 1.3e-6 of a gradient's largest
    # entry (measured), more than the elementwise 1e-4 / 1e-5 allows on its small entries (cosine
    # attention's normalization, the bias MLP's sigmoid); in float64 by 2.5e-15.
    block = _v2_block(*CASES[case])
    te = fp8vit.TE_SwinV2Block.from_timm(block, backend="reference", exact_gelu=True)
    _assert_block_matches(block, te, dtype=torch.float64)


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_v2_block_in_train_mode_with_drop_path_matches_timm(qkv_bias):
    block = _v2_block(*CASES["shifted"], drop_path=0.5, qkv_bias=qkv_bias)
    te = fp8vit.TE_SwinV2Block.from_timm(block, backend="reference", exact_gelu=True)
    _assert_block_matches(block, te, train=True, dtype=torch.float64)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train_drop_path"])
def test_swin_v2_model_matches_timm_and_round_trips(train):
    ref = perturbed(timm.create_model("swinv2_tiny_window8_256", pretrained=False, img_size=64, window_size=4,
                                      embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=5,
                                      drop_path_rate=0.3))
    model = _convert(copy.deepcopy(ref))
    assert fp8vit.conversion_summary(model).num_fused == 4
    assert_model_matches_timm(ref, model, torch.randn(2, 3, 64, 64), train)
    back = fp8vit.convert_from_te(model)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ref.state_dict().values()))
