"""FP8 carried by the model (``set_fp8_autocast``, ``convert_to_te(autocast=True)``) on the CPU.

The reference backend: ``fp8_context`` falls back to bf16 autocast here, so these tests check the
wiring (the context entered once per forward, with which recipe, dtype and group; calling through
an enclosing one; the same output as the explicit ``with fp8_context(): model(x)`` loop, bit for
bit) and everything around it (modes, pickling, DDP, FSDP2, ``torch.compile``, conversion and its
summary). That FP8 really runs is tests/gpu/test_model_autocast_gpu.py's.
"""

import contextlib
import copy
import inspect
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import ResPostBlock, VisionTransformer

import fp8vit
from fp8vit import _te, _warn
from fp8vit.errors import Check
from fp8vit.training import context, detect
from fp8vit.training.autocast import FP8Forward
from fp8vit.training.detect import GPUInfo
from helpers import WORLD, dp_batches, full_params, max_diff, rank_results, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:fp8vit. FP8 is off:RuntimeWarning")


def _timm_vit(**kw):
    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4, num_classes=3, **kw)


def _vit(autocast=True, **kw):
    return fp8vit.convert_to_te(_timm_vit(**kw), backend="reference", exact_gelu=True, autocast=autocast)


def _x(n=2):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def entries(monkeypatch):
    """Every entry into fp8vit's FP8 context (explicit ``fp8_context`` and the model's own), as
    ``(recipe, enabled, dtype, strict, amax_reduction_group)``."""
    seen = []
    inner = context._fp8_context

    def spy(*args):
        seen.append(args)
        return inner(*args)

    monkeypatch.setattr(context, "_fp8_context", spy)
    return seen


@pytest.fixture
def fake_fp8(monkeypatch):
    """FP8 'on' without TE: the resolved recipe and TE's autocast record what they were given.

    Returns ``{"recipes": [recipe asked for, ...], "te": [(enabled, recipe, group), ...]}``."""
    seen = {"recipes": [], "te": []}

    class FakeRecipe:
        def delayed(self):
            return True

    @contextlib.contextmanager
    def fake_autocast(enabled, recipe, amax_reduction_group=None):
        seen["te"].append((enabled, recipe, amax_reduction_group))
        yield

    def resolve(recipe, support):
        seen["recipes"].append(recipe)
        return FakeRecipe()

    info = GPUInfo(name="GPU", capability=None, arch="Hopper", recipes={r: Check(True) for r in fp8vit.RECIPE_NAMES},
                   default_recipe="delayed", fp8=Check(True))
    monkeypatch.setattr(context, "gpu_info", lambda: info)
    monkeypatch.setattr(context, "resolve_recipe", resolve)
    monkeypatch.setattr(context._te, "autocast", fake_autocast)
    return seen


def _seen_autocast(model):
    """Record ``(cpu autocast on, its dtype)`` inside the first block's forward, per call."""
    seen = []
    model.blocks[0].register_forward_pre_hook(
        lambda m, a: seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
    return seen


# --------------------------------------------------------------------------- the unchanged loop
@pytest.mark.parametrize("mode", ["train", "eval", "no_grad", "inference_mode", "eval_inference_mode"])
def test_the_model_enters_the_context_once_per_forward_and_computes_the_explicit_loops_output(entries, mode):
    model, x = _vit(), _x()
    model.train(mode == "train" or mode in ("no_grad", "inference_mode"))
    guard = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
             "eval_inference_mode": torch.inference_mode}.get(mode, contextlib.nullcontext)
    seen = _seen_autocast(model)
    with guard():
        out = model(x)                  # no context in the loop
        assert len(entries) == 1 and entries[0] == (None, True, torch.bfloat16, False, None)
        with fp8vit.fp8_context():      # the explicit loop: the model calls through
            ref = model(x)
    assert len(entries) == 2 and seen == [(True, torch.bfloat16)] * 2
    # computed in bf16, handed back in fp32 (the loss after it then runs as under autocast)
    assert ref.dtype == torch.bfloat16 and out.dtype == torch.float32 and torch.equal(out, ref.float())
    if mode == "train":
        out.float().sum().backward()
        assert all(p.grad is not None for p in model.parameters())


