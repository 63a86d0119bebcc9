"""fp8vit._te.gemm_residual on the CPU: which of TE's GEMM calls take a block's residual (a stand-in
for TE's modules and FP8 tensors; the cuBLASLt call itself and its numbers against TE's GEMM then
torch's add are tests/gpu/test_residual_gemm_gpu.py)."""

import types

import pytest
import torch

from fp8vit._te import gemm_residual as rg
from fp8vit._te import route
from fp8vit.errors import Check
from fp8vit.tools.workload import VARIANTS, Variant


class _Storage:
    """TE's per-tensor FP8 tensor: rowwise bytes, ``1 / scale``, its format."""

    def __init__(self, rows, cols, fp8_dtype="e4m3"):
        self._data = torch.zeros(rows, cols, dtype=torch.uint8)
        self._transpose = torch.zeros(cols, rows, dtype=torch.uint8)  # columnwise copy: the weight's in dgrad
        self._transpose_invalid = False
        self._scale_inv = torch.ones(1)
        self._fp8_dtype = fp8_dtype


class _Plan:
    def __init__(self):
        self.calls = []

    def run(self, w, w_scale_inv, x, x_scale_inv, bias, residual, out, workspace):
        self.calls.append((w, x, bias, residual))
        out.copy_(2 if residual is None else (residual + 1).view_as(out))


@pytest.fixture
def fake_te(monkeypatch):
    calls = []

    def te_gemm(A, B, *args, **kwargs):
        calls.append((A, B, args, kwargs))
        return "te-out", None, None, None

    mods = {name: types.SimpleNamespace(__name__=name, general_gemm=te_gemm) for name in rg._MODULES}
    mods["transformer_engine.pytorch.tensor.storage.float8_tensor_storage"] = types.SimpleNamespace(
        Float8TensorStorage=_Storage)
    mods["transformer_engine_torch"] = types.SimpleNamespace(DType=types.SimpleNamespace(kFloat8E4M3="e4m3",
                                                                                         kFloat8E5M2="e5m2"))
    mods["transformer_engine.pytorch.cpp_extensions.gemm"] = types.SimpleNamespace(
        get_cublas_workspace=lambda *a: torch.empty(64, dtype=torch.uint8))
    monkeypatch.setattr(rg, "te_module", mods.__getitem__)
    monkeypatch.setattr(route, "te_module", mods.__getitem__)
    monkeypatch.setattr(rg, "_FP8_TYPES", {})
    monkeypatch.setattr(rg, "residual_gemm_support", lambda: Check(True))
    plan = _Plan()
    keys = []
    monkeypatch.setattr(rg, "_plan", lambda key, workspace, operands: keys.append(key) or plan)
    monkeypatch.setattr(rg, "_alignment", lambda ptr: 256)
    yield mods, te_gemm, calls, plan, keys
    assert all(mods[name].general_gemm is te_gemm for name in rg._MODULES)  # restored


def _call(mods, *args, **kwargs):
    return mods[rg._MODULES[0]].general_gemm(*args, **kwargs)


def test_install_and_restore(fake_te):
    mods, te_gemm, *_ = fake_te
    assert not rg.residual_gemm_enabled()
    with rg.residual_gemm(True) as on:
        assert on and rg.residual_gemm_enabled()
        assert all(mods[name].general_gemm is not te_gemm for name in rg._MODULES)
        with rg.residual_gemm(True) as again:  # nested: installed once, restored by the outer
            assert again
        assert rg.residual_gemm_enabled()
    assert not rg.residual_gemm_enabled()
    with rg.residual_gemm(False) as on:
        assert not on and all(mods[name].general_gemm is te_gemm for name in rg._MODULES)
    with rg.residual_gemm(True):  # off inside on (graphs with residual_gemm=False): TE's, then back
        with rg.residual_gemm(False) as on:
            assert not on and all(mods[name].general_gemm is te_gemm for name in rg._MODULES)
        assert rg.residual_gemm_enabled()
    with pytest.raises(RuntimeError), rg.residual_gemm(True):
        raise RuntimeError("a failed capture")
    assert not rg.residual_gemm_enabled()


