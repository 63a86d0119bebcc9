"""fp8vit's public API on every block family, on CPU (reference backend): the classic ViT (``TE_Block``)
and timm's ``Eva`` (``TE_EvaBlock``: EVA02 with RoPE, SwiGLU with a norm (scale_mlp) and separate q/k/v;
a RoPE ViT with ``AttentionRope``; ``EvaBlockPostNorm``). Most features were developed on the classic
ViT; EVA models differ where it matters here: timm's ``Eva`` passes each block its RoPE table by
keyword and holds its blocks in an ``nn.ModuleList`` (the ViT: an ``nn.Sequential``), and EVA02's
SwiGLU runs as fp8vit's unfused gated MLP.

Block-level exactness of ``TE_EvaBlock`` is in test_eva.py, diagnose on EVA in test_diagnostics.py;
this file checks the model-level features: conversion round trips, checkpointing, MLP recompute,
per-block FP8 switches, the guard, fp8_context, saving and copying, and the tools.
"""

import copy
import io
import json
import pickle
import warnings

import pytest
import timm
import torch

import fp8vit
import fp8vit._warn
import fp8vit.training.diagnostics as dg
from fp8vit.tools import bench
from fp8vit.tools import diagnose as diagnose_cli
from helpers import FAMILY_MODELS, family_timm_model, load_example, max_rel_err

# name: (timm model, its options, fp8vit block class), tiny; shared with test_distributed_families.py
MODELS = FAMILY_MODELS
KEYS = list(MODELS)
_timm_model = family_timm_model


def _converted(key, seed=0, **kw):
    # exact_gelu: the erf GELU of the ViT and the RoPE ViT kept, so outputs match timm's closely
    return fp8vit.convert_to_te(_timm_model(key, seed), backend="reference", exact_gelu=True, **kw)


