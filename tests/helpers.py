"""Shared test helpers: SNR, timm block/model factories, the examples as modules, tiny models of every
block family, and data-parallel runs over 2 gloo processes on the CPU."""

import contextlib
import datetime
import functools
import importlib.util
import io
import os
import sys
import socket
import traceback

import pytest
import torch
from timm.models.swin_transformer import SwinTransformerBlock
from timm.models.swin_transformer_v2 import SwinTransformerV2Block
import torch.nn.functional as F
from torch import nn

from fp8vit.training.numerics import snr_db  # noqa: F401 - one definition, shared by the tests


def max_rel_err(ref: torch.Tensor, test: torch.Tensor) -> float:
    """max |ref - test| / max |ref|."""
    ref, test = ref.detach().double(), test.detach().double()
    return float((ref - test).abs().max() / ref.abs().max())


def rel_l2_err(ref: torch.Tensor, test: torch.Tensor) -> float:
    """||ref - test|| / ||ref||: robust to a few elements that flip at an activation's kink."""
    ref, test = ref.detach().double(), test.detach().double()
    return float((ref - test).norm() / ref.norm())


# Option combinations of timm's Block that TE_Block must reproduce.
BLOCK_CASES = {
    "vit": dict(qkv_bias=True),
    "no_bias": dict(qkv_bias=False, proj_bias=False),
    "layerscale_qknorm": dict(qkv_bias=True, qk_norm=True, init_values=1e-5),
    "rmsnorm": dict(norm_layer="rms"),
    "exact_gelu": dict(qkv_bias=True, exact_gelu=True),
    "mlp_ratio_relu": dict(mlp_ratio=2.5, act_layer=nn.ReLU),
    "silu": dict(act_layer=nn.SiLU),
    "quick_gelu": dict(act_layer="quick_gelu"),
    "mish_unfused": dict(act_layer=nn.Mish),
    "dropout_unfused": dict(proj_drop=0.1, attn_drop=0.1),
}


# timm MLP kinds and options on a classic Block (keywords of timm's Block, as in BLOCK_CASES).
# Hidden 170 (mlp_ratio 170/64; 340 at dim 128) is not a multiple of 16: padded to 176 (352).
_TANH = functools.partial(nn.GELU, approximate="tanh")
_PAD = 170 / 64


def patch_gemm_errors(conv: nn.Conv2d, x: torch.Tensor) -> dict:
    """``{"Conv2d": (out, wgrad), "PatchGemmConv2d": (out, wgrad)}``: each one's relative L2 error
    under bf16 autocast against ``conv``'s own fp32 output and weight gradient (``conv`` is left a
    ``PatchGemmConv2d``; the loss is the output's sum of squares)."""
    from fp8vit.blocks.patch_embed import PatchGemmConv2d

    conv.__class__ = nn.Conv2d
    exact = conv(x)
    exact.square().sum().backward()
    g_exact = conv.weight.grad.clone()
    errs = {}
    for cls in (nn.Conv2d, PatchGemmConv2d):
        conv.weight.grad = conv.bias.grad = None
        conv.__class__ = cls
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            y = conv(x)
        assert y.shape == exact.shape and y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        errs[cls.__name__] = (rel_l2_err(exact, y.float()), rel_l2_err(g_exact, conv.weight.grad))
    return errs


