"""fp8vit's own FP8 GEMMs (:mod:`fp8vit._te.gemm_residual`): the residual add in the GEMM (lever 61)
against TE's GEMM then torch's add, the input gradients on the fastest algorithm (lever 60) against
TE's.

The GEMM's output is ``round(x W^T + b + r)`` where TE then torch give ``round(round(x W^T + b) + r)``:
within two bf16 roundings of each other. Gradients flow to both the branch and the residual, so
with a loss linear in the output the same output gradient reaches the same backward GEMMs: on the
heuristic's first algorithm (TE's) they equal TE's bit for bit; on another, the input gradients
differ by the order of the fp32 sums, within a bf16 rounding. The module-level tests run current
scaling: each pass quantizes its tensors alike, where delayed scaling would quantize the second
pass with the first's amaxes.
"""

import copy

import pytest
import torch

import fp8vit
from fp8vit._te import gemm_residual as rg
from helpers import bf16_ulps, fp8_step, need_recipe

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_fp8(monkeypatch):
    need_recipe("delayed")
    need_recipe("current")
    ok, why = rg.residual_gemm_support()
    if not ok:
        pytest.skip(f"the residual cannot go into the GEMM here: {why}")
    monkeypatch.setattr(rg, "_PLANS", {})  # each test sees the forms it made
    before = rg.residual_gemm_enabled()  # on: tests/gpu/conftest.py
    search = rg.set_algorithm_search(True)
    yield
    assert rg.set_algorithm_search(search) is True  # the test put it back
    assert rg.residual_gemm_enabled() == before


def _module(kind: str):
    te = fp8vit._te.load_te()
    torch.manual_seed(0)
    if kind == "Linear":
        return te.Linear(256, 256, bias=True, params_dtype=torch.float32).cuda(), 256
    return te.LayerNormMLP(256, 1024, bias=True, activation="gelu").cuda(), 1024


