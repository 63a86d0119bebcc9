"""HF accelerate: ``Accelerator(mixed_precision="bf16")`` with a model converted by
``convert_to_te(model, autocast=True, cuda_graphs=True)``: ``prepare``, steps in FP8 (bf16 on the CPU), ``save_state`` /
``load_state`` resuming exactly (CPU: reference modules; the GPU twin is
tests/gpu/test_frameworks_gpu.py). ``save_state``'s default, safetensors, holds fp8vit's FP8 scaling
state: one uint8 tensor per TE module."""

from __future__ import annotations

import pytest
import timm
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install '.[accelerate]')")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import fp8vit  # noqa: E402
from fp8vit._te import extra_state  # noqa: E402
from fp8vit.training.autocast import fp8_forward  # noqa: E402
from fp8vit.training.context import active_fp8_state  # noqa: E402


@pytest.fixture
def accelerator():
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    yield acc
    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate's state is process-wide
    GradientState._reset_state()


def batches(n=4, batch=4):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n * batch, 3, 32, 32, generator=g),
                                          torch.randint(0, 2, (n * batch,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=batch)


def test_prepare_train_save_state_load_state(accelerator, tmp_path):
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=2)
    fp8vit.convert_to_te(model, autocast=True, cuda_graphs=True)  # the whole fp8vit change to an accelerate script
    seen = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, args: seen.append(
            (active_fp8_state() is not None, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt, loader = accelerator.prepare(model, opt, batches())
    # accelerate wrapped the model's forward in its autocast: the summary still says FP8 runs inside
    assert "inside the model's forward" in (fp8vit.conversion_summary(model).fp8_forward or "")

    def steps(n):
        losses = []
        for _, (x, y) in zip(range(n), loader):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def weights():
        return {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}

    steps(2)
    accelerator.save_state(str(tmp_path / "state"))  # safetensors
    saved = weights()
    after = steps(2), weights()

    accelerator.load_state(str(tmp_path / "state"))
    assert all(torch.equal(v, saved[k]) for k, v in weights().items())
    again = steps(2), weights()
    assert again[0] == after[0]  # the same losses: weights and momentum came back
    assert all(torch.equal(v, after[1][k]) for k, v in again[1].items())
    assert all(torch.isfinite(torch.tensor(after[0])))

    # every block ran inside fp8vit's FP8 context, under accelerate's bf16 autocast
    assert len(seen) == 2 * 6 and set(seen) == {(True, True, torch.bfloat16)}
    assert "blocks.0.qkv.layer_norm_weight" in saved
    # unwrapped without accelerate's autocast wrapper, the model still carries FP8
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert fp8_forward(plain) is not None
    with torch.no_grad():
        assert plain(torch.randn(2, 3, 32, 32)).shape == (2, 2)


class _FP8State(torch.nn.Module):
    """What a TE module that ran delayed scaling puts in the state dict (fp8vit's encoding)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.loaded = None

    def get_extra_state(self):
        return extra_state.encode_state({
            "recipe": {"margin": 0, "fp8_format": "HYBRID", "amax_history_len": 16}, "extra_fp8_variables": {},
            "scale_fwd": torch.full((3,), 2.0), "amax_history_fwd": torch.ones(16, 3),
            "scale_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(16, 2)})

    def set_extra_state(self, state):
        self.loaded = extra_state.decode_state(state)


def test_save_state_default_safetensors_keeps_fp8_state(accelerator, tmp_path):
    model = accelerator.prepare(_FP8State())
    accelerator.save_state(str(tmp_path / "safe"))  # accelerate's default: safetensors, tensors only
    accelerator.load_state(str(tmp_path / "safe"))
    loaded = accelerator.unwrap_model(model).loaded
    assert loaded["recipe"]["amax_history_len"] == 16 and torch.equal(loaded["scale_fwd"], torch.full((3,), 2.0))
