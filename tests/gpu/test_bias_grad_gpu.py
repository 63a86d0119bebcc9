"""fp8vit's bias-gradient kernel (:mod:`fp8vit._te.bias_grad`) against TE's own fused call.

The FP8 bytes of the cast and of its transpose, the amax and ``1 / scale`` equal TE's exactly (the
same fp32 product, saturated and rounded to nearest). The bias gradient is the same fp32 column sum
in another order: within bf16 rounding of TE's. Then a TE ``Linear`` and ``LayerNormMLP`` train one
FP8 step alike with it and without. Row counts are multiples of 8: TE's own cast-transpose (the
reference) asserts rows % 4, its modules under FP8 want multiples of 8 and their FP8 weight-gradient
GEMMs multiples of 16.
"""

import pytest
import torch

import fp8vit
from helpers import need_recipe, need_triton

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_fp8_and_triton():
    need_recipe("delayed")
    need_triton()
    yield
    fp8vit._te.set_bias_grad_kernel(False)


def _tex():
    return fp8vit._te.te_module("transformer_engine_torch")


def _quantizer(e5m2: bool, scale: float):
    f8 = fp8vit._te.te_module("transformer_engine.pytorch.tensor.float8_tensor").Float8Quantizer
    dt = _tex().DType.kFloat8E5M2 if e5m2 else _tex().DType.kFloat8E4M3
    return f8(scale=torch.tensor([scale], device="cuda"), amax=torch.zeros(1, device="cuda"), fp8_dtype=dt)


def _both(fn_name, *args, e5m2, scale):
    """(TE's result, fp8vit's result, TE's quantizer, fp8vit's quantizer) for one call."""
    fp8vit._te.set_bias_grad_kernel(False)
    q_te = _quantizer(e5m2, scale)
    ref = getattr(_tex(), fn_name)(*args, q_te)
    assert fp8vit._te.set_bias_grad_kernel(True)
    q_ours = _quantizer(e5m2, scale)
    got = getattr(_tex(), fn_name)(*args, q_ours)
    fp8vit._te.set_bias_grad_kernel(False)
    return ref, got, q_te, q_ours


def _check(ref, got, q_te, q_ours, rows, cols):
    (db_ref, t_ref), (db, t) = ref, got
    assert t._data.shape == t_ref._data.shape and t._transpose.shape == t_ref._transpose.shape
    assert torch.equal(t._transpose.view(cols, rows), t._data.view(rows, cols).t())
    assert torch.equal(t._transpose, t_ref._transpose)
    assert torch.equal(t._scale_inv, t_ref._scale_inv)
    assert torch.equal(t._data, t_ref._data)
    assert torch.equal(q_ours.amax, q_te.amax)
    assert db.dtype == db_ref.dtype and db.shape == db_ref.shape == (cols,)
    torch.testing.assert_close(db.float(), db_ref.float(), rtol=1e-2, atol=1e-2 * float(db_ref.float().abs().mean()))


@pytest.mark.parametrize("e5m2", [True, False])
@pytest.mark.parametrize("shape", [(8, 197, 768), (592, 2304), (136, 96), (104, 48), (8, 1, 1000)])
def test_bgrad_quantize_matches_te(shape, e5m2):
    torch.manual_seed(0)
    g = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3
    rows, cols = g.numel() // shape[-1], shape[-1]
    ref, got, q_te, q_ours = _both("bgrad_quantize", g, e5m2=e5m2, scale=7.0)
    _check(ref, got, q_te, q_ours, rows, cols)
    assert float(q_ours.amax) == float(g.abs().max())


def test_saturation_and_fallbacks():
    # values beyond the FP8 range saturate as TE's cast does; a quantizer without the transpose
    # (rowwise only) and a non-contiguous gradient go to TE's function
    g = torch.tensor([[1e6, -1e6, 1.0, 0.0]] * 8, device="cuda", dtype=torch.bfloat16)
    ref, got, _, _ = _both("bgrad_quantize", g, e5m2=False, scale=1.0)
    assert torch.equal(got[1]._data, ref[1]._data)
    assert fp8vit._te.set_bias_grad_kernel(True)
    q = _quantizer(False, 1.0)
    q.set_usage(rowwise=True, columnwise=False)
    db, t = _tex().bgrad_quantize(g, q)
    assert t._transpose is None or t._transpose_invalid  # TE's own path: no transpose made
    gt = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16).t()
    db, t = _tex().bgrad_quantize(gt, _quantizer(False, 1.0))
    torch.testing.assert_close(db.float(), gt.float().sum(0), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_te_modules_train_alike(kind):
    # one FP8 step of a TE module from the same state and inputs: the input's and the weights'
    # gradients equal to TE's own (the same FP8 bytes go into the GEMMs), bias gradients within bf16
    te = fp8vit._te.load_te()
    results = []
    for on in (False, True):
        torch.manual_seed(0)
        mod = (te.Linear(256, 384, bias=True) if kind == "Linear"
               else te.LayerNormMLP(256, 1024, bias=True, activation="gelu")).cuda()
        x = torch.randn(16, 197, 256, device="cuda", requires_grad=True)
        assert fp8vit._te.set_bias_grad_kernel(on) == on
        with fp8vit.fp8_context("delayed"):
            y = mod(x)
        (y.float() ** 2).mean().backward()
        results.append({n: p.grad.clone() for n, p in mod.named_parameters()} | {"x": x.grad.clone()})
    ref, got = results
    for name in ref:
        if "bias" in name:
            torch.testing.assert_close(got[name].float(), ref[name].float(), rtol=2e-2, atol=1e-5)
        else:
            assert torch.equal(got[name], ref[name]), name


@pytest.mark.parametrize("triton_dbias", [True, False])
def test_graphs_capture_the_chosen_kernel_and_restore_the_setting(monkeypatch, triton_dbias):
    # make_graphed_blocks' backward graphs run fp8vit's kernel by default (each fp8vit block's
    # qkv, proj, fc1's... Linears: the calls TE routes through bgrad_quantize), TE's with
    # triton_dbias=False; the process-wide setting is what it was before the capture
    import timm
    from fp8vit._te import bias_grad
    calls = []
    real = bias_grad.cast_transpose_dbias
    monkeypatch.setattr(bias_grad, "cast_transpose_dbias", lambda *a: calls.append(a[0].shape) or real(*a))
    fp8vit._te.set_bias_grad_kernel(False)
    torch.manual_seed(0)
    model = fp8vit.convert_to_te(timm.create_model("vit_base_patch16_224", depth=2, num_classes=10).cuda())
    handle = fp8vit.make_graphed_blocks(model.train(), 16, triton_dbias=triton_dbias)
    assert not fp8vit._te.bias_grad_kernel_enabled()
    assert bool(calls) == triton_dbias, calls
    if triton_dbias:  # every call is one of the blocks' output gradients: 16 x 197 token rows
        assert {rows for rows, _ in calls} == {16 * 197} and {c for _, c in calls} >= {768, 3 * 768}
    x = torch.randn(16, 3, 224, 224, device="cuda")
    with fp8vit.fp8_context("delayed"):
        loss = model(x).float().square().mean()
    loss.backward()
    assert handle.replays == 1 and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    handle.release()
