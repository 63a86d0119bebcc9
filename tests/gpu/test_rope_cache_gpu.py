"""The RoPE angle cache of fp8vit.blocks.eva on the GPU (issue 32, item 3): the device part of its key,
and inference (``torch.inference_mode`` / ``no_grad``) of converted RoPE ViTs (fixed and mixed
RoPE), EVA02 and the Perception Encoder after a move from the CPU, eagerly and with CUDA-graphed
blocks. The CPU side (every other part of the key, timm's own model in inference mode) is
tests/test_rope_cache.py.

Tolerances as in test_eva_gpu.py: fp32 TE against timm 2e-3 of the output's max (TE's tanh GELU
kernel, other kernels); the same model computed twice (cached and uncached angles, eager and
graphed-but-eval) 1e-5.
"""

import copy

import pytest
import timm
import torch

import fp8vit
import fp8vit.blocks.eva
from fp8vit.blocks.eva import forward_rope_angles
from helpers import max_rel_err, rope_angles_uncached, snr_db

pytestmark = pytest.mark.gpu

B = 16  # 16 x 197 token rows: aligned for FP8
MODELS = {
    "vit_small_patch16_rope_224": {},        # fixed RoPE: the table is RotaryEmbeddingCat's buffer
    "vit_small_patch16_rope_mixed_224": {},  # mixed RoPE: learnable freqs, a per-head table
    "eva02_tiny_patch14_224": {},            # EVA02
    "vit_pe_core_tiny_patch16_384": dict(attn_pool_num_heads=4),  # Perception Encoder
}
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def _timm_model(name):
    """On the CPU, 256 wide (FP8 GEMMs want multiples of 16), 2 blocks, 224 px."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, depth=2, embed_dim=256, num_heads=4, num_classes=100,
                              img_size=224, **MODELS[name]).eval()
    with torch.no_grad():  # non-zero biases and LayerScale, so that every tensor counts
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _images(device, batch=B):
    g = torch.Generator(device).manual_seed(1)
    return torch.randn(batch, 3, 224, 224, device=device, generator=g)


def test_angles_follow_the_table_across_devices():
    """The same tensor object moved by ``t.data =`` (module.to() on a parameter): same version,
    another device; the angles are recomputed there, and again on the way back."""
    torch.manual_seed(0)
    table = torch.rand(196, 64) * 2 - 1
    cpu = forward_rope_angles(table, 197, 1)
    assert cpu.device.type == "cpu"
    v = table._version
    table.data = table.data.cuda()
    assert table._version == v
    gpu = forward_rope_angles(table, 197, 1)
    assert gpu.is_cuda and torch.allclose(gpu.cpu(), cpu, rtol=1e-6, atol=1e-6)
    assert forward_rope_angles(table, 197, 1) is gpu
    with torch.inference_mode():
        assert forward_rope_angles(table, 197, 1).is_cuda
    table.data = table.data.cpu()
    assert forward_rope_angles(table, 197, 1).device.type == "cpu"


@pytest.mark.parametrize("name", list(MODELS))
def test_inference_after_move_to_cuda(name):
    """Inference on the CPU first (the cache holds CPU angles), then the same converted model
    (reference backend) moved to the GPU, and a TE-backend conversion of the moved timm model:
    both match timm on the GPU under inference_mode and no_grad, in FP8 too."""
    ref = _timm_model(name)
    moved = fp8vit.convert_to_te(copy.deepcopy(ref), backend="reference", exact_gelu=True)
    x = _images("cpu", batch=2)
    with torch.inference_mode():
        torch.testing.assert_close(moved(x), ref(x), rtol=1e-5, atol=1e-5)
    ref.cuda(), moved.cuda()
    te = fp8vit.convert_to_te(copy.deepcopy(ref), backend="te")
    x = _images("cuda")
    for mode_name, mode in MODES.items():
        with mode():
            want = ref(x)
            got_moved, got_te = moved(x), te(x)
            with rope_angles_uncached():
                uncached_moved, uncached_te = moved(x), te(x)
            with fp8vit.fp8_context():
                fp8 = te(x)
        print(f"{name} {mode_name}: reference backend max rel err {max_rel_err(want, got_moved):.2e}, "
              f"TE {max_rel_err(want, got_te):.2e}, FP8 {snr_db(want, fp8):.1f} dB")
        assert got_moved.is_cuda and got_te.is_cuda
        assert got_te.is_inference() == (mode_name == "inference_mode")
        assert max_rel_err(uncached_moved, got_moved) < 1e-5 and max_rel_err(uncached_te, got_te) < 1e-5
        assert max_rel_err(want, got_moved) < 2e-3 and max_rel_err(want, got_te) < 2e-3
        assert snr_db(want, fp8) >= 20.0


def _train_step(model, x):
    import torch.nn.functional as F

    y = torch.arange(x.shape[0], device=x.device) % 100
    with fp8vit.fp8_context("delayed"):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", list(MODELS))
def test_graphed_blocks_then_inference(name):
    """A model converted on the CPU (reference backend) that ran inference there, converted back,
    moved to the GPU and converted with TE; per-block CUDA graphs (captured with the table as a
    graph input, uncached during capture), one graphed training forward and backward, then
    inference in eval mode (eager, TE's rule) against a twin converted the same way and never
    graphed: the cache must hand neither model a graph's or another device's angles."""
    ref = _timm_model(name)
    model = fp8vit.convert_to_te(copy.deepcopy(ref), backend="reference", exact_gelu=True)
    with torch.inference_mode():
        torch.testing.assert_close(model(_images("cpu", batch=2)), ref(_images("cpu", batch=2)),
                                   rtol=1e-5, atol=1e-5)
    model = fp8vit.convert_from_te(model).cuda()
    ref.cuda()
    eager = fp8vit.convert_to_te(copy.deepcopy(model), backend="te").train()
    graphed = fp8vit.convert_to_te(model, backend="te").train()
    handle = fp8vit.make_graphed_blocks(graphed, B, recipe="delayed", fused_wgrad=False)
    assert handle.per_block
    x = _images("cuda")
    _train_step(eager, x)
    _train_step(graphed, x)  # no optimizer step: the weights stay equal
    assert handle.replays == len(graphed.blocks) and handle.eager_calls == 0
    eager.eval(), graphed.eval()
    for mode in MODES.values():
        with mode():
            want, got = eager(x), graphed(x)
            with fp8vit.fp8_context("delayed"):
                want8, got8 = eager(x), graphed(x)
            ref_out = ref(x)
        assert max_rel_err(want, got) < 1e-5
        assert max_rel_err(ref_out, got) < 2e-3
        assert snr_db(want8, got8) > 40
    assert handle.eager_calls == 2 * len(MODES) * len(graphed.blocks)
