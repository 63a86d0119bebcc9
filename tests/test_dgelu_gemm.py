"""fp8vit._te.dgelu_gemm on the CPU: which GEMM of TE's ``LayerNormMLP`` backward is deferred, what
the fused call asks of TE's ``general_gemm``, and every way back to TE's own two steps (stand-ins
for TE's modules in TE 2.20's call order; the numbers against TE's are
tests/gpu/test_bias_grad_gpu.py)."""

import types

import pytest
import torch

from fp8vit._te import dgelu_gemm

T, C, H = 8, 16, 64
W2, W1, ACT = "fc2.weight", "fc1.weight", "act_out"  # operands: the stand-ins only pass them on
DGRAD = dict(layout="NN", grad=True, quantization_params=None, out_dtype=torch.bfloat16, gelu=False,
             gelu_in=None, use_split_accumulator=True, ub=None, ub_type=None)  # TE 2.20's fc2 dgrad call


class Float8Quantizer:
    def __init__(self, columnwise=True):
        self.rowwise_usage, self.columnwise_usage = True, columnwise
        self.scale, self.dtype = torch.tensor([4.0]), "E5M2"


class Recipe:
    def __init__(self, delayed=True):
        self._delayed = delayed

    def delayed(self):
        return self._delayed


def _ctx(**changes):
    ctx = dict(fp8=True, fp8_recipe=Recipe(), activation="gelu", debug=False, bias_gelu_fusion=False,
               ub_overlap_ag=False, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=False, ub_bulk_wgrad=False,
               fc1_grad_output_quantizer=Float8Quantizer())
    ctx.update(changes)
    return types.SimpleNamespace(**{k: v for k, v in ctx.items() if v is not _MISSING})


_MISSING = object()


@pytest.fixture
def te(monkeypatch):
    """TE's layernorm_mlp module and extension as stand-ins that log each call; yields
    ``(mlp, tex, calls)`` with the fusion installed, and checks TE's functions come back."""
    calls = []

    def general_gemm(A, B, *args, **kwargs):
        calls.append(("gemm", A, B, args, kwargs))
        if kwargs.get("gelu") and kwargs.get("grad"):  # the fused call: an FP8 tensor's parts
            out = types.SimpleNamespace(_data=torch.zeros(T, H, dtype=torch.uint8), _transpose=torch.zeros(H, T, dtype=torch.uint8),
                                        _scale_inv=torch.zeros(1), _transpose_invalid=True)
            return out, None, None, None
        return f"out of {A}", None, None, None

    def dbias_dgelu(grad, fwd_input, quantizer, *args, **kwargs):
        calls.append(("te-dbias_dgelu", grad, fwd_input, quantizer, args, kwargs))
        return ["te-dbias", "te-dact"]

    class _LayerNormMLP:
        @staticmethod
        def backward(ctx, dy, fc1_out=None, first_call=DGRAD, gelu_backward=True):
            # TE 2.20's order: fc2 dgrad, fc2 wgrad, the GELU's backward, fc1 dgrad
            fc2_dgrad = mlp.general_gemm(W2, dy, **first_call)[0]
            if not gelu_backward:  # a TE whose backward no longer calls dbias_dgelu on it
                return "grads"
            mlp.general_gemm(ACT, dy, layout="NT", grad=True)
            dbias, dact = tex.dbias_dgelu(fc2_dgrad, fc1_out, ctx.fc1_grad_output_quantizer)
            mlp.general_gemm(W1, dact, **DGRAD)
            return dbias, dact

    tex = types.SimpleNamespace(dbias_dgelu=dbias_dgelu, DType=types.SimpleNamespace(kFloat8E5M2="E5M2"))
    mlp = types.SimpleNamespace(_LayerNormMLP=_LayerNormMLP, general_gemm=general_gemm)
    mods = {"transformer_engine_torch": tex, "transformer_engine.pytorch.module.layernorm_mlp": mlp,
            "transformer_engine.pytorch.tensor.float8_tensor": types.SimpleNamespace(Float8Quantizer=Float8Quantizer)}
    monkeypatch.setattr(dgelu_gemm, "te_module", mods.__getitem__)
    monkeypatch.setattr(dgelu_gemm, "te_version", lambda: "2.20.2")
    originals = (_LayerNormMLP.backward, general_gemm, dbias_dgelu)
    assert dgelu_gemm.set_dgelu_gemm(True) and dgelu_gemm.dgelu_gemm_enabled()
    yield mlp, tex, calls
    assert dgelu_gemm.set_dgelu_gemm(False) is False
    assert (_LayerNormMLP.backward, mlp.general_gemm, tex.dbias_dgelu) == originals
    assert getattr(dgelu_gemm._LOCAL, "state", None) is None


