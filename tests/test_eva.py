"""TE_EvaBlock against timm's EvaBlock and EvaBlockPostNorm on the reference backend (CPU, fp32):
logits, gradients, exact weights both ways, the held-at-zero k bias, RoPE with prefix tokens, every
RoPE layout, grouped-query and gated attention."""

import copy
import dataclasses
import warnings

import pytest
import timm
import torch
from torch import nn
from timm.models.eva import EvaBlock, EvaBlockPostNorm

import fp8vit
from fp8vit.blocks.eva import TE_EvaBlock, rope_angles
from fp8vit.blocks.reference import rope as reference_rope
from helpers import count_rope_angle_computations

# Small versions of the EVA-family models the issue names; each covers an option set:
# q/v biases + separate q/k/v + SwiGLU with the inner norm (EVA02-B/L), packed SwiGLU (EVA02-T),
# AttentionRope with a full qkv bias + LayerScale (RoPE ViT), per-head mixed RoPE (timm's
# fallback path), rotate-half RoPE + register tokens + no qkv bias (DINOv3), the Perception
# Encoder (pre-transformer norm, attention pooling), a scaled attention inner norm (EVA-CLIP-style),
# grouped-query attention in the first block only + qk_norm + RMSNorm + attention-only LayerScale
# (Sapiens2, newer timm), the post-norm block with a padded GELU MLP (EVA-CLIP enormous) and with
# RoPE + separate q/k/v + SwiGLU with the inner norm (EVA02-T built post-norm).
SMALL = dict(num_classes=5, depth=2)  # images of 4 x 4 patches
MODELS = {
    "eva02_base_patch14_224": dict(embed_dim=64, num_heads=4),
    # hidden int(72 * 4 * 2 / 3) = 191, not a multiple of 16 (like EVA02-L's 2730): padded exactly
    "eva02_large_patch14_224": dict(embed_dim=72, num_heads=3),
    "eva02_tiny_patch14_224": dict(embed_dim=48, num_heads=3),
    "vit_base_patch16_rope_224": dict(embed_dim=64, num_heads=4),
    "vit_base_patch16_rope_mixed_224": dict(embed_dim=64, num_heads=4),
    "vit_small_patch16_dinov3": dict(embed_dim=64, num_heads=4),
    "vit_pe_core_large_patch14_336": dict(embed_dim=64, num_heads=4, attn_pool_num_heads=4),
    "eva02_base_patch14_224.scale_attn": dict(embed_dim=64, num_heads=4, scale_attn_inner=True),
    "vit_base_patch16_sapiens2": dict(embed_dim=64, num_heads=4, num_kv_heads=(2, 4)),
    # hidden int(64 * 15360 / 1792) = 548, padded to 560
    "eva02_enormous_patch14_clip_224": dict(embed_dim=64, num_heads=4),
    "eva02_tiny_patch14_224.post_norm": dict(embed_dim=48, num_heads=3, use_post_norm=True),
}


def _model(key, **overrides):
    name = key.split(".")[0]
    if name not in timm.list_models(name):
        pytest.skip(f"timm {timm.__version__} has no {name}")
    torch.manual_seed(0)
    patch = 16 if "patch16" in name else 14
    kwargs = {**SMALL, **MODELS[key], **overrides}
    model = timm.create_model(name, pretrained=False, img_size=4 * patch, **kwargs).eval()
    with torch.no_grad():  # timm zero-inits biases and LayerScale is ~1e-5: make every tensor count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _convert(model, exact_gelu=True):
    # exact_gelu: timm's erf GELU kept (the RoPE ViTs and PE use it); TE's kernel is tanh GELU
    for i, blk in enumerate(model.blocks):
        model.blocks[i] = TE_EvaBlock.from_timm(blk, backend="reference", exact_gelu=exact_gelu)
    return model


@pytest.mark.parametrize("key", list(MODELS))
def test_logits_and_grads_match_timm(key):
    model = _model(key)
    x = torch.randn(2, 3, *model.patch_embed.img_size)
    ref = model(x)
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if not n.startswith("blocks.")}
    ref_block_grads = [{n: p.grad.clone() for n, p in b.named_parameters()} for b in model.blocks]
    te = _convert(copy.deepcopy(model))
    te.zero_grad(set_to_none=True)
    out = te(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    for n, p in te.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-5, msg=n)
    for blk, want in zip(te.blocks, ref_block_grads):
        _assert_grads_match(blk, want)


