"""Capability detection with patched devices: reasons name the GPU and its capability."""

import pytest
import torch

import fp8vit
from fp8vit import _te
from fp8vit.training import detect


@pytest.fixture
def fake_device(monkeypatch):
    calls = []

    def set_device(name, cap, te_ok=True, checks=None):
        def _device():
            calls.append(1)
            return name, cap
        monkeypatch.setattr(detect, "_device", _device)
        monkeypatch.setattr(_te, "te_status", lambda: fp8vit.Check(te_ok, "" if te_ok else "TE is not installed"))
        answers = checks or {}
        # TE's own answer per capability function; the recipes ask through these names.
        by_fn = {"is_fp8_available": answers.get("delayed", (True, "")),
                 "is_fp8_block_scaling_available": answers.get("block", (True, "")),
                 "is_mxfp8_available": answers.get("mxfp8", (True, ""))}
        monkeypatch.setattr(_te, "te_check", lambda fn: fp8vit.Check(*by_fn[fn]))
        detect.gpu_info.cache_clear()  # TE's own caches are patched out above
        return calls

    yield set_device
    detect.gpu_info.cache_clear()


def test_no_gpu_reason_names_torch(fake_device):
    fake_device("cpu", None)
    ok, reason = fp8vit.fp8_support()
    assert not ok and "no CUDA GPU" in reason and "torch" in reason
    assert fp8vit.gpu_info().default_recipe is None


def test_ampere_has_no_fp8_and_says_why(fake_device):
    fake_device("NVIDIA A100-SXM4-80GB", (8, 0))
    ok, reason = fp8vit.fp8_support()
    assert not ok
    assert "A100" in reason and "8.0" in reason and "Ampere" in reason and "8.9" in reason


@pytest.mark.parametrize("cap, arch, default, usable", [
    ((8, 9), "Ada", "delayed", {"delayed", "current"}),
    ((9, 0), "Hopper", "delayed", {"delayed", "current", "block"}),
    ((10, 0), "Blackwell", "mxfp8", {"delayed", "current", "block", "mxfp8"}),
])
def test_fp8_gpus_and_default_recipe(fake_device, cap, arch, default, usable):
    fake_device("GPU", cap)
    info = fp8vit.gpu_info()
    assert info.fp8 == (True, "")
    assert info.arch == arch and info.default_recipe == default
    assert {r for r, (ok, _) in info.recipes.items() if ok} == usable


def test_te_check_is_respected(fake_device):
    # Hardware would allow it but TE says no (e.g. Ada with an old cuBLASLt): TE's reason is kept.
    fake_device("NVIDIA L4", (8, 9), checks={"delayed": (False, "cuBLASLt too old"),
                                              "current": (False, "cuBLASLt too old"),
                                              "block": (False, "x"), "mxfp8": (False, "x")})
    ok, reason = fp8vit.fp8_support()
    assert not ok and reason == "cuBLASLt too old"


def test_missing_te_reason(fake_device):
    fake_device("NVIDIA H200", (9, 0), te_ok=False)
    assert fp8vit.fp8_support() == (False, "TE is not installed")


def test_detection_is_cached(fake_device):
    calls = fake_device("NVIDIA H200", (9, 0))
    fp8vit.gpu_info(), fp8vit.fp8_support(), fp8vit.gpu_info()
    assert len(calls) == 1
    detect.gpu_info.cache_clear()
    fp8vit.gpu_info()
    assert len(calls) == 2


def test_a_recipe_name_resolves_to_one_object_until_clear_cache(fake_device, monkeypatch):
    # fp8_context resolves its recipe at every step: built once per name (lever 56), a new one
    # after clear_cache (a TE repaired since); an object of the user's own is passed through.
    fake_device("NVIDIA H200", (9, 0))
    made = []
    monkeypatch.setattr(detect, "make_recipe", lambda name: made.append(name) or object())
    detect._named_recipe.cache_clear()
    support = fp8vit.gpu_info().recipes
    first = detect.resolve_recipe("current", support)
    assert detect.resolve_recipe("current", support) is first and made == ["current"]
    default = detect.resolve_recipe(None, support)
    assert detect.resolve_recipe("delayed", support) is default and made == ["current", "delayed"]
    own = object()
    assert detect.resolve_recipe(own, support) is own
    detect.clear_cache()
    fake_device("NVIDIA H200", (9, 0))
    assert detect.resolve_recipe("current", fp8vit.gpu_info().recipes) is not first and made[-1] == "current"


def test_summary_lists_each_recipe(fake_device):
    fake_device("NVIDIA H200", (9, 0))
    text = fp8vit.gpu_info().summary()
    assert "sm_90" in text and "Hopper" in text
    for r in fp8vit.RECIPE_NAMES:
        assert r in text


def test_clear_cache_forgets_te_import_and_capability_answers(monkeypatch):
    # A TE installed or repaired after the first probe is seen after clear_cache().
    monkeypatch.setattr(_te.loader.importlib, "import_module", lambda name: (_ for _ in ()).throw(ImportError("boom")))
    detect.clear_cache()
    assert not _te.te_status().ok and "boom" in _te.te_status().reason
    monkeypatch.undo()
    detect.clear_cache()
    assert "boom" not in _te.te_status().reason


@pytest.mark.parametrize("name, rows", [("delayed", 16), ("current", 16), ("block", 16), ("mxfp8", 32)])
def test_token_rows_an_fp8_gemm_needs_per_recipe(name, rows):
    # TE_Block pads the token rows to this multiple; the name comes from a TE recipe object, probed
    # by its predicates (stood in for here: TE is not needed).
    from types import SimpleNamespace
    from fp8vit._te.recipes import _PREDICATE, recipe_name, row_multiple
    recipe = SimpleNamespace(**{pred: (lambda n=n: n == name) for n, pred in _PREDICATE.items()})
    assert recipe_name(recipe) == name
    assert row_multiple(recipe_name(recipe)) == rows
    assert row_multiple(None) == 1  # FP8 off: no padding


def test_triton_kernels_say_why_they_are_off(monkeypatch):
    from fp8vit._te.kernels import triton_support
    monkeypatch.setenv("FP8VIT_TRITON", "0")
    detect.clear_cache()
    assert triton_support() == (False, "turned off by FP8VIT_TRITON=0")
    monkeypatch.delenv("FP8VIT_TRITON")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    detect.clear_cache()  # the cached answer above must not stick
    assert triton_support() == (False, "no CUDA device")
    detect.clear_cache()
