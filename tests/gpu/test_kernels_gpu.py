"""fp8vit's Triton kernels on the GPU against the torch expressions they replace.

LayerScale's backward (:func:`fp8vit._te.kernels.layerscale_backward`): ``dy`` bit-identical to torch's
``grad * gamma``; ``dgamma`` (fp32 sums of exact products) no further from an fp64 sum than 1e-5 of
the column's sum of ``|grad * y|``. Shapes with rows and columns that are not multiples of the
kernel's tiles (32 x 128).

Drop path's residual add (:func:`fp8vit._te.kernels.row_scale_add`, :class:`DropPathAdd`): against
torch's ``addcmul`` and ``g * mask``, which compute the same fp32 multiply-add rounded once; an
fp32 fused multiply-add may round differently in the last fp32 bit, which moves the bf16 result by
one ulp at most, and rarely.

A padded MLP's inner norm (:class:`fp8vit.blocks.mlp.PaddedNorm`): against torch's slice, norm and
pad in fp32 (the same statistics; the output, input and weight gradients within bf16 rounding: the
weights are rounded to the activations' dtype, as ``norm_in_dtype`` does), the padding exactly 0
both ways; with nothing padded, as ``norm_in_dtype`` runs it on the GPU; and as a model's own
LayerNorm under autocast (:mod:`fp8vit.blocks.model_norm`): bf16 in, fp32 out, against autocast's.
"""

import pytest
import torch

from fp8vit._te.kernels import column_scale_add, layerscale_backward, row_scale_add
from fp8vit.blocks.base import DropPathAdd, LayerScaleAdd
from fp8vit.blocks.mlp import PaddedNorm, norm_in_dtype
from helpers import need_triton

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_triton():
    need_triton()


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


