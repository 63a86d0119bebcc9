"""FP8 carried by the model on the GPU: a loop with no ``fp8_context`` (the loop's own bf16 autocast,
or none) really trains the fused blocks in FP8 (TE's delayed-scaling state moves; the step runs TE's
FP8 kernels), eagerly and with CUDA-graphed blocks, as the explicit ``fp8_context`` loop does; eval
under ``inference_mode`` runs FP8 too. CPU wiring: tests/test_model_autocast.py.
"""

import contextlib
import warnings

import pytest
import timm
import torch

import fp8vit
from fp8vit._te.fp8 import _delayed_states
from fp8vit._te.recipes import recipe_name
from helpers import LOGITS_DB, need_recipe, snr_db, train_steps

pytestmark = pytest.mark.gpu

B = 16  # 16 x 197 token rows: aligned for FP8


@pytest.fixture(autouse=True)
def _fresh_warnings():
    from fp8vit import _warn
    _warn._seen.clear()


def _need_fp8():
    info = fp8vit.gpu_info()
    if not info.fp8.ok:
        pytest.skip(f"FP8 cannot run here: {info.fp8.reason}")


def _vit(autocast=True, depth=2, recipe=None):
    """ViT-B/16 of ``depth`` blocks, converted; ``autocast``: carrying FP8 (with ``recipe``)."""
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", pretrained=False, depth=depth, num_classes=10)
    model = fp8vit.convert_to_te(model.cuda(), autocast=autocast).train()
    return fp8vit.set_fp8_autocast(model, recipe=recipe) if autocast and recipe is not None else model


def _data(n=3, batch=B):
    g = torch.Generator("cuda").manual_seed(1)
    return [(torch.randn(batch, 3, 224, 224, device="cuda", generator=g),
             torch.randint(0, 10, (batch,), device="cuda", generator=g)) for _ in range(n)]


def _train(model, data, loop, recipe=None, like=None):
    """SGD steps; ``loop``: "unchanged" (no context), "amp" (the loop's own bf16 autocast) or
    "explicit" (``fp8_context(recipe)``). Returns the losses.

    ``like="unchanged"``: the explicit loop's loss from fp32 logits, as the unchanged loop computes it
    (the model hands out fp32 outside autocast; cross entropy of bf16 logits inside autocast differs
    by ~6e-4 at the first step, and a diverging lr=1e-2 run on random data amplifies it)."""
    ctx = {"unchanged": contextlib.nullcontext, "amp": lambda: torch.autocast("cuda", dtype=torch.bfloat16),
           "explicit": lambda: fp8vit.fp8_context(recipe)}[loop]
    run = (lambda x: model(x).float()) if like == "unchanged" else model
    return train_steps(run, data, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), ctx)


def _forward_scaling(model):
    """[(module, amax over the whole history, scale)] of the forward delayed-scaling state of every TE
    module with GEMMs (not DotProductAttention's: it runs in bf16 unless the recipe asks for fp8_dpa)."""
    return [(name, st.amax_history.amax(0).clone(), st.scale.clone())
            for name, key, st in _delayed_states(model)
            if key == "scaling_fwd" and "DotProductAttention" not in type(model.get_submodule(name)).__name__]


def _assert_fp8_ran(model):
    """Every GEMM module of the blocks recorded amaxes and moved its scales off their initial 1."""
    states = _forward_scaling(model)
    assert len(states) >= 3 * len(model.blocks), [n for n, _, _ in states]  # qkv, proj, mlp per block
    for name, amax, scale in states:
        assert bool((amax > 0).any()), f"{name}: no amax recorded: FP8 did not run"
        assert not bool(torch.all(scale == 1)), f"{name}: scales never updated"


def _assert_same_scaling(a, b):
    sa, sb = _forward_scaling(a), _forward_scaling(b)
    assert [n for n, _, _ in sa] == [n for n, _, _ in sb]
    for (name, amax_a, scale_a), (_, amax_b, scale_b) in zip(sa, sb):
        torch.testing.assert_close(amax_a, amax_b, rtol=1e-3, atol=0, msg=name)
        torch.testing.assert_close(scale_a, scale_b, rtol=1e-3, atol=0, msg=name)


def _fp8vit_warnings(record):
    return [str(w.message) for w in record if str(w.message).startswith("fp8vit:")]


def _assert_same_losses(la, lb):
    # The same kernels in the same order as the explicit loop: equal up to run-to-run noise.
    assert len(la) == len(lb) and all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(la, lb)), (la, lb)


@pytest.mark.parametrize("loop", ["unchanged", "amp"])
def test_a_loop_without_fp8_context_trains_in_fp8_as_the_explicit_loop(loop):
    need_recipe("delayed")  # its scaling state shows that FP8 ran
    data = _data()
    model, explicit = _vit(recipe="delayed"), _vit(autocast=False)
    assert all(not bool((amax > 0).any()) for _, amax, _ in _forward_scaling(model))  # nothing recorded yet
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        losses = _train(model, data, loop)
    assert not _fp8vit_warnings(record)  # no "FP8 is off" fallback
    reference = _train(explicit, data, "explicit", "delayed", like=loop)
    print(f"{loop}: losses {losses}, explicit fp8_context {reference}")
    _assert_fp8_ran(model)
    _assert_same_losses(losses, reference)
    _assert_same_scaling(model, explicit)


