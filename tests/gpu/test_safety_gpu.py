"""FP8 safety tools with TE on the GPU: per-block FP8 off, diagnose, NonFiniteGuard."""

import importlib.util
import math
import os

import pytest
import timm
import torch
import torch.nn.functional as F

import fp8vit

pytestmark = pytest.mark.gpu


def _vit(depth=4):
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", pretrained=False, depth=depth, num_classes=10)
    return fp8vit.convert_to_te(model.cuda())


def test_block_with_fp8_off_runs_bf16_inside_fp8_context():
    model = _vit(1).eval()
    blk = model.blocks[0]
    x = torch.randn(8, 197, 768, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = blk(x)
    blk.fp8_enabled = False
    with torch.no_grad(), fp8vit.fp8_context("current"):
        off = blk(x)
    blk.fp8_enabled = True
    with torch.no_grad(), fp8vit.fp8_context("current"):
        on = blk(x)
    torch.testing.assert_close(off, bf16, rtol=0, atol=0)
    assert not torch.equal(on, bf16)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_diagnose_on_vit_b(recipe):
    model = _vit().eval()
    x = torch.randn(16, 3, 224, 224, device="cuda")
    y = torch.randint(0, 10, (16,), device="cuda")
    rep = fp8vit.diagnose(model, x, target=y, recipe=recipe)
    print(rep.table())
    assert len(rep.blocks) == 4 and math.isfinite(rep.output_snr_db)
    for b in rep.blocks:
        assert math.isfinite(b.local_snr_db) and b.local_snr_db > 10 and b.nonfinite == 0
        assert math.isfinite(b.local_weight_grad_snr_db) and b.local_weight_grad_snr_db > 10
        assert bool(b.te_scaling) == (recipe == "delayed")
    assert all(p.grad is None for p in model.parameters())


def _convergence_example():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "convergence.py")
    spec = importlib.util.spec_from_file_location("convergence_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("factor", [1e5, 1e7])
def test_diagnose_flags_only_a_constructed_outlier_block(factor):
    # examples/convergence.py's construct: two LayerNorm channels of block 1 x factor, fc1's
    # matching columns / factor. The same function, but FP8 per-tensor scaling of fc1's input
    # crushes every other channel. Only that block may be flagged, and applying the
    # recommendation must raise the model-output SNR.
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", pretrained=False, depth=4, num_classes=10).cuda()
    _convergence_example().add_outliers(model, 1, factor)
    fp8vit.convert_to_te(model).eval()
    x = torch.randn(16, 3, 224, 224, device="cuda")
    y = torch.randint(0, 10, (16,), device="cuda")
    rep = fp8vit.diagnose(model, x, target=y, recipe="delayed")
    print(rep.table())
    assert rep.recommend_bf16 == ["blocks.1"]
    rep.apply(model)
    after = fp8vit.diagnose(model, x, target=y, recipe="delayed")
    print(f"x{factor:g}: model output SNR {rep.output_snr_db:.1f} -> {after.output_snr_db:.1f} dB")
    assert after.recommend_bf16 == [] and after.output_snr_db > rep.output_snr_db + 3


def test_guard_skips_an_inf_step_under_fp8_delayed():
    model = _vit().train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    guard = fp8vit.NonFiniteGuard(model, opt)
    x = torch.randn(16, 3, 224, 224, device="cuda")
    y = torch.randint(0, 10, (16,), device="cuda")

    def step(poison=False):
        with fp8vit.fp8_context("delayed"):
            xin = x * float("inf") if poison else x
            loss = F.cross_entropy(model(xin), y)
        loss.backward()
        return guard.step(loss)

    assert step()
    with pytest.warns(RuntimeWarning, match="first non-finite activation in blocks.0"):
        assert not step(poison=True)
    for m in model.modules():
        meta = getattr(m, "fp8_meta", None)
        if isinstance(meta, dict) and "scaling_fwd" in meta:
            assert torch.isfinite(meta["scaling_fwd"].amax_history).all()
    assert step() and step()
