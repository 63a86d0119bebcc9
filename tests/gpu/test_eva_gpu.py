"""TE_EvaBlock on the GPU: TE's fused RoPE kernel against timm's RoPE, FP8 off against timm (tight;
grouped-query, gated and post-norm attention too), FP8 against bf16 by SNR, any batch size under
FP8, the k bias held at zero through FP8 training, per-block CUDA graphs.

Tolerances as in test_block_gpu.py (fp32: different kernels, 2e-3 of the output's max) and
test_fp8_gpu.py (logits >= 20 dB, weight gradients >= 12 dB).
"""

import pytest
import timm
import torch
from timm.layers.pos_embed_sincos import apply_rot_embed_cat

import fp8vit
from fp8vit import _te
from fp8vit.blocks.eva import TE_EvaBlock, rope_angles
from helpers import fp8_snrs, fp8_step, max_rel_err, rel_l2_err, snr_db, train_steps

pytestmark = pytest.mark.gpu

# (timm name, overrides): EVA02 (q/v bias, separate q/k/v, SwiGLU + inner norm), the RoPE ViT
# (AttentionRope, LayerScale, GELU MLP), DINOv3 (rotate-half RoPE, register tokens), EVA02-L's
# padded SwiGLU hidden (int(72 * 8/3) = 191 -> 192), Sapiens2 (grouped-query attention in block 0
# through TE's num_gqa_groups, qk_norm, RMSNorm; newer timm only), the post-norm block (EVA-CLIP
# enormous: TE Linear q/k/v, unfused padded GELU MLP, torch norms after the branches).
MODELS = {
    "eva02_base_patch14_224": dict(embed_dim=256, num_heads=4),
    "vit_base_patch16_rope_224": dict(embed_dim=256, num_heads=4),
    "vit_small_patch16_dinov3": dict(embed_dim=256, num_heads=4),
    "eva02_large_patch14_224": dict(embed_dim=144, num_heads=4),
    "vit_base_patch16_sapiens2": dict(embed_dim=256, num_heads=4, num_kv_heads=(2, 4)),
    "eva02_enormous_patch14_clip_224": dict(embed_dim=256, num_heads=4),
}


def _model(name, depth=2):
    if name not in timm.list_models(name):
        pytest.skip(f"timm {timm.__version__} has no {name}")
    torch.manual_seed(0)
    m = timm.create_model(name, pretrained=False, depth=depth, num_classes=100, img_size=224, **MODELS[name])
    with torch.no_grad():  # non-zero biases and LayerScale, so that every tensor counts
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return m.cuda()


def _convert(model):
    for i, blk in enumerate(model.blocks):
        model.blocks[i] = TE_EvaBlock.from_timm(blk, backend="te")
    return model