def _kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if str(e.device_type).endswith("CUDA")}


def _fp8_kernels(names):
    return {n for n in names if "fp8" in n.lower() or "e4m3" in n.lower() or "e5m2" in n.lower()}


def test_the_unchanged_step_runs_te_fp8_kernels():
    _need_fp8()
    data = _data(1)
    model, explicit = _vit(), _vit(autocast=False)
    for m, loop in ((model, "unchanged"), (explicit, "explicit")):
        _train(m, data, loop)  # warm-up
    mine = _kernel_names(lambda: _train(model, data, "unchanged"))
    theirs = _kernel_names(lambda: _train(explicit, data, "explicit"))
    with fp8vit.fp8_context(enabled=False):  # decides: the same model in bf16
        bf16 = _kernel_names(lambda: _train(model, data, "amp"))
    print(f"FP8 kernels of the unchanged step: {sorted(k[:60] for k in _fp8_kernels(mine))}")
    assert _fp8_kernels(mine), "no FP8 kernel in the step: FP8 did not run"
    assert _fp8_kernels(mine) == _fp8_kernels(theirs)
    assert not _fp8_kernels(mine) <= _fp8_kernels(bf16)


@pytest.mark.parametrize("recipe", list(fp8vit.RECIPE_NAMES))
def test_the_models_recipe_runs_and_an_explicit_context_overrides_it(recipe):
    need_recipe(recipe)
    seen = []

    def recorded(model):
        model.blocks[0].register_forward_pre_hook(
            lambda m, a: seen.append(recipe_name(fp8vit._te.active_fp8_recipe())))
        return model

    model = recorded(_vit(recipe=recipe))
    losses = _train(model, _data(2), "unchanged")
    assert seen == [recipe, recipe] and all(torch.isfinite(torch.tensor(losses)))
    other = "current" if recipe != "current" else "delayed"
    need_recipe(other)
    model = recorded(_vit(recipe=recipe))  # fresh TE modules: no recipe switch on the same ones
    _train(model, _data(1), "explicit", other)
    assert seen[-1] == other and len(seen) == 3


@pytest.mark.parametrize("loop", ["unchanged", "amp"])
def test_graphed_blocks_replay_inside_the_models_fp8(loop):
    need_recipe("delayed")
    data = _data(4)
    model, explicit = _vit(depth=3, recipe="delayed"), _vit(autocast=False, depth=3)
    handle = fp8vit.make_graphed_blocks(model, B, recipe="delayed")
    reference_handle = fp8vit.make_graphed_blocks(explicit, B, recipe="delayed")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        losses = _train(model, data, loop)
    assert not _fp8vit_warnings(record)  # no eager fallback, no "FP8 is off"
    reference = _train(explicit, data, "explicit", "delayed", like=loop)
    print(f"graphed {loop}: losses {losses}, explicit fp8_context {reference}")
    assert handle.replays == len(data) and handle.eager_calls == 0
    assert reference_handle.replays == len(data) and reference_handle.eager_calls == 0
    _assert_same_losses(losses, reference)
    _assert_fp8_ran(model)
    _assert_same_scaling(model, explicit)


@pytest.mark.parametrize("guard", ["inference_mode", "no_grad"])
def test_eval_runs_fp8(guard):
    _need_fp8()
    data = _data(2)
    model = _vit()
    _train(model, data, "unchanged")  # scales from training (no_grad forwards do not update them)
    model.eval()
    x = data[0][0]
    with getattr(torch, guard)():
        out = model(x)
        with fp8vit.fp8_context():  # the explicit eval: the model calls through
            ref = model(x)
        with fp8vit.fp8_context(enabled=False):
            bf16 = model(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    same, vs_bf16 = snr_db(ref.float(), out), snr_db(bf16.float(), out)
    print(f"eval {guard}: vs explicit FP8 {same:.1f} dB, vs bf16 {vs_bf16:.1f} dB")
    assert same > 60  # the same FP8 forward
    assert LOGITS_DB <= vs_bf16 < 50  # FP8's rounding, not bf16's


def test_a_model_cast_to_bf16_by_the_framework_trains_in_fp8():
    need_recipe("delayed")
    data = _data()
    model = _vit(recipe="delayed").to(torch.bfloat16)  # e.g. Lightning's "bf16-true"
    explicit = _vit(autocast=False).to(torch.bfloat16)
    losses = _train(model, data, "unchanged")
    reference = _train(explicit, data, "explicit", "delayed", like="unchanged")
    print(f"bf16 weights: losses {losses}, explicit fp8_context {reference}")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    _assert_fp8_ran(model)
    _assert_same_losses(losses, reference)
    _assert_same_scaling(model, explicit)
