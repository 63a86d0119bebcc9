"""fp8vit.blocks.mlp on the reference backend: every timm MLP kind on a classic Block against timm.

fp32 on CPU, where the reference modules compute what timm computes in another order: outputs and
gradients agree to 1e-5 relative, weights round-trip bit for bit. The padded cases (hidden 170,
not a multiple of 16) also check that the padded units contribute nothing and get exactly zero
gradients. The same comparisons with TE's kernels are in tests/gpu/test_mlp_gpu.py.
"""

import functools
import os
import subprocess
import sys
import warnings

import pytest
import timm
import torch
from timm.layers import GatedMlp, GluMlp, Mlp, SwiGLU
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

import fp8vit
from fp8vit.blocks.config import BlockConfig
from fp8vit.blocks.mlp import (HIDDEN_MULTIPLE, build_mlp, mlp_config_from_kwargs, mlp_config_from_timm, mlp_ties,
                        torch_norm)
from fp8vit.blocks.weights import te_to_timm, timm_to_te
from helpers import MLP_CASES, PADDED_MLP_CASES, assert_matches_timm_on_cpu, block_pair, padded_masks

pytestmark = pytest.mark.filterwarnings("ignore:fp8vit. timm's exact")


def _pair(case, dim=64):
    return block_pair(MLP_CASES[case], backend="reference", dim=dim)


@pytest.mark.parametrize("case", list(MLP_CASES))
def test_forward_and_grads_match_timm(case):
    assert_matches_timm_on_cpu(*_pair(case))