def test_public_switch_returns_the_previous_setting_and_refuses_with_the_reason(fake_te, monkeypatch):
    import fp8vit
    mods, te_gemm, *_ = fake_te
    assert fp8vit.set_residual_gemm(True) is False and rg.residual_gemm_enabled()
    assert fp8vit.set_residual_gemm(True) is True
    assert fp8vit.set_residual_gemm(False) is True and mods[rg._MODULES[1]].general_gemm is te_gemm
    no = Check(False, "no CUDA device")
    monkeypatch.setattr(rg, "residual_gemm_support", lambda: no)
    monkeypatch.setattr(fp8vit._te, "residual_gemm_support", lambda: no)
    with pytest.raises(RuntimeError, match=r"set_residual_gemm\(True\): no CUDA device; the residual is added after"):
        fp8vit.set_residual_gemm(True)
    assert not rg.residual_gemm_enabled()


def test_not_installed_where_unsupported(fake_te, monkeypatch):
    mods, te_gemm, *_ = fake_te
    monkeypatch.setattr(rg, "residual_gemm_support", lambda: Check(False, "no CUDA device"))
    with rg.residual_gemm(True) as on:
        assert not on and all(mods[name].general_gemm is te_gemm for name in rg._MODULES)


def test_the_matching_gemm_takes_it_once(fake_te):
    # proj's forward GEMM: W [C, C'] (inner C'), X [T, C'], output [T, C] like the residual
    mods, _, calls, plan, keys = fake_te
    r = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    w, x, bias = _Storage(16, 32), _Storage(16, 32), torch.zeros(16, dtype=torch.bfloat16)
    with rg.residual_gemm(True), rg.into_residual(r, 32) as offer:
        out, *rest = _call(mods, w, x, out_dtype=torch.bfloat16, bias=bias, use_split_accumulator=False,
                           quantization_params=None, ub=None, ub_type=None, extra_output=None)
        assert offer.taken and rest == [None, None, None]
        assert out.shape == (16, 16) and torch.equal(out, (r + 1).view(16, 16))
        assert plan.calls[0][2] is bias and plan.calls[0][3] is r
        # m, n, k; fast accumulation, bias, residual; the algorithm search (on by default)
        assert keys[0][1:4] == (16, 16, 32) and keys[0][6:9] == (True, True, True) and keys[0][-1] is True
        assert _call(mods, w, x, out_dtype=torch.bfloat16)[0] == "te-out"  # taken once: the next is TE's
    assert len(calls) == 1 and len(plan.calls) == 1


@pytest.mark.parametrize("change", [
    dict(kwargs=dict(gelu=True)), dict(kwargs=dict(quantization_params=object())),
    dict(kwargs=dict(accumulate=True)), dict(kwargs=dict(layout="NN")), dict(kwargs=dict(grad=True)),
    dict(kwargs=dict(layout="NT")),
    dict(kwargs=dict(out=torch.empty(16, 16, dtype=torch.bfloat16))), dict(kwargs=dict(out_dtype=torch.float32)),
    dict(kwargs=dict(ub=object())), dict(kwargs=dict(bias=torch.zeros(16))),  # an fp32 bias
    dict(kwargs=dict(unknown=1)), dict(args=(torch.bfloat16,)),  # positional: not how TE's modules call it
    dict(inner=16), dict(w=(8, 32)), dict(x=(8, 32)), dict(fmt="mxfp8"),
    dict(residual_dtype=torch.float32), dict(no_offer=True),
])
def test_other_calls_go_to_te(fake_te, change):
    # anything but TE's forward GEMM of the offered shape, in bf16, without extras, runs TE's own
    mods, _, calls, plan, _ = fake_te
    r = torch.randn(16, 16, dtype=change.get("residual_dtype", torch.bfloat16))
    w, x = _Storage(*change.get("w", (16, 32))), _Storage(*change.get("x", (16, 32)))
    if "fmt" in change:
        x = types.SimpleNamespace(_data=x._data, _scale_inv=x._scale_inv)  # not a Float8TensorStorage
    kwargs = dict(out_dtype=torch.bfloat16) | change.get("kwargs", {})
    with rg.residual_gemm(True):
        if change.get("no_offer"):
            assert _call(mods, w, x, *change.get("args", ()), **kwargs)[0] == "te-out"
        else:
            with rg.into_residual(r, change.get("inner", 32)) as offer:
                assert _call(mods, w, x, *change.get("args", ()), **kwargs)[0] == "te-out"
            assert not offer.taken
    assert len(calls) == 1 and not plan.calls