def _mlp_cases():
    from timm.layers import GluMlp, SwiGLU, SwiGLUPacked
    from timm.models.vitamin import GeGluMlp

    gate_first = functools.partial(GluMlp, gate_last=False)
    return {
        "swiglu": dict(mlp_layer=SwiGLU, act_layer=nn.SiLU),                            # AIMv2
        "swiglu_no_bias_rms": dict(mlp_layer=SwiGLU, act_layer=nn.SiLU, proj_bias=False, norm_layer="rms"),
        "swiglu_norm": dict(mlp_layer=SwiGLU, act_layer=nn.SiLU, scale_mlp_norm=True),  # EVA02 (scale_mlp)
        "swiglu_norm_rms": dict(mlp_layer=SwiGLU, act_layer=nn.SiLU, scale_mlp_norm=True, norm_layer="rms"),
        "swiglu_align_to": dict(mlp_layer=functools.partial(SwiGLU, align_to=48), act_layer=nn.SiLU, mlp_ratio=2.0),
        "swiglu_dropout": dict(mlp_layer=SwiGLU, act_layer=nn.SiLU, proj_drop=0.1),
        "glu_sigmoid": dict(mlp_layer=GluMlp, act_layer=nn.Sigmoid),                   # GluMlp's defaults
        "glu_sigmoid_gate_first": dict(mlp_layer=gate_first, act_layer=nn.Sigmoid),
        "glu_silu_packed": dict(mlp_layer=SwiGLUPacked, act_layer=nn.SiLU),            # DINOv2-giant
        "glu_gelu_tanh": dict(mlp_layer=GluMlp, act_layer=_TANH),
        "glu_gelu_exact": dict(mlp_layer=gate_first, act_layer=nn.GELU, exact_gelu=True),
        "glu_relu_norm": dict(mlp_layer=GluMlp, act_layer=nn.ReLU, scale_mlp_norm=True),
        "glu_mish_unfused": dict(mlp_layer=GluMlp, act_layer=nn.Mish),
        "geglu_mlp": dict(mlp_layer=GeGluMlp, act_layer=_TANH, mlp_ratio=2.0),          # ViTamin
        "geglu_mlp_exact": dict(mlp_layer=GeGluMlp, act_layer=nn.GELU, mlp_ratio=2.0, exact_gelu=True),
        "mlp_norm": dict(scale_mlp_norm=True),
        "beit3": dict(scale_attn_norm=True, scale_mlp_norm=True, norm_layer=functools.partial(nn.LayerNorm, eps=1e-5)),
        "swiglu_padded": dict(mlp_layer=SwiGLU, act_layer=nn.SiLU, mlp_ratio=_PAD),
        "swiglu_norm_padded": dict(mlp_layer=SwiGLU, act_layer=nn.SiLU, mlp_ratio=_PAD, scale_mlp_norm=True),
        "glu_sigmoid_padded": dict(mlp_layer=GluMlp, act_layer=nn.Sigmoid, mlp_ratio=2 * _PAD),
        "mlp_gelu_padded": dict(mlp_ratio=_PAD),
        "mlp_sigmoid_padded": dict(act_layer=nn.Sigmoid, mlp_ratio=_PAD),              # act(0) != 0: sliced
        "mlp_sigmoid_norm_padded": dict(act_layer=nn.Sigmoid, mlp_ratio=_PAD, scale_mlp_norm=True),
    }


MLP_CASES = _mlp_cases()
PADDED_MLP_CASES = [k for k in MLP_CASES if k.endswith("_padded")]


def is_forward_gelu_kernel(name: str) -> bool:
    """A GPU kernel that computes a forward GELU: TE's own activation kernel, or a cuBLASLt GEMM with
    a GELU epilogue (``..._geluauxbias_...``); not the backward dGELU kernels."""
    return "gelu" in name.lower() and "dgelu" not in name.lower() and "CTDBiasDAct" not in name