def _assert_grads_match(blk, want):
    """The gradients of TE_EvaBlock ``blk``, mapped back to timm's names through the block's own
    conversion, match ``want`` ({timm name: gradient})."""
    grads = {n: p.grad for n, p in blk.named_parameters()}
    saved = {n: p.detach().clone() for n, p in blk.named_parameters()}
    with torch.no_grad():  # push the gradients through the weight mapping like weights
        for n, p in blk.named_parameters():
            p.copy_(grads[n])
    got = blk.to_timm().state_dict()
    with torch.no_grad():
        for n, p in blk.named_parameters():
            p.copy_(saved[n])
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-5, msg=n)


def _assert_round_trip(blk):
    """timm block -> TE_EvaBlock -> timm block gives back the same class and every tensor bit for bit."""
    te = TE_EvaBlock.from_timm(blk, backend="reference")
    back = te.to_timm()
    assert type(back) is type(blk)
    want, got = blk.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    if getattr(blk.attn, "k_bias", None) is not None:
        assert torch.equal(back.attn.k_bias, torch.zeros_like(back.attn.k_bias))


@pytest.mark.parametrize("key", ["eva02_base_patch14_224", "vit_base_patch16_rope_224", "vit_small_patch16_dinov3",
                                 "vit_base_patch16_sapiens2", "eva02_enormous_patch14_clip_224",
                                 "eva02_tiny_patch14_224.post_norm"])
def test_weights_round_trip_bit_exact(key):
    for blk in _model(key).blocks:
        _assert_round_trip(blk)


def _block_kw(name):
    import inspect
    return name in inspect.signature(EvaBlock.__init__).parameters


# Gated attention (timm's gated_attn: no timm model enables it yet, so single blocks): the gate's
# rows join the fused q/k/v GEMM; with the inner norm (scale_attn_inner) the norm runs in torch,
# before the gate.
GATED = {
    "eva_fused_qv_bias_inner_norm": (EvaBlock, dict(attn_type="eva", qkv_fused=True, scale_attn_inner=True,
                                                    swiglu_mlp=True, scale_mlp=True)),
    "eva_separate_qv_bias": (EvaBlock, dict(attn_type="eva", qkv_fused=False)),
    "rope_fused_no_bias": (EvaBlock, dict(attn_type="rope", qkv_fused=True, qkv_bias=False, rotate_half=True)),
    "rope_gqa_qk_norm": (EvaBlock, dict(attn_type="rope", qkv_fused=False, num_kv_heads=2, qk_norm=True,
                                        rotate_half=True, init_values=0.5)),
    "post_norm_rope_inner_norm": (EvaBlockPostNorm, dict(attn_type="rope", qkv_fused=False, scale_attn_inner=True)),
}


def _gated_block(key):
    cls, kw = GATED[key]
    if not _block_kw("gated_attn") or any(k in kw and not _block_kw(k) for k in ("num_kv_heads", "qk_norm")):
        pytest.skip(f"timm {timm.__version__}'s EvaBlock lacks an option of {key}")
    torch.manual_seed(0)
    blk = cls(64, 4, gated_attn=True, num_prefix_tokens=1, **kw).eval()
    with torch.no_grad():
        for p in blk.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return blk


@pytest.mark.parametrize("key", list(GATED))
def test_gated_attention_matches_timm(key):
    blk = _gated_block(key)
    te = TE_EvaBlock.from_timm(blk, backend="reference", exact_gelu=True)
    assert te.cfg.gated and "gated" in repr(te)
    D = 16
    theta = torch.rand(16, D // 2) * 6  # 16 patch tokens and the class token
    theta = theta.repeat(1, 2) if te.cfg.rotate_half else theta.repeat_interleave(2, -1)
    rope = torch.cat([theta.sin(), theta.cos()], -1)
    x = torch.randn(2, 17, 64)
    g = torch.randn(2, 17, 64)
    outs, dxs = [], []
    for module in (blk, te):
        xi = x.clone().requires_grad_(True)
        out = module(xi, rope=rope)
        out.backward(g)
        outs.append(out)
        dxs.append(xi.grad)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dxs[1], dxs[0], rtol=1e-4, atol=1e-5)
    _assert_grads_match(te, {n: p.grad for n, p in blk.named_parameters()})
    if te.cfg.qkv_bias == "qv":  # the k part of the fused [q; k; v; gate] bias stays zero
        A = te.cfg.attn_dim
        assert torch.count_nonzero(te.qkv.bias.grad[A:2 * A]) == 0
    _assert_round_trip(blk)


