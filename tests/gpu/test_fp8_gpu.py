"""FP8 numerics on the GPU, judged by signal-to-noise ratio against the same model in bf16.

Floors, from the formats (``helpers.LOGITS_DB``, ``GRAD_DB``, which say why): logits >= 20 dB, each
weight gradient >= 12 dB; a broken scale or layout gives about 0 dB. Measured values are printed and
recorded in docs/numerics.md.
"""


import pytest
import timm
import torch

import fp8vit
from helpers import (GRAD_DB, LOGITS_DB, fp8_snrs, fp8_step, is_forward_gelu_kernel, need_recipe, saved_after_fp8_steps,
                     snr_db, step_snrs)

pytestmark = pytest.mark.gpu

RECIPES = list(fp8vit.RECIPE_NAMES)


def _vit(depth=2, **kw):
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", pretrained=False, depth=depth, num_classes=100, **kw)
    return fp8vit.convert_to_te(model.cuda())




def test_default_recipe_on_this_gpu():
    info = fp8vit.gpu_info()
    print(info.summary())
    assert info.fp8[0], info.fp8[1]
    expected = "mxfp8" if info.capability >= (10, 0) else "delayed"
    with fp8vit.fp8_context() as state:
        assert state.fp8 and state.recipe_name == expected


def _fp8_vs_bf16(recipe, batch):
    """SNRs of the third FP8 training step against bf16 (delayed scaling: the first step only
    fills the amax history), for a 2-block ViT-B/16 on ``batch`` images of 197 tokens."""
    need_recipe(recipe)
    model = _vit().train()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    snrs, worst, _, _ = fp8_snrs(model, x, recipe, fp8_steps=1)
    print(f"{recipe} batch {batch}: logits {snrs['logits']:.1f} dB, worst {worst} {snrs[worst]:.1f} dB")
    return snrs["logits"], snrs[worst]


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_step_snr_vs_bf16(recipe):
    logits, worst_grad = _fp8_vs_bf16(recipe, 16)  # 16 x 197 rows: aligned, no padding
    assert logits >= LOGITS_DB and worst_grad >= GRAD_DB


def _stuck_delayed_scales(model):
    """The TE modules (by name) whose delayed-scaling forward scales are all still 1.0, and how many
    TE modules hold a delayed-scaling state."""
    states = {n: m.fp8_meta["scaling_fwd"] for n, m in model.named_modules()
              if isinstance(getattr(m, "fp8_meta", None), dict)
              and type(m.fp8_meta.get("scaling_fwd")).__name__ == "DelayedScalingRecipeState"}
    return {n for n, st in states.items() if bool((st.scale == 1).all())}, len(states)