def timm_block(dim=64, num_heads=4, **kw):
    """A timm Block with random (not default) norm/LayerScale weights, so mapping errors show."""
    from timm.layers import RmsNorm
    from timm.models.vision_transformer import Block

    kw = dict(kw)
    exact = kw.pop("exact_gelu", False)
    if kw.get("norm_layer") == "rms":
        kw["norm_layer"] = functools.partial(RmsNorm, eps=1e-6)
    kw.setdefault("norm_layer", functools.partial(nn.LayerNorm, eps=1e-6))
    kw.setdefault("act_layer", nn.GELU if exact else functools.partial(nn.GELU, approximate="tanh"))
    if isinstance(kw["act_layer"], str):  # timm's Block takes classes; VisionTransformer resolves names
        from timm.layers import get_act_layer
        kw["act_layer"] = get_act_layer(kw["act_layer"])
    block = Block(dim, num_heads, **kw)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") or "gamma" in name else 0.0))
    return block, exact


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load_script(path, name: str):
    """The script at ``path`` imported as module ``name`` (its ``main`` not run), to test its
    functions; registered in ``sys.modules`` first, where its dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_example(name: str):
    """``examples/<name>.py`` imported as a module (its ``main`` not run), to test its functions."""
    return load_script(os.path.join(EXAMPLES, f"{name}.py"), f"example_{name}")


# SNR floors of an FP8 step against the same step in bf16 (docs/numerics.md). E4M3 (forward) keeps 3
# mantissa bits: quantizing one tensor costs about 29 dB, a GEMM of two such tensors about 26 dB and a
# chain of them less, so logits must stay >= 20 dB (noise power 1% of the signal). Gradients are E5M2
# (2 mantissa bits, about 23 dB per tensor) and each weight gradient is a product of an E4M3 and an
# E5M2 tensor: 12 dB per weight gradient. A broken scale or layout gives about 0 dB.
LOGITS_DB, GRAD_DB = 20.0, 12.0


def need_recipe(recipe: str) -> None:
    """Skip the calling test, with TE's reason, where this GPU cannot run FP8 recipe ``recipe``."""
    import fp8vit

    ok, why = fp8vit.gpu_info().recipes[recipe]
    if not ok:
        pytest.skip(f"recipe {recipe!r} not supported here: {why}")


def need_triton() -> None:
    """Skip the calling test, with the reason, where fp8vit's Triton kernels cannot run here."""
    from fp8vit._te.kernels import triton_support

    ok, why = triton_support()
    if not ok:
        pytest.skip(f"fp8vit's Triton kernels cannot run here: {why}")


