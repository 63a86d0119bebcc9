"""TE_BeitBlock against timm's BEiT ``Block`` on the reference backend (CPU, fp32): output and every
gradient (the relative position bias table's included), exact weights both ways, the model's shared
bias, and the refusals. The family's public API (conversion, pickling, checkpoints, FSDP2) runs in
test_families_api.py and test_distributed_families.py (``helpers.FAMILY_MODELS["beit"]``)."""

import copy

import pytest
import torch
from timm.models.beit import Beit, Block
from torch import nn

import fp8vit
from fp8vit.blocks.beit import TE_BeitBlock
from helpers import assert_matches_timm_on_cpu, max_rel_err

# Each a 4 x 4 window of patches and the class token: 17 tokens, as assert_matches_timm_on_cpu feeds.
CASES = {
    "beit": dict(qkv_bias=True, window_size=(4, 4), init_values=0.1),  # BEiT-B: q/v biases, a table, LayerScale
    "no_table": dict(qkv_bias=True, window_size=None),  # the shared bias's blocks, or BEiT without one
    "swiglu": dict(qkv_bias=False, window_size=(4, 4), swiglu_mlp=True, scale_mlp=True, init_values=0.1),
    "plain": dict(qkv_bias=False, window_size=(4, 4)),  # no q/v biases, no LayerScale
}


def _block(kw):
    torch.manual_seed(0)
    block = Block(64, 4, **kw).eval()
    with torch.no_grad():  # timm zero-inits the table and the biases: make every tensor count
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return block


def _te(block):
    return TE_BeitBlock.from_timm(block, backend="reference", exact_gelu=True)  # BEiT's GELU is erf


@pytest.mark.parametrize("kernel", ["te", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_block_matches_timm(case, kernel):
    block = _block(CASES[case])
    te = _te(block)
    te.bias_attention = kernel  # "torch": SDPA with the bias broadcast, instead of TE's post_scale_bias
    assert_matches_timm_on_cpu(block, te)


@pytest.mark.parametrize("case", list(CASES))
def test_weights_round_trip_bit_exact(case):
    block = _block(CASES[case])
    back = _te(block).to_timm()
    assert type(back) is Block
    want, got = block.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    for name in ("k_bias", "relative_position_index"):  # not saved: rebuilt as timm builds them
        a, b = getattr(block.attn, name), getattr(back.attn, name)
        assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("own", [True, False], ids=["own_and_shared", "shared_only"])
def test_model_with_a_shared_bias_matches_timm(own):
    # Beit(use_shared_rel_pos_bias=True) hands every block one [H, N, N] bias; blocks with a table of
    # their own add both (timm's Attention)
    torch.manual_seed(0)
    model = Beit(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5,
                 use_shared_rel_pos_bias=True, use_rel_pos_bias=own, init_values=0.1).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    te = fp8vit.convert_to_te(copy.deepcopy(model), backend="reference", exact_gelu=True)
    assert {type(b) for b in te.blocks} == {TE_BeitBlock}
    x = torch.randn(2, 3, 32, 32)
    ref, out = model(x), te(x)
    assert max_rel_err(ref, out) < 1e-5
    ref.square().sum().backward()
    out.square().sum().backward()
    shared = "rel_pos_bias.relative_position_bias_table"
    torch.testing.assert_close(dict(te.named_parameters())[shared].grad, dict(model.named_parameters())[shared].grad,
                               rtol=1e-4, atol=1e-6)
    if own:
        for b, tb in zip(model.blocks, te.blocks):
            torch.testing.assert_close(tb.relative_position_bias_table.grad, b.attn.relative_position_bias_table.grad,
                                       rtol=1e-4, atol=1e-6)


def test_other_token_counts_are_refused_with_the_numbers():
    te = _te(_block(CASES["beit"]))
    with pytest.raises(ValueError, match=r"x has 10 tokens.*covers 17 \(window \(4, 4\)"):
        te(torch.randn(2, 10, 64))
    with pytest.raises(ValueError, match=r"shared_rel_pos_bias of shape \(4, 9, 9\) for x with 17 tokens"):
        te(torch.randn(2, 17, 64), shared_rel_pos_bias=torch.zeros(4, 9, 9))


def test_refusals_are_named():
    block = _block(CASES["beit"])
    block.attn.qkv.bias = nn.Parameter(torch.zeros(192))  # a bias on the qkv Linear itself: not timm's BEiT
    with pytest.raises(ValueError, match="attn.qkv Linear has a bias of its own"):
        _te(block)
    block = _block(CASES["beit"])
    block.norm2 = nn.LayerNorm(64, eps=1e-3)
    with pytest.raises(ValueError, match=r"norm1 .* and norm2 .* that differ"):
        _te(block)


def test_set_input_size_resizes_the_tables_as_timm_does():
    # timm's Beit.set_input_size calls blk.attn.set_window_size on every block: the converted model
    # resamples its tables as timm's does, and converts back at the new size
    torch.manual_seed(0)
    model = Beit(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5,
                 use_rel_pos_bias=True, init_values=0.1).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    te = fp8vit.convert_to_te(copy.deepcopy(model), backend="reference", exact_gelu=True)
    for net in (model, te):
        net.set_input_size(img_size=(48, 48))
    x = torch.randn(2, 3, 48, 48)
    assert te.blocks[0].cfg.window_size == (6, 6)
    assert max_rel_err(model(x), te(x)) < 1e-5
    back = fp8vit.convert_from_te(te)
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
