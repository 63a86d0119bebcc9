"""The TE import boundary explains failures; import fp8vit works without TE."""

import subprocess
import types
import warnings
import sys

import pytest
import torch

import fp8vit
from fp8vit import _te
from fp8vit._te import loader, ops


def test_not_installed_gives_install_command():
    err = ModuleNotFoundError("No module named 'transformer_engine'", name="transformer_engine")
    reason = loader._explain_import_error(err)
    assert "not installed" in reason
    # TE's own package name (fp8vit is not on PyPI), at the version fp8vit needs, or the extra from a clone
    assert f'pip install "transformer-engine[pytorch]>={_te.MIN_TE_VERSION}"' in reason
    assert "pip install '.[te]'" in reason and "fp8vit[te]" not in reason


def test_cudnn_clash_is_named_with_fix():
    err = ImportError("/usr/lib/libcudnn_cnn.so.9: undefined symbol: cudnnGetLibConfig, version libcudnn_graph.so.9")
    reason = loader._explain_import_error(err)
    assert "different cuDNN" in reason and "undefined symbol" in reason
    assert "before running any model" in reason and "CUDNN_PATH" in reason


def test_other_errors_keep_the_message():
    reason = loader._explain_import_error(RuntimeError("boom 42"))
    assert "boom 42" in reason and "RuntimeError" in reason


def test_import_fp8vit_without_te_or_gpu():
    # A fresh interpreter with TE hidden: the package imports and reports why FP8 is off.
    code = ("import sys; sys.modules['transformer_engine'] = None\n"
            "import fp8vit\n"
            "print(*fp8vit._te.te_status()); print(*fp8vit.fp8_support())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    te_line, fp8_line = out.splitlines()
    assert te_line.startswith("False") and "not installed" in te_line
    assert fp8_line.startswith("False")  # and says why: no GPU here, or no TE on a GPU machine


def test_load_te_raises_with_reason(monkeypatch):
    monkeypatch.setattr(loader, "_import", lambda: (None, "because reasons"))
    try:
        _te.load_te()
    except fp8vit.TEUnavailableError as err:
        assert "because reasons" in str(err)
    else:
        raise AssertionError("load_te did not raise")


def test_too_old_te_is_refused_with_the_versions(monkeypatch):
    # Older TE unpickles a checkpoint's FP8 state on load: fp8vit does not run on it.
    monkeypatch.setattr(loader, "te_version", lambda: "2.8.0")
    _te.clear_cache()
    try:
        check = _te.te_status()
        assert not check.ok and "2.8.0" in check.reason and _te.MIN_TE_VERSION in check.reason
        assert "pip install -U" in check.reason
    finally:
        monkeypatch.undo()
        _te.clear_cache()


def test_resolve_backend_raises_for_a_broken_te_on_a_gpu_machine(monkeypatch):
    # TE installed but failing to import, CUDA present: no silent fallback to the reference modules.
    import pytest
    import torch
    from fp8vit.blocks import backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_te, "installed", lambda: True)
    monkeypatch.setattr(_te, "te_status", lambda: fp8vit.Check(False, "undefined symbol: foo"))
    with pytest.raises(fp8vit.TEUnavailableError, match="installed but unusable: undefined symbol: foo.*'reference'"):
        backend.resolve_backend(None)
    assert backend.resolve_backend("reference") == "reference"  # asked for: fine


def test_cudnn_layernorm_switch_names_bad_input_and_missing_support(monkeypatch):
    import types

    import fp8vit
    with pytest.raises(TypeError, match=r"enabled=1\): pass True or False"):
        fp8vit.set_cudnn_layernorm(1)
    # A TE whose core library lacks the switch: the error names the TE version and what to do.
    common = types.SimpleNamespace(_TE_LIB_CTYPES=object())
    monkeypatch.setattr(ops, "te_module", {"transformer_engine.common": common}.__getitem__)
    monkeypatch.setattr(ops, "te_version", lambda: "9.9")
    with pytest.raises(fp8vit.TEUnavailableError, match="Transformer Engine 9.9 does not expose nvte_enable_cudnn_norm"):
        fp8vit.set_cudnn_layernorm(True)
    assert not _te.cudnn_norm_enabled()  # a refused switch changes nothing
    with pytest.raises(fp8vit.TEUnavailableError) as info, _te.cudnn_norm(True):
        pass
    # the scoped switch raises that error alone: nothing was set, so nothing is restored (which
    # would raise again, chained)
    assert info.value.__context__ is None and not _te.cudnn_norm_enabled()


