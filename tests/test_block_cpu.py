"""TE_Block on the PyTorch reference backend against timm's Block: weights, forward, grads.

The reference modules share TE's parameter names and semantics, so this checks the weight
mapping, the block wiring, LayerScale, qk_norm, drop_path, masks and row padding on CPU. The
same comparisons with TE's kernels are in tests/gpu/.
"""

import os
import subprocess
import sys

import pytest
import torch

import fp8vit
from fp8vit.blocks.base import aligned_rows
from fp8vit.blocks.weights import te_to_timm, timm_to_te
from helpers import BLOCK_CASES, assert_matches_timm_on_cpu, block_pair

torch.manual_seed(0)


def _pair(case):
    return block_pair(BLOCK_CASES[case], backend="reference")


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_state_dict_round_trip_is_exact(case):
    block, te = _pair(case)
    sd = block.state_dict()
    back = te_to_timm(timm_to_te(sd, te.cfg), te.cfg)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    again = te.to_timm().state_dict()
    assert all(torch.equal(again[k], sd[k]) for k in sd)


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_forward_and_grads_match_timm(case):
    assert_matches_timm_on_cpu(*_pair(case))


def test_missing_or_extra_keys_are_listed():
    block, te = _pair("vit")
    sd = block.state_dict()
    sd.pop("attn.qkv.bias")
    sd["attn.extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['attn.qkv.bias'\], unexpected \['attn.extra'\]"):
        timm_to_te(sd, te.cfg)


def test_drop_path_is_per_sample_like_timm():
    block, te = _pair("layerscale_qknorm")
    block.drop_path1 = block.drop_path2 = None
    from timm.layers import DropPath
    block.drop_path1, block.drop_path2 = DropPath(0.5), DropPath(0.5)
    te.drop_path1, te.drop_path2 = DropPath(0.5), DropPath(0.5)
    block.train(), te.train()
    x = torch.randn(16, 5, 64)
    torch.manual_seed(1)
    y = block(x)
    torch.manual_seed(1)
    y2 = te(x)
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)
    # per sample: each image's whole branch is either dropped or scaled; some of each in 16
    branch_dropped = [torch.allclose(y[i], x[i]) for i in range(16)]
    assert 0 < sum(branch_dropped) < 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drop_path_mask_draws_what_timms_drop_path_draws(dtype):
    # the branch's drop path as one addcmul (x + y * mask) must draw timm's masks: the same RNG
    # calls (the generator ends in the same state), the mask in y's dtype scaled by 1 / keep
    from timm.layers import DropPath
    from fp8vit.blocks.base import drop_path_mask
    dp = DropPath(0.3).train()
    y = torch.randn(64, 5, 8, dtype=dtype)
    torch.manual_seed(3)
    want = dp(y)
    after = torch.random.get_rng_state()
    torch.manual_seed(3)
    mask = drop_path_mask(dp, y)
    assert torch.equal(torch.random.get_rng_state(), after)
    assert mask.shape == (64, 1, 1) and mask.dtype == dtype and torch.equal(y * mask, want)
    assert drop_path_mask(dp.eval(), y) is None and drop_path_mask(torch.nn.Identity(), y) is None
    from fp8vit.blocks import base
    assert drop_path_mask(torch.nn.Dropout(0.1), y) is base._NOT_A_DROP_PATH  # another module: called as is