def bf16_ulps(a: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference in units of the last bf16 place of ``ref``'s largest value."""
    return float((a.float() - ref.float()).abs().max() / (ref.float().abs().max() * 2 ** -7))


def fp8_step(model, x, recipe, enabled=True):
    """One forward/backward inside ``fp8_context`` (FP8 on or off), loss ``mean(logits^2)``.

    Returns:
        (logits in fp32, {parameter name: gradient in fp32}) for the SNR comparisons.
    """
    import fp8vit

    model.zero_grad(set_to_none=True)
    with fp8vit.fp8_context(recipe, enabled=enabled, strict=enabled) as state:
        out = model(x)
    assert state.fp8 == enabled
    out.float().square().mean().backward()
    return out.float().detach(), {k: p.grad.float().clone() for k, p in model.named_parameters()
                                  if p.grad is not None}


def block_weight(name: str, grad=None) -> bool:
    """A weight of a transformer block (``blocks.N.`` anywhere in the name): :func:`fp8_snrs`'s default."""
    return ".blocks." in f".{name}" and name.endswith("weight")


def saved_after_fp8_steps(model, x, recipe, steps: int = 3) -> dict:
    """``model``'s state dict after ``steps`` FP8 SGD steps, saved to bytes and loaded back with
    ``weights_only=True`` (a checkpoint that needs pickle fails to load)."""
    assert os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE") != "1"
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        fp8_step(model, x, recipe)
        opt.step()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def step_snrs(ref, test, keep=block_weight, full=lambda t: t) -> dict:
    """SNR in dB of step ``test`` against step ``ref`` (each as :func:`fp8_step` returns it): the
    logits', and each gradient ``keep`` accepts.

    Args:
        keep: ``keep(name, ref's gradient)``: whether to compare that parameter's gradient.
        full: applied to each gradient first (FSDP2's DTensors to full tensors).

    Returns:
        ``{"logits": dB, name: dB, ...}``.
    """
    out = {"logits": snr_db(ref[0], test[0])}
    for k, g in ref[1].items():
        g = full(g)
        if keep(k, g):
            out[k] = snr_db(g, full(test[1][k]))
    return out


def fp8_snrs(model, x, recipe, keep=block_weight, *, fp8_steps=2, full=lambda t: t):
    """SNR in dB of an FP8 step (:func:`fp8_step`) against the same step with FP8 off: the logits',
    and each gradient ``keep`` accepts, after asserting that every FP8 gradient is finite.

    Delayed scaling quantizes a step's gradients with scales from the steps before; after one FP8
    step they can still be the initial 1, and gradients of ~1e-6 then flush to zero in E5M2 (measured
    on the H200: 0.0 dB for every block-0/1 weight of DINOv3-S and AIMv2-L, 24 dB one step later;
    git show d51209d:docs/results/gpu_tests_families_run1.log). Hence ``fp8_steps`` FP8 steps before
    the one measured (two, as ``diagnose()`` runs).

    Args:
        keep, full: as :func:`step_snrs` takes them.
        fp8_steps: FP8 steps run before the measured one.

    Returns:
        (``{"logits": dB, name: dB, ...}``, the name of the lowest, the bf16 step, the FP8 step); the
        steps as :func:`fp8_step` returns them, each gradient through ``full``.
    """
    steps = [fp8_step(model, x, recipe, enabled=False)]
    for _ in range(fp8_steps):
        fp8_step(model, x, recipe)
    steps.append(fp8_step(model, x, recipe))
    ref, test = ((logits, {k: full(g) for k, g in grads.items()}) for logits, grads in steps)
    bad = [k for k, g in test[1].items() if not torch.isfinite(g).all()]
    assert not bad, f"non-finite FP8 gradients: {bad}"
    snrs = step_snrs(ref, test, keep)
    return snrs, min(snrs, key=snrs.get), ref, test


def block_pair(case_kw: dict, *, backend: str, dim: int = 64, num_heads: int = 4, device: str = "cpu"):
    """A timm Block with options ``case_kw`` (a ``BLOCK_CASES``/``MLP_CASES`` entry; seed 0) in eval
    mode on ``device``, and the ``TE_Block`` converted from it on ``backend``."""
    import fp8vit

    torch.manual_seed(0)
    block, exact = timm_block(dim=dim, num_heads=num_heads, **case_kw)
    block = block.to(device).eval()
    return block, fp8vit.TE_Block.from_timm(block, exact_gelu=exact, backend=backend)


def assert_matches_timm_on_cpu(block, te):
    """Assert that ``te`` (a ``TE_Block`` built by ``block_pair`` on the reference backend) computes
    timm's ``block``: output, input gradient and every parameter gradient, elementwise, in fp32 on the
    CPU on a [3, 17, 64] input. The same math in another order, so 1e-5 relative is the rounding
    floor (1e-4 for weight gradients, sums over 51 rows)."""
    from fp8vit.blocks.weights import te_to_timm

    x = torch.randn(3, 17, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = block(x), te(x2)
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g), y2.backward(g)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)
    te_grads = te_to_timm({k: p.grad for k, p in te.named_parameters()}, te.cfg)  # raises on padding != 0
    assert te_grads.keys() == dict(block.named_parameters()).keys()
    for k, p in block.named_parameters():
        torch.testing.assert_close(te_grads[k], p.grad, rtol=1e-4, atol=1e-5, msg=k)


def padded_masks(block) -> dict:
    """``{parameter: boolean mask of its padded entries}`` of a TE_Block's MLP (hidden units
    padded for FP8: fc1's rows of each half, fc2's columns)."""
    c = block.cfg.mlp
    out = {}
    for name, p in block.mlp.named_parameters():
        mask = torch.zeros_like(p, dtype=torch.bool)
        if name in ("fc1_weight", "fc1_bias", "fc1.weight", "fc1.bias"):
            for half in range(2 if c.gated else 1):
                mask[half * c.hidden_padded + c.hidden:(half + 1) * c.hidden_padded] = True
        elif name in ("fc2_weight", "fc2.weight"):
            mask[:, c.hidden:] = True
        if mask.any():
            out[name] = mask
    return out