def _images(n=2):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _grads(model, x):
    """Output and parameter gradients of one train-mode forward/backward (loss sum(out^2))."""
    model.train().zero_grad(set_to_none=True)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_step(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys()
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n


@pytest.mark.parametrize("key", KEYS)
def test_convert_round_trip_is_bit_exact(key):
    timm_model = _timm_model(key)
    x = _images()
    ref = timm_model(x)
    model = fp8vit.convert_to_te(copy.deepcopy(timm_model), backend="reference", exact_gelu=True)
    block_cls = MODELS[key][2]
    summary = fp8vit.conversion_summary(model)
    assert summary.fused == ((block_cls, ("blocks.0", "blocks.1")),)
    assert summary.kept == () and summary.swapped == () and summary.outside == ("head",)
    assert max_rel_err(ref, model(x)) < 1e-5
    # timm's other entry point into the blocks (the RoPE table handed per block there too)
    for got, want in zip(model.forward_intermediates(x, intermediates_only=True),
                         timm_model.forward_intermediates(x, intermediates_only=True)):
        assert max_rel_err(want, got) < 1e-5

    back = fp8vit.convert_from_te(model)
    assert [type(b) for b in back.blocks] == [type(b) for b in timm_model.blocks]
    want, got = timm_model.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert torch.equal(back(x), ref)
    with pytest.raises(ValueError, match="was not converted"):
        fp8vit.conversion_summary(back)


@pytest.mark.parametrize("how", ["fp8vit", "timm"])
@pytest.mark.parametrize("key", KEYS)
def test_grad_checkpointing_recomputes_every_block_with_the_same_gradients(key, how):
    # blocks.0 kept as timm's: it checkpoints itself too, and must get the RoPE table on recompute
    model = _converted(key, module_filter_fn=lambda m, fqn: fqn != "blocks.0")
    assert type(model.blocks[0]).__name__ != MODELS[key][2] and type(model.blocks[1]).__name__ == MODELS[key][2]
    x = _images()
    plain = _grads(model, x)
    if how == "fp8vit":
        fp8vit.set_grad_checkpointing(model)
    else:
        model.set_grad_checkpointing(True)
        assert model.grad_checkpointing is False  # timm's checkpoint() around the blocks stays off
    calls = [0, 0]
    for i, blk in enumerate(model.blocks):
        blk.attn.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    _assert_same_step(plain, _grads(model, x))
    assert calls == [2, 2]  # forward, and the recompute in backward: both blocks checkpointed
    fp8vit.convert_from_te(model)  # back to timm: its own checkpointing on, no wrapper left behind
    assert model.grad_checkpointing and not any("forward" in vars(b) for b in model.blocks)


@pytest.mark.parametrize("key", [k for k in KEYS if MODELS[k][2] == "TE_EvaBlock"])
def test_linear_fallback_for_an_eva_block_it_cannot_fuse(key):
    timm_model = _timm_model(key)
    timm_model.blocks[0].norm2.eps = 1e-5  # norm1's is 1e-6: TE_EvaBlock refuses norms that differ
    x = _images()
    ref = timm_model(x)
    with warnings.catch_warnings():  # EVA02's hidden 85: its MLP Linears are kept, and that is said
        warnings.simplefilter("ignore", UserWarning)
        model = fp8vit.convert_to_te(copy.deepcopy(timm_model), backend="reference", exact_gelu=True,
                                     fallback="linear")
    summary = fp8vit.conversion_summary(model)
    assert summary.fused == (("TE_EvaBlock", ("blocks.1",)),)
    swapped = [p for _, paths in summary.swapped for p in paths]
    assert swapped and all(p.startswith("blocks.0.") for p in swapped)
    assert max_rel_err(ref, model(x)) < 1e-5
    plain = _grads(model, x)
    model.set_grad_checkpointing(True)  # the swapped block checkpoints itself, RoPE table included
    _assert_same_step(plain, _grads(model, x))
    fp8vit.convert_from_te(model)
    want, got = timm_model.state_dict(), model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # EvaAttention's switch to call its swapped qkv (fp8vit.blocks.linear.switch_owner) is set back
    assert getattr(model.blocks[0].attn, "qkv_bias_separate", None) == getattr(
        timm_model.blocks[0].attn, "qkv_bias_separate", None)
    assert torch.equal(model.eval()(x), ref)


@pytest.mark.parametrize("key", KEYS)
def test_mlp_recompute_reruns_the_chosen_mlps_with_the_same_gradients(key):
    model = _converted(key)
    x = _images()
    plain = _grads(model, x)
    fp8vit.set_mlp_recompute(model, every=2)  # blocks.0 only
    assert [b.recompute_mlp for b in model.blocks] == [True, False]
    calls = [0, 0]
    for i, blk in enumerate(model.blocks):
        blk.mlp.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    _assert_same_step(plain, _grads(model, x))
    assert calls == [2, 1]


@pytest.mark.parametrize("key", KEYS)
def test_set_block_fp8_by_block_and_by_container(key):
    model = _converted(key)
    assert fp8vit.set_block_fp8(model, "blocks.1", False) == ["blocks.1"]
    assert [b.fp8_enabled for b in model.blocks] == [True, False]
    fp8vit.set_block_fp8(model, "blocks", False)  # the ModuleList / Sequential holding them
    assert [b.fp8_enabled for b in model.blocks] == [False, False]
    with pytest.raises(ValueError, match=r"\['blocks\.5'\] are not fp8vit blocks .*its 2 are blocks\.0, blocks\.1"):
        fp8vit.set_block_fp8(model, "blocks.5", True)
    assert [b.fp8_enabled for b in model.blocks] == [False, False]


@pytest.mark.parametrize("key", KEYS)
def test_state_dict_save_pickle_and_deepcopy_keep_the_model(key):
    model = _converted(key).train()
    x = _images()
    _grads(model, x)  # a trained-mode pass first: an EVA block's k-bias gradient hook is on now
    model.eval()
    ref = model(x)

    other = _converted(key, seed=5).eval()  # other weights: everything must come from the state dict
    assert not torch.equal(other(x), ref)
    other.load_state_dict(model.state_dict(), strict=True)
    assert torch.equal(other(x), ref)

    buf = io.BytesIO()
    torch.save(model, buf)  # failed for EVA02 (the unfused gated MLP held a closure)
    buf.seek(0)
    copies = [torch.load(buf, weights_only=False), pickle.loads(pickle.dumps(model)), copy.deepcopy(model)]
    for c in copies:
        assert torch.equal(c(x), ref)
        assert fp8vit.conversion_summary(c) == fp8vit.conversion_summary(model)
        # a copy trains like the original; EVA's k third of the fused q/k/v bias stays without gradient
        _grads(c, x)
        for blk in c.blocks:
            if getattr(blk.cfg, "qkv_bias", None) == "qv":
                A = blk.cfg.attn_dim
                assert torch.count_nonzero(blk.qkv.bias.grad[A:2 * A]) == 0
                assert torch.count_nonzero(blk.qkv.bias.grad[:A]) > 0


@pytest.mark.parametrize("key", KEYS)
def test_guard_names_a_timm_block_kept_in_a_converted_model(key):
    model = _converted(key, module_filter_fn=lambda m, fqn: fqn != "blocks.0").train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = fp8vit.NonFiniteGuard(model, opt)
    # every block of model.blocks, the kept timm one too (Eva holds them in an nn.ModuleList, which the
    # guard once passed over: it watched the fp8vit blocks only, and blamed blocks.1 for blocks.0)
    assert list(guard.blocks) == ["blocks.0", "blocks.1"]
    with torch.no_grad():
        model.blocks[0].mlp.fc2.weight[0, 0] = float("nan")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = model(_images()).square().mean()
    loss.backward()
    with pytest.warns(RuntimeWarning, match="skipped"):
        assert not guard.step(loss)
    (event,) = guard.events
    assert event.first_bad_activation == "blocks.0"
    assert event.bad_grads == ["blocks.0", "blocks.1"]
    assert not any(n.startswith("blocks.") for n in event.other_bad_grads)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) or n == "blocks.0.mlp.fc2.weight", n