class _NoKernel(torch.nn.Module):
    """A DotProductAttention stand-in that fails as TE's does when no backend takes the call."""

    def __init__(self, message):
        super().__init__()
        self.message = message

    def forward(self, **kwargs):
        raise ValueError(self.message)


TE_NO_BACKEND = ("No dot product attention backend is available for the provided inputs. Please run with "
                 "NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 to find out the reasons for disabling all backends.")


@pytest.mark.parametrize("fp8_dpa", [True, False])
def test_no_attention_kernel_names_the_shapes_and_the_fix(monkeypatch, fp8_dpa):
    # TE's message names neither the shapes nor that FP8 attention (fp8_dpa) is what it turned down
    # (on the H200, TE 2.20: head dim 128 only; ViT-B's is 64)
    monkeypatch.setattr(ops, "active_fp8_recipe", lambda: types.SimpleNamespace(fp8_dpa=fp8_dpa))
    qkv = torch.randn(2, 197, 3, 12, 64)
    q, k, v = qkv.unbind(2)
    with pytest.raises(ValueError) as info:
        ops.packed_attention(_NoKernel(TE_NO_BACKEND), q, k, v, attn_mask_type="no_mask")
    msg = str(info.value)
    assert "q [B=2, N=197, H=12, D=64] torch.float32, k/v 12 heads, mask no_mask" in msg
    assert ("fp8_attention" in msg and "this block's is 64" in msg) is fp8_dpa
    assert "NVTE_DEBUG=1" in msg and isinstance(info.value.__cause__, ValueError)


def test_no_fp8_attention_kernel_at_head_dim_128_does_not_blame_the_head_dim(monkeypatch):
    monkeypatch.setattr(ops, "active_fp8_recipe", lambda: types.SimpleNamespace(fp8_dpa=True))
    q, k, v = torch.randn(2, 197, 3, 6, 128).unbind(2)
    with pytest.raises(ValueError) as info:
        ops.packed_attention(_NoKernel(TE_NO_BACKEND), q, k, v)
    msg = str(info.value)
    assert "D=128" in msg and "head dim 128 only" not in msg and "without fp8_attention" in msg


@pytest.mark.parametrize("name", ["delayed", "current"])
@pytest.mark.parametrize("cap, te, refused", [((9, 0), "2.20.2", True), ((9, 0), "2.19.0", True),
                                              ((9, 0), "2.21.0", False), ((10, 0), "2.20.2", False)])
def test_fp8_attention_refused_on_hopper_with_te_up_to_2_20(monkeypatch, name, cap, te, refused):
    # measured on the H200 (TE 2.20.2): delayed-scaling FP8 attention gave logits 1.1 dB from bf16's,
    # current scaling had no kernel; the refusal comes before TE is loaded
    from fp8vit._te import recipes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap)
    monkeypatch.setattr(recipes, "te_version", lambda: te)
    monkeypatch.setattr(recipes, "te_module", lambda mod: (_ for _ in ()).throw(_Reached(mod)))
    if refused:  # a ValueError before TE is loaded (_Reached is not one)
        with pytest.raises(ValueError) as info:
            recipes.make_recipe(name, fp8_attention=True)
        msg = str(info.value)
        assert f"make_recipe({name!r}, fp8_attention=True)" in msg and "9.0" in msg and te in msg
        assert ("1.1 dB" in msg) is (name == "delayed") and f"make_recipe({name!r})" in msg
    else:
        with pytest.raises(_Reached):
            recipes.make_recipe(name, fp8_attention=True)


