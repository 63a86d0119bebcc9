"""fp8vit.diagnose on CPU: SNR maths, thresholds, JSON schema, and the whole pass with FP8's
error emulated by known noise inside one block (FP8 itself needs a GPU)."""

import contextlib
import json
import math

import pytest
import torch
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer

import fp8vit
from fp8vit.training import diagnostics as dg
from fp8vit.training import numerics as nm


def test_snr_known_values():
    ref = torch.ones(1000)
    assert nm.snr_db(ref, ref) == math.inf
    assert nm.snr_db(ref, ref + 0.1) == pytest.approx(20.0)          # noise power 1% of signal
    assert nm.snr_db(ref, ref * 0.5) == pytest.approx(10 * math.log10(4))
    assert math.isnan(nm.snr_db(ref, torch.full((1000,), float("inf"))))
    assert nm.snr_db(torch.zeros(3), torch.ones(3)) == -math.inf


def test_underflow_fraction_known_values():
    # amax 1 maps to 448; 1e-6 * 448 = 4.5e-4 < 2^-10 flushes, 0.01 * 448 = 4.48 does not, zeros don't count
    x = torch.tensor([1.0, 1e-6, 0.0, 0.01])
    assert nm.underflow_fraction(x, nm.E4M3_MAX, 2.0 ** -10) == pytest.approx(1 / 3)
    assert nm.underflow_fraction(torch.zeros(4), nm.E4M3_MAX, 2.0 ** -10) == 0.0


def _stats(name, local=30.0, act=25.0, grad=18.0, nonfinite=0):
    # end-to-end weight-gradient SNR 5 dB everywhere: the recommendation must not use it
    return dg.BlockStats(name=name, local_snr_db=local, activation_snr_db=act, weight_grad_snr_db=5.0,
                         local_weight_grad_snr_db=grad,
                         input_amax=3.0, input_underflow=0.01, grad_underflow=0.02, nonfinite=nonfinite,
                         te_scaling={"qkv": [2.5, 100.0]})


def _report(threshold=20.0, grad_threshold=12.0):
    blocks = (_stats("blocks.0", local=15.0), _stats("blocks.1"), _stats("blocks.2", grad=11.9),
              _stats("blocks.3", nonfinite=2), _stats("blocks.4", local=math.nan), _stats("blocks.5", local=math.inf))
    return dg.DiagnosisReport("delayed", threshold, grad_threshold, 21.5, blocks)


def test_recommendation_thresholds():
    assert _report().recommend_bf16 == ["blocks.0", "blocks.2", "blocks.3", "blocks.4"]
    assert _report(threshold=10.0, grad_threshold=11.0).recommend_bf16 == ["blocks.3", "blocks.4"]
    keep = _report().module_filter_fn()
    assert keep(None, "blocks.1") and not keep(None, "blocks.0")


def test_json_schema_round_trip():
    rep = _report()
    text = rep.to_json()
    d = json.loads(text)  # plain JSON: inf/nan written as strings
    assert d["schema_version"] == dg.SCHEMA_VERSION
    assert set(d) == {"schema_version", "recipe", "threshold_db", "grad_threshold_db", "output_snr_db",
                      "recommend_bf16", "blocks"}
    assert set(d["blocks"][0]) == {"name", "local_snr_db", "activation_snr_db", "weight_grad_snr_db",
                                   "local_weight_grad_snr_db",
                                   "input_amax", "input_underflow", "grad_underflow", "nonfinite", "te_scaling"}
    assert d["blocks"][4]["local_snr_db"] == "nan" and d["blocks"][5]["local_snr_db"] == "inf"
    back = dg.DiagnosisReport.from_dict(d)
    assert back.recommend_bf16 == rep.recommend_bf16 and back.blocks[1] == rep.blocks[1]
    d["schema_version"] = 99
    with pytest.raises(ValueError, match="schema_version 99"):
        dg.DiagnosisReport.from_dict(d)


def test_table_names_every_block_and_verdict():
    text = _report().table()
    for i in range(6):
        assert f"blocks.{i}" in text
    assert sum(line.endswith("keep bf16") for line in text.splitlines()) == 4 and "recommend bf16 for: blocks.0, blocks.2, blocks.3, blocks.4" in text


# --- the whole pass, with FP8's error emulated ------------------------------------------------
_fp8_on = {"on": False}


@contextlib.contextmanager
def _emulated(recipe, enabled):
    _fp8_on["on"] = enabled
    try:
        yield
    finally:
        _fp8_on["on"] = False


