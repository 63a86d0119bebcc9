"""fp8vit's Triton kernels on the GPU against the torch (and timm) expressions they replace.

LayerScale's backward (:func:`fp8vit.kernels.layerscale_backward`): ``dy`` bit-identical to torch's
``grad * gamma``; ``dgamma`` (fp32 sums of exact products) no further from an fp64 sum than 1e-5 of
the column's sum of ``|grad * y|``. Shapes with rows and columns that are not multiples of the
kernel's tiles (32 x 128).

RoPE on the packed QKV buffer (:func:`fp8vit.kernels.rope_packed_qkv`): timm's ``apply_rot_embed_cat``
within one fused multiply-add in fp32 and one rounding in bf16, v and the prefix tokens copied
exactly; the in-place backward equal to autograd's through timm's expression; and the EVA block
taking it.
"""

import pytest
import torch
from timm.layers.pos_embed_sincos import apply_rot_embed_cat

from fp8vit.kernels import layerscale_backward, rope_packed_qkv, triton_support
from fp8vit.layers import LayerScaleAdd

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_triton():
    ok, why = triton_support()
    if not ok:
        pytest.skip(f"fp8vit's Triton kernels cannot run here: {why}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(128, 197, 768), (3, 5, 200), (1, 1, 16), (2, 257, 1280)])
def test_layerscale_backward_against_torch(shape, dtype):
    torch.manual_seed(0)
    g = torch.randn(shape, device="cuda", dtype=dtype)
    y = torch.randn_like(g)
    gamma = (torch.rand(shape[-1], device="cuda") * 0.2).to(dtype)
    dy, dgamma = layerscale_backward(g, y, gamma)
    assert dy.shape == g.shape and dy.dtype == dtype and dgamma.dtype == torch.float32
    assert torch.equal(dy, g * gamma)
    prod = g.double() * y.double()
    ref, scale = prod.flatten(0, -2).sum(0), prod.abs().flatten(0, -2).sum(0)
    assert float(((dgamma.double() - ref).abs() / scale).max()) < 1e-5


def test_layerscale_add_backward_on_cuda_sums_exact_products():
    # LayerScaleAdd's backward on CUDA (the kernel) against fp32 sums of the exact products: torch's
    # path, which rounds each product to bf16 first, misses the tolerance by ~100x.
    torch.manual_seed(0)
    x = torch.randn(4, 65, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn_like(x, requires_grad=True)
    gamma = torch.full((384,), 0.1, device="cuda", requires_grad=True)
    g = torch.randn_like(x)
    LayerScaleAdd.apply(x, y, gamma).backward(g)
    assert torch.equal(x.grad, g) and torch.equal(y.grad, g * gamma.to(torch.bfloat16))
    ref = (g.float() * y.float()).flatten(0, -2).sum(0)
    assert gamma.grad.dtype == torch.float32
    torch.testing.assert_close(gamma.grad, ref, rtol=1e-5, atol=1e-4)


def _rope_case(dtype, interleaved, B=3, npt=1, n_patch=196, H=4, D=64):
    theta = torch.rand(n_patch, D // 2, device="cuda") * 6
    theta = theta.repeat_interleave(2, -1) if interleaved else theta.repeat(1, 2)
    table = torch.cat([theta.sin(), theta.cos()], -1)
    qkv = torch.randn(B, npt + n_patch, 3, H, D, device="cuda", dtype=dtype)
    return qkv, table, npt


def _timm_rope(t, table, npt, interleaved):  # t [B, N, H, D] -> timm's EvaAttention maths, fp32
    t = t.float().transpose(1, 2)
    t = torch.cat([t[:, :, :npt], apply_rot_embed_cat(t[:, :, npt:], table, half=not interleaved)], 2)
    return t.transpose(1, 2)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_packed_qkv_is_timms_rope(dtype, interleaved):
    torch.manual_seed(0)
    qkv, table, npt = _rope_case(dtype, interleaved)
    out = rope_packed_qkv(qkv, table, npt, interleaved)
    assert torch.equal(out[:, :, 2], qkv[:, :, 2]) and torch.equal(out[:, :npt], qkv[:, :npt])
    for i in (0, 1):
        ref = _timm_rope(qkv[:, :, i], table, npt, interleaved)
        # fp32: one fused multiply-add apart at most; bf16: timm's fp32 result rounded once.
        tol = 1e-6 if dtype == torch.float32 else 2 ** -8
        err = ((out[:, :, i].float() - ref).abs() / ref.abs().clamp_min(1e-3)).max()
        assert float(err) <= tol, (i, float(err))


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_packed_qkv_backward_in_place_is_the_transpose(interleaved):
    torch.manual_seed(0)
    qkv, table, npt = _rope_case(torch.float32, interleaved)
    x = qkv.clone().requires_grad_(True)
    q, k, v = x.unbind(2)
    y = torch.stack([_timm_rope(q, table, npt, interleaved), _timm_rope(k, table, npt, interleaved), v], 2)
    g = torch.randn_like(y)
    y.backward(g)
    got = g.clone()
    assert rope_packed_qkv(got, table, npt, interleaved, backward=True) is got  # in place
    torch.testing.assert_close(got, x.grad, rtol=1e-5, atol=1e-6)


def test_eva_block_rotates_the_packed_buffer():
    # The wiring: a RoPE ViT block on CUDA takes RopeQKV (one Triton pass) and matches timm's block.
    import timm
    from fp8vit.eva import TE_EvaBlock
    torch.manual_seed(0)
    m = timm.create_model("vit_base_patch16_rope_224", pretrained=False, depth=1, embed_dim=256,
                          num_heads=4).cuda()
    blk = m.blocks[0]
    x = torch.randn(2, 197, 256, device="cuda")
    rope = m.rope.get_embed()
    ref = blk(x, rope=rope)
    te_blk = TE_EvaBlock.from_timm(blk, backend="te")
    out = te_blk(x, rope=rope)
    names, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and type(fn).__name__ not in names:
            names.add(type(fn).__name__)
            todo.extend(f for f, _ in fn.next_functions)
    assert "RopeQKVBackward" in names, sorted(names)
    assert float((out - ref).abs().max() / ref.abs().max()) < 2e-3