def test_make_recipe_delayed_takes_fast_input_gradient_accumulation(monkeypatch):
    # lever 53: delayed scaling's input-gradient GEMMs accumulate fast (within 0.05 dB of TE's split
    # accumulator); its weight-gradient GEMMs and the other recipes keep TE's defaults
    import types

    from fp8vit._te import recipes

    class MMParams:
        def __init__(self, use_split_accumulator=True):
            self.use_split_accumulator = use_split_accumulator

    class Recipe:
        def __init__(self, **kw):
            vars(self).update(kw)

    class DelayedScaling(Recipe):  # as TE 2.20's: no fp8_gemm_* fields
        def delayed(self):
            return True

    class Float8CurrentScaling(Recipe):
        def __init__(self, **kw):
            super().__init__(fp8_gemm_dgrad=MMParams(True), fp8_gemm_wgrad=MMParams(True), **kw)

        def float8_current_scaling(self):
            return True

    fake = types.SimpleNamespace(MMParams=MMParams, DelayedScaling=DelayedScaling, Float8CurrentScaling=Float8CurrentScaling,
                                 Format=types.SimpleNamespace(HYBRID="HYBRID"))
    monkeypatch.setattr(recipes, "te_module", lambda mod: fake)
    delayed = recipes.make_recipe("delayed")
    assert isinstance(delayed, DelayedScaling) and delayed.fp8_format == "HYBRID"
    assert delayed.fp8_gemm_dgrad.use_split_accumulator is False and delayed.fp8_gemm_wgrad.use_split_accumulator is True
    current = recipes.make_recipe("current")
    assert current.fp8_gemm_dgrad.use_split_accumulator is True and current.fp8_gemm_wgrad.use_split_accumulator is True


class _Reached(Exception):
    """make_recipe got past its checks to loading TE."""


def test_other_attention_errors_pass_through(monkeypatch):
    monkeypatch.setattr(ops, "active_fp8_recipe", lambda: None)
    q = k = v = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="^something else 7$"):
        ops.packed_attention(_NoKernel("something else 7"), q, k, v)


class _Attention(torch.nn.Module):
    def forward(self, query_layer, key_layer, value_layer, **kwargs):
        return query_layer.flatten(2)


@pytest.mark.parametrize("chosen, name", [
    ({"attention_params": None, "use_fused_attention": True}, None),  # no call yet
    ({"attention_params": object(), "use_flash_attention": False, "use_fused_attention": 1,
      "use_unfused_attention": True}, "fused"),
    ({"attention_params": object(), "use_flash_attention": False, "use_fused_attention": False,
      "use_unfused_attention": True}, "unfused"),
    (None, None),  # a TE without the record
])
def test_attention_backend_reads_tes_choice_and_warns_when_unfused(monkeypatch, chosen, name):
    from fp8vit import _warn
    monkeypatch.setattr(ops, "_te_backends", lambda: chosen)
    monkeypatch.setattr(ops, "active_fp8_recipe", lambda: None)
    monkeypatch.setattr(_warn, "_seen", set())
    assert ops.attention_backend() == name
    q, k, v = torch.randn(2, 197, 3, 12, 64, dtype=torch.bfloat16).unbind(2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ops.packed_attention(_Attention(), q, k, v)
        ops.packed_attention(_Attention(), q.float(), k.float(), v.float())  # fp32: unfused is expected
    said = [str(w.message) for w in seen if "unfused" in str(w.message)]
    assert len(said) == (name == "unfused")
    assert all("q [B, N=197, H=12, D=64] torch.bfloat16" in m and "NVTE_DEBUG=1" in m for m in said)


@pytest.mark.parametrize("d, reason", [(36, "head dim 36 is not a multiple of 8"), (64, "NVTE_DEBUG=1")])
def test_unfused_attention_warning_names_an_odd_head_dim(monkeypatch, d, reason):
    # TE's fused (cuDNN) and flash attention both need head dims that are multiples of 8
    from fp8vit import _warn
    monkeypatch.setattr(ops, "_te_backends", lambda: {"attention_params": object(), "use_unfused_attention": True})
    monkeypatch.setattr(ops, "active_fp8_recipe", lambda: None)
    monkeypatch.setattr(_warn, "_seen", set())
    q, k, v = torch.randn(2, 257, 3, 4, d, dtype=torch.bfloat16).unbind(2)
    with pytest.warns(RuntimeWarning, match="runs attention unfused") as seen:
        ops.packed_attention(_Attention(), q, k, v)
    assert reason in str(seen[0].message) and f"D={d}]" in str(seen[0].message)
