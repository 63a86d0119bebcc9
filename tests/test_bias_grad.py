"""fp8vit._te.bias_grad on the CPU: how TE's fused bias-gradient call is routed (a stand-in
for TE's extension module; the kernel itself and its numbers against TE's are
tests/gpu/test_bias_grad_gpu.py)."""

import types

import pytest
import torch

from fp8vit._te import bias_grad
from fp8vit.errors import Check
from fp8vit.tools.workload import VARIANTS, Variant


class _Float8Quantizer:
    rowwise_usage = columnwise_usage = True


@pytest.fixture
def fake_te(monkeypatch):
    calls = []
    tex = types.SimpleNamespace(bgrad_quantize=lambda *a, **k: calls.append(("bgrad", a, k)) or "te-bgrad",
                                dbias_dgelu=lambda *a, **k: calls.append(("dgelu", a, k)) or "te-dgelu")
    mods = {"transformer_engine_torch": tex,
            "transformer_engine.pytorch.tensor.float8_tensor": types.SimpleNamespace(Float8Quantizer=_Float8Quantizer)}
    monkeypatch.setattr(bias_grad, "te_module", mods.__getitem__)
    monkeypatch.setattr(bias_grad, "triton_support", lambda: Check(True))
    originals = (tex.bgrad_quantize, tex.dbias_dgelu)
    yield tex, originals, calls
    bias_grad.set_bias_grad_kernel(False)
    assert (tex.bgrad_quantize, tex.dbias_dgelu) == originals


def test_install_and_restore(fake_te):
    tex, originals, _ = fake_te
    assert not bias_grad.bias_grad_kernel_enabled()
    assert bias_grad.set_bias_grad_kernel(True) and bias_grad.bias_grad_kernel_enabled()
    assert tex.bgrad_quantize is bias_grad._bgrad_quantize
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
        assert on and tex.bgrad_quantize is bias_grad._bgrad_quantize
        with bias_grad.bias_grad_kernel(False) as on2:
            assert on2 is False and tex.bgrad_quantize is originals[0]
        assert tex.bgrad_quantize is bias_grad._bgrad_quantize
    assert tex.bgrad_quantize is originals[0] and not bias_grad.bias_grad_kernel_enabled()
    with pytest.raises(RuntimeError), bias_grad.bias_grad_kernel(True):
        raise RuntimeError("a failed capture")
    assert tex.bgrad_quantize is originals[0]


def test_public_switch_returns_the_previous_setting_and_refuses_without_triton(fake_te, monkeypatch):
    import fp8vit
    tex, originals, _ = fake_te
    assert fp8vit.set_bias_grad_kernel(True) is False and tex.bgrad_quantize is bias_grad._bgrad_quantize
    assert fp8vit.set_bias_grad_kernel(True) is True
    assert fp8vit.set_bias_grad_kernel(False) is True and tex.bgrad_quantize is originals[0]
    assert fp8vit.set_bias_grad_kernel(False) is False
    no = Check(False, "no CUDA device")
    monkeypatch.setattr(bias_grad, "triton_support", lambda: no)
    monkeypatch.setattr(fp8vit._te.kernels, "triton_support", lambda: no)
    with pytest.raises(RuntimeError, match=r"set_bias_grad_kernel\(True\).*\(no CUDA device\); TE's kernel stays"):
        fp8vit.set_bias_grad_kernel(True)
    assert tex.bgrad_quantize is originals[0]


# ---- lever 67: a forked tensor's two gradients summed in the kernel of the sum's reader


class _Reader(torch.autograd.Function):
    """Stands for a TE Linear whose output is the forked tensor: its backward hands the gradient it
    gets to ``bgrad_quantize`` with ``quantizer`` (None: never calls it), as TE's
    ``grad_output_preprocess`` does, and records the result."""

    @staticmethod
    def forward(ctx, w, tex, quantizer, seen):
        ctx.tex, ctx.quantizer, ctx.seen = tex, quantizer, seen
        return w * 1.0

    @staticmethod
    def backward(ctx, g):
        if ctx.quantizer is not None:
            ctx.seen.append(ctx.tex.bgrad_quantize(g.reshape(-1, g.shape[-1]).contiguous(), ctx.quantizer))
        return g, None, None, None


@pytest.fixture
def forked(fake_te, monkeypatch):
    """The fake TE with fp8vit's bias-gradient call installed and lever 67 on; the kernel (CUDA
    only) replaced by a stand-in that sums in fp32 and records each call."""
    tex, _, calls = fake_te
    casts = []

    def cast(grad, quantizer, shape, addend=None, total=None):
        if addend is not None:
            total.copy_((grad.float() + addend.float()).to(total.dtype))
        casts.append((quantizer, addend is not None))
        return f"dbias{len(casts)}", torch.full(shape, len(casts))  # stands for the FP8 tensor

    monkeypatch.setattr(bias_grad, "_cast", cast)
    monkeypatch.setattr(bias_grad, "_takes", lambda grad, q: isinstance(q, _Float8Quantizer))
    monkeypatch.setattr(bias_grad, "active_fp8_recipe", lambda: _Recipe(True))
    bias_grad.set_bias_grad_kernel(True)
    old = bias_grad.set_gradient_sum_kernel(True)
    yield tex, calls, casts
    bias_grad.set_gradient_sum_kernel(old)