def fp32_against_timm(block, te, x: torch.Tensor) -> dict:
    """Run timm's ``block`` and its ``TE_Block`` twin ``te`` in fp32 on input ``x`` [B, N, C] with one
    random cotangent; both must have been built by ``block_pair``.

    Returns:
        ``out`` (max relative error of the output), ``dx`` (relative L2 error of the input gradient),
        ``grads`` ({timm parameter: relative L2 error of its gradient, floored at 1% of the block's
        largest gradient norm: some gradients are analytically zero, k_norm.bias's for one, and hold
        only rounding noise}) and ``kink_dx``: the dx error of timm's own block with its weights
        multiplied by (1 + 1e-4 * noise), the size of the kernel differences TE's fp32 kernels measure
        (tests/gpu/test_block_gpu.py). With ReLU, pre-activations within that of 0 flip the kink;
        ``kink_dx`` is what such flips do to dx in this block, on this input.
    """
    import copy

    import fp8vit

    def grad_of(module):
        xi = x.detach().clone().requires_grad_(True)
        module(xi).backward(g)
        return xi.grad

    with torch.no_grad():
        y = block(x)
        g = torch.randn_like(y)
        bumped = copy.deepcopy(block)
        for p in bumped.parameters():
            p.mul_(1 + 1e-4 * torch.randn_like(p))
    block.zero_grad(set_to_none=True), te.zero_grad(set_to_none=True)
    dx = grad_of(block)
    with torch.no_grad():
        out = max_rel_err(y, te(x))
    dx_te = grad_of(te)
    te_grads = fp8vit.blocks.weights.te_to_timm({k: p.grad for k, p in te.named_parameters()}, te.cfg)
    floor = 1e-2 * max(float(p.grad.norm()) for p in block.parameters())
    grads = {k: float((p.grad - te_grads[k]).norm()) / max(float(p.grad.norm()), floor)
             for k, p in block.named_parameters()}
    return dict(out=out, dx=rel_l2_err(dx, dx_te), grads=grads, kink_dx=rel_l2_err(dx, grad_of(bumped)))


# --------------------------------------------------------------------------- every block family, tiny
# name: (timm model, its options, fp8vit block class). Images of 4 x 4 patches of 8 px, 2 blocks.
FAMILY_SMALL = dict(img_size=32, patch_size=8, num_classes=5, depth=2)
FAMILY_MODELS = {
    "vit": ("vit_tiny_patch16_224", dict(embed_dim=32, num_heads=2), "TE_Block"),
    # RoPE, q/v biases with separate q/k/v projections, SwiGLU with a norm before fc2 (hidden 85,
    # padded to 96): the unfused gated MLP
    "eva02": ("eva02_base_patch14_224", dict(embed_dim=32, num_heads=2), "TE_EvaBlock"),
    # AttentionRope with one fused qkv Linear, LayerScale, erf GELU
    "rope_vit": ("vit_base_patch16_rope_224", dict(embed_dim=32, num_heads=2), "TE_EvaBlock"),
    # EvaBlockPostNorm: norms after the branches, a packed SwiGLU run unfused
    "eva_post_norm": ("eva02_tiny_patch14_224", dict(embed_dim=48, num_heads=3, use_post_norm=True),
                      "TE_EvaBlock"),
    # BEiT: q/v biases, a relative position bias table per block, LayerScale, erf GELU
    "beit": ("beit_base_patch16_224", dict(embed_dim=32, num_heads=2), "TE_BeitBlock"),
}