def test_k_bias_stays_zero_through_training_and_copies():
    model = _model("eva02_base_patch14_224").train()
    te = _convert(model)
    blk = te.blocks[0]
    A = blk.cfg.attn_dim
    assert blk.cfg.qkv_bias == "qv"
    opt = torch.optim.AdamW(te.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        if step == 1:  # a deep copy has new parameters: the k third must be held there too
            te = copy.deepcopy(te)
            opt = torch.optim.AdamW(te.parameters(), lr=1e-2, weight_decay=0.1)
        te(torch.randn(2, 3, *te.patch_embed.img_size)).square().mean().backward()
        g = te.blocks[0].qkv.bias.grad
        assert torch.count_nonzero(g[A:2 * A]) == 0 and torch.count_nonzero(g[:A]) > 0
        opt.step()
        opt.zero_grad()
    for b in te.blocks:
        assert torch.count_nonzero(b.qkv.bias[A:2 * A]) == 0


def test_frozen_parameters_carried_both_ways():
    model = _model("eva02_base_patch14_224")
    blk = model.blocks[0]
    for n in ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "norm1.weight"):
        blk.get_parameter(n).requires_grad_(False)
    te = TE_EvaBlock.from_timm(blk, backend="reference")
    assert not te.qkv.weight.requires_grad and not te.qkv.layer_norm_weight.requires_grad
    assert te.proj.weight.requires_grad
    back = te.to_timm()
    assert not back.attn.k_proj.weight.requires_grad and back.attn.proj.weight.requires_grad
    blk.attn.k_proj.weight.requires_grad_(True)  # only some of the fused parts frozen: refused
    with pytest.raises(ValueError, match="requires_grad differs"):
        TE_EvaBlock.from_timm(blk, backend="reference")


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_angles_reproduce_timm(interleaved):
    """The angle table TE's kernel gets reproduces timm's sin/cos RoPE, prefix tokens untouched."""
    from timm.layers.pos_embed_sincos import apply_rot_embed_cat

    torch.manual_seed(0)
    B, npt, n_patch, H, D = 2, 3, 10, 2, 8
    theta = torch.rand(n_patch, D // 2) * 6
    theta = theta.repeat_interleave(2, -1) if interleaved else theta.repeat(1, 2)
    table = torch.cat([theta.sin(), theta.cos()], -1)  # [N_patch, 2D], timm's layout
    x = torch.randn(B, npt + n_patch, H, D)
    got = reference_rope(x, rope_angles(table, npt + n_patch, npt), interleaved)
    want_patch = apply_rot_embed_cat(x[:, npt:].transpose(1, 2), table, half=not interleaved).transpose(1, 2)
    assert torch.equal(got[:, :npt], x[:, :npt])
    torch.testing.assert_close(got[:, npt:], want_patch, rtol=1e-6, atol=1e-6)
    # the other pairing does not match: the layout flag matters
    wrong = reference_rope(x, rope_angles(table, npt + n_patch, npt), not interleaved)
    assert not torch.allclose(wrong[:, npt:], want_patch, atol=1e-3)


def test_rope_angles_once_per_forward_bit_identical_to_uncached(monkeypatch):
    model = _convert(_model("vit_base_patch16_rope_224", depth=4))
    x = torch.randn(2, 3, *model.patch_embed.img_size)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.square().sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    calls = count_rope_angle_computations(monkeypatch)
    cached = step()
    assert len(calls) == 1  # one table for 4 blocks
    # the uncached path: every block computes its own angles
    monkeypatch.setattr(fp8vit.blocks.eva, "forward_rope_angles", lambda *args: fp8vit.blocks.eva.rope_angles(*args))
    del calls[:]
    uncached = step()
    assert len(calls) == 4
    assert torch.equal(cached[0], uncached[0])
    for n, g in cached[1].items():
        assert torch.equal(g, uncached[1][n]), n


def test_rope_angles_cache_keys(monkeypatch):
    """Recomputed for another table, an in-place change, another token count or inference mode, a
    table that requires grad, and during CUDA-graph capture; never past the table's life."""
    from fp8vit.blocks.eva import forward_rope_angles

    calls = count_rope_angle_computations(monkeypatch)
    table = torch.rand(16, 8)
    first = forward_rope_angles(table, 17, 1)
    assert forward_rope_angles(table, 17, 1) is first and len(calls) == 1
    table.mul_(1.0)  # same values, new version: recomputed
    assert torch.equal(forward_rope_angles(table, 17, 1), first) and len(calls) == 2
    forward_rope_angles(table, 18, 2)
    forward_rope_angles(table.clone(), 18, 2)
    assert len(calls) == 4
    with torch.inference_mode():
        inferred = forward_rope_angles(table, 18, 2)
        assert forward_rope_angles(table, 18, 2) is inferred and len(calls) == 5
    assert not forward_rope_angles(table, 18, 2).is_inference() and len(calls) == 6
    trained = table.clone().requires_grad_()
    forward_rope_angles(trained, 17, 1)
    forward_rope_angles(trained, 17, 1)
    assert len(calls) == 8
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    forward_rope_angles(table, 18, 2)
    forward_rope_angles(table, 18, 2)
    assert len(calls) == 10
    monkeypatch.undo()
    del calls[:], table  # the cache's entry goes with its table
    assert fp8vit.blocks.eva._ANGLES._entry[0] is None


def test_rope_angles_refuses_other_tables():
    assert rope_angles(torch.zeros(4, 10, 16), 11, 1) is None  # per head
    assert rope_angles(torch.zeros(9, 16), 11, 1) is None  # token count does not match


def test_rejections_are_named():
    class MyEvaBlock(EvaBlock):
        pass

    with pytest.raises(ValueError, match="MyEvaBlock cannot be converted to TE_EvaBlock.*eva.EvaBlock or .*eva.EvaBlockPostNorm"):
        TE_EvaBlock.from_timm(MyEvaBlock(64, 4), backend="reference")
    if _block_kw("gated_attn"):  # a gate whose bias flag differs from q/k/v's cannot join their GEMM
        blk = EvaBlock(64, 4, gated_attn=True)
        blk.attn.gate = nn.Linear(64, 64, bias=False)
        with pytest.raises(ValueError, match="gated attention output.*bias=False.*one bias flag"):
            TE_EvaBlock.from_timm(blk, backend="reference")


def test_timm_block_keeps_no_skeleton_parameters():
    blk = _model("vit_base_patch16_rope_224").blocks[0]
    te = TE_EvaBlock.from_timm(blk, backend="reference")
    names = {n for n, _ in te.named_parameters()}
    assert not any("skeleton" in n for n in names)
    assert sum(p.numel() for p in te.parameters()) == sum(p.numel() for p in blk.parameters())
    assert isinstance(te, fp8vit.blocks.base.FP8Block)


def test_boolean_and_additive_padding_masks_match_timm():
    blk = _model("vit_base_patch16_rope_224").blocks[0]
    te = TE_EvaBlock.from_timm(blk, backend="reference", exact_gelu=True)
    x = torch.randn(2, 17, 64)
    keep = torch.ones(2, 1, 1, 17, dtype=torch.bool)
    keep[1, ..., 12:] = False  # the second image's last 5 tokens are padding
    additive = torch.zeros(2, 1, 1, 17).masked_fill(~keep, float("-inf"))
    for mask in (keep, additive):
        torch.testing.assert_close(te(x, attn_mask=mask), blk(x, attn_mask=mask), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="padding mask"):
        te(x, attn_mask=additive + 0.5)


def test_post_norm_mlp_runs_unfused_with_the_exact_activation():
    # EvaBlockPostNorm has no norm before its MLP to fuse: fc1 is a plain Linear and the MLP runs
    # unfused, with TE's gated kernel where it is exact (SwiGLU: silu(gate) * value), and timm's
    # own (erf) GELU in an ungated MLP even with exact_gelu=False: nothing there maps to tanh GELU.
    swiglu = TE_EvaBlock.from_timm(_model("eva02_tiny_patch14_224.post_norm").blocks[0], backend="reference")
    assert not swiglu.cfg.mlp.block_norm and not swiglu.cfg.mlp.fused
    assert swiglu.cfg.mlp.te_activation == "swiglu" and swiglu.mlp.gated_act is not None
    gelu = TE_EvaBlock.from_timm(_model("eva02_enormous_patch14_clip_224", use_post_norm=True).blocks[0],
                                 backend="reference", exact_gelu=False)
    assert gelu.cfg.mlp.te_activation is None and not gelu.cfg.mlp.fused
    assert isinstance(gelu.mlp.act, torch.nn.GELU) and gelu.mlp.act.approximate == "none"


# --- RoPE in one pass over the packed QKV buffer (rope_kernel="triton", RopeQKV) -------------------

def _timm_rope_packed(qkv, table, npt, interleaved):
    """timm's RoPE on q and k of a packed [B, N, 3, H, D] buffer (fp32 math), v as it is: the
    reference for the Triton kernel and for RopeQKV's gradient."""
    from timm.layers.pos_embed_sincos import apply_rot_embed_cat

    outs = []
    for i in (0, 1):
        t = qkv[:, :, i].transpose(1, 2).float()  # [B, H, N, D], timm's layout
        r = torch.cat([t[:, :, :npt], apply_rot_embed_cat(t[:, :, npt:], table, half=not interleaved)], 2)
        outs.append(r.transpose(1, 2).to(qkv.dtype))
    return torch.stack([*outs, qkv[:, :, 2]], 2)


def test_packed_rope_kernel_is_timms_rope_and_its_transpose_in_tritons_interpreter():
    # The kernel behind RopeQKV, run by Triton's CPU interpreter (TRITON_INTERPRET=1, a fresh process)
    # on bf16 data where every product and sum is exact (multiples of 1/4, table values in {0, +-1/2,
    # +-1}): forward equal to timm's apply_rot_embed_cat, backward (in place) equal to autograd's
    # gradient of it, for both pairings, prefix tokens, and head counts and head dims whose halves are
    # no power of two (masked lanes).
    pytest.importorskip("triton", reason="Triton is not installed with this torch")
    code = """
import contextlib
import torch
import fp8vit._te.kernels as K
from test_eva import _timm_rope_packed
torch.cuda.device = lambda device: contextlib.nullcontext()  # the wrapper's launch context, on the CPU
torch.manual_seed(0)
vals = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0])
for B, N, H, D, npt, inter in [(2, 5, 3, 8, 1, False), (2, 5, 3, 8, 1, True), (1, 7, 2, 10, 0, True),
                               (3, 4, 1, 4, 2, False), (1, 6, 5, 6, 1, False)]:
    qkv = torch.randint(-8, 8, (B, N, 3, H, D)).float().div(4).bfloat16()
    table = vals[torch.randint(0, 5, (N - npt, 2 * D))].contiguous()
    out = K.rope_packed_qkv(qkv, table, npt, inter)
    assert out.data_ptr() != qkv.data_ptr()
    assert torch.equal(out, _timm_rope_packed(qkv, table, npt, inter)), (B, N, H, D, npt, inter)
    x = qkv.float().requires_grad_(True)
    g = torch.randint(-8, 8, x.shape).float().div(4)
    _timm_rope_packed(x, table, npt, inter).backward(g)
    gb = g.bfloat16()
    assert K.rope_packed_qkv(gb, table, npt, inter, backward=True) is gb  # in place
    assert torch.equal(gb.float(), x.grad), (B, N, H, D, npt, inter)
print("ok")
"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-3000:]


def _rope_packed_in_torch(calls):
    """A torch stand-in for the Triton kernel (same contract: new buffer forward, in place backward),
    counting its calls: RopeQKV's plumbing on the CPU."""
    def rope_packed(qkv, table, npt, interleaved, backward=False):
        calls.append("backward" if backward else "forward")
        if not backward:
            return _timm_rope_packed(qkv, table, npt, interleaved)
        with torch.enable_grad():  # called inside RopeQKV's backward, where grad mode is off
            x = qkv.detach().float().requires_grad_(True)
            _timm_rope_packed(x, table, npt, interleaved).float().backward(qkv.float())
        return qkv.copy_(x.grad)
    return rope_packed


@pytest.mark.parametrize("key", ["vit_base_patch16_rope_224", "vit_small_patch16_dinov3", "vit_pe_core_large_patch14_336"])
def test_packed_rope_trains_as_te_rope(key, monkeypatch):
    # rope_kernel="triton" (RopeQKV) against the default path, the kernel replaced by torch's
    # arithmetic: the views, the prefix tokens (class and registers), the pairing and the packed
    # gradient's assembly (the reference attention's dq, dk, dv are stacked) are RopeQKV's
    calls = []
    monkeypatch.setattr(fp8vit.blocks.eva, "rope_packed_qkv", _rope_packed_in_torch(calls))
    monkeypatch.setattr(TE_EvaBlock, "_packed_rope_refusal", lambda self, qkv, rope: None)  # CPU tensors
    x = torch.randn(2, 3, *_model(key).patch_embed.img_size)
    results = []
    for kernel in ("te", "triton"):
        model = _convert(_model(key)).train()
        for blk in model.blocks:
            blk.rope_kernel = kernel
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        out.square().sum().backward()
        results.append((out, xi.grad, {n: p.grad for n, p in model.named_parameters()}))
    (out_te, dx_te, g_te), (out_tr, dx_tr, g_tr) = results
    depth = len(model.blocks)
    assert calls == ["forward"] * depth + ["backward"] * depth
    # the default ("auto") takes the packed pass wherever it can run
    model = _convert(_model(key)).train()
    assert torch.equal(model(x), out_tr) and len(calls) == 3 * depth
    torch.testing.assert_close(out_tr, out_te, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_tr, dx_te, rtol=1e-4, atol=1e-5)
    for n in g_te:
        torch.testing.assert_close(g_tr[n], g_te[n], rtol=1e-4, atol=1e-5, msg=n)


def test_packed_rope_says_why_it_cannot_run_and_runs_te_rope(monkeypatch):
    from fp8vit import _warn

    model = _convert(_model("vit_base_patch16_rope_224"))
    x = torch.randn(2, 3, *model.patch_embed.img_size)
    monkeypatch.setattr(_warn, "_seen", set())
    assert {blk.rope_kernel for blk in model.blocks} == {"auto"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default falls back to TE's RoPE without a word
        want = model(x)
    for blk in model.blocks:
        blk.rope_kernel = "te"
    assert torch.equal(model(x), want)
    for blk in model.blocks:
        blk.rope_kernel = "triton"
    with pytest.warns(RuntimeWarning, match=r"rope_kernel='triton' cannot run here \(Triton kernels run on CUDA tensors\)"):
        got = model(x)
    assert torch.equal(got, want)  # TE's path (the reference backend's RoPE), said once
    blk = model.blocks[0]
    blk.rope_kernel = "Triton"
    with pytest.raises(ValueError, match=r"rope_kernel='Triton': expected one of \('auto', 'te', 'triton'\)"):
        model(x)
    # the other refusals, each named
    D, npt = blk.cfg.head_dim, blk.cfg.num_prefix_tokens
    qkv = torch.zeros(2, 17, 3 * blk.cfg.attn_dim)
    table = torch.zeros(17 - npt, 2 * D)
    assert "one row per patch token (16, 32)" in blk._packed_rope_refusal(qkv, torch.zeros(4, 17 - npt, 2 * D))
    assert "learnable" in blk._packed_rope_refusal(qkv, table.requires_grad_(True))
    qk_norm = _convert(_model("vit_base_patch16_rope_224")).blocks[0]
    object.__setattr__(qk_norm, "cfg", dataclasses.replace(qk_norm.cfg, qk_norm=True))
    assert "q/k norm" in qk_norm._packed_rope_refusal(qkv, table.detach())
    gqa = dataclasses.replace(blk.cfg, num_kv_heads=blk.cfg.num_heads // 2)
    object.__setattr__(qk_norm, "cfg", gqa)
    assert "grouped-query" in qk_norm._packed_rope_refusal(qkv, table.detach())