@pytest.mark.parametrize("case", list(MLP_CASES))
def test_weights_round_trip_exactly(case):
    block, te = _pair(case)
    sd = block.state_dict()
    back = te_to_timm(timm_to_te(sd, te.cfg), te.cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    rebuilt = te.to_timm()
    assert type(rebuilt.mlp) is type(block.mlp) and getattr(rebuilt.mlp, "gate_last", None) == getattr(
        block.mlp, "gate_last", None)
    again = rebuilt.state_dict()
    assert again.keys() == sd.keys() and all(torch.equal(again[k], sd[k]) for k in sd)
    assert fp8vit.TE_Block.from_timm(rebuilt, exact_gelu=MLP_CASES[case].get("exact_gelu", False),
                                     backend="reference").cfg.mlp == te.cfg.mlp


def test_fused_or_unfused_per_kind():
    # Fused = one TE LayerNormMLP with the kernel named; the rest runs unfused (exact).
    expected = {
        "swiglu": "swiglu", "swiglu_no_bias_rms": "swiglu", "swiglu_align_to": "swiglu",
        "glu_sigmoid": "glu", "glu_sigmoid_gate_first": "glu", "glu_silu_packed": "swiglu",
        "glu_gelu_tanh": "geglu", "geglu_mlp": "geglu", "swiglu_padded": "swiglu",
        "glu_sigmoid_padded": "glu", "mlp_gelu_padded": "gelu",
    }
    for case in MLP_CASES:
        _, te = _pair(case)
        fused = case in expected
        assert te.cfg.fused_mlp == fused, case
        assert isinstance(te.mlp, fp8vit.blocks.reference.LayerNormMLP) == fused, case
        if fused:
            assert te.mlp.activation == expected[case], case
    assert _pair("geglu_mlp")[1].norm2 is not None  # two norms in a row: the block's runs in torch


def test_unfused_gated_mlps_run_te_kernels_only_where_exact():
    # Unfused (norm or dropout inside): the gated activation still runs in TE's kernel where that
    # kernel is timm's activation exactly; an erf GELU and Mish run in torch.
    expected = {"swiglu_norm_padded": "swiglu", "glu_relu_norm": "reglu", "glu_gelu_exact": None,
                "glu_mish_unfused": None, "geglu_mlp_exact": None, "beit3": None}
    for case, kernel in expected.items():
        _, te = _pair(case)
        assert not te.cfg.fused_mlp and te.cfg.mlp.te_activation == kernel, (case, te.cfg.mlp.te_activation)
        assert (te.mlp.gated_act is not None) == (kernel is not None), case


def test_gate_comes_first_in_te_fc1():
    # TE activates the first half of fc1: timm's gate rows must be there, whatever timm's order.
    for case, gate in (("swiglu", "mlp.fc1_g.weight"), ("geglu_mlp", "mlp.w0.weight")):
        block, te = _pair(case)
        H = te.cfg.mlp.hidden
        assert torch.equal(te.mlp.fc1_weight[:H], block.state_dict()[gate]), case
    block, te = _pair("glu_sigmoid")  # gate_last=True: timm's gate is its second half
    H = te.cfg.mlp.hidden
    assert torch.equal(te.mlp.fc1_weight[:H], block.mlp.fc1.weight[H:])
    block, te = _pair("glu_silu_packed")  # gate_last=False: already first
    assert torch.equal(te.mlp.fc1_weight[:H * 2], block.mlp.fc1.weight)


@pytest.mark.parametrize("case", PADDED_MLP_CASES)
def test_padded_units_stay_zero_under_adamw(case):
    block, te = _pair(case)
    c = te.cfg.mlp
    assert c.hidden == 170 and c.hidden_padded == 176 and c.hidden_padded % HIDDEN_MULTIPLE == 0
    pads = padded_masks(te)
    params = dict(te.mlp.named_parameters())
    assert pads and all(torch.count_nonzero(params[k][m]) == 0 for k, m in pads.items())
    opt = torch.optim.AdamW(te.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        te(torch.randn(2, 9, 64)).square().mean().backward()
        for k, m in pads.items():
            assert torch.count_nonzero(params[k].grad[m]) == 0, k  # exactly zero, not just small
        opt.step()
        opt.zero_grad()
    for k, m in pads.items():
        assert torch.count_nonzero(params[k][m]) == 0, k
    te_to_timm(te.state_dict(), te.cfg)  # and it still converts: the padding is zero


def test_padded_inner_norm_counts_the_real_units_only():
    # The norm before fc2 over 170 real units, not 176: fp8vit runs it in torch on the real units.
    _, te = _pair("swiglu_norm_padded")
    assert te.mlp.norm.normalized_shape == (170,) and te.mlp.fc2.weight.shape == (64, 176)
    _, unpadded = _pair("swiglu_norm")
    assert unpadded.mlp.norm is None and hasattr(unpadded.mlp.fc2, "layer_norm_weight")  # fused into fc2


def test_eva02_large_width_2730_pads_to_2736():
    torch.manual_seed(0)
    block = Block(1024, 16, mlp_ratio=2730 / 1024, mlp_layer=SwiGLU, act_layer=nn.SiLU, scale_mlp_norm=True,
                  norm_layer=functools.partial(nn.LayerNorm, eps=1e-6)).eval()
    te = fp8vit.TE_Block.from_timm(block, backend="reference")
    assert te.cfg.mlp.hidden == 2730 and te.mlp.fc1.weight.shape == (2 * 2736, 1024)
    x = torch.randn(2, 5, 1024)
    torch.testing.assert_close(te(x), block(x), rtol=1e-5, atol=1e-5)
    back = te.to_timm().state_dict()
    assert all(torch.equal(back[k], v) for k, v in block.state_dict().items())


def test_nonzero_padding_is_refused_on_the_way_back():
    _, te = _pair("swiglu_padded")
    sd = dict(te.state_dict())
    sd["mlp.fc2_weight"] = sd["mlp.fc2_weight"].clone()
    sd["mlp.fc2_weight"][0, -1] = 1.0
    with pytest.raises(ValueError, match=r"padding of mlp.fc2_weight .*not zero"):
        te_to_timm(sd, te.cfg)


def test_reset_parameters_keeps_the_padding_zero():
    # Model-level init functions (EVA's apply(_init_weights), timm's needs_reset) call each TE
    # module's reset_parameters: the padded modules' init methods keep the padding zero.
    for case in ("swiglu_padded", "swiglu_norm_padded", "mlp_sigmoid_padded"):
        _, te = _pair(case)
        for m in te.mlp.modules():
            if hasattr(m, "reset_parameters") and not isinstance(m, (nn.SiLU, nn.Sigmoid)):
                m.reset_parameters()
        params = dict(te.mlp.named_parameters())
        for k, m in padded_masks(te).items():
            assert torch.count_nonzero(params[k][m]) == 0, (case, k)
        assert float(params["fc1_weight" if te.cfg.fused_mlp else "fc1.weight"].detach().std()) > 0.01


@pytest.mark.parametrize("case", ["swiglu", "glu_sigmoid", "glu_silu_packed", "swiglu_padded"])
@pytest.mark.parametrize("mode", ["", "jax"])
def test_init_weights_follows_timm_glu_init(case, mode):
    # timm's ViT init calls GluMlp/SwiGLU.init_weights after the Linears: the gate's weights ~0
    # (std 1e-6) and its biases 1 (GluMlp: fc1's second half, whichever half the gate is).
    kw = dict(MLP_CASES[case])
    kw.pop("exact_gelu", None)
    model_kw = dict(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4, num_classes=5,
                    weight_init=mode, **kw)
    torch.manual_seed(0)
    ref = VisionTransformer(**model_kw)
    torch.manual_seed(0)
    te = VisionTransformer(block_fn=functools.partial(fp8vit.TE_Block, backend="reference"), **model_kw)
    for a, b in zip(ref.blocks, te.blocks):
        got = te_to_timm(b.state_dict(), b.cfg)  # raises if the init left padding non-zero
        for name, t in a.state_dict().items():
            g = got[name]
            assert g.shape == t.shape, name
            if float(t.std()) == 0 if t.numel() > 1 else True:
                torch.testing.assert_close(g, t, msg=name)
            else:
                sa, sb = float(t.std()), float(g.std())
                assert abs(sb / sa - 1) < (0.15 if t.dim() == 2 else 0.6), (name, mode, sa, sb)
        H = b.cfg.mlp.hidden
        gate = got["mlp.fc1_g.weight"] if case.startswith("swiglu") else got["mlp.fc1.weight"][H:]
        assert float(gate.std()) < 1e-5


def test_frozen_halves_must_agree():
    block, _ = _pair("swiglu")
    block.mlp.fc1_g.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"mlp.fc1_g.weight.*mlp.fc1_x.weight.*one tensor 'mlp.fc1_weight'"):
        fp8vit.TE_Block.from_timm(block, backend="reference")
    block.mlp.fc1_x.weight.requires_grad_(False)  # both frozen: fine, and carried over both ways
    te = fp8vit.TE_Block.from_timm(block, backend="reference")
    assert not te.mlp.fc1_weight.requires_grad and te.mlp.fc1_bias.requires_grad
    back = te.to_timm()
    assert not back.mlp.fc1_g.weight.requires_grad and not back.mlp.fc1_x.weight.requires_grad


def test_mxfp8_widths_run_the_mlp_without_fp8():
    # 176 padded units are a multiple of 16, not of 32 (MXFP8): that MLP runs with FP8 off, warned.
    _, te = _pair("swiglu_padded")
    assert te.cfg.mlp.fp8_widths_ok(16) and not te.cfg.mlp.fp8_widths_ok(32)
    from fp8vit import _warn
    _warn._seen.clear()
    x = torch.randn(2, 16, 64)
    with pytest.warns(RuntimeWarning, match=r"not multiples of 32.*FP8 off"):
        y = te._forward(x, None, False, 32, False)  # what _dispatch calls under MXFP8
    torch.testing.assert_close(y, te(x))


def test_mlp_module_api_for_other_block_families():
    # What a block family does (the EVA block, say): a timm MLP built apart from a Block, the
    # family's own norm before it, its own prefixes.
    torch.manual_seed(0)
    timm_mlp = SwiGLU(64, 170, norm_layer=functools.partial(nn.LayerNorm, eps=1e-6), align_to=8)  # 176
    pre = nn.LayerNorm(64, eps=1e-6)
    with torch.no_grad():
        for p in list(timm_mlp.parameters()) + list(pre.parameters()):
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + 1)
    cfg = mlp_config_from_timm(timm_mlp)
    assert cfg == mlp_config_from_kwargs(64, 170, mlp_layer=SwiGLU, act_layer=nn.SiLU, align_to=8,
                                         norm_layer=functools.partial(nn.LayerNorm, eps=1e-6))
    assert (cfg.hidden, cfg.pad, cfg.norm, cfg.fused) == (176, 0, ("LayerNorm", 1e-6), False)
    built = build_mlp(cfg, "LayerNorm", 1e-6, fp8vit.blocks.reference.modules(), {"device": "cpu"}, {"device": "cpu"})
    holder = nn.Module()
    holder.ffn = built.mlp
    sd = {f"pre.{k}": v for k, v in pre.state_dict().items()}
    sd.update({f"m.{k}": v for k, v in timm_mlp.state_dict().items()})
    ties = mlp_ties(cfg, "LayerNorm", timm_mlp="m.", te_mlp="ffn.", timm_norm="pre.", te_norm="unused.")
    holder.load_state_dict(timm_to_te(sd, ties))
    x = torch.randn(3, 7, 64)
    torch.testing.assert_close(holder.ffn(x), timm_mlp(pre(x)), rtol=1e-5, atol=1e-5)
    back = te_to_timm(holder.state_dict(), ties)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("mlp_layer, match", [
    (GatedMlp, "GatedMlp is not supported"),
    (functools.partial(Mlp, use_conv=True), r"Conv2d \(use_conv=True\)"),
])
def test_unsupported_mlps_are_named(mlp_layer, match):
    with pytest.raises(ValueError, match=match):
        BlockConfig.from_timm_kwargs(64, 4, mlp_layer=mlp_layer)