def test_training_steps_equal_the_explicit_loops_bit_for_bit(entries):
    a, b = _vit(), _vit(autocast=False)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (a, b))
    for x, y in dp_batches():
        F.cross_entropy(a(x), y).backward()          # unchanged loop
        with fp8vit.fp8_context():
            loss = F.cross_entropy(b(x), y)
        loss.backward()
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert len(entries) == 6 and max_diff(full_params(a), full_params(b)) == 0.0


def test_the_callers_autocast_dtype_is_kept(entries):
    model, x = _vit(), _x()
    seen = _seen_autocast(model)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    assert entries[-1][2] is None  # no torch autocast of its own: the caller's stays
    assert seen == [(True, torch.float16)] and out.dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    with fp8vit.fp8_context():
        ref = model(x)
    assert torch.equal(out, ref)


def test_fp8_context_around_the_model_decides(entries):
    model, x = _vit(), _x()
    with fp8vit.fp8_context(enabled=False, dtype=None):  # FP8 and autocast off, explicitly
        out = model(x)
    assert len(entries) == 1 and out.dtype == torch.float32


def test_te_autocast_around_the_model_calls_through(entries, monkeypatch):
    model = _vit()
    monkeypatch.setattr(_te, "active_fp8_recipe", lambda: object())  # as inside te.autocast(recipe=...)
    assert model(_x()).dtype == torch.float32 and entries == []