def _rope_table(n_patch, D, interleaved):
    """A timm-layout RoPE table [n_patch, 2 D] (sin | cos) of random angles, paired as ``interleaved``."""
    theta = torch.rand(n_patch, D // 2, device="cuda") * 6
    theta = theta.repeat_interleave(2, -1) if interleaved else theta.repeat(1, 2)
    return torch.cat([theta.sin(), theta.cos()], -1)


@pytest.mark.parametrize("interleaved", [True, False])
def test_fused_rope_kernel_matches_timm_on_packed_views(interleaved):
    torch.manual_seed(0)
    B, npt, n_patch, H, D = 4, 1, 256, 4, 64
    table = _rope_table(n_patch, D, interleaved)
    qkv = torch.randn(B, npt + n_patch, 3, H, D, device="cuda", requires_grad=True)
    q = qkv[:, :, 0]  # a strided view, as TE_EvaBlock hands it over
    got = _te.fused_rope(q, rope_angles(table, npt + n_patch, npt), interleaved)
    ref = q.transpose(1, 2)
    ref = torch.cat([ref[:, :, :npt], apply_rot_embed_cat(ref[:, :, npt:], table, half=not interleaved)], 2)
    ref = ref.transpose(1, 2)
    print(f"interleaved={interleaved}: max rel err {max_rel_err(ref, got):.2e}")
    assert torch.equal(got[:, :npt], q[:, :npt])
    assert max_rel_err(ref, got) < 1e-5
    g = torch.randn_like(got)
    (dq_te,) = torch.autograd.grad(got, qkv, g)
    (dq_ref,) = torch.autograd.grad(ref, qkv, g)
    assert rel_l2_err(dq_ref, dq_te) < 1e-5


@pytest.mark.parametrize("name", list(MODELS))
def test_fp32_logits_and_input_grad_match_timm(name):
    model = _model(name).eval()
    x = torch.randn(2, 3, 224, 224, device="cuda", requires_grad=True)
    ref = model(x)
    (dx_ref,) = torch.autograd.grad(ref.square().sum(), x)
    te = _convert(model)
    out = te(x)
    (dx,) = torch.autograd.grad(out.square().sum(), x)
    print(f"{name}: fp32 logits max rel err {max_rel_err(ref, out):.2e}, dx rel L2 {rel_l2_err(dx_ref, dx):.2e}")
    assert max_rel_err(ref, out) < 2e-3 and rel_l2_err(dx_ref, dx) < 2e-3




@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("batch", [16, 3])  # 3 x 257 rows: padded to a multiple of 16
def test_fp8_snr_vs_bf16(name, recipe, batch):
    model = _convert(_model(name)).train()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    # two FP8 steps before the one measured: fp8_snrs says why
    snrs, worst, ref, test = fp8_snrs(model, x, recipe, lambda k, _: k.startswith("blocks.") and k.endswith("weight"))
    print(f"{name} {recipe} batch {batch}: logits {snrs['logits']:.1f} dB, worst {worst} {snrs[worst]:.1f} dB; "
          f"below 20 dB: {({k: round(v, 1) for k, v in snrs.items() if v < 20})}; "
          f"norms {[(k, f'{ref[1][k].norm():.2e}', f'{test[1][k].norm():.2e}') for k in snrs if snrs[k] < 12]}")
    if snrs[worst] < 12.0:  # diagnostic: does one more FP8 step (a longer amax history) change it?
        again = fp8_step(model, x, recipe)
        print(f"  one step later: {worst} {snr_db(ref[1][worst], again[1][worst]):.1f} dB, "
              f"input grad of the blocks {[(n, f'{p.grad.norm():.2e}') for n, p in model.named_parameters() if 'patch_embed' in n]}")
    assert snrs["logits"] >= 20.0 and snrs[worst] >= 12.0


@pytest.mark.parametrize("kw", [
    dict(attn_type="eva", qkv_fused=True, scale_attn_inner=True),
    dict(attn_type="rope", qkv_fused=False, num_kv_heads=2, qk_norm=True, rotate_half=True),
], ids=["eva_inner_norm", "rope_gqa"])
def test_gated_block_fp32_matches_timm(kw):
    """Gated attention (no timm model enables it: a single block): the gate's rows in the q/k/v GEMM."""
    import inspect

    from timm.models.eva import EvaBlock

    if any(k not in inspect.signature(EvaBlock.__init__).parameters for k in ("gated_attn", *kw)):
        pytest.skip(f"timm {timm.__version__}'s EvaBlock lacks an option of {kw}")
    torch.manual_seed(0)
    blk = EvaBlock(256, 4, gated_attn=True, num_prefix_tokens=1, **kw).cuda().eval()
    with torch.no_grad():
        for p in blk.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    te = TE_EvaBlock.from_timm(blk, backend="te", exact_gelu=True)
    rope = _rope_table(256, 64, not te.cfg.rotate_half)
    x = torch.randn(4, 257, 256, device="cuda", requires_grad=True)
    ref = blk(x, rope=rope)
    (dx_ref,) = torch.autograd.grad(ref.square().sum(), x)
    out = te(x, rope=rope)
    (dx,) = torch.autograd.grad(out.square().sum(), x)
    print(f"gated {kw}: fp32 max rel err {max_rel_err(ref, out):.2e}, dx rel L2 {rel_l2_err(dx_ref, dx):.2e}")
    assert max_rel_err(ref, out) < 2e-3 and rel_l2_err(dx_ref, dx) < 2e-3


def test_k_bias_stays_zero_under_fp8_training():
    model = _convert(_model("eva02_base_patch14_224")).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05, fused=True)
    A = model.blocks[0].cfg.attn_dim
    for _ in range(3):
        with fp8vit.fp8_context("delayed"):
            loss = model(torch.randn(8, 3, 224, 224, device="cuda")).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    for b in model.blocks:
        assert torch.count_nonzero(b.qkv.bias[A:2 * A]) == 0
        assert torch.count_nonzero(b.qkv.bias[:A]) > 0


def _batches(n):
    """``n`` seeded (images [16, 3, 224, 224], labels of 100 classes) training batches."""
    g = torch.Generator("cuda").manual_seed(1)
    return [(torch.randn(16, 3, 224, 224, device="cuda", generator=g),
             torch.randint(0, 100, (16,), device="cuda", generator=g)) for _ in range(n)]


def _eva_train(model, data, recipe):
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    return train_steps(model, data, opt, lambda: fp8vit.fp8_context(recipe))