def family_timm_model(key, seed=0):
    """The timm model ``key`` of FAMILY_MODELS in eval mode, every tensor moved off its init value
    (timm zero-inits biases and LayerScale), so that a tensor mapped wrong shows."""
    import timm

    name, kw, _ = FAMILY_MODELS[key]
    if name not in timm.list_models(name):
        pytest.skip(f"timm {timm.__version__} has no {name}")
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, **FAMILY_SMALL, **kw).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


# --------------------------------------------------------------------------- data parallel on the CPU
WORLD = 2
STEPS = 3
BATCH = 4  # per rank; the single-process run takes WORLD * BATCH

# fp32 on 2 ranks against 1: the same sums in another order. After 3 SGD steps (lr 0.1, momentum) the
# parameters agree to 1.9e-8 (measured on 2 CPU cores, printed by the tests); 1e-5 leaves room for
# another CPU's kernels and still catches a gradient that is not averaged or reduced (the steps are
# 1e-3 to 1e-1 per weight) or a shard left out.
FP32_ATOL = 1e-5


def dp_batches():
    """STEPS batches of WORLD * BATCH 32 px images, labels in [0, 3)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(WORLD * BATCH, 3, 32, 32, generator=g), torch.randint(0, 3, (WORLD * BATCH,), generator=g))
            for _ in range(STEPS)]


def dp_train(net, batches, rank=None, opt=None):
    """SGD steps on ``batches``, rank ``rank``'s slice of each (None: all of it). Returns the optimizer."""
    opt = opt or torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        if rank is not None:
            x, y = x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH:(rank + 1) * BATCH]
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def full_params(model):
    """{name: full fp32 parameter}; a collective for a sharded model (every rank calls it)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in model.named_parameters()}


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def rel_update_err(start, ref, test):
    """max over parameters of ||test update - ref update|| / ||ref update||."""
    return max(float((test[k] - ref[k]).norm() / (ref[k] - start[k]).norm()) for k in ref
               if float((ref[k] - start[k]).norm()) > 0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank, port, tmp, cases):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A case that fails on one rank leaves the other in a collective: time out instead of hanging.
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD,
                                         timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)  # two processes on CI's two cores
    results = {}
    try:
        for name, case in cases.items():
            try:
                results[name] = case(rank, tmp)
            except Exception:  # noqa: BLE001 - reported by that case's test
                results[name] = {"traceback": traceback.format_exc()}
    finally:
        torch.save(results, os.path.join(tmp, f"rank{rank}.pt"))
        try:
            torch.distributed.barrier()  # both ranks done before either tears gloo down
        finally:
            torch.distributed.destroy_process_group()
    exit_without_shutdown()  # the results are saved above


def exit_without_shutdown():
    """End a gloo rank's process now, skipping the interpreter's shutdown: gloo's worker threads outlive
    destroy_process_group() once FSDP2 ran, and one still releasing a finished collective's tensors
    while Python finalizes aborts the process (SIGABRT), as examples/train_vit.py's __main__ explains."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(cases, tmp):
    """Run every ``case(rank, tmp)`` of ``cases`` ({name: module-level function}) on each of WORLD
    gloo processes, in one ``torch.multiprocessing.spawn`` (starting processes that import torch
    and timm is most of the cost).

    Returns:
        ``[results of rank 0, results of rank 1]``, each ``{case: result}``; a case that raised has
        ``{"traceback": ...}`` instead, so that each test fails on its own (:func:`rank_results`).
    """
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip(f"torch {torch.__version__} has no gloo backend for CPU process groups")
    torch.multiprocessing.spawn(_rank_worker, args=(free_port(), tmp, cases), nprocs=WORLD)
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def rank_results(results, case):
    """Each rank's result of ``case`` (from :func:`run_ranks`); fails with a rank's traceback."""
    out = []
    for r, res in enumerate(results):
        got = res[case]
        if "traceback" in got:
            pytest.fail(f"rank {r}, case {case}:\n{got['traceback']}")
        out.append(got)
    return out