def test_recipe_dtype_and_amax_group_reach_te(fake_fp8, entries):
    model, x = _vit(), _x()
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    fp8vit.set_fp8_autocast(model, recipe="current", dtype=torch.float16, amax_reduction_group=group)
    seen = _seen_autocast(model)
    model(x)
    assert fake_fp8["recipes"] == ["current"] and fake_fp8["te"][-1][0] is True and fake_fp8["te"][-1][2] is group
    assert seen[-1] == (True, torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the caller's autocast: TE's FP8 part only
        model(x)
    assert len(fake_fp8["te"]) == 2 and fake_fp8["te"][-1][2] is group and seen[-1] == (True, torch.bfloat16)
    fp8vit.set_fp8_autocast(model)  # again: replaces the settings
    model(x)
    assert fake_fp8["recipes"][-1] is None and fake_fp8["te"][-1][2] is None and seen[-1] == (True, torch.bfloat16)
    with fp8vit.fp8_context("delayed"):  # an explicit context: one TE autocast, its recipe
        model(x)
    assert fake_fp8["recipes"][-1] == "delayed" and len(fake_fp8["te"]) == 4 and len(entries) == 4


def test_without_fp8_it_runs_bf16_with_one_warning():
    if torch.cuda.is_available():
        pytest.skip("this test checks the no-GPU fallback; a GPU is visible here")
    _warn._seen.clear()
    detect.clear_cache()
    model = _vit()
    with pytest.warns(RuntimeWarning, match="FP8 is off.*no CUDA GPU") as record:
        for _ in range(3):
            assert model(_x()).dtype == torch.float32
    assert len([w for w in record if "FP8 is off" in str(w.message)]) == 1


def test_a_named_recipe_that_cannot_run_raises_at_the_forward():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without FP8")
    model = fp8vit.set_fp8_autocast(_vit(), recipe="delayed")
    with pytest.raises(fp8vit.FP8UnavailableError, match="recipe 'delayed' cannot run here"):
        model(_x())


# --------------------------------------------------------------------------- installing and removing
def test_setting_it_twice_or_converting_twice_installs_one_forward(entries):
    model = _vit()
    fp8vit.set_fp8_autocast(model)
    fp8vit.convert_to_te(model, backend="reference", exact_gelu=True, autocast=True)
    forward = vars(model)["forward"]
    assert isinstance(forward, FP8Forward) and forward.inner is None
    model(_x())
    assert len(entries) == 1


def test_a_wrapper_around_an_fp8_carrying_model_can_carry_it_too(entries):
    model, x = _vit(), _x()
    ref = model(x)
    outer = fp8vit.set_fp8_autocast(torch.nn.Sequential(model))  # e.g. a framework's wrapper module
    assert torch.equal(outer(x), ref) and len(entries) == 2  # the inner model calls through


def test_disabling_and_convert_from_te_remove_it():
    model = _vit()
    assert fp8vit.set_fp8_autocast(model, False) is model
    assert "forward" not in vars(model) and "extra_repr" not in vars(model)
    assert "FP8" not in repr(model).splitlines()[1]
    assert fp8vit.conversion_summary(model).fp8_forward is None
    fp8vit.set_fp8_autocast(model, False)  # nothing to remove: fine
    fp8vit.set_fp8_autocast(model)
    fp8vit.convert_from_te(model)
    assert "forward" not in vars(model) and "extra_repr" not in vars(model)
    assert model(_x()).dtype == torch.float32  # plain timm again


def test_a_model_without_fp8_modules_is_refused():
    model = _timm_vit()
    with pytest.raises(ValueError, match=r"holds no fp8vit block .*convert_to_te\(model\) first"):
        fp8vit.set_fp8_autocast(model)
    assert "forward" not in vars(model)
    with pytest.warns(UserWarning, match="excluded.*autocast=True installed no FP8 forward"):
        fp8vit.convert_to_te(model, backend="reference", module_filter_fn=lambda m, fqn: False, autocast=True)
    assert "forward" not in vars(model)
    with pytest.warns(UserWarning, match="holds nothing fp8vit can convert.*autocast=True installed no FP8"):
        fp8vit.convert_to_te(torch.nn.Sequential(torch.nn.ReLU()), autocast=True)


def test_the_state_dict_is_unchanged():
    with_it, without = _vit(), _vit(autocast=False)
    a, b = with_it.state_dict(), without.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    without.load_state_dict(a)
    with_it.load_state_dict(b)


def test_summary_and_repr_say_fp8_runs_inside_the_model():
    model = _vit()
    summary = fp8vit.conversion_summary(model)
    assert "inside the model's forward" in summary.fp8_forward and "recipe the GPU's default" in summary.fp8_forward
    assert f"FP8: {summary.fp8_forward}" in summary.table()
    assert summary.short().endswith("; FP8 inside the model's forward")
    assert summary.to_dict()["fp8_forward"] == summary.fp8_forward
    fp8vit.set_fp8_autocast(model, recipe="mxfp8", dtype=torch.float16)
    text = repr(model)
    assert text.splitlines()[0] == "VisionTransformer("
    assert text.splitlines()[1] == f"  fp8vit: FP8 {fp8vit.conversion_summary(model).fp8_forward}"
    assert "recipe 'mxfp8', torch.float16 autocast" in text and "(patch_embed): PatchEmbed(" in text
    assert "FP8: inside fp8_context() only" in str(fp8vit.conversion_summary(_vit(autocast=False)))
    assert inspect.signature(model.forward) == inspect.signature(VisionTransformer.forward.__get__(model))


@pytest.mark.parametrize("arg", ["recipe", "dtype", "enabled", "model"])
def test_bad_arguments_change_nothing(arg):
    model = _vit()
    forward = vars(model)["forward"]
    bad = {"recipe": dict(recipe="dealyed"), "dtype": dict(dtype=torch.float32), "enabled": dict(enabled=1)}
    with pytest.raises((TypeError, ValueError), match="set_fp8_autocast"):
        if arg == "model":
            fp8vit.set_fp8_autocast("model")
        else:
            fp8vit.set_fp8_autocast(model, **bad[arg])
    assert vars(model)["forward"] is forward and forward.recipe is None and forward.dtype is torch.bfloat16


# --------------------------------------------------------------------------- copies, casts, compile
def test_pickle_and_deepcopy(entries):
    model, x = _vit(), _x()
    ref = model(x)
    for other in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        forward = vars(other)["forward"]
        assert isinstance(forward, FP8Forward) and forward.model is other
        assert torch.equal(other(x), ref) and "fp8vit: FP8 inside" in repr(other)
    assert len(entries) == 3


def test_a_process_group_is_shared_by_a_deepcopy_and_refused_by_pickle():
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    model = fp8vit.set_fp8_autocast(_vit(), amax_reduction_group=group)
    ema = copy.deepcopy(model)  # timm's ModelEmaV3 copies the model so
    assert vars(ema)["forward"].amax_reduction_group is group and vars(ema)["forward"].model is ema
    with pytest.raises(TypeError, match=r"cannot be pickled: call fp8vit.set_fp8_autocast\(model, "
                                        r"amax_reduction_group=None\) before saving"):
        pickle.dumps(model)


def test_a_model_cast_to_bf16_by_the_framework(entries):
    model, x = _vit().to(torch.bfloat16), _x()
    assert isinstance(vars(model)["forward"], FP8Forward)
    out = model(x)
    with fp8vit.fp8_context():
        ref = model(x)
    assert out.dtype == torch.float32 and torch.equal(out, ref.float()) and len(entries) == 2
    out.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_torch_compile_of_the_model(entries):
    model, x = _vit(), _x()
    ref = model(x)
    compiled = torch.compile(model, backend="eager")
    torch._dynamo.reset()
    out = compiled(x)
    assert torch.equal(out, ref) and len(entries) == 2  # the wrapper runs eagerly, once per call
    with torch.autocast("cpu", dtype=torch.float16):
        assert compiled(x).dtype == torch.float16  # recompiled under the caller's autocast
    out.float().sum().backward()


def test_a_model_that_is_a_block_keeps_both_checkpointing_and_fp8():
    # fallback="linear" on a bare block: set_grad_checkpointing installs its forward on the root too
    torch.manual_seed(0)
    block = fp8vit.convert_to_te(ResPostBlock(64, 4), backend="reference", fallback="linear", autocast=True)
    x = torch.randn(2, 5, 64)
    ref = block(x)
    fp8vit.set_grad_checkpointing(block)
    forward = vars(block)["forward"]
    assert isinstance(forward, FP8Forward) and type(forward.inner).__name__ == "_CheckpointedForward"
    out = block(x.requires_grad_())
    out.float().sum().backward()
    assert torch.equal(out, ref)
    fp8vit.set_grad_checkpointing(block, False)
    assert vars(block)["forward"] is forward and forward.inner is None
    fp8vit.set_grad_checkpointing(block)
    fp8vit.set_fp8_autocast(block, False)
    assert type(vars(block)["forward"]).__name__ == "_CheckpointedForward"


def test_the_fp8_context_marker_is_reset_after_an_error(entries):
    model = _vit()
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5, 32, 32))  # wrong channels
    assert context.active_fp8_state() is None
    model(_x())
    assert len(entries) == 2


