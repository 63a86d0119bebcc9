"""The RoPE angle cache of fp8vit.blocks.eva (forward_rope_angles) on the reference backend (CPU, fp32).

Issue 32 (3): a converted vit_small_patch16_rope_mixed_224 crashed under ``torch.inference_mode``
("Inference tensors do not track version counter": the cache read ``_version`` of a table made
there). Here: converted RoPE ViTs (fixed and mixed RoPE), EVA02 and the Perception Encoder under
``inference_mode`` and ``no_grad`` against timm's own model, alternating with training forwards;
and the cache's key: every property of the table that changes the angles (content, dtype,
shape, storage, the table object itself, token counts) gives what an uncached computation gives.
The device part of the key needs a GPU: tests/gpu/test_rope_cache_gpu.py.
"""

import contextlib
import copy

import pytest
import timm
import torch

import fp8vit.blocks.eva
from fp8vit.blocks.eva import TE_EvaBlock, forward_rope_angles, rope_angles
from helpers import count_rope_angle_computations, rope_angles_uncached

# Small versions (2 blocks, 4 x 4 patches, 64 wide) of the smallest timm model of each RoPE kind.
MODELS = {
    "vit_small_patch16_rope_224": {},        # fixed RoPE (RotaryEmbeddingCat's buffer), AttentionRope
    "vit_small_patch16_rope_mixed_224": {},  # mixed RoPE: learnable freqs, a per-head table (timm's path)
    "eva02_tiny_patch14_224": {},            # EVA02: q/v bias, SwiGLU
    "vit_pe_core_tiny_patch16_384": dict(attn_pool_num_heads=4),  # Perception Encoder
}
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


def _timm_model(name, **overrides):
    torch.manual_seed(0)
    patch = 16 if "patch16" in name else 14
    kw = dict(depth=2, embed_dim=64, num_heads=4, num_classes=5, img_size=4 * patch, **MODELS[name])
    model = timm.create_model(name, pretrained=False, **{**kw, **overrides}).eval()
    with torch.no_grad():  # timm zero-inits biases and LayerScale is ~1e-5: make every tensor count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _convert(model):
    # exact_gelu: timm's erf GELU kept (the RoPE ViTs and PE use it), so that fp32 matches tightly
    for i, blk in enumerate(model.blocks):
        model.blocks[i] = TE_EvaBlock.from_timm(blk, backend="reference", exact_gelu=True)
    return model


def _pair(name, **overrides):
    ref = _timm_model(name, **overrides)
    return ref, _convert(copy.deepcopy(ref))


def _images(model, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *model.patch_embed.img_size, generator=g)