def _names(seen):
    """(bias gradient, which cast) per bgrad_quantize result; the FP8 tensor has the [B N, C] shape
    TE hands bgrad_quantize"""
    assert all(fp8.shape == (6, 4) for _, fp8 in seen)
    return [(db, int(fp8[0, 0])) for db, fp8 in seen]


def _forked_step(tex, owner, quantizer, seen):
    """w -> reader (quantizer) -> x, forked: loss = sum(3 a) + sum(b * b); returns w's gradient."""
    w = torch.linspace(-1, 1, 24, dtype=torch.bfloat16).view(2, 3, 4).requires_grad_(True)  # [B, N, C]
    x = _Reader.apply(w, tex, quantizer, seen)
    a, b = bias_grad.residual_fork(owner, "mlp", x)
    assert a is not b
    ((a.float() * 3).sum() + (b.float() ** 2).sum()).backward()
    assert not bias_grad._READY and not bias_grad._SUMS  # nothing kept past the backward pass
    return w.grad, (3 + 2 * w.detach().float()).to(torch.bfloat16)


class _Recipe:
    def __init__(self, delayed):
        self._delayed = delayed

    def delayed(self):
        return self._delayed


def test_gradient_sum_is_off_by_default_and_needs_the_bias_grad_kernel_and_delayed_fp8(fake_te, monkeypatch):
    recipe = [_Recipe(True)]
    monkeypatch.setattr(bias_grad, "active_fp8_recipe", lambda: recipe[0])
    x = torch.ones(2, 4, requires_grad=True)
    owner = torch.nn.Linear(1, 1)

    def unforked(t):
        a, b = bias_grad.residual_fork(owner, "attn", t)
        return a is t and b is t
    assert unforked(x)  # off
    old = bias_grad.set_gradient_sum_kernel(True)
    try:
        assert old is False
        assert unforked(x)  # the bias-gradient kernel is not installed
        bias_grad.set_bias_grad_kernel(True)
        assert unforked(x.detach())  # no gradient to sum
        with torch.no_grad():
            assert unforked(x)
        recipe[0] = None  # no FP8 autocast: no FP8 backward casts the sum
        assert unforked(x)
        recipe[0] = _Recipe(False)  # not delayed scaling: not the kernel's
        assert unforked(x)
        recipe[0] = _Recipe(True)
        a, b = bias_grad.residual_fork(owner, "attn", x)
        assert a is not x and b is not x and torch.equal(a, x) and torch.equal(b, x)
    finally:
        bias_grad.set_gradient_sum_kernel(False)


def test_the_sums_reader_is_learned_then_the_sum_is_made_in_its_cast(forked):
    tex, calls, casts = forked
    owner, q, seen = torch.nn.Linear(1, 1), _Float8Quantizer(), []
    grad, expected = _forked_step(tex, owner, q, seen)  # step 1: torch's add; bgrad_quantize learns q
    assert torch.equal(grad, expected)
    assert casts == [(q, False)] and _names(seen) == [("dbias1", 1)]
    grad, expected = _forked_step(tex, owner, q, seen)  # step 2: summed in q's cast, once
    assert torch.equal(grad, expected)
    assert casts[1:] == [(q, True)] and _names(seen)[1] == ("dbias2", 2)
    assert not calls  # TE's own function never ran


def test_a_fused_sum_nobody_reads_or_another_reader_unlearns_the_site(forked):
    tex, calls, casts = forked
    owner, q, seen = torch.nn.Linear(1, 1), _Float8Quantizer(), []
    _forked_step(tex, owner, q, seen)
    grad, expected = _forked_step(tex, owner, None, seen)  # fused for q, then not read: dropped
    assert torch.equal(grad, expected) and casts[1:] == [(q, True)]
    site = bias_grad._SITES[owner]["mlp"]
    assert site.quantizer is None
    _forked_step(tex, owner, q, seen)  # learned again
    q2 = _Float8Quantizer()
    grad, expected = _forked_step(tex, owner, q2, seen)  # fused for q, read with q2: cast anew for q2
    assert torch.equal(grad, expected)
    assert casts[-2:] == [(q, True), (q2, False)] and _names(seen)[-1] == (f"dbias{len(casts)}", len(casts))
    assert site.quantizer is None and not calls


def test_forksum_variant():
    assert "fp8vit-fp8-delayed-forksum-graphed" in VARIANTS
    assert Variant.parse("fp8vit-fp8-delayed-forksum-graphed").grad_sum
    assert not Variant.parse("fp8vit-fp8-delayed-graphed").grad_sum