def _assert_graphed_trains_like_eager(eager, graphed, data, recipe, label):
    """Per-block graphs of ``graphed`` (fused_wgrad=False: the graphs run the eager kernels exactly)
    train as ``eager`` does on ``data``: every replay taken, parameters within 40 dB. The handle."""
    handle = fp8vit.make_graphed_blocks(graphed, 16, recipe=recipe, fused_wgrad=False)
    le, lg = _eva_train(eager, data, recipe), _eva_train(graphed, data, recipe)
    print(f"{label}: eager losses {le}, graphed {lg}")
    assert handle.per_block and handle.replays == len(data) * len(graphed.blocks) and handle.eager_calls == 0
    for (n, a), b in zip(eager.named_parameters(), graphed.parameters()):
        assert snr_db(a, b) > 40, n
    return handle


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_per_block_graphs_train_like_eager(recipe):
    # EVA's blocks sit in an nn.ModuleList and get the RoPE table as a keyword: one graph pair per
    # block, the table a graph input. fused_wgrad=False: the graphs run the eager kernels exactly.
    eager = _convert(_model("eva02_base_patch14_224", depth=3)).train()
    graphed = _convert(_model("eva02_base_patch14_224", depth=3)).train()
    handle = _assert_graphed_trains_like_eager(eager, graphed, _batches(4), recipe, recipe)
    assert handle.call_kwargs["rope"][0] == (256, 2 * 64)
    A = graphed.blocks[0].cfg.attn_dim
    assert all(torch.count_nonzero(b.qkv.bias[A:2 * A]) == 0 for b in graphed.blocks)


@pytest.mark.parametrize("name", ["vit_base_patch16_sapiens2", "eva02_enormous_patch14_clip_224"])
def test_per_block_graphs_train_like_eager_gqa_and_post_norm(name):
    # Grouped-query attention (Sapiens2's block 0) and the post-norm block, graphed per block.
    _assert_graphed_trains_like_eager(_convert(_model(name)).train(), _convert(_model(name)).train(), _batches(3),
                                      "delayed", name)


def test_per_block_graphs_fall_back_on_another_rope_table():
    from fp8vit import _warn
    _warn._seen.clear()
    model = _convert(_model("eva02_base_patch14_224", depth=2)).train()
    handle = fp8vit.make_graphed_blocks(model, 16, fused_wgrad=False)
    x = torch.randn(16, 257, 256, device="cuda")
    rope = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)  # the capture saw fp32
    with fp8vit.fp8_context(), pytest.warns(RuntimeWarning, match="rope is"):
        model.blocks[0](x, rope=rope)
    assert handle.eager_calls == 1


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-current"])
def test_mixed_rope_frequencies_get_their_gradient_through_per_block_graphs(fp8):
    # Mixed RoPE's per-block tables come from learnable frequencies every forward: the graphs must
    # return the tables' gradient (captured requiring grad), or the frequencies silently stop training.
    # Judged by the frequencies' gradient, not their change: it is ~3e-10 (H200, this model), too
    # small for an SGD step to move fp32 values of ~0.1-0.8. Under FP8 with delayed scaling it is
    # exactly 0 in the first step (measured), eager too (likely: E5M2 gradients at scale 1 flushing to zero): current
    # scaling here.
    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(16, 3, 224, 224, device="cuda", generator=g)
    y = torch.randint(0, 100, (16,), device="cuda", generator=g)

    def build():
        torch.manual_seed(0)
        m = timm.create_model("vit_small_patch16_rope_mixed_224", depth=2, embed_dim=256, num_heads=4,
                              num_classes=100).cuda()
        return _convert(m).train()

    grads = []
    for graphed in (False, True):
        model = build()
        handle = fp8vit.make_graphed_blocks(model, 16, fp8=fp8, recipe="current" if fp8 else None,
                                            fused_wgrad=False) if graphed else None
        for _ in range(2):  # two steps: the second replays over buffers the first left
            model.zero_grad(set_to_none=True)
            with fp8vit.fp8_context("current" if fp8 else None, enabled=fp8):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        grads.append(model.rope.freqs.grad)
    eager, graphed = grads
    print(f"mixed RoPE, fp8={fp8}: rope.freqs gradient norm eager {float(eager.norm()):.3e}, "
          f"graphed {float(graphed.norm()):.3e}; {handle}")
    assert handle.per_block and handle.replays == 2 * 2 and handle.eager_calls == 0
    assert float(eager.norm()) > 0 and graphed is not None
    assert snr_db(eager, graphed) > 40


# --- rope_kernel="triton": RoPE in one Triton pass over the packed QKV buffer (RopeQKV, lever 43) ---