def test_delayed_scaling_updates_after_a_recipe_switch():
    # delayed -> current -> delayed on the same modules. TE 2.20 rebuilds the delayed state (scale 1)
    # but keeps the module's first place in its amax/scale buffers, so the new scales never update
    # (fp8vit._te.recipe_switch); fp8vit's modules forget that place. Measured on TE's own Linear too,
    # the premise: if TE keeps its scales at 1.0 there, the fix is still needed.
    need_recipe("current")
    te = fp8vit._te.load_te()
    x = torch.randn(16, 3, 224, 224, device="cuda")
    model = _vit().train()
    lin = te.Linear(256, 256).cuda()
    xl = torch.randn(64, 256, device="cuda")

    def lin_step(recipe):
        with fp8vit.fp8_context(recipe, strict=True):
            y = lin(xl)
        y.float().square().mean().backward()

    control = _vit().train()  # delayed scaling only, as many steps: which scales stay 1.0 anyway
    for recipe, steps in (("delayed", 3), ("current", 2), ("delayed", 3)):
        for _ in range(steps):
            fp8_step(model, x, recipe)
            fp8_step(control, x, "delayed")
            lin_step(recipe)
    ref = fp8_step(model, x, "delayed", enabled=False)
    snrs = step_snrs(ref, fp8_step(model, x, "delayed"))
    worst = min(snrs, key=snrs.get)
    (stuck, n), (stuck_anyway, n_control) = _stuck_delayed_scales(model), _stuck_delayed_scales(control)
    te_stuck = bool((lin.fp8_meta["scaling_fwd"].scale == 1).all())
    # Attention without FP8 (fp8_dpa off) keeps its delayed-scaling state at 1.0 in either model.
    print(f"after delayed -> current -> delayed: {len(stuck)} of {n} fp8vit modules with every scale 1.0 "
          f"({sorted(stuck)}); delayed only: {len(stuck_anyway)} of {n_control} ({sorted(stuck_anyway)}); "
          f"logits {snrs['logits']:.1f} dB, worst {worst} {snrs[worst]:.1f} dB; "
          f"TE's own Linear stuck at 1.0: {te_stuck}")
    assert n == n_control and len(stuck_anyway) < n and stuck == stuck_anyway
    assert snrs["logits"] >= LOGITS_DB and snrs[worst] >= GRAD_DB
    assert te_stuck, "TE's Linear now updates its scales after a recipe switch: fp8vit._te.recipe_switch may go"


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_attention_snr_vs_bf16(recipe):
    # make_recipe(..., fp8_attention=True): TE's fp8_dpa, attention's matmuls in FP8. ViT-B's width
    # in 6 heads of 128 (TE 2.20 with cuDNN 9.19 has FP8 attention on Hopper for head dim 128 only).
    # Where make_recipe refuses it (Hopper, TE <= 2.20), the refusal's premise is measured on TE's
    # own recipe object: delayed scaling still below the floors, current scaling still no kernel;
    # should TE fix it, this fails and says to lift the refusal. Elsewhere: against bf16 by the same
    # floors, and against the same recipe with bf16 attention the logits must differ.
    need_recipe(recipe)
    try:
        fp8_attn, refused = fp8vit.make_recipe(recipe, fp8_attention=True), None
    except ValueError as err:
        assert "refused on this GPU" in str(err) and torch.cuda.get_device_capability()[0] == 9
        rec = fp8vit._te.te_module("transformer_engine.common.recipe")
        cls = rec.DelayedScaling if recipe == "delayed" else rec.Float8CurrentScaling
        fp8_attn, refused = cls(fp8_format=rec.Format.HYBRID, fp8_dpa=True), err
    x = torch.randn(16, 3, 224, 224, device="cuda")
    out = {}
    for name, rec in (("bf16 attention", recipe), ("fp8 attention", fp8_attn)):
        model = _vit(num_heads=6).train()
        ref = fp8_step(model, x, recipe, enabled=False)
        if refused is not None and recipe == "current" and name == "fp8 attention":
            with pytest.raises(ValueError, match="no FP8 attention kernel"):
                fp8_step(model, x, rec)
            return
        for _ in range(2):
            fp8_step(model, x, rec)
        out[name] = fp8_step(model, x, rec)
    snrs = step_snrs(ref, out["fp8 attention"])
    worst = min(snrs, key=snrs.get)
    same = snr_db(out["bf16 attention"][0], out["fp8 attention"][0])
    print(f"{recipe} + FP8 attention{' (refused by make_recipe)' if refused else ''}: logits "
          f"{snrs['logits']:.1f} dB, worst {worst} {snrs[worst]:.1f} dB; against bf16 attention {same:.1f} dB")
    passes = snrs["logits"] >= LOGITS_DB and snrs[worst] >= GRAD_DB
    if refused is not None:
        assert not passes, f"FP8 attention now passes the floors on this GPU: lift make_recipe's refusal ({refused})"
        return
    assert passes
    assert not torch.equal(out["bf16 attention"][0], out["fp8 attention"][0]), "FP8 attention did not run"


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("batch", [1, 3, 8, 63])
def test_any_batch_size_under_fp8(recipe, batch):
    logits, worst_grad = _fp8_vs_bf16(recipe, batch)  # batch x 197 rows: padded to 16
    assert logits >= LOGITS_DB and worst_grad >= GRAD_DB


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_grad_checkpointing_under_fp8(recipe):
    need_recipe(recipe)
    x = torch.randn(8, 3, 224, 224, device="cuda")
    plain, ckpt = _vit(depth=3).train(), _vit(depth=3).train()  # same seed: same weights
    for model in (plain, ckpt):  # same warm-up: same FP8 scaling state
        fp8_step(model, x, recipe)
    ckpt.set_grad_checkpointing(True)
    assert all(b.grad_checkpointing for b in ckpt.blocks) and not ckpt.grad_checkpointing
    a, b = fp8_step(plain, x, recipe), fp8_step(ckpt, x, recipe)
    snrs = step_snrs(a, b)
    worst = min(snrs, key=snrs.get)
    print(f"{recipe} checkpointed vs not: worst {worst} {snrs[worst]:.1f} dB")
    assert snrs[worst] >= 40  # the same computation, recomputed