def _one_ulp_at_most(a, b, share=1e-3):
    """``a`` and ``b`` (half precision) equal but for at most ``share`` of the elements, those one ulp apart."""
    diff = (a.float() - b.float()).abs()
    ulp = torch.finfo(a.dtype).eps * torch.maximum(a.float().abs(), b.float().abs())
    return bool((diff <= ulp).all()) and float((diff > 0).float().mean()) <= share


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(128 * 64, 49, 128), (3, 5, 200), (1, 1, 16), (7, 197, 768)])
def test_row_scale_add_against_torch(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    y = torch.randn_like(x)
    mask = (torch.rand(shape[0], *(1,) * (len(shape) - 1), device="cuda") > 0.3).to(dtype) / 0.7
    out, scaled = row_scale_add(x, y, mask), row_scale_add(None, y, mask)
    assert out.dtype == scaled.dtype == dtype and out.shape == scaled.shape == x.shape
    assert _one_ulp_at_most(out, torch.addcmul(x, y, mask)) and torch.equal(scaled, y * mask)


def _launched(fn):
    """``fn()``'s result and the names of the CUDA kernels it launched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("with_x", [True, False], ids=["residual_add", "row_scale_alone"])
def test_drop_path_add_runs_one_kernel_each_way_and_matches_torch(with_x):
    # Swin-B stage 1's shape: window-major rows [nW * B, 49, 128], the mask one value per row; without
    # x, drop path before LayerScale (y * mask alone). Forward and backward one Triton pass each.
    torch.manual_seed(0)
    x = torch.randn(64 * 16, 49, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn_like(x, requires_grad=True)
    mask = (torch.rand(64 * 16, 1, 1, device="cuda") > 0.1).to(torch.bfloat16) / 0.9
    g = torch.randn_like(x)

    def step():
        out = DropPathAdd.apply(x if with_x else None, y, mask)
        out.backward(g)
        return out

    out, kernels = _launched(step)
    print(f"DropPathAdd kernels: {sorted(set(k[:60] for k in kernels))}")
    assert sum("row_scale_add" in k for k in kernels) == 2, kernels
    assert not any("addcmul" in k or "BinaryFunctor" in k for k in kernels), kernels
    if with_x:
        assert _one_ulp_at_most(out, torch.addcmul(x, y, mask)) and torch.equal(x.grad, g)
    else:
        assert torch.equal(out, y * mask) and x.grad is None
    assert torch.equal(y.grad, g * mask)


def test_drop_path_add_leaves_other_mask_shapes_to_torch():
    # a mask that is not one value per leading row in y's dimensions ([S] broadcasts over the last
    # dimension in torch): torch's addcmul, not the row kernel, so GPU and CPU compute the same
    x = torch.randn(4, 3, 4, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    mask = torch.tensor([0.0, 2.0, 1.0, 4.0], device="cuda", dtype=torch.bfloat16)
    assert torch.equal(DropPathAdd.apply(x, y, mask), torch.addcmul(x, y, mask))


@pytest.mark.parametrize("real,hp,via", [(2730, 2736, "PaddedNorm"), (1024, 1024, "norm_in_dtype")],
                         ids=["eva02_large_mlp", "vitamin_large_norm2"])
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_padded_norm_against_torch_in_fp32(kind, real, hp, via):
    # EVA02-L/14's MLP: 2730 real of 2736 hidden units; ViTamin-L's norm before its MLP, nothing
    # padded, through norm_in_dtype under autocast (lever 38). Batch 8 x 257 tokens, bf16.
    import torch.nn.functional as F
    from torch import nn
    torch.manual_seed(0)
    norm = (nn.LayerNorm(real) if kind == "LayerNorm" else nn.RMSNorm(real, eps=1e-6)).cuda()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        if kind == "LayerNorm":
            norm.bias.uniform_(-0.5, 0.5)
    h = (torch.randn(8, 257, hp, device="cuda") * 2 + 0.3).to(torch.bfloat16)
    h[..., real:] = 0
    h.requires_grad_(True)
    g = torch.randn(8, 257, hp, device="cuda").to(torch.bfloat16)
    def step():
        if via == "PaddedNorm":
            out = PaddedNorm.of(norm, h, real)
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = norm_in_dtype(norm, h)
        out.backward(g)
        return out

    y, kernels = _launched(step)
    assert any("padded_norm_fwd" in k for k in kernels) and any("padded_norm_bwd" in k for k in kernels), kernels
    got = {n: p.grad.clone() for n, p in norm.named_parameters()}
    norm.zero_grad()
    x = h.detach()[..., :real].float().requires_grad_(True)  # the fp32 reference
    ref = F.pad(norm(x), (0, hp - real))
    ref.backward(g.float())
    assert y.dtype == torch.bfloat16 and bool((y[..., real:] == 0).all()) and bool((h.grad[..., real:] == 0).all())
    assert float((y.float() - ref).abs().max()) <= 2 ** -7 * float(ref.abs().max())
    assert float((h.grad[..., :real].float() - x.grad).abs().max()) <= 2 ** -7 * float(x.grad.abs().max())
    for n, p in norm.named_parameters():
        assert got[n].dtype == torch.float32
        torch.testing.assert_close(got[n], p.grad, rtol=2 ** -7, atol=2 ** -7 * float(p.grad.abs().max()))
    empty = torch.zeros(0, 257, hp, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    norm.zero_grad()
    PaddedNorm.of(norm, empty, real).sum().backward()  # an empty batch: no launch, zero gradients
    assert empty.grad.shape == empty.shape and not norm.weight.grad.any()


@pytest.mark.parametrize("shape", [(32, 577, 1024), (3, 5, 200), (1, 1, 16)])
def test_layerscale_forward_is_one_column_scale_pass(shape):
    # LayerScaleAdd's forward (x + y * gamma, gamma per column) as one contiguous pass: torch's
    # addcmul within one ulp, and no torch addcmul kernel (its broadcast gamma: non-vectorized).
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    gamma = torch.rand(shape[-1], device="cuda") * 0.2
    assert _one_ulp_at_most(column_scale_add(x, y, gamma.to(x.dtype)), torch.addcmul(x, y, gamma.to(x.dtype)))
    out, kernels = _launched(lambda: LayerScaleAdd.apply(x, y, gamma))
    assert any("row_scale_add" in k for k in kernels) and not any("addcmul" in k for k in kernels), kernels
    assert _one_ulp_at_most(out, torch.addcmul(x, y, gamma.to(x.dtype)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16_stream", "fp32_input"])
@pytest.mark.parametrize("timm_class", [False, True], ids=["nn.LayerNorm", "timm.LayerNorm"])
def test_model_norm_under_autocast_is_autocasts_layernorm_in_one_pass_each_way(timm_class, dtype):
    # ViT-B/16's final norm on the bf16 stream [16, 197, 768] (fp8vit.blocks.model_norm, lever 45),
    # and an fp32 input (PE's norm_pre after timm's fp32 position embedding). Autocast runs torch's
    # LayerNorm in fp32 on the exact inputs with fp32 weights and gives an fp32 output; the switched
    # norm computes the same in one Triton pass each way: the output within fp32 rounding, the input
    # gradient within one rounding of its dtype, the fp32 weight and bias gradients within fp32
    # summation-order noise.
    import copy

    from timm.layers import LayerNorm as TimmLayerNorm
    from torch import nn

    from fp8vit.blocks.model_norm import set_model_norms

    torch.manual_seed(0)
    holder = nn.Module()
    holder.norm = (TimmLayerNorm(768) if timm_class else nn.LayerNorm(768, eps=1e-6)).cuda()
    with torch.no_grad():
        holder.norm.weight.uniform_(0.5, 1.5)
        holder.norm.bias.uniform_(-0.5, 0.5)
    ref = copy.deepcopy(holder.norm)
    assert set_model_norms(holder) == ["norm"]
    x = (torch.randn(16, 197, 768, device="cuda") * 2 + 0.3).to(dtype)
    g = torch.randn(16, 197, 768, device="cuda")

    def run(norm):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = norm(xi)
        y.backward(g)
        return y.detach(), xi.grad, norm.weight.grad, norm.bias.grad

    (y, dx, dw, db), kernels = _launched(lambda: run(holder.norm))
    assert any("padded_norm_fwd" in k for k in kernels) and any("padded_norm_bwd" in k for k in kernels), kernels
    ry, rdx, rdw, rdb = run(ref)
    assert y.dtype == ry.dtype == torch.float32 and dx.dtype == rdx.dtype == dtype
    err = {"out": float((y - ry).abs().max() / ry.abs().max()),
           "dx": float((dx.float() - rdx.float()).abs().max() / rdx.float().abs().max()),
           "dw": float((dw - rdw).abs().max() / rdw.abs().max()),
           "db": float((db - rdb).abs().max() / rdb.abs().max())}
    print(err)
    dx_bound = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    assert err["out"] <= 1e-6 and err["dx"] <= dx_bound and err["dw"] <= 1e-5 and err["db"] <= 1e-5, err