@contextlib.contextmanager
def rope_angles_uncached():
    """Every EVA block computes its RoPE angles itself (``rope_angles``), as before the cache existed."""
    import fp8vit.blocks.eva as eva

    saved = eva.forward_rope_angles
    eva.forward_rope_angles = lambda *args: eva.rope_angles(*args)
    try:
        yield
    finally:
        eva.forward_rope_angles = saved


def count_rope_angle_computations(monkeypatch) -> list:
    """Each call of ``fp8vit.blocks.eva.rope_angles`` (the atan2 + cat) appends its arguments to the
    list returned."""
    import fp8vit.blocks.eva as eva

    calls = []
    uncounted = eva.rope_angles

    def counted(*args):
        calls.append(args)
        return uncounted(*args)

    monkeypatch.setattr(eva, "rope_angles", counted)
    return calls


def train_steps(model, data, opt, context=contextlib.nullcontext) -> list:
    """One optimizer step per ``(x, y)`` in ``data``, cross entropy computed inside ``context()``
    with the forward; the losses as floats."""
    losses = []
    for x, y in data:
        with context():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses



class KeptSwinBlock(SwinTransformerBlock):
    """timm's Swin block under another class name: fp8vit keeps it (it fuses exact classes only)."""


class KeptSwinV2Block(SwinTransformerV2Block):
    """The same for Swin V2's block."""


def kept_swin_blocks(model):
    """Give ``model``'s Swin (V1, V2) blocks the classes :class:`KeptSwinBlock` / :class:`KeptSwinV2Block`
    (same code and weights), which fp8vit has no family for: a model of blocks fp8vit does not fuse,
    for the generic paths (Linear fallback, compile fallback) on [B, H, W, C] blocks."""
    kept = {SwinTransformerBlock: KeptSwinBlock, SwinTransformerV2Block: KeptSwinV2Block}
    for m in model.modules():
        if type(m) in kept:
            m.__class__ = kept[type(m)]
    return model