# --------------------------------------------------------------------------- DDP and FSDP2, 2 gloo processes
def _explicit(net, batches, rank, opt=None, unchanged=False):
    """SGD steps of rank ``rank``'s half of each batch, in the explicit fp8_context loop (or unchanged)."""
    n = batches[0][0].shape[0] // WORLD
    opt = opt or torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        with contextlib.nullcontext() if unchanged else fp8vit.fp8_context():
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _counting():
    inner, seen = context._fp8_context, []

    def spy(*args):
        seen.append(args)
        return inner(*args)

    context._fp8_context = spy
    return seen, inner


def _case_ddp(rank, tmp):
    warnings.simplefilter("ignore")
    batches = dp_batches()
    ref = torch.nn.parallel.DistributedDataParallel(_vit(autocast=False))
    _explicit(ref, batches, rank)
    model = _vit()
    fp8vit.set_fp8_autocast(model, amax_reduction_group=torch.distributed.group.WORLD)  # once the group exists
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    seen, inner = _counting()
    try:
        _explicit(ddp, batches, rank, unchanged=True)
        with torch.no_grad():
            ddp.eval()(batches[0][0])
    finally:
        context._fp8_context = inner
    return {"diff": max_diff(full_params(ref), full_params(ddp)), "entries": len(seen),
            "group_passed": all(args[4] is torch.distributed.group.WORLD for args in seen)}


def _case_fsdp2(rank, tmp):
    warnings.simplefilter("ignore")
    batches = dp_batches()
    ref = fp8vit.shard_model(_vit(autocast=False))
    _explicit(ref, batches, rank)
    model = fp8vit.shard_model(_vit())  # converted with autocast=True, then sharded
    seen, inner = _counting()
    try:
        _explicit(model, batches, rank, unchanged=True)
    finally:
        context._fp8_context = inner
    return {"diff": max_diff(full_params(ref), full_params(model)), "entries": len(seen),
            "fp8_forward": fp8vit.conversion_summary(model).fp8_forward is not None}


CASES = {name[len("_case_"):]: fn for name, fn in dict(globals()).items() if name.startswith("_case_")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(CASES, str(tmp_path_factory.mktemp("autocast_dist")))


def test_ddp_unchanged_loop_equals_the_explicit_loop(ranks):
    for r in rank_results(ranks, "ddp"):
        assert r["diff"] == 0.0 and r["entries"] == len(dp_batches()) + 1 and r["group_passed"]


def test_fsdp2_unchanged_loop_equals_the_explicit_loop(ranks):
    for r in rank_results(ranks, "fsdp2"):
        assert r["diff"] == 0.0 and r["entries"] == len(dp_batches()) and r["fp8_forward"]
