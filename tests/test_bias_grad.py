"""fp8vit._te.bias_grad on the CPU: how TE's fused bias-gradient call is routed (a stand-in
for TE's extension module; the kernel itself and its numbers against TE's are
tests/gpu/test_bias_grad_gpu.py)."""

import types

import pytest
import torch

from fp8vit._te import bias_grad, route
from fp8vit.errors import Check
from fp8vit.tools.workload import VARIANTS, Variant


class _Float8Quantizer:
    rowwise_usage = columnwise_usage = True


def _routed(tex):
    """Whether TE's function is fp8vit's now (bound to TE's own)."""
    return getattr(tex.bgrad_quantize, "func", None) is bias_grad._bgrad_quantize


@pytest.fixture
def fake_te(monkeypatch):
    calls = []
    tex = types.SimpleNamespace(bgrad_quantize=lambda *a, **k: calls.append(("bgrad", a, k)) or "te-bgrad",
                                dbias_dgelu=lambda *a, **k: calls.append(("dgelu", a, k)) or "te-dgelu")
    mods = {"transformer_engine_torch": tex,
            "transformer_engine.pytorch.tensor.float8_tensor": types.SimpleNamespace(Float8Quantizer=_Float8Quantizer)}
    monkeypatch.setattr(bias_grad, "te_module", mods.__getitem__)
    monkeypatch.setattr(route, "te_module", mods.__getitem__)
    monkeypatch.setattr(bias_grad, "triton_support", lambda: Check(True))
    originals = (tex.bgrad_quantize, tex.dbias_dgelu)
    yield tex, originals, calls
    bias_grad.set_bias_grad_kernel(False)
    assert (tex.bgrad_quantize, tex.dbias_dgelu) == originals


def test_install_and_restore(fake_te):
    tex, originals, _ = fake_te
    assert not bias_grad.bias_grad_kernel_enabled()
    assert bias_grad.set_bias_grad_kernel(True) and bias_grad.bias_grad_kernel_enabled()
    assert _routed(tex)
    assert tex.dbias_dgelu is originals[1]  # fc1's GELU backward stays TE's (faster there)
    assert bias_grad.set_bias_grad_kernel(True)  # twice: TE's functions are still the ones kept
    assert bias_grad.set_bias_grad_kernel(False) is False
    assert (tex.bgrad_quantize, tex.dbias_dgelu) == originals


def test_not_installed_where_triton_cannot_run(fake_te, monkeypatch):
    tex, originals, _ = fake_te
    monkeypatch.setattr(bias_grad, "triton_support", lambda: Check(False, "no CUDA device"))
    assert bias_grad.set_bias_grad_kernel(True) is False
    assert (tex.bgrad_quantize, tex.dbias_dgelu) == originals


def test_what_the_kernel_does_not_take_goes_to_te(fake_te):
    # CPU tensors (fp8vit's kernels need CUDA), other quantizers, none: TE's own function, with the
    # same arguments; dbias_dgelu is never routed
    tex, _, calls = fake_te
    bias_grad.set_bias_grad_kernel(True)
    g = torch.zeros(4, 16, dtype=torch.bfloat16)
    q, other = _Float8Quantizer(), object()
    assert tex.bgrad_quantize(g, q) == "te-bgrad" and tex.bgrad_quantize(g, other) == "te-bgrad"
    assert tex.bgrad_quantize(g, None) == "te-bgrad"
    assert tex.dbias_dgelu(g, g, q) == "te-dgelu" and tex.dbias_dgelu(g, g, q, alpha=1.0) == "te-dgelu"
    assert [(c[0], c[1][-1] if c[1] else None, c[2]) for c in calls] == [
        ("bgrad", q, {}), ("bgrad", other, {}), ("bgrad", None, {}), ("dgelu", q, {}), ("dgelu", q, {"alpha": 1.0})]


def test_turning_off_needs_no_te():
    # off while never on: nothing to restore, TE not imported (a CPU machine without TE)
    assert bias_grad.set_bias_grad_kernel(False) is False


def test_tedbias_variant():
    # graphed variants capture fp8vit's kernel unless -tedbias- says TE's
    assert "fp8vit-fp8-delayed-tedbias-graphed" in VARIANTS
    v = Variant.parse("fp8vit-fp8-delayed-tedbias-graphed")
    assert not v.triton_dbias and v.fp8 == "delayed" and v.graphed
    assert Variant.parse("fp8vit-fp8-delayed-graphed").triton_dbias


def test_context_restores_the_previous_setting(fake_te):
    tex, originals, _ = fake_te
    with bias_grad.bias_grad_kernel(True) as on:
        assert on and _routed(tex)
        with bias_grad.bias_grad_kernel(False) as on2:
            assert on2 is False and tex.bgrad_quantize is originals[0]
        assert _routed(tex)
    assert tex.bgrad_quantize is originals[0] and not bias_grad.bias_grad_kernel_enabled()
    with pytest.raises(RuntimeError), bias_grad.bias_grad_kernel(True):
        raise RuntimeError("a failed capture")
    assert tex.bgrad_quantize is originals[0]


def test_public_switch_returns_the_previous_setting_and_refuses_without_triton(fake_te, monkeypatch):
    import fp8vit
    tex, originals, _ = fake_te
    assert fp8vit.set_bias_grad_kernel(True) is False and _routed(tex)
    assert fp8vit.set_bias_grad_kernel(True) is True
    assert fp8vit.set_bias_grad_kernel(False) is True and tex.bgrad_quantize is originals[0]
    assert fp8vit.set_bias_grad_kernel(False) is False
    no = Check(False, "no CUDA device")
    monkeypatch.setattr(bias_grad, "triton_support", lambda: no)
    monkeypatch.setattr(fp8vit._te.kernels, "triton_support", lambda: no)
    with pytest.raises(RuntimeError, match=r"set_bias_grad_kernel\(True\).*\(no CUDA device\); TE's kernel stays"):
        fp8vit.set_bias_grad_kernel(True)
    assert tex.bgrad_quantize is originals[0]


def test_turning_on_without_te_names_te(monkeypatch):
    # where TE does not import, that is the reason given (before Triton's)
    from fp8vit.errors import TEUnavailableError

    def no_te(name):
        raise TEUnavailableError("transformer_engine is not installed")
    monkeypatch.setattr(bias_grad, "te_module", no_te)
    monkeypatch.setattr(bias_grad, "triton_support", lambda: Check(False, "no CUDA device"))
    with pytest.raises(TEUnavailableError, match="not installed"):
        bias_grad.set_bias_grad_kernel(True)
    assert not bias_grad.bias_grad_kernel_enabled()