def _gemms(calls):
    """Each GEMM call as (A, layout, whether the GELU's backward is in it)."""
    return [(c[1], c[4].get("layout"), bool(c[4].get("gelu"))) for c in calls if c[0] == "gemm"]


def _kernel_stand_in(monkeypatch, log):
    monkeypatch.setattr(dgelu_gemm, "_takes", lambda fwd_input, quantizer: True)  # a CUDA input, in effect
    monkeypatch.setattr(dgelu_gemm, "fp8_transpose_dbias",
                        lambda data, data_t, scale_inv, e5m2, dtype: log.append((data.shape, data_t.shape, float(scale_inv), e5m2, dtype)) or "dbias")


def test_fc2_dgrad_runs_with_the_gelu_backward_in_its_epilogue(te, monkeypatch):
    mlp, tex, calls = te
    log = []
    _kernel_stand_in(monkeypatch, log)
    fc1_out, ctx = torch.zeros(T, H, dtype=torch.bfloat16), _ctx()
    dbias, dact = mlp._LayerNormMLP.backward(ctx, "dy", fc1_out)
    # fc2's dgrad waits for the GELU's backward and runs there, fused; fc1's dgrad is TE's call
    assert _gemms(calls) == [(ACT, "NT", False), (W2, "NN", True), (W1, "NN", False)]
    fused = calls[1][4]
    assert fused == dict(DGRAD, gelu=True, gelu_in=fc1_out, quantization_params=ctx.fc1_grad_output_quantizer)
    assert not [c for c in calls if c[0] == "te-dbias_dgelu"]
    # the transpose and bias gradient from the GEMM's FP8 bytes, scaled by 1 / scale
    assert log == [((T, H), (H, T), 0.25, True, torch.bfloat16)]
    assert dbias == "dbias" and float(dact._scale_inv) == 0.25 and dact._transpose_invalid is False


@pytest.mark.parametrize("change", [dict(activation="relu"), dict(fp8=False), dict(fp8_recipe=Recipe(delayed=False)),
                                    dict(fp8_recipe=None), dict(debug=True), dict(bias_gelu_fusion=True),
                                    dict(ub_bulk_dgrad=True), dict(ub_overlap_ag=True), dict(debug=_MISSING),
                                    dict(fc1_grad_output_quantizer=object())],
                         ids=lambda c: "-".join(f"{k}={'missing' if v is _MISSING else type(v).__name__ if not isinstance(v, (bool, str, type(None))) else v}" for k, v in c.items()))
def test_other_backwards_run_tes_calls(te, change):
    mlp, tex, calls = te
    fc1_out = torch.zeros(T, H, dtype=torch.bfloat16)
    assert mlp._LayerNormMLP.backward(_ctx(**change), "dy", fc1_out) == ("te-dbias", "te-dact")
    assert _gemms(calls) == [(W2, "NN", False), (ACT, "NT", False), (W1, "NN", False)]
    assert [c[1] for c in calls if c[0] == "te-dbias_dgelu"] == [f"out of {W2}"]


@pytest.mark.parametrize("first_call", [dict(DGRAD, gelu=True), dict(DGRAD, out="buffer"), dict(DGRAD, layout="NT"),
                                        dict(DGRAD, out_dtype=torch.float32), dict(DGRAD, ub="userbuffers")],
                         ids=["gelu", "out", "NT", "fp32-out", "ub"])
def test_a_first_grad_gemm_of_another_form_is_not_deferred(te, first_call):
    # only TE 2.20's fc2 dgrad form is deferred, and only the backward's first grad GEMM can be it:
    # fc1's dgrad (NN, the same form) later in the same backward runs as TE calls it
    mlp, tex, calls = te
    mlp._LayerNormMLP.backward(_ctx(), "dy", torch.zeros(T, H, dtype=torch.bfloat16), first_call)
    assert [c[1] for c in calls if c[0] == "gemm"] == [W2, ACT, W1]
    assert calls[0][4] == first_call and calls[3][4] == DGRAD