def test_activation_with_parameters_is_refused():
    with pytest.raises(ValueError, match="PReLU has parameters"):
        mlp_config_from_timm(GluMlp(64, 128, act_layer=nn.PReLU))


def test_timm_config_attributes_other_code_reads():
    cfg = BlockConfig.from_timm_kwargs(64, 4, mlp_layer=GluMlp, act_layer=nn.Sigmoid, mlp_ratio=4)
    assert (cfg.mlp_hidden, cfg.mlp.hidden, cfg.te_activation, cfg.fused_mlp) == (256, 128, "glu", True)
    assert cfg.timm_kwargs()["mlp_layer"] is GluMlp and cfg.timm_kwargs()["mlp_ratio"] == 4


def test_torch_norm_kinds():
    assert isinstance(torch_norm("RMSNorm", 1e-5, 8), nn.RMSNorm)
    with pytest.raises(ValueError, match="'BatchNorm'"):
        torch_norm("BatchNorm", 1e-5, 8)


# ----------------------------------------------------------------------------- real timm models
@pytest.mark.parametrize("name, kw", [
    ("aimv2_large_patch14_224", dict(embed_dim=64, num_heads=4, depth=2, img_size=28)),   # SwiGLU, RMSNorm
    ("vit_giant_patch14_dinov2", dict(embed_dim=96, num_heads=4, depth=2, img_size=28)),  # SwiGLUPacked
    ("beit3_base_patch16_224", dict(embed_dim=64, num_heads=4, depth=2, img_size=32)),    # scale_*_norm
    ("vitamin_small_224", dict(depth=2, img_size=32)),                                    # GeGluMlp
])
def test_glu_vits_convert_and_keep_logits(name, kw):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10, **kw).eval()
    with torch.no_grad():  # non-trivial norm weights, so that a mapping error shows
        for n, p in model.named_parameters():
            if p.dim() == 1 and "blocks" in n:
                p.add_(torch.randn_like(p) * 0.1)
    ref_sd = model.state_dict()
    x = torch.randn(2, 3, kw["img_size"], kw["img_size"])
    with torch.no_grad():
        truth = model(x)
        fp8vit.convert_to_te(model, backend="reference", exact_gelu=True)
        assert all(isinstance(b, fp8vit.TE_Block) for b in model.blocks)
        torch.testing.assert_close(model(x), truth, rtol=1e-5, atol=1e-5)
    fp8vit.convert_from_te(model)
    back = model.state_dict()
    assert back.keys() == ref_sd.keys() and all(torch.equal(back[k], ref_sd[k]) for k in ref_sd)


