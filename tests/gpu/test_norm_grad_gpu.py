"""The residual gradient added in TE's LayerNorm backward (:mod:`fp8vit._te.norm_grad`, lever 70).

fp8vit's kernel gives ``dx + skip`` rounded once where TE's backward then torch's add round twice:
within one bf16 rounding of each other; dgamma and dbeta are the same fp32 column sums in another
order, within a bf16 rounding of TE's. Through TE's ``LayerNormLinear`` and ``LayerNormMLP`` the
block's gradient reaches ``x`` once, whether the norm adds the skip path's gradient or the fork
does; and a graphed ViT trains as close to bf16 with it as without it.
"""

import copy

import pytest
import torch

import fp8vit
from fp8vit._te import norm_grad
from fp8vit._te.kernels import layernorm_backward_add
from helpers import bf16_ulps, fp8_step, need_recipe, need_triton

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_te_and_triton():
    need_recipe("delayed")
    need_triton()


@pytest.mark.parametrize("rows, width", [(25216, 1024), (1000, 768), (37, 1280), (64, 1000)])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_te_then_add(rows, width, weight_dtype):
    tex = fp8vit._te.te_module("transformer_engine_torch")
    te_bwd = norm_grad._ROUTE.te_function("transformer_engine_torch", "layernorm_bwd")
    torch.manual_seed(0)
    x = (torch.randn(rows, width, device="cuda") * 3 + torch.randn(rows, 1, device="cuda")).bfloat16()
    w = (1 + 0.1 * torch.randn(width, device="cuda")).to(weight_dtype)
    b = (0.1 * torch.randn(width, device="cuda")).to(weight_dtype)
    _, mu, rs = tex.layernorm_fwd(x, w.bfloat16(), b.bfloat16(), 1e-6, None, None, tex.DType.kBFloat16, 0, False)
    dz = torch.randn(rows, width, device="cuda").bfloat16()
    skip = torch.randn(rows, width, device="cuda").bfloat16()
    ref_dx, ref_dw, ref_db = te_bwd(dz, x, mu, rs, w.bfloat16(), 0, False)
    dx, dw, db = layernorm_backward_add(dz, x, mu, rs, w, skip)
    assert dx.dtype == torch.bfloat16 and dw.dtype == db.dtype == weight_dtype
    assert bf16_ulps(dx, ref_dx.float() + skip.float()) <= 1.0
    assert bf16_ulps(dw, ref_dw) <= 1.0 and bf16_ulps(db, ref_db) <= 1.0


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("route", [True, False])
def test_the_block_gradient_reaches_x_once(kind, route, monkeypatch):
    # The block's pattern: the branch reads x through fork, its output already holds x (here added
    # with x detached, as lever 61's GEMM adds it) and goes through join. x's gradient must equal
    # autograd's for branch(x) + x, whether the norm adds the skip path's gradient (route on) or
    # the fork does (route off: TE's backward). bf16, FP8 off: the two differ by one rounding.
    te = fp8vit._te.load_te()
    torch.manual_seed(0)
    if kind == "LayerNormLinear":
        mod = te.LayerNormLinear(256, 256, bias=True, params_dtype=torch.bfloat16).cuda()
    else:
        mod = te.LayerNormMLP(256, 1024, bias=True, activation="gelu", params_dtype=torch.bfloat16).cuda()
    x0 = torch.randn(4, 64, 256, device="cuda").bfloat16()
    w = torch.randn(4, 64, 256, device="cuda").bfloat16()
    calls = []
    real = norm_grad.layernorm_backward_add
    monkeypatch.setattr(norm_grad, "layernorm_backward_add", lambda *a: calls.append(1) or real(*a))

    def grads(fused: bool):
        mod.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        if fused:
            slot = norm_grad.Slot()
            y = norm_grad.join(mod(norm_grad.fork(x, slot)) + x.detach(), slot)
        else:
            y = mod(x) + x
        (y.float() * w.float()).sum().backward()
        return x.grad, {n: p.grad.clone() for n, p in mod.named_parameters()}

    ref_x, ref_p = grads(False)
    with norm_grad.norm_grad_add(route):
        got_x, got_p = grads(True)
    assert len(calls) == (1 if route else 0)
    assert not norm_grad._PARKED  # nothing left waiting
    assert bf16_ulps(got_x, ref_x) <= 1.0, bf16_ulps(got_x, ref_x)
    for n in ref_p:
        assert bf16_ulps(got_p[n], ref_p[n]) <= 1.0, (n, bf16_ulps(got_p[n], ref_p[n]))


def test_graphs_take_it_and_train_alike(monkeypatch):
    # make_graphed_blocks' backward graphs sum both of a classic ViT block's gradient pairs in the
    # norms (4 calls a 2-block step). The third step of a graphed ViT at fixed weights against the
    # same model in bf16: as close with it as without it (as test_gemm_residual_gpu's test).
    import timm
    calls = []
    real = norm_grad.layernorm_backward_add
    monkeypatch.setattr(norm_grad, "layernorm_backward_add", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    base = fp8vit.convert_to_te(timm.create_model("vit_base_patch16_224", depth=2, num_classes=10).cuda())
    x = torch.randn(16, 3, 224, 224, device="cuda")

    with norm_grad.norm_grad_add(False):
        ref, g_ref = fp8_step(copy.deepcopy(base).train(), x, "delayed", enabled=False)  # bf16, eager
    snr = {}
    for on in (True, False):
        model = copy.deepcopy(base)
        calls.clear()
        with norm_grad.norm_grad_add(False):  # eager steps as TE's; the capture sets its own
            handle = fp8vit.make_graphed_blocks(model.train(), 16, norm_grad_add=on)
            captured = len(calls)
            for _ in range(3):
                logits, grads = fp8_step(model, x, "delayed")
        assert (captured >= 4) if on else (captured == 0), captured
        assert handle.replays == 3 and grads.keys() == g_ref.keys()
        snr[on] = (fp8vit.snr_db(ref, logits), {n: fp8vit.snr_db(g_ref[n], g) for n, g in grads.items()})
        handle.release()
    (l_on, g_on), (l_off, g_off) = snr[True], snr[False]
    assert l_on >= 18 and l_on >= l_off - 1.5, (l_on, l_off)
    for name in g_off:
        assert g_on[name] >= g_off[name] - 2, (name, g_on[name], g_off[name])