@pytest.mark.parametrize("recipe", RECIPES)
def test_state_dict_round_trip_resumes_training(recipe):
    need_recipe(recipe)
    model = _vit().train()
    x = torch.randn(16, 3, 224, 224, device="cuda")
    sd = saved_after_fp8_steps(model, x, recipe)  # no pickle anywhere in the checkpoint
    resumed = _vit().train()
    resumed.load_state_dict(sd)
    if recipe == "delayed":
        for (n, a), b in zip(model.named_modules(), resumed.modules()):
            if hasattr(a, "fp8_meta") and "scaling_fwd" in a.fp8_meta:
                for key in ("scaling_fwd", "scaling_bwd"):
                    assert torch.equal(a.fp8_meta[key].scale, b.fp8_meta[key].scale), n
                    assert torch.equal(a.fp8_meta[key].amax_history, b.fp8_meta[key].amax_history), n
    a, b = fp8_step(model, x, recipe), fp8_step(resumed, x, recipe)
    assert torch.equal(a[0], b[0]), f"resumed logits differ: SNR {snr_db(a[0], b[0]):.1f} dB"


@pytest.mark.parametrize("exact_gelu", [False, True], ids=["te-fused-mlp", "unfused-mlp"])
def test_mlp_recompute_same_step_less_memory(exact_gelu):
    # Recompute reruns the same kernels with the forward's FP8 scales: the step must not change.
    need_recipe("delayed")
    x = torch.randn(32, 3, 224, 224, device="cuda")

    def model():
        torch.manual_seed(0)
        m = timm.create_model("vit_base_patch16_224", pretrained=False, depth=3, num_classes=100)
        return fp8vit.convert_to_te(m.cuda(), exact_gelu=exact_gelu).train()

    plain, recomputed, first_only = model(), model(), model()
    for m in (plain, recomputed, first_only):  # same warm-up: same FP8 scaling state
        fp8_step(m, x, "delayed")
    fp8vit.set_mlp_recompute(recomputed)
    fp8vit.set_mlp_recompute(first_only, module_filter_fn=lambda m, fqn: fqn == "blocks.0")
    assert [b.recompute_mlp for b in first_only.blocks] == [True, False, False]
    peaks, results = [], []
    for m in (plain, recomputed, first_only):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        results.append(fp8_step(m, x, "delayed"))
        peaks.append(torch.cuda.max_memory_allocated() - base)
    for name, run in (("all blocks", results[1]), ("block 0 only", results[2])):
        snrs = step_snrs(results[0], run)
        worst = min(snrs, key=snrs.get)
        print(f"MLP recompute ({'unfused' if exact_gelu else 'TE fused'}, {name}): worst {worst} "
              f"{snrs[worst]:.1f} dB")
        assert snrs[worst] >= 40, name
    print("step peak MiB: plain {:.0f}, all blocks {:.0f}, block 0 only {:.0f}".format(*(p / 2**20 for p in peaks)))
    assert peaks[1] < 0.85 * peaks[0]
    # One block of three: the saving lies strictly between none and all (about a third of it).
    assert peaks[1] < peaks[2] < peaks[0] - 0.2 * (peaks[0] - peaks[1])
    if exact_gelu:  # the unfused MLP recomputes by activation checkpointing: not in a graph
        with pytest.raises(ValueError, match=r"MLP recompute is on in blocks \['0', '1', '2'\]"):
            fp8vit.make_graphed_blocks(recomputed, batch_size=32)