@pytest.mark.parametrize("interleaved", [True, False])
def test_packed_rope_kernel_matches_timm(interleaved):
    # bf16 q, k, v of 256 patch tokens and a class token: the forward is timm's fp32 expression
    # rounded once (at most one bf16 ulp apart: fused multiply-adds), v copied bit for bit; the
    # backward (autograd through RopeQKV, TE's attention not involved) is its transpose
    from fp8vit.blocks.eva import RopeQKV

    torch.manual_seed(0)
    B, npt, n_patch, H, D = 4, 1, 256, 4, 64
    table = _rope_table(n_patch, D, interleaved)
    qkv = torch.randn(B, npt + n_patch, 3, H, D, device="cuda").bfloat16().requires_grad_(True)
    q, k, v = RopeQKV.apply(qkv, table, npt, interleaved)
    assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()  # one packed buffer (bs3hd)
    x = qkv.detach().float().requires_grad_(True)
    ref = []
    for i in (0, 1):
        t = x[:, :, i].transpose(1, 2)
        t = torch.cat([t[:, :, :npt], apply_rot_embed_cat(t[:, :, npt:], table, half=not interleaved)], 2)
        ref.append(t.transpose(1, 2))
    for got, want in zip((q, k), ref):
        assert torch.equal(got[:, :npt], qkv[:, :npt, 0 if got is q else 1])
        # one bf16 rounding of a value that may differ from timm's fp32 one in its last fp32 bits
        # (fused multiply-adds: absolute, ~1e-7 of the terms), which matters where the two terms cancel
        err = (got.float() - want).abs()
        rel = (err / want.abs())[want.abs() > 1e-2].max()
        print(f"interleaved={interleaved}: max relative error {rel:.1e} where |x| > 0.01 (bf16 half-ulp 3.9e-3)")
        assert bool((err <= want.abs() * 2 ** -8 + 1e-5).all())
    assert torch.equal(v, qkv[:, :, 2])
    gq, gk, gv = (torch.randn_like(t) for t in (q, k, v))
    (dqkv,) = torch.autograd.grad((q, k, v), qkv, (gq, gk, gv))
    (dx,) = torch.autograd.grad((*ref, x[:, :, 2]), x, (gq.float(), gk.float(), gv.float()))
    print(f"interleaved={interleaved}: gradient rel L2 {rel_l2_err(dx, dqkv.float()):.1e}")
    assert rel_l2_err(dx, dqkv.float()) < 5e-3 and torch.equal(dqkv[:, :, 2], gv)


@pytest.mark.parametrize("name", ["vit_base_patch16_rope_224", "vit_small_patch16_dinov3", "eva02_base_patch14_224"])
def test_packed_rope_block_trains_as_te_rope(name, monkeypatch):
    # Whole models in bf16 autocast (FP8 off: the comparison is RoPE's alone) with rope_kernel="triton"
    # (and the default, "auto") against TE's fused RoPE: the kernel ran in every block, forward and
    # backward, and logits and every gradient agree to bf16's noise (TE's kernel recomputes sin and cos from angles; this one
    # reads timm's table). A wrong pairing or prefix would give ~0 dB.
    import fp8vit.blocks.eva as eva

    calls = []
    kernel = eva.rope_packed_qkv

    def counted(qkv, *args, **kwargs):
        calls.append(kwargs.get("backward", False))
        return kernel(qkv, *args, **kwargs)
    monkeypatch.setattr(eva, "rope_packed_qkv", counted)
    x = torch.randn(8, 3, 224, 224, device="cuda")
    results = {}
    for rope_kernel in ("te", "triton", "auto"):
        model = _convert(_model(name)).train()
        for blk in model.blocks:
            blk.rope_kernel = rope_kernel
        results[rope_kernel] = fp8_step(model, x, None, enabled=False)
    depth = len(model.blocks)
    # "triton" and the default ("auto") each ran the kernel in every block, forward and backward
    assert calls == ([False] * depth + [True] * depth) * 2
    (ref, ref_g), (got, got_g) = results["te"], results["triton"]
    snrs = {"logits": snr_db(ref, got), **{n: snr_db(ref_g[n], got_g[n]) for n in ref_g}}
    worst = min(snrs, key=snrs.get)
    print(f"{name}: logits {snrs['logits']:.1f} dB, worst {worst} {snrs[worst]:.1f} dB")
    assert snrs[worst] > 30


def test_packed_rope_per_block_graphs_train_like_eager():
    # the kernel's launches captured in per-block graphs (the table a graph input), FP8 delayed
    models = []
    for _ in range(2):
        m = _convert(_model("vit_base_patch16_rope_224", depth=3)).train()
        for blk in m.blocks:
            blk.rope_kernel = "triton"
        models.append(m)
    _assert_graphed_trains_like_eager(*models, _batches(4), "delayed", "rope_kernel='triton'")