def _check(te, ref, x, mode=contextlib.nullcontext):
    """te(x) under ``mode``: equal to the uncached computation, close to timm's model."""
    with mode():
        got = te(x)
        with rope_angles_uncached():
            uncached = te(x)
        want = ref(x)
    assert torch.equal(got, uncached)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return got


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(MODELS))
def test_inference_and_no_grad_match_timm(name, mode):
    ref, te = _pair(name)
    x = _images(te)
    first = _check(te, ref, x, MODES[mode])
    assert first.is_inference() == (mode == "inference_mode")
    with MODES[mode]():  # again: the cache's entry (if any) is reused, same result
        assert torch.equal(te(x), first)
    # then a training forward and backward (angles cached under inference mode are inference
    # tensors, which autograd could not save): gradients as timm's
    te.train(), ref.train()
    out, want = te(x), ref(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    want.square().sum().backward()
    for n, p in ref.named_parameters():
        if not n.startswith("blocks.") and p.grad is not None:  # rope.freqs (mixed RoPE) among them
            torch.testing.assert_close(te.get_parameter(n).grad, p.grad, rtol=1e-4, atol=1e-5, msg=n)
    te.eval(), ref.eval()
    _check(te, ref, x, MODES[mode])  # and back


@pytest.mark.parametrize("name", ["vit_small_patch16_rope_224", "vit_small_patch16_rope_mixed_224"])
def test_inference_mode_with_dynamic_image_size(name):
    # dynamic_img_size: timm builds the table for each input size, every forward (bands mode)
    ref, te = _pair(name, dynamic_img_size=True)
    for size in [(64, 64), (96, 80), (64, 64)]:
        x = torch.randn(1, 3, *size)
        for mode in MODES.values():
            _check(te, ref, x, mode)


def _turned(table: torch.Tensor, by: float) -> torch.Tensor:
    """timm's table ``cat(sin, cos)`` of angles ``by`` times the table's own (sin^2 + cos^2 stays 1:
    fp8vit takes a table as angles, which other scalings of sin and cos would not be)."""
    sin, cos = table.chunk(2, dim=-1)
    theta = torch.atan2(sin, cos) * by
    return torch.cat([theta.sin(), theta.cos()], -1)


def test_fixed_rope_table_changed_in_place_or_replaced():
    ref, te = _pair("vit_small_patch16_rope_224")
    x = _images(te)
    first = _check(te, ref, x, torch.inference_mode)
    for rope in (ref.rope, te.rope):  # the buffer timm hands every block, changed in place
        with torch.no_grad():
            rope.pos_embed.copy_(_turned(rope.pos_embed, 1.1))
    changed = _check(te, ref, x, torch.inference_mode)
    assert not torch.equal(changed, first)
    _check(te, ref, x, torch.no_grad)
    for rope in (ref.rope, te.rope):  # replaced by another tensor
        rope.pos_embed = rope.pos_embed.flip(0).clone()
    _check(te, ref, x, torch.inference_mode)
    _check(te, ref, x)
    # the same tensor object given other data (what module.to() does to a parameter): its
    # version stays, its storage changes
    for rope in (ref.rope, te.rope):
        v = rope.pos_embed._version
        rope.pos_embed.data = _turned(rope.pos_embed, 0.9)
        assert rope.pos_embed._version == v
    _check(te, ref, x, torch.no_grad)


def test_model_to_float64():
    ref, te = _pair("vit_small_patch16_rope_224")
    x = _images(te)
    _check(te, ref, x, torch.inference_mode)
    ref.double(), te.double()
    got = _check(te, ref, x.double(), torch.inference_mode)
    assert got.dtype == torch.float64
    ref.float(), te.float()
    _check(te, ref, x, torch.inference_mode)


def test_mixed_rope_after_optimizer_step_and_load_state_dict():
    # mixed RoPE's table comes from learnable frequencies: trained, then evaluated; then new weights loaded
    ref, te = _pair("vit_small_patch16_rope_mixed_224")
    x = _images(te)
    _check(te, ref, x, torch.inference_mode)
    for model in (ref, te):
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(x).square().mean().backward()
        assert model.rope.freqs.grad is not None and model.rope.freqs.grad.abs().sum() > 0
        opt.step()
        model.eval()
    torch.testing.assert_close(te.rope.freqs, ref.rope.freqs, rtol=1e-5, atol=1e-6)
    _check(te, ref, x, torch.inference_mode)
    _check(te, ref, x, torch.no_grad)
    other, other_te = _pair("vit_small_patch16_rope_mixed_224")
    with torch.no_grad():
        other.rope.freqs.mul_(2.0)
        other_te.rope.freqs.mul_(2.0)
    ref.load_state_dict(other.state_dict())
    te.load_state_dict(other_te.state_dict())
    _check(te, ref, x, torch.inference_mode)
    _check(te, ref, x, torch.no_grad)


def _in_cache(table) -> bool:
    ref = fp8vit.blocks.eva._ANGLES._entry[0]
    return ref is not None and ref() is table


def _fresh(table, n, npt):
    return rope_angles(table.detach().clone(), n, npt)


def test_cache_key_each_property(monkeypatch):
    """Each change of what the angles depend on recomputes them, to what a fresh computation gives."""
    calls = count_rope_angle_computations(monkeypatch)
    torch.manual_seed(0)
    table = torch.rand(16, 8) * 2 - 1
    first = forward_rope_angles(table, 17, 1)
    assert forward_rope_angles(table, 17, 1) is first and len(calls) == 1  # a hit

    def recomputed(n=17, npt=1):
        before = len(calls)
        got = forward_rope_angles(table, n, npt)
        assert len(calls) == before + 1
        assert torch.equal(got, _fresh(table, n, npt))
        assert forward_rope_angles(table, n, npt) is got and len(calls) == before + 1  # then a hit
        return got

    with torch.no_grad():
        table.mul_(1.01)  # content, in place (an optimizer step, load_state_dict's copy_)
    assert not torch.equal(recomputed(), first)
    table.copy_(torch.rand(16, 8))
    recomputed()
    # the same object given other data, its version unchanged (t.data =, module.to() on a Parameter)
    v = table._version
    table.data = table.data.bfloat16()  # dtype (and values: bf16 rounds)
    assert table._version == v
    recomputed()
    table.data = table.data.float()
    recomputed()
    table.data = torch.rand(16, 8)  # same dtype, shape and version: another storage
    recomputed()
    table.data = torch.rand(20, 8)  # shape
    recomputed(21, 1)
    table.data = torch.rand(8, 20).t()  # strides
    recomputed(21, 1)
    recomputed(22, 2)  # token counts
    with torch.inference_mode():  # inference mode: angles that are inference tensors, kept apart
        inferred = recomputed(22, 2)
        assert inferred.is_inference()
    assert not recomputed(22, 2).is_inference()
    other = table.clone()  # another tensor object
    before = len(calls)
    forward_rope_angles(other, 22, 2)
    assert len(calls) == before + 1


def test_uncached_tables(monkeypatch):
    """Inference tensors, tables that require grad, tensor subclasses, and tables seen during CUDA
    graph capture or compilation are computed every call and never enter the cache."""
    calls = count_rope_angle_computations(monkeypatch)
    torch.manual_seed(0)
    with torch.inference_mode():
        table = torch.rand(16, 8)  # an inference tensor: no version counter
        a = forward_rope_angles(table, 17, 1)
        table.mul_(1.5)  # in place, unseen by any version counter
        b = forward_rope_angles(table, 17, 1)
        assert torch.equal(b, _fresh(table, 17, 1)) and not torch.equal(a, b)
    assert len(calls) == 2
    assert torch.equal(forward_rope_angles(table, 17, 1), _fresh(table, 17, 1))  # outside inference mode too
    assert len(calls) == 3 and not _in_cache(table)
    # a table that requires grad: the angles carry its gradient, every call (gradient accumulation)
    learnable = (torch.rand(16, 8) * 2 - 1).requires_grad_()
    for _ in range(2):
        forward_rope_angles(learnable, 17, 1).sum().backward()
    g = learnable.grad.clone()
    learnable.grad = None
    rope_angles(learnable, 17, 1).sum().backward()
    assert torch.equal(g, 2 * learnable.grad)
    param = torch.nn.Parameter(torch.rand(16, 8), requires_grad=False)  # a subclass
    forward_rope_angles(param, 17, 1)
    forward_rope_angles(param, 17, 1)
    assert len(calls) == 3 + 2 + 2 and not _in_cache(learnable) and not _in_cache(param)
    plain = torch.rand(16, 8)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    forward_rope_angles(plain, 17, 1)
    forward_rope_angles(plain, 17, 1)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    forward_rope_angles(plain, 17, 1)
    forward_rope_angles(plain, 17, 1)
    assert len(calls) == 11 and not _in_cache(plain)