@pytest.mark.parametrize("key", KEYS)
def test_fp8_context_on_cpu_runs_bf16_autocast_as_timm(key):
    timm_model = _timm_model(key)
    model = _converted(key)
    x = _images()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "FP8 is off ...: no CUDA GPU"
        with fp8vit.fp8_context() as state:
            out = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = timm_model(x)
    assert not state.fp8 and state.dtype == torch.bfloat16
    assert out.dtype == want.dtype == torch.bfloat16
    assert max_rel_err(want, out) < 2e-2  # bf16 rounding in another order, not another function
    # fp32_residual: the blocks hand on an fp32 residual stream under autocast, as timm's do
    fp32 = _converted(key, fp32_residual=True)
    tokens = torch.randn(2, 17, model.embed_dim)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fp32.blocks[0](tokens).dtype == torch.float32
        assert model.blocks[0](tokens).dtype == torch.bfloat16


@pytest.mark.parametrize("key", KEYS)
def test_make_graphed_blocks_refuses_a_cpu_model_by_name(key):
    model = _converted(key)
    with pytest.raises(ValueError, match="the blocks are on cpu; CUDA graphs need the model on its GPU"):
        fp8vit.make_graphed_blocks(model, 2)


def test_reference_backend_warning_does_not_call_every_block_te_block(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the warning is for machines without TE or a GPU")
    monkeypatch.setattr(fp8vit._warn, "_seen", set())
    with pytest.warns(RuntimeWarning) as caught:
        fp8vit.convert_to_te(_timm_model("eva02"))  # backend None: reference here, said once
    (msg,) = [str(w.message) for w in caught if "reference modules" in str(w.message)]
    assert msg.startswith("fp8vit: the fused blocks and FP8 Linears use PyTorch reference modules")


# --- the tools, with an EVA model by name (eva02_tiny: 12 blocks of 192 channels; 2 x 2 patches at 28 px)
EVA_TOOL_ARGS = ["--model", "eva02_tiny_patch14_224", "--img-size", "28", "--batch-size", "2"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke test")
def test_bench_runs_an_eva_model(tmp_path):
    out = tmp_path / "b.json"
    assert bench.main(EVA_TOOL_ARGS + ["--steps", "1", "--warmup", "0", "--variants", "fp8vit-bf16",
                                       "--mlp-recompute", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["median_ms"] > 0 and row["tflops"] > 0  # the FLOP count describes an Eva too


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke test")
def test_diagnose_cli_runs_an_eva_model(tmp_path, monkeypatch, capsys):
    # No FP8 on the CPU: the FP8 passes run as the bf16 pass (as test_diagnostics emulates FP8), so
    # every block's own error is zero: infinite SNR, unless a rerun computes another function
    # (an EVA block rerun without its RoPE table, as diagnose once did).
    bf16 = fp8vit.training.context.fp8_context
    monkeypatch.setattr(dg, "fp8_context", lambda recipe, enabled, strict: bf16(enabled=False))
    report = tmp_path / "r.json"
    assert diagnose_cli.main(EVA_TOOL_ARGS + ["--json", str(report)]) == 0
    assert "recommend bf16 for: none" in capsys.readouterr().out
    blocks = json.loads(report.read_text())["blocks"]
    assert [b["name"] for b in blocks] == [f"blocks.{i}" for i in range(12)]
    assert all(b["local_snr_db"] == "inf" and b["local_weight_grad_snr_db"] == "inf" for b in blocks), blocks


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke test")
def test_train_example_trains_saves_and_resumes_an_eva_model(tmp_path, capsys):
    ex = load_example("train_vit")
    ckpt = tmp_path / "ckpt.pt"
    common = EVA_TOOL_ARGS + ["--num-classes", "4", "--log-every", "1", "--workers", "0", "--checkpoint", str(ckpt),
                              "--mlp-recompute", "2"]
    ex.main(common + ["--steps", "1"])
    ex.main(common + ["--steps", "2", "--epochs", "2", "--resume"])
    out = capsys.readouterr().out
    assert "MLP recompute: 6 of 12 blocks (every 2)" in out
    assert f"saved {ckpt} (step 1)" in out and f"saved {ckpt} (step 2)" in out
    assert "epoch 1 step      2  loss" in out
    state = torch.load(ckpt, weights_only=False)["model"]
    model = fp8vit.convert_to_te(timm.create_model("eva02_tiny_patch14_224", num_classes=4, img_size=28),
                                 backend="reference")
    model.load_state_dict(state, strict=True)
    assert {type(b).__name__ for b in model.blocks} == {"TE_EvaBlock"}