# ----------------------------------------------------------------------------- NaFlexViT masks
def _naflex():
    torch.manual_seed(0)
    model = timm.create_model("naflexvit_base_patch16_gap", embed_dim=64, depth=2, num_heads=4,
                              num_classes=7, reg_tokens=1).eval()
    patches = torch.randn(2, 8, 16 * 16 * 3)
    coord = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(4), indexing="ij"), -1).reshape(1, 8, 2)
    valid = torch.tensor([[True] * 5 + [False] * 3, [True] * 7 + [False]])
    return model, dict(patch_coord=coord.expand(2, -1, -1), patch_valid=valid), patches


def test_naflexvit_additive_mask_matches_timm():
    model, kw, patches = _naflex()
    with torch.no_grad():
        truth = model(patches, **kw)
        fp8vit.convert_to_te(model, backend="reference")
        torch.testing.assert_close(model(patches, **kw), truth, rtol=1e-5, atol=1e-5)


def test_float_mask_is_the_boolean_mask_it_encodes():
    block, te = _pair("swiglu")
    x = torch.randn(2, 6, 64)
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[0, ..., 4:] = False  # sample 0: the last two keys are padding
    for value in (float("-inf"), torch.finfo(torch.float32).min):
        additive = torch.zeros(2, 1, 6, 6).masked_fill(~keep, value)
        torch.testing.assert_close(te(x, attn_mask=additive), block(x, attn_mask=additive), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(te(x, attn_mask=additive), te(x, attn_mask=keep))
    key_only = torch.zeros(2, 1, 1, 6).masked_fill(~keep[:, :, :1], torch.finfo(torch.float32).min)
    torch.testing.assert_close(te(x, attn_mask=key_only), block(x, attn_mask=key_only), rtol=1e-5, atol=1e-5)
    bf16 = torch.zeros(2, 1, 6, 6, dtype=torch.bfloat16).masked_fill(~keep, torch.finfo(torch.bfloat16).min)
    torch.testing.assert_close(te(x, attn_mask=bf16), te(x, attn_mask=keep))


def test_other_float_masks_are_refused_naming_a_value():
    _, te = _pair("swiglu")
    x = torch.randn(1, 4, 64)
    bias = torch.zeros(4, 4)
    bias[1, 2] = -0.5  # a real attention bias: TE has no kernel for it
    with pytest.raises(ValueError, match=r"torch.float32 mask holds -0.5.*boolean mask"):
        te(x, attn_mask=bias)
    mask = torch.zeros(4, 4)
    te(x, attn_mask=mask)
    mask[0, 0] = float("nan")  # changed in place after a check: checked again
    with pytest.raises(ValueError, match="holds nan"):
        te(x, attn_mask=mask)
    with pytest.raises(ValueError, match="torch.int64"):
        te(x, attn_mask=torch.zeros(4, 4, dtype=torch.long))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="either attn_mask or is_causal"):
            te(x, attn_mask=torch.zeros(4, 4), is_causal=True)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_in_dtype_keeps_bf16_under_autocast(kind):
    # CUDA autocast runs torch's norms in fp32; norm_in_dtype keeps bf16 in and out, with
    # fp32 statistics: the output within bf16 rounding of the fp32 norm, fp32 weight gradients.
    from fp8vit.blocks.mlp import norm_in_dtype, torch_norm
    norm = torch_norm(kind, 1e-6, 40)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        if getattr(norm, "bias", None) is not None:
            norm.bias.uniform_(-0.5, 0.5)
    h = (torch.randn(6, 40) * 3 + 1).bfloat16()
    g = torch.randn(6, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm_in_dtype(norm, h)
    assert out.dtype == torch.bfloat16
    (out.float() * g).sum().backward()
    got = {n: p.grad.clone() for n, p in norm.named_parameters()}
    norm.zero_grad()
    ref = norm(h.float())  # fp32 throughout
    (ref * g).sum().backward()
    assert float((out.float() - ref).abs().max()) <= 2 ** -7 * float(ref.abs().max())
    for n, p in norm.named_parameters():
        assert got[n].dtype == torch.float32
        assert float((got[n] - p.grad).abs().max()) <= 2 ** -6 * float(p.grad.abs().max()), n
    with torch.no_grad():  # FP32 in, or no autocast: the module itself, bit for bit
        assert torch.equal(norm_in_dtype(norm, h.float()), norm(h.float()))


def test_norm_before_geglu_mlp_runs_in_the_stream_dtype(monkeypatch):
    # ViTamin's GeGluMlp normalizes its input after the block's norm2: norm2 runs in torch, and CUDA
    # autocast ran it in fp32 (a bf16 -> fp32 copy, fp32 norm kernels, an fp32 input for TE's fused
    # MLP). It goes through norm_in_dtype (bf16 in and out; CPU autocast keeps bf16 by itself, so
    # the dtype itself is checked on the GPU: tests/gpu/test_mlp_gpu.py).
    import fp8vit.blocks.vit as vit
    from helpers import MLP_CASES, block_pair

    block, te = block_pair(MLP_CASES["geglu_mlp"], backend="reference")
    assert type(te.norm2) is nn.LayerNorm
    calls = []

    def spy(norm, h):
        calls.append(norm)
        return vit.norm_in_dtype.__wrapped__(norm, h)

    spy.__wrapped__ = vit.norm_in_dtype
    monkeypatch.setattr(vit, "norm_in_dtype", spy)
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        torch.testing.assert_close(te(x), block(x), rtol=1e-5, atol=1e-5)
    assert calls == [te.norm2]
    h = torch.randn(3, 4).bfloat16()
    plain = nn.LayerNorm(4, elementwise_affine=False)  # no weight to round: the module itself
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert spy.__wrapped__(nn.Identity(), h) is h  # not a torch norm: passed through
        assert torch.equal(spy.__wrapped__(plain, h), plain(h))


def test_padded_norm_kernels_in_tritons_interpreter():
    # The Triton kernels of a padded MLP's inner norm (mlp.PaddedNorm), run by Triton's CPU
    # interpreter (TRITON_INTERPRET=1, a fresh process) in fp32 against torch's slice -> norm ->
    # pad and its autograd: output (padding exactly 0), input gradient (padding 0), weight and
    # bias gradients, LayerNorm and RMSNorm, EVA02-L's 2730 of 2736 and rows across program strips;
    # and a model's norm under autocast: half in, fp32 out (fp8vit.blocks.model_norm).
    pytest.importorskip("triton", reason="Triton is not installed with this torch")
    code = """
import torch, torch.nn.functional as F
import fp8vit._te.kernels as K
k = K._kernels()
for rms in (False, True):
    for rows, real, hp in ((7, 45, 48), (130, 2730, 2736), (3, 16, 16)):
        torch.manual_seed(0)
        h = torch.randn(rows, hp) * 2 + 0.5
        w, b = torch.rand(real) + 0.5, (None if rms else torch.randn(real))
        x = h[:, :real].clone().requires_grad_(True)
        wr = w.clone().requires_grad_(True)
        br = None if b is None else b.clone().requires_grad_(True)
        ref = F.rms_norm(x, (real,), wr, 1e-6) if rms else F.layer_norm(x, (real,), wr, br, 1e-6)
        ref = F.pad(ref, (0, hp - real))
        g = torch.randn(rows, hp)
        ref.backward(g)
        block = k.triton.next_power_of_2(hp)
        y, mean, rstd = torch.empty_like(h), torch.empty(rows), torch.empty(rows)
        k.padded_norm_fwd[(rows,)](h, w, w if b is None else b, y, mean, rstd, real, hp, 1e-6, b is not None, rms,
                                   block)
        per = 4
        progs = k.triton.cdiv(rows, per)
        dh, pw, pb = torch.empty_like(h), torch.zeros(progs, real), torch.zeros(progs, real)
        k.padded_norm_bwd[(progs,)](g, h, w, mean, rstd, dh, pw, pb, rows, real, hp, per, b is not None, rms, block)
        assert bool((y[:, real:] == 0).all()) and bool((dh[:, real:] == 0).all())
        torch.testing.assert_close(y, ref.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dh[:, :real], x.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pw.sum(0), wr.grad, rtol=1e-5, atol=1e-4)
        if b is not None:
            torch.testing.assert_close(pb.sum(0), br.grad, rtol=1e-5, atol=1e-4)
# a model's own norm under autocast (fp8vit.blocks.model_norm): half in, fp32 out as autocast's norm;
# an fp32 gradient in, a half input gradient out; against the fp32 norm of the same half inputs
torch.manual_seed(0)
rows, c = 9, 40
h = (torch.randn(rows, c) * 2 + 0.5).half()
w, b = torch.rand(c) + 0.5, torch.randn(c)
x, wr, br = h.float().requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True)
ref = F.layer_norm(x, (c,), wr, br, 1e-6)
g = torch.randn(rows, c)
ref.backward(g)
y, mean, rstd = torch.empty(rows, c), torch.empty(rows), torch.empty(rows)
k.padded_norm_fwd[(rows,)](h, w, b, y, mean, rstd, c, c, 1e-6, True, False, 64)
dh, pw, pb = torch.empty_like(h), torch.zeros(3, c), torch.zeros(3, c)
k.padded_norm_bwd[(3,)](g, h, w, mean, rstd, dh, pw, pb, rows, c, c, 3, True, False, 64)
assert y.dtype == torch.float32 and dh.dtype == torch.float16
torch.testing.assert_close(y, ref.detach(), rtol=1e-5, atol=1e-5)
torch.testing.assert_close(dh, x.grad.half(), rtol=2e-3, atol=2e-3)
torch.testing.assert_close(pw.sum(0), wr.grad, rtol=1e-5, atol=1e-4)
torch.testing.assert_close(pb.sum(0), br.grad, rtol=1e-5, atol=1e-4)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-3000:]


def test_naflexvit_float_mask_under_inference_mode():
    # NaFlexViT builds its additive padding mask inside the forward: under torch.inference_mode it is
    # an inference tensor, which has no version counter to key a cache on (reading it raised).
    model, kw, patches = _naflex()
    with torch.no_grad():
        truth = model(patches, **kw)
    fp8vit.convert_to_te(model, backend="reference")
    with torch.inference_mode():
        torch.testing.assert_close(model(patches, **kw), truth, rtol=1e-5, atol=1e-5)


def test_float_mask_check_is_cached_per_mask_and_redone_after_a_change():
    from fp8vit.blocks import base

    block, te = _pair("swiglu")
    x = torch.randn(2, 6, 64)
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[0, ..., 4:] = False
    additive = torch.zeros(2, 1, 6, 6).masked_fill(~keep, float("-inf"))
    te(x, attn_mask=additive)
    assert base._MASKS._entry[0]() is additive  # checked once, shared by the next blocks
    with torch.no_grad():
        additive[1, ..., 0] = float("-inf")  # in place: the cached boolean mask is stale now
        keep[1, ..., 0] = False
    torch.testing.assert_close(te(x, attn_mask=additive), te(x, attn_mask=keep))
    torch.testing.assert_close(te(x, attn_mask=additive), block(x, attn_mask=additive), rtol=1e-5, atol=1e-5)
    additive += 0.5  # no longer a padding mask: refused, not served from the cache
    with pytest.raises(ValueError, match="padding mask"):
        te(x, attn_mask=additive)
