"""The fork/join that lets a LayerNorm backward add the skip path's gradient (:mod:`fp8vit._te.norm_grad`),
on the CPU: where no norm takes the parked gradient (here TE's function stands in, and the kernel
never takes CPU tensors), the fork adds it, so ``x`` gets autograd's gradient for ``branch(x) + x``
exactly once, and nothing stays parked; the route in and out of TE's extension (a stand-in). The kernel
path: tests/gpu/test_norm_grad_gpu.py."""

import types

import pytest
import torch

from fp8vit._te import norm_grad


def _te_layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma):
    """TE's ``layernorm_bwd`` as torch computes it (no bias: dbeta is the column sum)."""
    x = x.detach().requires_grad_()
    w = gamma.detach().requires_grad_()
    with torch.enable_grad():  # called inside a backward
        torch.nn.functional.layer_norm(x, x.shape[-1:], w).backward(dz)
    return [x.grad, w.grad, dz.sum(0)]


class _TENorm(torch.autograd.Function):
    """A LayerNorm whose backward goes through ``tex.layernorm_bwd``, as TE's modules' do."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.nn.functional.layer_norm(x, x.shape[-1:], w)

    @staticmethod
    def backward(ctx, dz):
        x, w = ctx.saved_tensors
        C = x.shape[-1]
        mu = x.reshape(-1, C).mean(1)
        rs = x.reshape(-1, C).var(1, unbiased=False).add(1e-5).rsqrt()
        dx, dw, _ = norm_grad._layernorm_bwd(_te_layernorm_bwd, dz.reshape(-1, C), x.reshape(-1, C), mu, rs, w, 0,
                                             False)
        return dx.view_as(x), dw


@pytest.mark.parametrize("routed", [False, True], ids=["torch-norm", "routed-norm-declines"])
def test_fork_adds_the_skip_gradient_where_no_norm_took_it(routed):
    # The block's pattern: the branch reads x through fork, its output already holds x (added
    # with x detached, as lever 61's GEMM adds it) and goes through join. Where the branch's norm
    # is routed here but declines (CPU tensors: the kernel takes none), TE's function runs and the
    # fork adds the parked gradient; x's gradient is autograd's for branch(x) + x either way.
    torch.manual_seed(0)
    x0, w, m, g = torch.randn(3, 5, 8), torch.randn(8) + 1, torch.randn(8, 8), torch.randn(3, 5, 8)

    def branch(x):
        h = _TENorm.apply(x, w) if routed else torch.nn.functional.layer_norm(x, x.shape[-1:], w)
        return h @ m

    x = x0.clone().requires_grad_()
    (branch(x) + x).backward(g)
    ref = x.grad
    x = x0.clone().requires_grad_()
    slot = norm_grad.Slot()
    norm_grad.join(branch(norm_grad.fork(x, slot)) + x.detach(), slot).backward(g)
    torch.testing.assert_close(x.grad, ref, rtol=1e-6, atol=1e-6)
    assert not norm_grad._PARKED and slot.grad is None and not slot.taken


def test_the_route_declines_cpu_tensors_and_leaves_the_slot_to_the_fork():
    calls = []
    x = torch.randn(4, 8)
    slot = norm_grad.Slot()
    norm_grad.fork(x.requires_grad_(), slot)
    slot.grad = torch.ones(4, 8)
    norm_grad._PARKED[slot.key] = slot
    out = norm_grad._layernorm_bwd(lambda *a: calls.append(a) or ["te"], torch.ones(4, 8), x.detach(), torch.zeros(4),
                                   torch.ones(4), torch.ones(8), 0, False)
    assert out == ["te"] and len(calls) == 1
    assert not slot.taken and slot.grad is not None  # the fork will add it
    assert not norm_grad._PARKED  # looked up once, not left for an unrelated norm


def test_route_installs_restores_and_drops_parked_gradients(monkeypatch):
    # TE's extension stands in; turning the route off gives TE its function back and forgets
    # gradients parked by a backward that never reached its norm (else a later tensor at the same
    # address could take a stale one)
    from fp8vit._te import route
    from fp8vit.errors import Check, TEUnavailableError
    tex = types.SimpleNamespace(layernorm_bwd=_te_layernorm_bwd)
    monkeypatch.setattr(norm_grad, "triton_support", lambda: Check(False, "no CUDA device"))

    def no_te(name):
        raise TEUnavailableError("transformer_engine is not installed")
    monkeypatch.setattr(norm_grad, "te_module", no_te)
    with pytest.raises(TEUnavailableError, match="not installed"):  # TE's reason first, not Triton's
        norm_grad.set_norm_grad_add(True)
    for mod in (route, norm_grad):
        monkeypatch.setattr(mod, "te_module", {"transformer_engine_torch": tex}.__getitem__)
    assert norm_grad.set_norm_grad_add(True) is False and tex.layernorm_bwd is _te_layernorm_bwd
    monkeypatch.setattr(norm_grad, "triton_support", lambda: Check(True))
    try:
        with norm_grad.norm_grad_add(True) as on:
            assert on and norm_grad.norm_grad_add_enabled()
            assert tex.layernorm_bwd.func is norm_grad._layernorm_bwd and tex.layernorm_bwd.args == (_te_layernorm_bwd,)
            norm_grad._PARKED[(-1, 0, 1)] = norm_grad.Slot()
        assert tex.layernorm_bwd is _te_layernorm_bwd and not norm_grad._PARKED
        assert not norm_grad.norm_grad_add_enabled()
    finally:
        norm_grad.set_norm_grad_add(False)
        norm_grad._PARKED.clear()