def _model_with_noisy_block(noisy=2, amplitude=0.3, arch="vit"):
    torch.manual_seed(0)
    if arch == "vit":
        model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=4, num_heads=4, num_classes=5)
    else:  # EVA02-style: RoPE (timm hands each block its table by keyword), SwiGLU with a norm, q/v biases
        model = Eva(img_size=32, patch_size=8, embed_dim=64, depth=4, num_heads=4, num_classes=5, qkv_fused=False,
                    mlp_ratio=4 * 2 / 3, swiglu_mlp=True, scale_mlp=True, use_rot_pos_emb=True, ref_feat_shape=(4, 4))
    fp8vit.convert_to_te(model, backend="reference").eval()
    blk = model.blocks[noisy]
    inner = blk.mlp.forward

    def mlp_forward(x):
        y = inner(x)
        if _fp8_on["on"] and blk.fp8_enabled:  # "FP8" error inside this block only
            y = y + amplitude * y.std() * torch.randn_like(y)
        return y

    blk.mlp.forward = mlp_forward
    return model


@pytest.mark.parametrize("arch", ["vit", "eva"])
def test_diagnose_finds_the_noisy_block_and_apply_fixes_it(monkeypatch, arch):
    monkeypatch.setattr(dg, "fp8_context", lambda recipe, enabled, strict: _emulated(recipe, enabled))
    model = _model_with_noisy_block(arch=arch)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))
    rep = fp8vit.diagnose(model, x, target=y)
    local = {b.name: b.local_snr_db for b in rep.blocks}
    assert local["blocks.2"] < 20 and all(local[f"blocks.{i}"] == math.inf for i in (0, 1, 3))
    # error propagates downstream in the end-to-end SNR, and upstream in the weight gradients
    act = {b.name: b.activation_snr_db for b in rep.blocks}
    assert act["blocks.3"] < math.inf and act["blocks.0"] == math.inf
    assert rep.blocks[0].weight_grad_snr_db < math.inf
    # ... but each block's own weight-gradient error is its own: only the noisy block has any
    local_wgrad = {b.name: b.local_weight_grad_snr_db for b in rep.blocks}
    assert all(local_wgrad[f"blocks.{i}"] == math.inf for i in (0, 1, 3)) and local_wgrad["blocks.2"] < math.inf
    assert rep.recommend_bf16 == ["blocks.2"]
    assert rep.apply(model) == ["blocks.2"] and not model.blocks[2].fp8_enabled
    after = fp8vit.diagnose(model, x, target=y)
    assert after.recommend_bf16 == [] and after.output_snr_db > rep.output_snr_db
    assert all(p.grad is None for p in model.parameters())  # diagnose leaves no gradients behind


def test_diagnose_needs_te_blocks_and_fp8():
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=4, num_classes=5)
    with pytest.raises(ValueError, match="convert_to_te"):
        fp8vit.diagnose(model, torch.randn(1, 3, 32, 32))
    if not fp8vit.fp8_support()[0]:
        fp8vit.convert_to_te(model, backend="reference")
        with pytest.raises(fp8vit.FP8UnavailableError, match="cannot run here"):
            fp8vit.diagnose(model, torch.randn(1, 3, 32, 32))


def test_set_block_fp8_names_unknown_blocks():
    model = _model_with_noisy_block()
    with pytest.raises(ValueError, match="blocks.9"):
        fp8vit.set_block_fp8(model, ["blocks.1", "blocks.9"], enabled=False)
    assert model.blocks[1].fp8_enabled  # nothing changed on error


def test_set_block_fp8_takes_one_name_or_several():
    model = fp8vit.convert_to_te(VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=3, num_heads=4,
                                                   num_classes=5), backend="reference")
    # a bare string is one block's name, not a sequence of one-character names
    assert fp8vit.set_block_fp8(model, "blocks.0", False) == ["blocks.0"]
    assert [b.fp8_enabled for b in model.blocks] == [False, True, True]
    assert fp8vit.set_block_fp8(model, ("blocks.1", "blocks.2"), False) == ["blocks.1", "blocks.2"]
    assert [b.fp8_enabled for b in model.blocks] == [False, False, False]
    assert fp8vit.set_block_fp8(model, "blocks.1", True) == ["blocks.1"]
    assert [b.fp8_enabled for b in model.blocks] == [False, True, False]
    with pytest.raises(ValueError, match=r"\['blocks\.7'\] are not fp8vit blocks .*; its 3 are "
                                         r"blocks\.0, blocks\.1, blocks\.2 "):
        fp8vit.set_block_fp8(model, "blocks.7", True)
    with pytest.raises(ValueError, match="has no fp8vit blocks or swapped Linears; convert it with fp8vit.convert_to_te first"):
        fp8vit.set_block_fp8(VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=4),
                             "blocks.0", False)
