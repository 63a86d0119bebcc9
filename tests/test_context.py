"""fp8_context: fallback with one warning, strict mode, recipe validation."""

import warnings

import pytest
import torch

import fp8vit
from fp8vit import _warn
from fp8vit.training import context, detect
from fp8vit.training.detect import GPUInfo
from fp8vit.errors import Check


def _info(fp8_ok, recipes=None, default=None, cap=(9, 0)):
    recipes = recipes or {r: Check(fp8_ok, "" if fp8_ok else "no FP8 here") for r in fp8vit.RECIPE_NAMES}
    return GPUInfo(name="GPU", capability=cap, arch="Hopper",
                   recipes={r: Check(*c) for r, c in recipes.items()}, default_recipe=default,
                   fp8=Check(fp8_ok, "" if fp8_ok else "no FP8 here"))


@pytest.fixture(autouse=True)
def _fresh():
    _warn._seen.clear()
    yield
    detect.clear_cache()


def test_cpu_fallback_warns_once_and_runs_autocast():
    # This machine (CI) has no GPU: FP8 off, bf16 autocast on, one warning with the reason.
    if torch.cuda.is_available():
        pytest.skip("this test checks the no-GPU fallback; a GPU is visible here")
    lin = torch.nn.Linear(8, 8)
    with pytest.warns(RuntimeWarning, match="FP8 is off.*no CUDA GPU"):
        with fp8vit.fp8_context() as state:
            y = lin(torch.randn(2, 8))
    assert state.fp8 is False and state.recipe is None and "no CUDA GPU" in state.reason
    assert y.dtype == torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second use must not warn again
        with fp8vit.fp8_context():
            pass


def test_strict_raises_with_reason(monkeypatch):
    monkeypatch.setattr(context, "gpu_info", lambda: _info(False))
    with pytest.raises(fp8vit.FP8UnavailableError, match="no FP8 here"):
        with fp8vit.fp8_context(strict=True):
            pass


def test_disabled_is_silent_and_dtype_none_disables_autocast(monkeypatch):
    monkeypatch.setattr(context, "gpu_info", lambda: _info(False, cap=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fp8vit.fp8_context(enabled=False, dtype=None) as state:
            assert not torch.is_autocast_enabled("cpu")
    assert state.fp8 is False and state.dtype is None


def test_unknown_recipe_name_is_an_error_everywhere(monkeypatch):
    monkeypatch.setattr(context, "gpu_info", lambda: _info(False))
    with pytest.raises(ValueError, match="'dealyed'.*delayed"):
        with fp8vit.fp8_context("dealyed"):
            pass


def test_named_recipe_unsupported_on_this_gpu(monkeypatch):
    recipes = {"delayed": (True, ""), "current": (True, ""), "block": (True, ""),
               "mxfp8": (False, "GPU has compute capability 9.0 (Hopper); recipe 'mxfp8' needs 10.0+")}
    monkeypatch.setattr(context, "gpu_info", lambda: _info(True, recipes, "delayed"))
    with pytest.raises(fp8vit.FP8UnavailableError, match=r"mxfp8.*10\.0.*\['delayed', 'current', 'block'\]"):
        with fp8vit.fp8_context("mxfp8"):
            pass


def test_fp8_path_enters_te_autocast(monkeypatch):
    # Without TE, check the wiring: the resolved recipe goes to TE's autocast.
    seen = {}

    class FakeRecipe:
        def delayed(self):
            return True

    import contextlib

    @contextlib.contextmanager
    def fake_autocast(enabled, recipe, amax_reduction_group=None):
        seen["args"] = (enabled, recipe, amax_reduction_group)
        yield

    monkeypatch.setattr(context, "gpu_info", lambda: _info(True, default="delayed", cap=None))
    monkeypatch.setattr(context, "resolve_recipe", lambda recipe, support: FakeRecipe())
    monkeypatch.setattr(context._te, "autocast", fake_autocast)
    with fp8vit.fp8_context() as state:
        assert "args" in seen
    assert state.fp8 and state.recipe_name == "delayed" and seen["args"][0] is True
    assert seen["args"][2] is None  # TE's default: the world group, where torch.distributed is up
    # a ProcessGroup that needs no init_process_group (one rank, in-memory store): passed on as is
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)
    with fp8vit.fp8_context(amax_reduction_group=group):
        pass
    assert seen["args"][2] is group


def test_named_recipe_raises_where_fp8_cannot_run(monkeypatch):
    # Asking for a recipe by name is asking for FP8: no silent fallback.
    monkeypatch.setattr(context, "gpu_info", lambda: _info(False))
    with pytest.raises(fp8vit.FP8UnavailableError, match="recipe 'delayed'.*no FP8 here"):
        with fp8vit.fp8_context("delayed"):
            pass


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.float32])
def test_dtype_must_be_an_autocast_dtype(dtype):
    with pytest.raises(ValueError, match=f"dtype={dtype}.*bfloat16"):
        with fp8vit.fp8_context(enabled=False, dtype=dtype):
            pass


def test_cpu_model_is_autocast_on_a_gpu_machine(monkeypatch):
    # The model's device, not the machine's, decides where autocast must act: CPU autocast is on too.
    monkeypatch.setattr(context, "gpu_info", lambda: _info(False, cap=(9, 0)))
    monkeypatch.setattr(torch, "autocast", _recording_autocast(seen := []))
    with fp8vit.fp8_context(enabled=False):
        pass
    assert ("cpu", torch.bfloat16) in seen and ("cuda", torch.bfloat16) in seen


def _recording_autocast(seen):
    import contextlib

    @contextlib.contextmanager
    def autocast(device_type, dtype=None, **kw):
        seen.append((device_type, dtype))
        yield
    return autocast


def test_recipe_object_raises_where_fp8_cannot_run(monkeypatch):
    monkeypatch.setattr(context, "gpu_info", lambda: _info(False))
    with pytest.raises(fp8vit.FP8UnavailableError, match="FP8 cannot run here: no FP8 here"):
        # stands in for a TE recipe object: it answers recipe_name's predicates (a bare object() is refused)
        with fp8vit.fp8_context(type("FakeRecipe", (), {"delayed": lambda self: True})()):
            pass