def _dgrad(mods, w, dy, **change):
    # TE's input-gradient call in linear.py / layernorm_mlp.py's backward
    kwargs = dict(layout="NN", grad=True, quantization_params=None, out=None, out_dtype=torch.bfloat16,
                  use_split_accumulator=False, ub=None, ub_type=None, extra_output=None, bulk_overlap=False)
    return _call(mods, w, dy, **(kwargs | change))


def test_input_gradient_gemm_runs_on_the_weights_transpose(fake_te):
    # dx [T, in] = dy [T, out] @ W [out, in]: cuBLASLt's TN form reads W's FP8 transpose [in, out]
    mods, _, calls, plan, keys = fake_te
    w, dy = _Storage(48, 32), _Storage(16, 48, "e5m2")  # W [out=48, in=32], dy [T=16, out=48]
    with rg.residual_gemm(True):
        dx, *rest = _dgrad(mods, w, dy)
    assert not calls and rest == [None, None, None]
    assert dx.shape == (16, 32) and dx.dtype == torch.bfloat16 and torch.equal(dx, torch.full((16, 32), 2.0))
    assert plan.calls[0][0] is w._transpose and plan.calls[0][1] is dy._data and plan.calls[0][2:] == (None, None)
    assert keys[0][1:4] == (32, 16, 48) and keys[0][4:9] == (rg._R_8F_E4M3, rg._R_8F_E5M2, True, False, False)


def test_input_gradient_leaves_an_offer_alone(fake_te):
    mods, _, calls, plan, _ = fake_te
    r = torch.randn(16, 32, dtype=torch.bfloat16)
    with rg.residual_gemm(True), rg.into_residual(r, 48) as offer:
        _dgrad(mods, _Storage(48, 32), _Storage(16, 48, "e5m2"))
    assert not offer.taken and plan.calls[0][3] is None


@pytest.mark.parametrize("change", [
    dict(bias=torch.zeros(32, dtype=torch.bfloat16)), dict(grad=False), dict(quantization_params=object()),
    dict(out=torch.empty(16, 32, dtype=torch.bfloat16)), dict(accumulate=True), dict(out_dtype=torch.float32),
    dict(gelu=True), dict(transpose="invalid"), dict(transpose=None), dict(use_split_accumulator="yes"),
])
def test_other_input_gradient_calls_go_to_te(fake_te, change):
    # a bias gradient, a quantized or given output, accumulation, a GELU, no valid FP8 transpose
    # (Blackwell's TE keeps none): TE's own
    mods, _, calls, plan, _ = fake_te
    w = _Storage(48, 32)
    t = change.pop("transpose", "ok")
    if t == "invalid":
        w._transpose_invalid = True
    elif t is None:
        w._transpose = None
    with rg.residual_gemm(True):
        if change.get("use_split_accumulator") == "yes":
            change["use_split_accumulator"] = True
            _dgrad(mods, w, _Storage(16, 48, "e5m2"), **change)  # split accumulation: a plan of its own
            assert len(plan.calls) == 1 and not calls
            return
        assert _dgrad(mods, w, _Storage(16, 48, "e5m2"), **change)[0] == "te-out"
    assert len(calls) == 1 and not plan.calls


def test_algorithm_search_setting_is_in_the_key(fake_te):
    mods, _, _, _, keys = fake_te
    old = rg.set_algorithm_search(False)
    try:
        assert old is True
        with rg.residual_gemm(True):
            _dgrad(mods, _Storage(48, 32), _Storage(16, 48, "e5m2"))
        assert rg.set_algorithm_search(True) is False
        with rg.residual_gemm(True):
            _dgrad(mods, _Storage(48, 32), _Storage(16, 48, "e5m2"))
    finally:
        rg.set_algorithm_search(old)
    assert [k[-1] for k in keys] == [False, True] and keys[0][:-1] == keys[1][:-1]