@pytest.mark.parametrize("search", [False, True], ids=["heuristic", "search"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_gemm_adds_the_residual_as_te_then_torch(kind, search):
    rg.set_algorithm_search(search)
    mod, inner = _module(kind)
    x = torch.randn(16, 197, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16, 197, 256, device="cuda")  # the loss is linear in the output: same output gradient
    results = []
    for on in (False, True):
        mod.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with fp8vit.fp8_context("current"), rg.residual_gemm(on) as installed:
            assert installed == on
            with rg.into_residual(xi.detach(), inner) as offer:
                y = mod(xi)
            y = rg.residual_added(xi, y) if offer.taken else xi + y
        assert offer.taken == on
        (y.float() * w).sum().backward()
        results.append((y.detach().float(), xi.grad.clone(), {n: p.grad.clone() for n, p in mod.named_parameters()}))
    rg.set_algorithm_search(True)
    (y_ref, gx_ref, g_ref), (y, gx, g) = results
    # two bf16 roundings apart at most: 2 units of the last place of the largest value
    assert bf16_ulps(y, y_ref) <= 2
    # the input gradient: by fp8vit's GEMM (and LayerNormMLP's fc2 input gradient inside it, on to
    # fc1's weight gradient); bit for bit on TE's algorithm, else within a rounding
    if search:
        assert bf16_ulps(gx, gx_ref) <= 1
        for name in g_ref:
            assert fp8vit.snr_db(g_ref[name], g[name]) >= 40, name
    else:
        assert torch.equal(gx, gx_ref)
        for name in g_ref:
            assert torch.equal(g[name], g_ref[name]), name
    # the forms: the residual one (fc2's or the Linear's), and each GEMM's input gradient
    forms = sorted((k[1], k[3], k[8]) for k, p in rg._PLANS.items() if p is not None)
    dgrads = [(256, 256, False)] if kind == "Linear" else [(256, 1024, False), (1024, 256, False)]
    assert forms == sorted([(256, inner, True), *dgrads]), forms
    assert all(p.rank == 0 for p in rg._PLANS.values()) or search


def test_calls_that_do_not_match_go_to_te():
    # an offer with another inner width, or taken once already: TE's GEMM, the caller adds
    mod, inner = _module("LayerNormMLP")
    x = torch.randn(8, 197, 256, device="cuda", dtype=torch.bfloat16)
    with fp8vit.fp8_context("current"), rg.residual_gemm(True):
        with rg.into_residual(x, inner + 16) as offer:
            mod(x)
        assert not offer.taken
        with rg.into_residual(x, inner) as offer:
            y1 = mod(x)
            assert offer.taken
            y2 = mod(x)  # a second GEMM in the same offer: TE's, no residual in it
    diff = (y1.float() - y2.float() - x.float()).abs().max()
    assert diff <= 2 ** -6 * y1.float().abs().max(), float(diff)


def test_search_keeps_the_fastest_algorithm():
    # ViT-L/16 b128's proj input gradient (n = 128 * 197 rows, 1024 wide): lever 60's
    # microbenchmark found a faster algorithm than the heuristic's first. Timed again here, with
    # more runs, the kept one is not slower than the first (5% for the clock's noise).
    lib = rg.load_cublaslt()
    te = fp8vit._te.load_te()
    n, c = 128 * 197, 1024
    mod = te.Linear(c, c, bias=True, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(n, c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with fp8vit.fp8_context("current"), rg.residual_gemm(True):
        mod(x).float().square().mean().backward()
    [(key, plan)] = [(k, p) for k, p in rg._PLANS.items() if p is not None]
    assert key[1:4] == (c, n, c) and len(plan.algos) > 1, (key, len(plan.algos))
    w = torch.randint(0, 100, (c, c), device="cuda", dtype=torch.uint8)
    dy = torch.randint(0, 100, (n, c), device="cuda", dtype=torch.uint8)
    one, out = torch.ones(1, device="cuda"), torch.empty(n, c, device="cuda", dtype=torch.bfloat16)
    ws = fp8vit._te.te_module("transformer_engine.pytorch.cpp_extensions.gemm").get_cublas_workspace(
        torch.cuda.current_device(), False, False)  # the size the plan's algorithms were chosen for

    def timed(algo) -> float:
        for _ in range(3):
            plan.run(w, one, dy, one, None, None, out, ws, algo=algo)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            plan.run(w, one, dy, one, None, None, out, ws, algo=algo)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 20

    kept, first = timed(plan.algo), timed(plan.algos[0])
    print(f"cuBLASLt {lib.cublasLtGetVersion()}: kept rank {plan.rank} of {len(plan.algos)}, "
          f"{kept * 1e3:.1f} us vs the first's {first * 1e3:.1f} us")
    assert kept <= first * 1.05, (plan.rank, kept, first)


@pytest.mark.parametrize("model_kwargs", [{}, {"init_values": 1e-5}])
def test_graphs_take_it_in_plain_blocks_and_train_alike(model_kwargs):
    # make_graphed_blocks' forward graphs put both adds of a classic ViT block in the GEMMs (blocks
    # with LayerScale add as before). The third step of a graphed ViT at fixed weights (two FP8
    # steps first: delayed scaling's initial scale 1 flushes small gradients to zero in E5M2),
    # against the same model in bf16: as close with it as without it, above the suite's floors
    # (numerics.md). Two FP8 runs are not compared with each other: a last-bit change of an
    # activation moves its amax, so the next FP8 casts round everything differently.
    import timm
    torch.manual_seed(0)
    base = fp8vit.convert_to_te(timm.create_model("vit_base_patch16_224", depth=2, num_classes=10,
                                                  **model_kwargs).cuda())
    x = torch.randn(16, 3, 224, 224, device="cuda")

    ref, g_ref = fp8_step(copy.deepcopy(base).train(), x, "delayed", enabled=False)  # bf16, FP8 off, eager
    snr = {}
    for on in (True, False):
        rg._PLANS.clear()
        model = copy.deepcopy(base)
        handle = fp8vit.make_graphed_blocks(model.train(), 16, residual_gemm=on)
        forms = sorted(k[3] for k, p in rg._PLANS.items() if p is not None and k[8])
        assert forms == ([768, 3072] if on and not model_kwargs else []), forms
        # the input gradients (qkv's, proj's, fc1's, fc2's: m, k), with LayerScale too
        dgrads = sorted(k[1:4:2] for k, p in rg._PLANS.items() if p is not None and not k[8])
        assert dgrads == ([(768, 768), (768, 2304), (768, 3072), (3072, 768)] if on else []), dgrads
        for _ in range(3):
            logits, grads = fp8_step(model, x, "delayed")
        assert handle.replays == 3 and grads.keys() == g_ref.keys()
        snr[on] = (fp8vit.snr_db(ref, logits), {n: fp8vit.snr_db(g_ref[n], g) for n, g in grads.items()})
        handle.release()
    (l_on, g_on), (l_off, g_off) = snr[True], snr[False]
    # H100: 20.0 dB with, 20.1 without (a 2-block model's third FP8 step at batch 16 sits at the
    # suite's 20 dB floor either way); the check is the comparison
    assert l_on >= 18 and l_on >= l_off - 1.5, (l_on, l_off)
    worst = min(g_on, key=g_on.get)
    assert g_on[worst] >= 12, (worst, g_on[worst])
    for name in g_off:
        assert g_on[name] >= g_off[name] - 2, (name, g_on[name], g_off[name])