def perturbed(model):
    """``model`` in eval mode with every tensor moved off its init value (timm zero-inits biases and
    sets LayerScale to 1e-6), so that a tensor mapped wrong shows."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def assert_model_matches_timm(ref, model, x, train):
    """Assert that ``model`` (``ref`` converted on the reference backend) computes ``ref``: logits
    within 1e-5 relative, and every parameter gradient under timm's name (the fused blocks' mapped
    back through their ``cfg.ties()``), in train mode on the same drop-path draws if ``train``."""
    from fp8vit.blocks.base import FP8Block
    from fp8vit.blocks.weights import te_to_timm

    ref.train(train), model.train(train)
    torch.manual_seed(3)
    a = ref(x)
    torch.manual_seed(3)
    b = model(x)
    assert max_rel_err(a, b) < 1e-5
    a.square().sum().backward(), b.square().sum().backward()
    blocks = {fqn: m for fqn, m in model.named_modules() if isinstance(m, FP8Block)}
    grads = {n: p.grad for n, p in model.named_parameters() if not any(n.startswith(f + ".") for f in blocks)}
    for fqn, blk in blocks.items():
        grads.update({f"{fqn}.{k}": g for k, g in
                      te_to_timm({k: p.grad for k, p in blk.named_parameters()}, blk.cfg.ties()).items()})
    assert grads.keys() == dict(ref.named_parameters()).keys()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def assert_gradients_alike(eager_seq: list, graphed_seq: list, note: str = "") -> None:
    """Each step's gradients (``{name: tensor}`` per step, the same names) within 40 dB of eager's
    (bf16 rounding of eager's weight gradients against fused fp32 ones: about 59 dB); a failure
    lists the tensors below it, then ``note``."""
    assert len(eager_seq) == len(graphed_seq) > 0
    assert all(e.keys() == g.keys() for e, g in zip(eager_seq, graphed_seq))
    low = [(step, n, round(db, 1)) for step, (e, g) in enumerate(zip(eager_seq, graphed_seq))
           for n, a in e.items() for db in [snr_db(a, g[n])] if not db > 40]
    assert not low, f"{len(low)} gradients below 40 dB (step, name, dB): {low[:12]}{note}"


def same_norm_kernels(graphed) -> bool:
    """GPU: make a graphed model's graphs and eager TE LayerNorms run the same kernels: the graphs'
    default (cuDNN's where every fp8vit block's width is one TE has no tuned kernel for, e.g. test
    models of width 256) set on every graph cache of ``graphed``, so that a stage's own default
    cannot differ from the model's. Returns that setting, for :func:`norm_kernels` around the
    eager steps of both models."""
    from fp8vit.blocks.base import FP8Block
    from fp8vit.training.graph_cache import cudnn_norm_pays
    from fp8vit.training.graphs import graphed_handles

    cudnn = cudnn_norm_pays([m for m in graphed.modules() if isinstance(m, FP8Block)])
    for h in graphed_handles(graphed):
        h.cudnn_layernorm = cudnn
    return cudnn


@contextlib.contextmanager
def norm_kernels(cudnn: bool):
    """Within: TE's LayerNorms run cuDNN's kernels (``cudnn``) or TE's own, process-wide."""
    import fp8vit
    old = fp8vit.set_cudnn_layernorm(cudnn)
    try:
        yield
    finally:
        fp8vit.set_cudnn_layernorm(old)


def assert_stage_graphs_train_like_eager(make_model, convert, stages: int, img_size: int = 224):
    """GPU: ``convert(make_model(), cuda_graphs=True)`` on a model whose blocks sit in stages (no
    ``model.blocks``) or branches (CrossViT): each stage's or branch's blocks get a graph cache,
    captured at the shape's second step. Against the same model eager, on the same LayerNorm
    kernels (:func:`same_norm_kernels`), delayed scaling: four micro-batches' gradients at fixed
    weights within 40 dB (the graphs' fused fp32 weight gradients against eager's bf16-rounded
    ones: about 59 dB; over optimizer steps FP8 amplifies that rounding, so steps are not compared
    tensor by tensor), then one SGD step on each and the next loss alike, which a graph reading
    stale weights would miss: the step moves the loss by more than the two models differ."""
    import fp8vit
    from fp8vit.training.graphs import graphed_handles

    g = torch.Generator("cuda").manual_seed(1)
    data = [(torch.randn(16, 3, img_size, img_size, device="cuda", generator=g),
             torch.randint(0, 100, (16,), device="cuda", generator=g)) for _ in range(4)]
    eager = convert(make_model()).train()
    graphed = convert(make_model(), cuda_graphs=True).train()
    cudnn = same_norm_kernels(graphed)
    handles = graphed_handles(graphed)

    def loss_of(model, x, y):
        with fp8vit.fp8_context("delayed"):
            return F.cross_entropy(model(x), y)

    def run(model):
        grads, losses = [], []
        for x, y in data:
            loss = loss_of(model, x, y)
            loss.backward()
            losses.append(float(loss))
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss_of(model, *data[0]).backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, *data[0])  # with grad and backward: the graphed model replays
        loss.backward()
        model.zero_grad(set_to_none=True)
        losses.append(float(loss))
        return grads, losses

    with norm_kernels(cudnn):
        (ge, le), (gg, lg) = run(eager), run(graphed)
    print(f"{type(graphed).__name__} graphed (cuDNN LayerNorm {cudnn}): eager losses {le}, graphed {lg}; "
          f"{[repr(h)[:120] for h in handles]}")
    assert len(handles) == stages and all(h.replays >= 2 for h in handles), [repr(h) for h in handles]
    assert_gradients_alike(ge, gg)
    moved, apart = abs(le[-1] - le[0]), abs(le[-1] - lg[-1])
    assert apart < 0.1 * moved, (le, lg)
