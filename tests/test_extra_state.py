"""FP8 scaling state is checkpointed as one plain tensor (loadable with weights_only=True, by DCP and
by safetensors), never a pickle.

TE is not needed: a stand-in base class has the attributes TE's modules have
(``fp8_meta`` with ``scaling_fwd``/``scaling_bwd``, ``init_fp8_meta_tensors``). The real TE
modules are covered by tests/gpu/test_fp8_gpu.py.
"""

import dataclasses
import enum
import io
import types

import pytest
import torch
from torch import nn

from fp8vit import _te
from fp8vit._te import extra_state


class Format(enum.Enum):
    E4M3 = 1
    HYBRID = 2


@dataclasses.dataclass
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: object = "max"
    scaling_factor_compute_algo: object = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def delayed(self):
        return True


class FakeTEModule(nn.Module):
    """What _SafeExtraState touches in TE's TransformerEngineBaseModule."""

    def __init__(self):
        super().__init__()
        self.fp8 = self.fp8_calibration = False
        self.fp8_meta = {"fp8_checkpoint": False, "recipe": None}
        self.legacy_calls = []
        self.weight = nn.Parameter(torch.randn(4))

    def init_fp8_meta_tensors(self, recipe):
        for key, n in (("scaling_fwd", 3), ("scaling_bwd", 2)):
            self.fp8_meta[key] = types.SimpleNamespace(
                scale=torch.ones(n), amax_history=torch.zeros(recipe.amax_history_len, n))

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        self.legacy_calls.append(state)


class Module(extra_state.SafeExtraState, FakeTEModule):
    pass


@pytest.fixture(autouse=True)
def fake_recipe_module(monkeypatch):
    recipe_module = types.SimpleNamespace(DelayedScaling=DelayedScaling, Format=Format)
    monkeypatch.setattr(extra_state, "te_module", {"transformer_engine.common.recipe": recipe_module}.__getitem__)


def _trained(recipe=None, m=None):
    m = Module() if m is None else m
    recipe = recipe or DelayedScaling(margin=1, amax_history_len=4)
    m.fp8, m.fp8_meta["recipe"], m.fp8_meta["num_gemms"] = True, recipe, 1
    m.init_fp8_meta_tensors(recipe)
    for which in ("scaling_fwd", "scaling_bwd"):
        s = m.fp8_meta[which]
        s.scale.uniform_(0.5, 4.0)
        s.amax_history.uniform_(0.0, 100.0)
    return m


def test_round_trip_through_weights_only_load():
    src = _trained()
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)  # would raise on any pickled object
    blob = sd["_extra_state"]
    assert isinstance(blob, torch.Tensor) and blob.dtype == torch.uint8
    assert bytes(blob[:40].tolist()).startswith(_te.EXTRA_STATE_FORMAT.encode())
    _assert_same_state(_loaded(sd), src)


def _loaded(sd):
    dst = Module()
    dst.load_state_dict(sd)
    assert dst.legacy_calls == []
    return dst


def _assert_same_state(dst, src):
    assert dst.fp8_meta["recipe"] == src.fp8_meta["recipe"] and dst.fp8_meta["num_gemms"] == 1
    for which in ("scaling_fwd", "scaling_bwd"):
        for name in ("scale", "amax_history"):
            assert torch.equal(getattr(dst.fp8_meta[which], name), getattr(src.fp8_meta[which], name))


def test_round_trip_through_safetensors(tmp_path):
    # accelerate's save_state writes safetensors, which takes tensors only (it refused the dict of 0.1)
    from safetensors.torch import load_file, save_file

    src = _trained()
    save_file(src.state_dict(), str(tmp_path / "m.safetensors"))
    _assert_same_state(_loaded(load_file(str(tmp_path / "m.safetensors"))), src)


def test_round_trip_through_a_distributed_checkpoint(tmp_path):
    import fp8vit

    src = nn.Sequential(_trained())
    fp8vit.save_checkpoint(str(tmp_path / "ckpt"), src)
    dst = nn.Sequential(Module())
    fp8vit.load_checkpoint(str(tmp_path / "ckpt"), dst)
    _assert_same_state(dst[0], src[0])


def test_the_dict_of_fp8vit_0_1_still_loads():
    src = _trained()
    state = extra_state.decode_state(src.get_extra_state())
    sd = dict(src.state_dict(), _extra_state=dict(state, format="fp8vit.delayed_scaling.v1"))
    _assert_same_state(_loaded(sd), src)


def test_a_damaged_state_is_refused():
    blob = _trained().get_extra_state()
    used = int(blob.nonzero().max()) + 1  # the state ends with amax history: nonzero here
    with pytest.raises(ValueError, match="damaged"):
        Module().set_extra_state(blob[:used - 4])  # cut into the state
    bad = blob.clone()
    bad[-1] = 7  # the padding is zeros
    with pytest.raises(ValueError, match="damaged"):
        Module().set_extra_state(bad)


