"""Lightning with ``fp8vit.integrations.lightning.FP8VitPrecision``: the plugin converts the module,
every step runs inside ``fp8_context``, checkpoints resume through Lightning; one process and DDP on
2 gloo processes (CPU: reference modules, bf16; the GPU twin is tests/gpu/test_frameworks_gpu.py).
The runs themselves are tests/lightning_child.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning", reason="Lightning is not installed (pip install '.[lightning]')")

import fp8vit  # noqa: E402
from fp8vit.integrations.lightning import FP8VitPrecision  # noqa: E402
from lightning_child import RESUMED_STEPS, STEPS, run  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def check_rank(res: dict, world: int) -> None:
    assert res["world"] == world
    assert res["blocks"] == ["TE_Block", "TE_Block"]  # converted by the plugin
    assert res["resumed_blocks"] == ["TE_Block", "TE_Block"]  # by configure_model, before the restore
    assert "fused fp8vit blocks          2" in res["summary"]
    assert "never converted: model.head" in res["summary"]  # the classifier stays out, not a "kept block"
    assert res["steps"] == (STEPS, RESUMED_STEPS)
    # every block forward ran inside fp8_context under bf16 autocast (FP8 itself is off on the CPU)
    for seen in (res["seen"], res["resumed_seen"]):
        assert seen and set(map(tuple, seen)) == {(True, False, "torch.bfloat16")}
    # the resumed run started from the checkpoint's weights, then trained
    end, start, resumed = res["end_weights"], res["resumed_start_weights"], res["resumed_end_weights"]
    assert end.keys() == start.keys() and all(torch.equal(end[k], start[k]) for k in end)
    assert any(not torch.equal(start[k], resumed[k]) for k in start)
    assert len(res["losses"]) == STEPS and len(res["resumed_losses"]) == RESUMED_STEPS - STEPS
    assert all(torch.isfinite(torch.tensor(res["losses"] + res["resumed_losses"])))


def test_trainer_with_the_plugin_converts_steps_in_fp8_context_and_resumes(tmp_path):
    check_rank(run(str(tmp_path)), world=1)


def test_ddp_on_two_processes(tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip(f"torch {torch.__version__} has no gloo backend for CPU process groups")
    res = subprocess.run([sys.executable, os.path.join(HERE, "lightning_child.py"), str(tmp_path), "2", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        check_rank(r, world=2)
    # DDP kept the ranks' weights equal, on their different data
    a, b = ranks[0]["resumed_end_weights"], ranks[1]["resumed_end_weights"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert ranks[0]["losses"] != ranks[1]["losses"]


def test_convert_module_converts_in_place_and_keeps_converted_blocks():
    import timm

    plugin = FP8VitPrecision()
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=2)
    wrapper = torch.nn.ModuleDict({"model": model})
    assert plugin.convert_module(wrapper) is wrapper
    block = model.blocks[0]
    assert type(block).__name__ == "TE_Block"
    plugin.convert_module(wrapper)  # configure_model converted it already: left as it is
    assert model.blocks[0] is block


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_convert_module_graphs_the_vit_inside_unless_told_not_to(cuda_graphs):
    # Lightning hands the plugin the LightningModule; its ViT is inside (self.model). Eager FP8
    # blocks are slower than bf16 at ViT-B, so the plugin graphs them by default.
    import timm

    plugin = FP8VitPrecision() if cuda_graphs else FP8VitPrecision(cuda_graphs=False)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=2)
    fp8vit.convert_to_te(model)  # as configure_model does, without graphs
    plugin.convert_module(torch.nn.ModuleDict({"model": model}))
    assert (fp8vit.GraphedBlocks.of(model) is not None) is cuda_graphs


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(recipe="nope"), ValueError, "nope"),
    (dict(recipe=3), TypeError, "recipe"),
    (dict(amax_reduction_group="world"), TypeError, "amax_reduction_group"),
    (dict(cuda_graphs="yes"), TypeError, "cuda_graphs"),
])
def test_plugin_refuses_a_bad_argument_at_the_call(kwargs, error, match):
    with pytest.raises(error, match=match):
        FP8VitPrecision(**kwargs)