def _kernel_names(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    return out, {e.name for e in prof.events() if str(e.device_type).endswith("CUDA")}


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_cudnn_layernorm_runs_cudnn_kernels_as_accurately(recipe):
    # ViT-H width (1280): TE has no tuned LayerNorm kernel for it, which is where cuDNN's pays.
    # Two FP8 runs whose amax differs in the last bit re-round every element (delayed scales are
    # not powers of two), so both are judged against bf16, not against each other.
    need_recipe(recipe)
    x = torch.randn(32, 3, 224, 224, device="cuda")
    plain, cudnn = (_vit(embed_dim=1280, num_heads=16).train() for _ in range(2))
    ref = fp8_step(plain, x, recipe, enabled=False)
    for _ in range(2):  # delayed scaling: fill the amax history first
        fp8_step(plain, x, recipe)
    te_run, te_kernels = _kernel_names(lambda: fp8_step(plain, x, recipe))
    old = fp8vit.set_cudnn_layernorm(True)
    try:
        for _ in range(2):
            fp8_step(cudnn, x, recipe)
        cudnn_run, cudnn_kernels = _kernel_names(lambda: fp8_step(cudnn, x, recipe))
    finally:
        assert fp8vit.set_cudnn_layernorm(old) is True
    te_norm = {k for k in te_kernels if "normalization::ln_" in k}
    print(f"TE's LayerNorm kernels: {len(te_norm)}; with the switch: "
          f"{sorted(k[:40] for k in cudnn_kernels if 'layer_norm' in k or 'ln_' in k)}")
    assert te_norm and not any("normalization::ln_" in k for k in cudnn_kernels), "kernels unchanged"
    a, b = step_snrs(ref, te_run), step_snrs(ref, cudnn_run)
    worst_a, worst_b = min(a, key=a.get), min(b, key=b.get)
    print(f"{recipe} vs bf16: TE LayerNorm worst {worst_a} {a[worst_a]:.1f} dB, "
          f"cuDNN LayerNorm worst {worst_b} {b[worst_b]:.1f} dB")
    assert b["logits"] >= LOGITS_DB and b[worst_b] >= GRAD_DB
    assert b[worst_b] >= a[worst_a] - 1.0  # no worse than TE's own kernels
    if recipe == "delayed":  # cuDNN's kernel must feed the FP8 amax the way TE's does
        sa, sb = fp8vit._te.scaling_state(plain), fp8vit._te.scaling_state(cudnn)
        assert sa.keys() == sb.keys() and sa
        for name in sa:
            assert abs(sb[name][0] - sa[name][0]) <= 0.05 * sa[name][0], (name, sa[name], sb[name])


@pytest.mark.parametrize("width, want_cudnn", [(1280, True), (768, False)])
def test_graphs_take_cudnn_layernorm_by_default_at_vit_h_width(width, want_cudnn):
    # make_graphed_blocks(cudnn_layernorm=None): cuDNN's LayerNorm in the captured graphs at widths
    # TE has no tuned kernel for under delayed scaling (levers 8, 32), TE's own at tuned widths; the
    # eager setting is untouched.
    model = _vit(embed_dim=width, num_heads=16).train()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    fp8vit.make_graphed_blocks(model, batch_size=8)
    for _ in range(2):
        fp8_step(model, x, "delayed")
    _, kernels = _kernel_names(lambda: fp8_step(model, x, "delayed"))
    te_norm = any("normalization::ln_" in k for k in kernels)
    print(f"width {width} graphed: TE LayerNorm kernels {te_norm}; "
          f"{sorted({k[:40] for k in kernels if 'norm' in k.lower()})[:6]}")
    assert te_norm != want_cudnn
    assert not fp8vit._te.cudnn_norm_enabled()  # the process-wide switch is restored after capture


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_gelu_in_fc1_gemm_epilogue(recipe):
    # Under delayed scaling fc1's GEMM computes GELU in its epilogue and writes fc2's FP8 input
    # (lever 12); TE's separate GELU+cast kernel must then be gone, and the step must be as
    # accurate against bf16 as with that kernel. Other recipes keep the separate kernel.
    need_recipe(recipe)
    x = torch.randn(32, 3, 224, 224, device="cuda")
    fused, plain = _vit(depth=3).train(), _vit(depth=3).train()  # same seed: same weights
    assert all(b.gelu_in_gemm for b in fused.blocks)  # the default
    for b in plain.blocks:
        b.gelu_in_gemm = False
    ref = fp8_step(plain, x, recipe, enabled=False)
    runs = {}
    for name, model in (("fused", fused), ("plain", plain)):
        for _ in range(2):  # delayed scaling: fill the amax history first
            fp8_step(model, x, recipe)
        runs[name] = _kernel_names(lambda: fp8_step(model, x, recipe))
    gelu_kernels = {name: sorted(k[:60] for k in kernels if is_forward_gelu_kernel(k))
                    for name, (_, kernels) in runs.items()}
    print(f"{recipe}: forward GELU kernels {gelu_kernels}")
    te_gelu = {name: [k for k in ks if "unary_kernel" in k or "act_fn" in k] for name, ks in gelu_kernels.items()}
    assert te_gelu["plain"], "TE's GELU kernel not found: the kernel-name test is stale"
    if recipe == "delayed":
        assert not te_gelu["fused"] and [k for k in gelu_kernels["fused"] if k not in te_gelu["fused"]], \
            "fc1's GEMM did not take the GELU epilogue"
    else:
        assert gelu_kernels["fused"] == gelu_kernels["plain"]
    a, b = step_snrs(ref, runs["plain"][0]), step_snrs(ref, runs["fused"][0])
    worst_a, worst_b = min(a, key=a.get), min(b, key=b.get)
    print(f"{recipe} vs bf16: separate GELU worst {worst_a} {a[worst_a]:.1f} dB, logits {a['logits']:.1f} dB; "
          f"GELU in the GEMM worst {worst_b} {b[worst_b]:.1f} dB, logits {b['logits']:.1f} dB")
    assert b["logits"] >= LOGITS_DB and b[worst_b] >= GRAD_DB
    assert b[worst_b] >= a[worst_a] - 1.0 and b["logits"] >= a["logits"] - 1.0
    if recipe == "delayed":  # the GEMM's epilogue must feed fc2's input amax as TE's kernel does
        sa, sb = _forward_amaxes(plain), _forward_amaxes(fused)
        recorded = [k for k, v in sa.items() if v > 0]  # inputs and weights of every GEMM
        assert sa.keys() == sb.keys() and len(recorded) >= 8 * len(plain.blocks), sa
        for name in recorded:
            assert abs(sb[name] - sa[name]) <= 0.05 * sa[name], (name, sa[name], sb[name])


def _forward_amaxes(model):
    """``{"module[i]": amax}`` over the whole history, for each forward FP8 tensor ``i`` of every
    TE module under ``model`` (delayed scaling; LayerNormMLP's fc2 input is one of them)."""
    return {f"{name}[{i}]": float(v) for name, key, st in fp8vit._te.fp8._delayed_states(model)
            if key == "scaling_fwd" for i, v in enumerate(st.amax_history.amax(0))}