def test_where_the_kernel_does_not_take_the_input_tes_two_steps_run(te):
    # a CPU pre-GELU input (fp8vit's kernel needs CUDA), a quantizer without the transpose, extra
    # arguments: TE's dgrad GEMM with the deferred arguments exactly, then TE's dbias_dgelu
    mlp, tex, calls = te
    for fc1_out, quantizer in ((torch.zeros(T, H, dtype=torch.bfloat16), Float8Quantizer()),
                               (torch.zeros(T, H, dtype=torch.bfloat16), Float8Quantizer(columnwise=False))):
        calls.clear()
        out = mlp._LayerNormMLP.backward(_ctx(fc1_grad_output_quantizer=quantizer), "dy", fc1_out)
        assert out == ("te-dbias", "te-dact")
        assert _gemms(calls) == [(ACT, "NT", False), (W2, "NN", False), (W1, "NN", False)]
        assert calls[1][4] == DGRAD
        assert [(c[1], c[2] is fc1_out, c[3] is quantizer) for c in calls if c[0] == "te-dbias_dgelu"] == [(f"out of {W2}", True, True)]


def test_a_backward_that_never_takes_the_deferred_dgrad_raises(te):
    mlp, tex, calls = te
    with pytest.raises(RuntimeError, match=r"lever 59.*did not pass fc2's deferred dgrad.*TE's version \(2\.20\.2\)"):
        mlp._LayerNormMLP.backward(_ctx(), "dy", None, DGRAD, False)
    assert mlp._LayerNormMLP.backward(_ctx(activation="relu"), "dy", None, DGRAD, False) == "grads"  # not deferred


def test_outside_a_backward_tes_functions_run_as_called(te):
    mlp, tex, calls = te
    assert mlp.general_gemm(W2, "dy", **DGRAD)[0] == f"out of {W2}"
    assert tex.dbias_dgelu("g", "x", "q") == ["te-dbias", "te-dact"]
    assert [c[0] for c in calls] == ["gemm", "te-dbias_dgelu"]


def test_turning_off_needs_no_te():
    assert dgelu_gemm.set_dgelu_gemm(False) is False


def test_where_cublaslt_refuses_the_epilogue_tes_two_steps_run_from_then_on(te, monkeypatch):
    mlp, tex, calls = te
    _kernel_stand_in(monkeypatch, [])
    monkeypatch.setattr(dgelu_gemm, "_REFUSED", [])
    tes = dgelu_gemm._TE_FUNCTIONS["general_gemm"]
    error = "Unable to find suitable cuBLAS GEMM algorithm"  # TE's message where cuBLASLt has none

    def refusing(A, B, *args, **kwargs):
        if kwargs.get("gelu"):
            raise RuntimeError(error)
        return tes(A, B, *args, **kwargs)
    fc1_out = torch.zeros(T, H, dtype=torch.bfloat16)
    dgelu_gemm._TE_FUNCTIONS["general_gemm"] = refusing
    try:
        with pytest.warns(UserWarning, match=r"cuBLASLt refuses .*Unable to find suitable cuBLAS GEMM algorithm.*lever 59"):
            assert mlp._LayerNormMLP.backward(_ctx(), "dy", fc1_out) == ("te-dbias", "te-dact")
        assert _gemms(calls) == [(ACT, "NT", False), (W2, "NN", False), (W1, "NN", False)]
        calls.clear()
        mlp._LayerNormMLP.backward(_ctx(), "dy", fc1_out)  # not asked again
        assert _gemms(calls) == [(ACT, "NT", False), (W2, "NN", False), (W1, "NN", False)]
        assert dgelu_gemm._REFUSED == [error]
        error = "an illegal memory access"  # any other error is a bug: raised
        dgelu_gemm._REFUSED.clear()
        with pytest.raises(RuntimeError, match="illegal memory access"):
            mlp._LayerNormMLP.backward(_ctx(), "dy", fc1_out)
    finally:
        dgelu_gemm._TE_FUNCTIONS["general_gemm"] = tes