def test_drop_path_add_is_x_plus_y_times_mask_with_its_gradients():
    # DropPathAdd (the residual add under drop path): off the GPU torch's addcmul and mul; the
    # Triton pass on the GPU is checked against them in tests/gpu/test_kernels_gpu.py.
    from fp8vit.blocks.base import DropPathAdd
    torch.manual_seed(0)
    x = torch.randn(6, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn_like(x, requires_grad=True)
    mask = torch.tensor([0.0, 2.0, 2.0, 0.0, 2.0, 2.0], dtype=torch.bfloat16).view(6, 1, 1)
    g = torch.randn_like(x)
    out = DropPathAdd.apply(x, y, mask)
    out.backward(g)
    assert torch.equal(out, torch.addcmul(x.detach(), y.detach(), mask))
    assert torch.equal(out[0], x[0].detach()) and torch.equal(x.grad, g) and torch.equal(y.grad, g * mask)
    assert not y.grad[0].any() and torch.equal(y.grad[1], g[1] * 2)
    y.grad = None
    scaled = DropPathAdd.apply(None, y, mask)  # no x: the row scale alone (before LayerScale)
    scaled.backward(g)
    assert torch.equal(scaled, y.detach() * mask) and torch.equal(y.grad, g * mask)


def test_scale_add_kernel_indexes_rows_and_columns_right_in_tritons_interpreter():
    # The Triton kernel behind DropPathAdd and LayerScaleAdd's forward, run by Triton's CPU interpreter
    # (TRITON_INTERPRET=1, in a fresh process: it is read at import) on integer-valued bf16 data, where
    # every result is exact: each element's row (rows of 231) or column (33) across program blocks of 64. The
    # interpreter rounds fp32 -> bf16 by truncation, the GPU to nearest: rounding is the GPU test's.
    pytest.importorskip("triton", reason="Triton is not installed with this torch")
    code = """
import torch
import fp8vit._te.kernels as K
k = K._kernels()
triton, kernel = k.triton, k.row_scale_add
torch.manual_seed(0)
x = torch.randint(-20, 20, (5, 7, 33)).bfloat16()
y = torch.randint(-20, 20, (5, 7, 33)).bfloat16()
mask = torch.tensor([0.0, 2.0, 0.5, 1.0, 4.0]).bfloat16().view(5, 1, 1)
n = y.numel()
out, scaled = torch.empty_like(y), torch.empty_like(y)
kernel[(triton.cdiv(n, 64),)](x, y, mask, out, n, n // 5, True, False, 64)
kernel[(triton.cdiv(n, 64),)](y, y, mask, scaled, n, n // 5, False, False, 64)
assert torch.equal(out, torch.addcmul(x, y, mask)), (out - torch.addcmul(x, y, mask)).abs().max()
assert torch.equal(scaled, y * mask)
gamma = torch.tensor([0.5, 2.0, -1.0] * 11).bfloat16()  # one value per column (LayerScale)
kernel[(triton.cdiv(n, 64),)](x, y, gamma, out, n, 33, True, True, 64)
assert torch.equal(out, torch.addcmul(x, y, gamma)), (out - torch.addcmul(x, y, gamma)).abs().max()
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-3000:]


def test_bool_mask_and_causal_match_timm():
    block, te = _pair("vit")
    x = torch.randn(2, 9, 64)
    mask = torch.rand(2, 1, 9, 9) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    torch.testing.assert_close(te(x, attn_mask=mask), block(x, attn_mask=mask), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(te(x, is_causal=True), block(x, is_causal=True), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_named():
    _, te = _pair("vit")
    with pytest.raises(ValueError, match=r"\[B, N, 64\], got \(3, 64\)"):
        te(torch.randn(3, 64))
    with pytest.raises(ValueError, match="additive float attn_mask only as a padding mask.*torch.float32"):
        te(torch.randn(1, 4, 64), attn_mask=torch.full((4, 4), 0.5))
    with pytest.raises(ValueError, match="either attn_mask or is_causal"):
        te(torch.randn(1, 4, 64), attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)


@pytest.mark.parametrize("batch, tokens, multiple", [(1, 197, 16), (3, 65, 16), (63, 197, 32), (2, 8, 16)])
def test_row_padding_is_exact(batch, tokens, multiple):
    # Padding rows to the FP8 multiple must not change outputs or gradients.
    lin = fp8vit.blocks.reference.LayerNormLinear(32, 48)
    x = torch.randn(batch, tokens, 32, requires_grad=True)
    y = aligned_rows(lin, x, multiple)
    assert y.shape == (batch, tokens, 48)
    y.square().sum().backward()
    gx, gw = x.grad.clone(), lin.weight.grad.clone()
    x.grad = lin.weight.grad = None
    ref = lin(x)
    ref.square().sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, lin.weight.grad, rtol=1e-5, atol=1e-5)


def test_init_weights_follows_timm_vit_init():
    te = fp8vit.TE_Block(64, 4, qkv_bias=True, init_values=0.1, backend="reference")
    te.init_weights()
    assert abs(float(te.qkv.weight.detach().std()) - 0.02) < 0.003
    assert float(te.qkv.bias.abs().max()) == 0.0 and float(te.mlp.fc2_bias.abs().max()) == 0.0
    assert torch.all(te.ls1.gamma == 0.1) and torch.all(te.qkv.layer_norm_weight == 1)


def test_device_and_dtype_are_honoured():
    te = fp8vit.TE_Block(64, 4, dtype=torch.float64, backend="reference")
    assert {p.dtype for p in te.parameters()} == {torch.float64}


def test_te_backend_on_cpu_is_refused():
    if not fp8vit._te.te_status()[0]:
        with pytest.raises(fp8vit.TEUnavailableError, match="not installed"):
            fp8vit.TE_Block(64, 4, backend="te")
    with pytest.raises(ValueError, match="backend='cuda'"):
        fp8vit.TE_Block(64, 4, backend="cuda")


def test_split_qkv_hands_back_a_packed_gradient_without_copying():
    from fp8vit.blocks.base import SplitQKV
    qkv = torch.randn(2, 5, 3, 4, 8, requires_grad=True)
    q, k, v = SplitQKV.apply(qkv)
    assert q.data_ptr() == qkv.data_ptr() and torch.equal(v, qkv[:, :, 2])  # views, timm's order
    # Gradients laid out as TE's fused attention writes them: views of one packed buffer.
    packed = torch.randn(2, 5, 3, 4, 8)
    got = SplitQKV.backward(type("Ctx", (), {"packed_stride": qkv.stride()})(), *packed.unbind(2))
    assert got.data_ptr() == packed.data_ptr() and torch.equal(got, packed)
    # Separate gradients (the reference backend's): stacked, and equal to autograd's own unbind.
    g = [torch.randn(2, 5, 4, 8) for _ in range(3)]
    sum((t * gi).sum() for t, gi in zip(SplitQKV.apply(qkv), g)).backward()
    ref = qkv.detach().clone().requires_grad_()
    sum((t * gi).sum() for t, gi in zip(ref.unbind(2), g)).backward()
    assert torch.equal(qkv.grad, ref.grad)


def test_layer_scale_add_keeps_the_stream_dtype_and_gives_fp32_gamma_grads():
    # x + gamma * y for a bf16 stream and an fp32 gamma without fp32 intermediates: against the
    # same sum in fp64, within bf16 rounding (a few 2^-8 relative), dx passed through exactly.
    from fp8vit.blocks.base import LayerScaleAdd
    g64 = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 32, generator=g64).bfloat16().requires_grad_()
    y = torch.randn(3, 5, 32, generator=g64).bfloat16().requires_grad_()
    gamma = (torch.rand(32, generator=g64) + 0.5).requires_grad_()
    out = LayerScaleAdd.apply(x, y, gamma)
    assert out.dtype == torch.bfloat16
    ref = x.double() + gamma.double() * y.double()
    scale = (x.double().abs() + (gamma.double() * y.double()).abs()).max()
    assert float((out.detach().double() - ref.detach()).abs().max()) <= 2 ** -7 * float(scale.detach())
    g = torch.randn(3, 5, 32, generator=g64).bfloat16()
    out.backward(g)
    assert torch.equal(x.grad, g)
    dy = g.double() * gamma.double()
    assert float((y.grad.double() - dy).abs().max()) <= 2 ** -7 * float(dy.abs().max())
    assert gamma.grad.dtype == torch.float32
    dgamma = (g.double() * y.double()).sum((0, 1))
    bound = 2 ** -8 * (g.double() * y.double()).abs().sum((0, 1))
    assert bool(((gamma.grad.double() - dgamma).abs() <= bound).all())


def test_layerscale_under_bf16_autocast_matches_timm():
    # Under autocast LayerScale runs in the stream's dtype (LayerScaleAdd), where timm promotes to
    # fp32: the block output and both gammas' gradients within bf16 noise of timm's.
    block, te = _pair("layerscale_qknorm")
    for b in (block, te):
        b.ls1.gamma.data.uniform_(0.5, 1.5), b.ls2.gamma.data.uniform_(-1.5, -0.5)
    te.load_state_dict(fp8vit.TE_Block.from_timm(block, backend="reference").state_dict())
    x = torch.randn(2, 9, 64)
    outs, grads = [], []
    for b in (block, te):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = b(x)
        assert y.dtype == (torch.bfloat16 if b is te else torch.float32)  # timm's stream stays fp32
        y.float().square().sum().backward()
        outs.append(y.detach().float())
        grads.append({"ls1": b.ls1.gamma.grad, "ls2": b.ls2.gamma.grad})
    from helpers import snr_db
    assert snr_db(outs[0], outs[1]) > 35
    for k in ("ls1", "ls2"):
        assert grads[1][k].dtype == torch.float32
        assert snr_db(grads[0][k], grads[1][k]) > 25, k


def test_layerscale_with_drop_path_under_bf16_autocast_draws_timms_masks():
    # LayerScale (LayerScaleAdd) after drop path's row scale (DropPathAdd, no x): the same draws as timm's
    # DropPath, so with the same seed the same samples keep their branches; output and gammas'
    # gradients within bf16 noise of timm's, a dropped sample's gradient to its branch exactly 0.
    from timm.layers import DropPath
    block, te = _pair("layerscale_qknorm")
    for b in (block, te):
        b.ls1.gamma.data.uniform_(0.5, 1.5), b.ls2.gamma.data.uniform_(-1.5, -0.5)
    te.load_state_dict(fp8vit.TE_Block.from_timm(block, backend="reference").state_dict())
    for b in (block, te):
        b.drop_path1, b.drop_path2 = DropPath(0.5), DropPath(0.5)
        b.train()
    x = torch.randn(16, 9, 64)
    outs, grads = [], []
    for b in (block, te):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = b(x)
        y.float().square().sum().backward()
        outs.append(y.detach().float())
        grads.append({"ls1": b.ls1.gamma.grad, "ls2": b.ls2.gamma.grad})
    from helpers import snr_db
    kept = [not torch.allclose(outs[0][i], x[i]) for i in range(16)]
    assert 0 < sum(kept) < 16
    assert [not torch.allclose(outs[1][i], x[i], atol=2e-2, rtol=2e-2) for i in range(16)] == kept
    assert snr_db(outs[0], outs[1]) > 35
    for k in ("ls1", "ls2"):
        assert snr_db(grads[0][k], grads[1][k]) > 25, k


def test_a_replaced_layer_scale_module_is_applied():
    # ls1/ls2 are timm's LayerScale (handled in the stream's dtype) or nn.Identity; a module a user
    # puts there instead runs as it is, never skipped.
    class Times(torch.nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c = c

        def forward(self, y):
            return self.c * y

    _, te = _pair("layerscale_qknorm")
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        te.ls1.gamma.fill_(3.0), te.ls2.gamma.fill_(-2.0)
        ref = te(x)
        te.ls1, te.ls2 = Times(3.0), Times(-2.0)
        assert torch.equal(te(x), ref)
        te.ls2 = torch.nn.Identity()
        assert not torch.allclose(te(x), ref)