def test_module_that_never_ran_fp8_stores_a_state_of_the_same_size_and_loads_it_as_nothing():
    # Code that copies one model's state dict into another's tensor by tensor (timm's ModelEmaV3:
    # ema_v.copy_(model_v)) needs one size whether the module ran FP8 or not.
    empty, trained = Module().get_extra_state(), _trained().get_extra_state()
    assert empty.dtype == torch.uint8 and empty.shape == trained.shape == (extra_state.state_bytes(1),)
    assert extra_state.decode_state(empty) == {}
    dst = _trained()
    before = dst.fp8_meta["scaling_fwd"].scale.clone()
    dst.set_extra_state(empty)  # nothing to load: the module keeps its state, TE's loader is not called
    assert torch.equal(dst.fp8_meta["scaling_fwd"].scale, before) and dst.legacy_calls == []


def test_the_size_is_the_same_for_any_history_up_to_te_default():
    sizes = {_trained(DelayedScaling(amax_history_len=n)).get_extra_state().numel() for n in (1, 16, 1024)}
    assert sizes == {extra_state.state_bytes(1)}
    src = _trained(DelayedScaling(amax_history_len=2048))
    longer = src.get_extra_state()
    assert longer.numel() > extra_state.state_bytes(1)  # larger, and still loads
    dst = Module()
    dst.set_extra_state(longer)
    _assert_same_state(dst, src)


def test_timm_model_ema_updates_over_a_model_that_ran_fp8():
    # timm's train.py --model-ema: the EMA copy is made before the first (FP8) step
    from timm.utils import ModelEmaV3

    model = nn.Sequential(Module(), Module())
    ema = ModelEmaV3(model, decay=0.5)
    for m in model:
        m.fp8, m.fp8_meta = True, _trained().fp8_meta
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ema.update(model, step=10)  # raised "size of tensor a (0) must match ... b (20838)" before
    assert torch.allclose(ema.module[0].weight, model[0].weight - 0.5)


def test_legacy_te_state_goes_to_te_loader():
    m = Module()
    legacy = torch.tensor([1, 2, 3], dtype=torch.uint8)
    m.set_extra_state(legacy)
    assert len(m.legacy_calls) == 1 and m.legacy_calls[0] is legacy


def test_shape_mismatch_is_reported():
    sd = _trained().state_dict()
    state = extra_state.decode_state(sd["_extra_state"])
    state["recipe"]["amax_history_len"] = 8
    sd["_extra_state"] = extra_state.encode_state(state)
    with pytest.raises(ValueError, match=r"amax_history_fwd has shape \(4, 3\).*expects \(8, 3\)"):
        Module().load_state_dict(sd)


def test_callable_recipe_parts_are_refused():
    m = _trained(DelayedScaling(amax_compute_algo=lambda h: h.max(), amax_history_len=2))
    with pytest.raises(ValueError, match="custom callable"):
        m.state_dict()


class SwappedModule(_te.SwappedLinear, extra_state.SafeExtraState, FakeTEModule):
    """``fallback="linear"``'s FP8 Linear, over the fake TE module."""


def test_a_swapped_linear_keeps_its_state_key_so_that_timm_model_ema_stays_aligned():
    # timm's ModelEmaV3 pairs the EMA copy's state dict with the model's by position. The copy is
    # made before the first FP8 step; a key that appeared once delayed scaling ran (an nn.Linear-like
    # state dict until then) paired 1.weight with 0._extra_state.
    from timm.utils import ModelEmaV3

    model = nn.Sequential(SwappedModule(), SwappedModule())
    assert list(model.state_dict()) == ["0.weight", "0._extra_state", "1.weight", "1._extra_state"]
    ema = ModelEmaV3(model, decay=0.5)
    before = [m.weight.detach().clone() for m in ema.module]
    for m in model:
        _trained(m=m)
    ema.update(model, step=1000)
    for e, m, w0 in zip(ema.module, model, before):
        torch.testing.assert_close(e.weight, 0.5 * w0 + 0.5 * m.weight)
        # ModelEmaV3 copies into the tensor state_dict() returned, so the EMA copy keeps scaling
        # state of its own (from its own forwards, as a plain TE module's EMA does)
        assert "scaling_fwd" not in e.fp8_meta
    SwappedModule().load_state_dict({"weight": torch.randn(4)}, strict=True)  # a checkpoint without it loads


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_registers_its_own_scaling_state_with_te(how):
    # TE enters a module into its process-wide delayed-scaling buffers once, keyed by positions it
    # writes into fp8_meta; a copy that kept them would never be entered, its scales frozen as
    # copied (an EMA or teacher copy made after FP8 steps). The original keeps its positions.
    import copy
    import pickle
    m = _trained()
    m.fp8_meta["buffer_index_and_autocast_key"] = [0, "forward_key", 0, "backward_key"]
    m.fp8_meta["global_fp8_buffer_pos_fwd_recompute"] = 3
    c = copy.deepcopy(m) if how == "deepcopy" else pickle.loads(pickle.dumps(m))
    assert "buffer_index_and_autocast_key" not in c.fp8_meta
    assert "global_fp8_buffer_pos_fwd_recompute" not in c.fp8_meta
    assert m.fp8_meta["buffer_index_and_autocast_key"] == [0, "forward_key", 0, "backward_key"]
    assert m.fp8_meta["global_fp8_buffer_pos_fwd_recompute"] == 3
    for which in ("scaling_fwd", "scaling_bwd"):  # the scaling tensors themselves are copied
        assert torch.equal(c.fp8_meta[which].scale, m.fp8_meta[which].scale)
        assert c.fp8_meta[which].scale is not m.fp8_meta[which].scale