def test_a_refused_run_falls_back_to_te(fake_te, monkeypatch):
    mods, _, calls, plan, keys = fake_te

    def refuse(*a):
        raise RuntimeError("cuBLASLt Matmul returned status 15")

    monkeypatch.setattr(plan, "run", refuse)
    monkeypatch.setattr(rg, "_PLANS", {})
    r = torch.randn(16, 16, dtype=torch.bfloat16)
    with rg.residual_gemm(True), rg.into_residual(r, 32) as offer:
        with pytest.warns(RuntimeWarning, match="m=16, n=16, k=32.*status 15"):
            assert _call(mods, _Storage(16, 32), _Storage(16, 32), out_dtype=torch.bfloat16)[0] == "te-out"
    assert not offer.taken and rg._PLANS == {keys[0]: None}


def test_residual_added_passes_the_gradient_to_both():
    x = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(4, 8, requires_grad=True)
    y = rg.residual_added(x, b * 3)  # b * 3 stands for the GEMM's output that holds x already
    (y * torch.arange(8.0)).sum().backward()
    assert torch.equal(x.grad, torch.arange(8.0).expand(4, 8))
    assert torch.equal(b.grad, 3 * torch.arange(8.0).expand(4, 8))


def test_offer_is_scoped():
    r = torch.zeros(2, 2)
    assert rg._OFFER.get() is None
    with rg.into_residual(r, 2) as offer:
        assert rg._OFFER.get() is offer and offer.residual is r and not offer.taken
    assert rg._OFFER.get() is None


def test_alignment():
    assert [rg._alignment(p) for p in (0, 512, 256 + 64, 1024 + 2, 7)] == [256, 256, 64, 2, 1]


def test_unsupported_without_te_or_gpu():
    # CI: no TE (or no CUDA device): the reason says which
    rg.residual_gemm_support.cache_clear()
    ok, why = rg.residual_gemm_support()
    assert ok == (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) and
                  rg.te_status().ok)
    assert ok or why


def test_torchadd_variant():
    assert "fp8vit-fp8-delayed-torchadd-graphed" in VARIANTS
    v = Variant.parse("fp8vit-fp8-delayed-torchadd-graphed")
    assert not v.residual_gemm and v.fp8 == "delayed" and v.graphed
    assert Variant.parse("fp8vit-fp8-delayed-graphed").residual_gemm


def test_heuristic_variant():
    v = Variant.parse("fp8vit-fp8-delayed-heuristic-graphed")
    assert not v.gemm_search and v.residual_gemm and v.fp8 == "delayed" and v.graphed
    assert Variant.parse("fp8vit-fp8-delayed-graphed").gemm_search


def _timed_plan(monkeypatch, costs):
    """A plan whose algorithms take ``costs`` ms a run (None: cuBLASLt refuses it), on a fake clock
    read by fake CUDA events."""
    plan = object.__new__(rg._Plan)
    plan.algos = list(costs)
    plan.algo, plan.rank = plan.algos[0], 0
    clock = [0.0]

    def run(*operands, algo=None):
        assert operands == ("operands",)
        if costs[algo] is None:
            raise RuntimeError("cuBLASLt Matmul returned status 15")
        clock[0] += costs[algo]

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.t = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    plan.run = run
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return plan


def test_search_keeps_the_fastest_and_skips_refused_algorithms(monkeypatch):
    plan = _timed_plan(monkeypatch, {"first": 3.0, "refused": None, "fast": 1.0, "mid": 2.0})
    plan.pick("operands")
    assert plan.algo == "fast" and plan.rank == 2


@pytest.mark.parametrize("why", ["capturing", "deterministic", "one"])
def test_search_keeps_the_heuristics_first(monkeypatch, why):
    # inside a capture nothing can be timed; torch's deterministic mode wants the same algorithm
    # every run; one candidate (the search off) needs no timing
    plan = _timed_plan(monkeypatch, {"first": 3.0, "fast": 1.0} if why != "one" else {"first": 3.0})
    if why == "capturing":
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    if why == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    plan.pick("operands")
    assert plan.algo == "first" and plan.rank == 0


def test_search_raises_where_cublaslt_runs_none(monkeypatch):
    plan = _timed_plan(monkeypatch, {"first": None, "second": None})
    with pytest.raises(RuntimeError, match="none of the heuristic's 2 algorithms"):
        plan.pick("operands")
