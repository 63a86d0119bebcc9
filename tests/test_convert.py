"""convert_to_te / convert_from_te on real timm models (reference backend on CPU): fused blocks, the
registry of block families, and the generic path (FP8 Linears) with its summary."""

import contextlib
import functools
import warnings

import pytest
import timm
import torch
from timm.models.vision_transformer import Block, ResPostBlock, VisionTransformer

import fp8vit
from helpers import kept_swin_blocks

# Small variants of the families the issue names: class token (vit_*, deit_*), LayerScale
# (deit3_*), register tokens + no class token + avg pool (reg4_gap), and a deeper one.
MODELS = {
    "vit_tiny_patch16_224": {},
    "deit3_small_patch16_224": {},
    "vit_little_patch16_reg4_gap_256": {},
    "deit_tiny_patch16_224": {},
}


def _model(name):
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, img_size=64, num_classes=7, **MODELS[name]).eval()


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_kept_and_state_dict_loads_back_into_timm(name):
    model = _model(name)
    x = torch.randn(2, 3, 64, 64)
    ref = model(x)
    fp8vit.convert_to_te(model, exact_gelu=True, backend="reference")
    assert all(isinstance(b, fp8vit.TE_Block) for b in model.blocks)
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    fp8vit.convert_from_te(model)
    fresh = _model(name)
    fresh.load_state_dict(model.state_dict(), strict=True)
    torch.testing.assert_close(fresh(x), ref, rtol=1e-5, atol=1e-5)


def test_training_mode_device_dtype_kept():
    model = _model("vit_tiny_patch16_224").double().train()
    model.blocks[1].eval()
    fp8vit.convert_to_te(model, backend="reference")
    assert model.blocks[0].training and not model.blocks[1].training
    assert {p.dtype for p in model.parameters()} == {torch.float64}


def test_filter_keeps_first_and_last_block():
    model = _model("vit_tiny_patch16_224")
    last = len(model.blocks) - 1
    fp8vit.convert_to_te(model, backend="reference",
                         module_filter_fn=lambda m, fqn: fqn not in ("blocks.0", f"blocks.{last}"))
    kinds = [type(b).__name__ for b in model.blocks]
    assert kinds[0] == kinds[-1] == "Block" and set(kinds[1:-1]) == {"TE_Block"}


def test_unconvertible_block_is_named_with_fallback_error():
    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4,
                              block_fn=ResPostBlock, num_classes=3)
    with pytest.raises(fp8vit.ConversionError, match=r"blocks\.0 \(ResPostBlock\).*fallback='linear'"):
        fp8vit.convert_to_te(model, backend="reference", fallback="error")


def test_unconvertible_block_is_kept_by_default_and_said_so():
    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4,
                              block_fn=ResPostBlock, num_classes=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.warns(UserWarning, match=r"kept 2 modules.*ResPostBlock: no fp8vit block"):
        assert fp8vit.convert_to_te(model, backend="reference") is model
    assert all(type(b) is ResPostBlock for b in model.blocks)
    assert model.state_dict().keys() == before.keys()
    summary = fp8vit.conversion_summary(model)
    assert summary.fallback == "keep" and summary.num_fused == summary.num_swapped == 0
    assert dict(summary.kept) == {"ResPostBlock: no fp8vit block for this class": ("blocks.0", "blocks.1")}
    assert "set_grad_checkpointing" not in vars(model)  # nothing converted: timm's own stays


def test_unsupported_block_option_is_named():
    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4,
                              num_classes=3)
    model.blocks[1].attn.norm = torch.nn.LayerNorm(64)  # what scale_attn_norm=True builds
    with pytest.raises(fp8vit.ConversionError, match=r"blocks\.1: .*scale_attn_norm"):
        fp8vit.convert_to_te(model, backend="reference", fallback="error")


def test_unsupported_block_option_goes_to_the_linear_fallback():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4,
                              num_classes=3).eval()
    model.blocks[1].attn.norm = torch.nn.LayerNorm(64)  # what scale_attn_norm=True builds
    x = torch.randn(2, 3, 32, 32)
    ref = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing kept: no warning
        fp8vit.convert_to_te(model, backend="reference", fallback="linear", exact_gelu=True)
    assert isinstance(model.blocks[0], fp8vit.TE_Block) and type(model.blocks[1]) is Block
    summary = fp8vit.conversion_summary(model)
    assert dict(summary.fused) == {"TE_Block": ("blocks.0",)}
    (why, paths), = summary.swapped
    assert why.startswith("Block: ") and "scale_attn_norm" in why
    assert paths == tuple(f"blocks.1.{n}" for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"))
    assert summary.outside == ("head",)
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


def test_block_fn_in_vision_transformer_and_timm_init():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=3, num_heads=4,
                              num_classes=5, block_fn=fp8vit.TE_Block, qkv_bias=True, init_values=1e-4)
    b = model.blocks[0]
    assert isinstance(b, fp8vit.TE_Block) and b.cfg.norm_eps == 1e-6 and b.cfg.qkv_bias
    # timm's init reached the TE_Block (truncated normal, std 0.02), not TE's own defaults
    assert abs(float(b.proj.weight.std()) - 0.02) < 0.004
    assert torch.all(b.ls1.gamma == 1e-4)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 5) and torch.isfinite(out).all()


def test_grad_checkpointing_routes_through_te_block():
    model = _model("vit_tiny_patch16_224").train()
    fp8vit.convert_to_te(model, backend="reference")
    x = torch.randn(2, 3, 64, 64)
    model(x).sum().backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    assert model.grad_checkpointing is False  # timm's checkpoint_seq stays out of the way
    assert all(b.grad_checkpointing for b in model.blocks)
    model(x).sum().backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[k], rtol=1e-5, atol=1e-6, msg=k)
    model.set_grad_checkpointing(False)
    assert not any(b.grad_checkpointing for b in model.blocks)


def test_frozen_parameters_stay_frozen_both_ways():
    model = _model("vit_tiny_patch16_224")
    model.blocks[0].attn.qkv.weight.requires_grad_(False)
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    fp8vit.convert_to_te(model, backend="reference")
    assert not model.blocks[0].qkv.weight.requires_grad and model.blocks[0].proj.weight.requires_grad
    assert not any(p.requires_grad for p in model.blocks[1].parameters())
    fp8vit.convert_from_te(model)
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen


def test_whole_model_pickles_after_conversion(tmp_path):
    model = _model("vit_tiny_patch16_224")
    fp8vit.convert_to_te(model, backend="reference")
    model.set_grad_checkpointing(True)
    torch.save(model, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=False)
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(back(x), model(x))
    assert all(b.grad_checkpointing for b in back.blocks)
    back.set_grad_checkpointing(False)  # the restored hook still works
    assert not any(b.grad_checkpointing for b in back.blocks)


def test_mixed_model_checkpoints_the_kept_timm_blocks_too():
    model = _model("vit_tiny_patch16_224").train()
    fp8vit.convert_to_te(model, backend="reference", module_filter_fn=lambda m, fqn: fqn != "blocks.0")
    x = torch.randn(2, 3, 64, 64)
    model(x).sum().backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    calls = []
    model.blocks[0].attn.register_forward_hook(lambda *a: calls.append(1))
    model(x).sum().backward()
    assert len(calls) == 2  # forward, then the recompute in backward: it was checkpointed
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[k], rtol=1e-5, atol=1e-6, msg=k)
    fp8vit.convert_from_te(model)  # back to timm, checkpointing now timm's own
    assert model.grad_checkpointing and "forward" not in vars(model.blocks[0])


def test_conversion_is_atomic():
    model = _model("vit_tiny_patch16_224")
    model.blocks[2].attn.norm = torch.nn.LayerNorm(192)  # unconvertible, after two good blocks
    with pytest.raises(fp8vit.ConversionError, match=r"blocks\.2"):
        fp8vit.convert_to_te(model, backend="reference", fallback="error")
    assert not any(isinstance(b, fp8vit.TE_Block) for b in model.blocks)
    assert "set_grad_checkpointing" not in vars(model)


def test_model_without_blocks_warns_or_is_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(fp8vit.ConversionError, match="Sequential holds nothing fp8vit can convert: no block"):
        fp8vit.convert_to_te(model, backend="reference", fallback="error")
    for fallback in ("keep", "linear"):
        with pytest.warns(UserWarning, match="Sequential holds nothing fp8vit can convert.*it is unchanged"):
            assert fp8vit.convert_to_te(model, backend="reference", fallback=fallback) is model
        assert type(model[0]) is torch.nn.Linear
        assert fp8vit.conversion_summary(model).outside == ("0",)


def test_a_bare_block_is_returned_converted():
    from timm.models.vision_transformer import Block
    block = Block(64, 4).eval()
    te = fp8vit.convert_to_te(block, backend="reference", exact_gelu=True)
    assert isinstance(te, fp8vit.TE_Block) and not dict(te.named_children()).get("")
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(te(x), block(x), rtol=1e-5, atol=1e-5)
    assert isinstance(fp8vit.convert_from_te(te), Block)


@pytest.mark.parametrize("cls_name", ["ParallelScalingBlock", "DiffParallelScalingBlock", "ResPostBlock"])
def test_every_other_vit_block_class_is_named(cls_name):
    import timm.models.vision_transformer as vt
    if not hasattr(vt, cls_name):
        pytest.skip(f"this timm has no {cls_name}")
    kw = {"dim": 64, "num_heads": 4}
    block = getattr(vt, cls_name)(**kw)
    with pytest.raises(fp8vit.ConversionError, match=cls_name):
        fp8vit.convert_to_te(torch.nn.Sequential(block), backend="reference", fallback="error")


@pytest.mark.parametrize("mode", ["", "jax", "moco"])
@pytest.mark.parametrize("fix_init", [False, True])
def test_block_fn_follows_timm_init_modes(mode, fix_init):
    # The same seed through timm's Block and through TE_Block must give the same statistics per
    # tensor (and the same draws: tests/test_init_rng.py checks them bit for bit).
    kw = dict(img_size=32, patch_size=16, embed_dim=96, depth=3, num_heads=4, num_classes=5, qkv_bias=True,
              init_values=1e-3, weight_init=mode, fix_init=fix_init)
    torch.manual_seed(0)
    ref = VisionTransformer(**kw)
    torch.manual_seed(0)
    te = VisionTransformer(block_fn=functools.partial(fp8vit.TE_Block, backend="reference"), **kw)
    for i, (a, b) in enumerate(zip(ref.blocks, te.blocks)):
        got, names = b.state_dict(), dict(fp8vit.blocks.weights.name_pairs(b.cfg))
        for timm_name, t in a.state_dict().items():
            g = got[names[timm_name]]
            if t.dim() == 1 and float(t.std()) == 0:  # constants: norms, zero biases, gamma
                torch.testing.assert_close(g, t, msg=f"blocks.{i}.{timm_name} ({mode})")
            else:  # random draws: same distribution (std within 10%, tiny biases within a factor)
                sa, sb = float(t.std()), float(g.std())
                assert abs(sb / sa - 1) < (0.1 if t.dim() == 2 else 0.5), (i, timm_name, mode, sa, sb)


def test_fx_feature_extraction_treats_te_block_as_a_leaf():
    from timm.models._features_fx import create_feature_extractor, get_graph_node_names
    model = _model("vit_tiny_patch16_224")
    fp8vit.convert_to_te(model, backend="reference", exact_gelu=True)
    train_nodes, _ = get_graph_node_names(model)
    assert "blocks.1" in train_nodes and not any(n.startswith("blocks.1.") for n in train_nodes)
    x = torch.randn(2, 3, 64, 64)
    feats = create_feature_extractor(model, return_nodes={"blocks.1": "b1"})(x)
    ref = model.patch_embed(x)
    ref = model.blocks[:2](model.norm_pre(model.patch_drop(model._pos_embed(ref))))
    torch.testing.assert_close(feats["b1"], ref)


def test_mlp_recompute_reruns_the_mlp_and_keeps_gradients():
    x = torch.randn(2, 3, 64, 64)
    plain, recomputed = _model("vit_tiny_patch16_224"), _model("vit_tiny_patch16_224")
    for m in (plain, recomputed):
        fp8vit.convert_to_te(m, backend="reference").train()
    assert fp8vit.set_mlp_recompute(recomputed) is recomputed
    assert all(b.recompute_mlp for b in recomputed.blocks)
    calls = []
    # a pre-hook: torch's checkpoint stops a recompute once it has the saved tensors it needs,
    # before a forward hook would fire
    recomputed.blocks[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    plain(x).square().mean().backward()
    recomputed(x).square().mean().backward()
    assert len(calls) == 2  # forward, then the recompute in backward
    for (n, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)
    fp8vit.set_mlp_recompute(recomputed, False)
    with torch.no_grad():
        recomputed(x)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="has no fp8vit block.*convert_to_te"):
        fp8vit.set_mlp_recompute(_model("vit_tiny_patch16_224"))


def test_mlp_recompute_on_the_blocks_a_filter_selects():
    model = fp8vit.convert_to_te(_model("vit_tiny_patch16_224"), backend="reference")
    every_third = lambda m, fqn: int(fqn.rsplit(".", 1)[-1]) % 3 == 0  # noqa: E731
    fp8vit.set_mlp_recompute(model, module_filter_fn=every_third)
    assert [b.recompute_mlp for b in model.blocks] == [i % 3 == 0 for i in range(len(model.blocks))]
    fp8vit.set_mlp_recompute(model, False, module_filter_fn=lambda m, fqn: fqn == "blocks.0")
    assert [i for i, b in enumerate(model.blocks) if b.recompute_mlp] == [3, 6, 9]
    with pytest.raises(ValueError, match=r"selected none of the 12 fp8vit blocks \(blocks.0 ... blocks.11\)"):
        fp8vit.set_mlp_recompute(model, module_filter_fn=lambda m, fqn: False)


def test_mlp_recompute_every_kth_block():
    model = fp8vit.convert_to_te(_model("vit_tiny_patch16_224"), backend="reference")
    fp8vit.set_mlp_recompute(model, every=2)
    assert [i for i, b in enumerate(model.blocks) if b.recompute_mlp] == [0, 2, 4, 6, 8, 10]
    fp8vit.set_mlp_recompute(model, False)
    # every counts over the blocks the filter chose: here blocks 6..11, so 6 and 9
    fp8vit.set_mlp_recompute(model, every=3, module_filter_fn=lambda m, fqn: int(fqn.rsplit(".", 1)[-1]) >= 6)
    assert [i for i, b in enumerate(model.blocks) if b.recompute_mlp] == [6, 9]
    for bad, error in ((0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)):
        with pytest.raises(error, match=rf"set_mlp_recompute\(every={bad!r}\): .*an integer >= 1"):
            fp8vit.set_mlp_recompute(model, every=bad)


# --------------------------------------------------------------------------- block families (registry)
def test_registry_maps_timm_block_to_te_block_and_checks_the_contract(monkeypatch):
    from fp8vit.blocks import families
    assert families.block_classes()[Block] is fp8vit.TE_Block
    for timm_cls, cls in families.block_classes().items():  # every family, the lead's included
        assert issubclass(cls, fp8vit.blocks.base.FP8Block) and callable(cls.from_timm) and callable(cls.to_timm)
    monkeypatch.setattr(families, "FAMILIES", families.FAMILIES + (
        families.Family("torch.nn.Linear", ("timm.models.vision_transformer.ResPostBlock",)),))
    families.block_classes.cache_clear()
    try:
        with pytest.raises(TypeError, match="torch.nn.Linear must subclass fp8vit.blocks.base.FP8Block"):
            families.block_classes()
    finally:
        monkeypatch.undo()
        families.block_classes.cache_clear()


def test_registry_matches_exact_classes_only():
    class MyBlock(Block):  # a user's variant: another family (none), never fused as a Block
        pass

    model = torch.nn.Sequential(MyBlock(64, 4), Block(64, 4))
    with pytest.warns(UserWarning, match="MyBlock: no fp8vit block"):
        fp8vit.convert_to_te(model, backend="reference")
    assert type(model[0]) is MyBlock and isinstance(model[1], fp8vit.TE_Block)


# --------------------------------------------------------------------------- generic path: FP8 Linears
def _swin(**kw):
    # Swin's blocks under a class fp8vit has no family for (helpers.kept_swin_blocks): the generic path
    from timm.models.swin_transformer import SwinTransformer
    torch.manual_seed(0)
    return kept_swin_blocks(SwinTransformer(img_size=32, patch_size=4, window_size=4, embed_dim=32, depths=(1, 1),
                                            num_heads=(2, 4), num_classes=5, **kw))


def _beit():
    from timm.models.beit import Beit
    torch.manual_seed(0)
    return Beit(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4, qkv_bias=True, num_classes=5)


def _swapped(model):
    return [n for n, m in model.named_modules() if fp8vit.blocks.linear.is_swapped(m)]


def test_linear_fallback_keeps_weights_keys_and_maths():
    model, fresh = _swin().train(), _swin()
    x = torch.randn(2, 3, 32, 32)
    ref = model(x)
    ref.square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before the swap: must still update them
    model.zero_grad()
    assert fp8vit.convert_to_te(model, backend="reference", fallback="linear") is model
    blocks = [f"layers.{i}.blocks.0" for i in range(2)]
    assert _swapped(model) == [f"{b}.{n}" for b in blocks for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
    assert all(p is params[n] for n, p in model.named_parameters())  # the very parameters
    assert list(model.state_dict()) == keys  # nn.Linear's keys: timm checkpoints load as they are
    fresh.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(fresh.state_dict(), strict=True)
    out = model(x)
    torch.testing.assert_close(out, ref)
    out.square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], msg=n)
    w = model.layers[0].blocks[0].mlp.fc1.weight.clone()
    opt.step()
    assert not torch.equal(model.layers[0].blocks[0].mlp.fc1.weight, w)
    summary = fp8vit.conversion_summary(model)
    assert summary.counts() == {"fused": 0, "linear": 8, "kept": {}}
    assert dict(summary.swapped) == {"KeptSwinBlock: no fp8vit block for this class": tuple(_swapped(model))}
    # the head and Swin's patch merging are outside every block: never swapped
    assert summary.outside == ("layers.1.downsample.reduction", "head.fc")


def test_linear_fallback_round_trip_gives_nn_linears_back():
    from timm.models.swin_transformer_v2 import SwinTransformerV2
    torch.manual_seed(0)
    model = kept_swin_blocks(SwinTransformerV2(img_size=32, patch_size=4, window_size=4, embed_dim=32, depths=(1, 1),
                                               num_heads=(2, 4), num_classes=5).eval())  # its blocks unfused
    attn = model.layers[0].blocks[0].attn
    assert attn.qkv_bias_separate is False
    x = torch.randn(2, 3, 32, 32)
    ref = model(x)
    params = dict(model.named_parameters())
    fp8vit.convert_to_te(model, backend="reference", fallback="linear")
    # Swin V2's (and BEiT's) attention calls F.linear on qkv.weight unless qkv_bias_separate: switched,
    # so that the swapped qkv runs (a hook counts the calls)
    calls = []
    for name in _swapped(model):
        model.get_submodule(name).register_forward_hook(lambda *a, n=name: calls.append(n))
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-6)
    assert sorted(calls) == sorted(_swapped(model)) and "layers.0.blocks.0.attn.qkv" in calls
    assert attn.qkv_bias_separate is True
    fp8vit.convert_from_te(model)
    assert not _swapped(model) and attn.qkv_bias_separate is False
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.endswith(("qkv", "fc1")))
    assert all(p is params[n] for n, p in model.named_parameters())
    torch.testing.assert_close(model(x), ref)
    with pytest.raises(ValueError, match="was not converted"):
        fp8vit.conversion_summary(model)


def test_linear_fallback_keeps_what_fp8_cannot_run_and_says_why():
    from timm.models.swin_transformer import SwinTransformerBlock
    torch.manual_seed(0)
    block = kept_swin_blocks(SwinTransformerBlock(24, (4, 4), num_heads=2, window_size=2).eval())  # 24 % 16 != 0
    x = torch.randn(2, 4, 4, 24)  # Swin blocks take [B, H, W, C]: any leading dims
    ref = block(x)
    with pytest.warns(UserWarning) as rec:
        out = fp8vit.convert_to_te(block, backend="reference", fallback="linear")
    assert len([w for w in rec if "fp8vit" in str(w.message)]) == 1  # one warning per call
    assert out is block  # a bare block fp8vit cannot fuse: converted in place
    summary = fp8vit.conversion_summary(block)
    reason = f"Linear features not multiples of {fp8vit.blocks.linear.FEATURE_MULTIPLE} (FP8 GEMMs need them)"
    assert dict(summary.kept) == {reason: ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    assert summary.num_swapped == 0 and reason in str(rec[0].message)
    torch.testing.assert_close(block(x), ref)


def test_module_filter_fn_applies_to_blocks_and_linears_without_a_warning():
    model = _swin()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kept only where the filter asked: no warning
        fp8vit.convert_to_te(model, backend="reference", fallback="linear",
                             module_filter_fn=lambda m, fqn: fqn not in ("layers.0.blocks.0", "layers.1.blocks.0.mlp.fc2"))
    assert _swapped(model) == [f"layers.1.blocks.0.{n}" for n in ("attn.qkv", "attn.proj", "mlp.fc1")]
    summary = fp8vit.conversion_summary(model)
    assert dict(summary.kept) == {"excluded by module_filter_fn": ("layers.0.blocks.0", "layers.1.blocks.0.mlp.fc2")}
    assert "excluded by module_filter_fn: 2" in summary.short() and "kept as they are" in str(summary)


def test_fallback_is_validated():
    with pytest.raises(ValueError, match=r"fallback='lin'.*\['linear', 'keep', 'error', 'compile'\]"):
        fp8vit.convert_to_te(_swin(), backend="reference", fallback="lin")


def test_second_conversion_counts_what_is_there_and_swaps_nothing_twice():
    model = _swin()
    fp8vit.convert_to_te(model, backend="reference", fallback="linear")
    first = fp8vit.conversion_summary(model)
    mods = dict(model.named_modules())
    fp8vit.convert_to_te(model, backend="reference", fallback="linear")
    assert fp8vit.conversion_summary(model) == first
    assert all(m is mods[n] for n, m in model.named_modules())


def test_mixed_model_fused_and_swapped_blocks_train_together():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=3, num_heads=4, num_classes=3)
    model.blocks[1] = ResPostBlock(64, 4)
    fp8vit.convert_to_te(model, backend="reference", fallback="linear")
    assert [type(b).__name__ for b in model.blocks] == ["TE_Block", "ResPostBlock", "TE_Block"]
    assert fp8vit.conversion_summary(model).counts() == {"fused": 2, "linear": 4, "kept": {}}
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_grad_checkpointing_of_swapped_blocks():
    model, ref_model = _swin().train(), _swin().train()
    for m in (model, ref_model):
        fp8vit.convert_to_te(m, backend="reference", fallback="linear")
    x = torch.randn(2, 3, 32, 32)
    ref_model(x).square().mean().backward()
    model.set_grad_checkpointing(True)
    # timm's own (per stage) checkpointing stays off around the blocks; each block checkpoints itself
    assert not any(getattr(s, "grad_checkpointing", False) for s in model.layers)
    calls = []
    model.layers[0].blocks[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    model(x).square().mean().backward()
    assert len(calls) == 2  # forward, and the recompute in backward
    for (n, a), b in zip(ref_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)
    model.set_grad_checkpointing(False)
    assert not any("forward" in vars(m) for m in model.modules())


def test_set_block_fp8_reaches_swapped_linears():
    model = _swin()
    fp8vit.convert_to_te(model, backend="reference", fallback="linear")
    assert fp8vit.set_block_fp8(model, ["layers.0.blocks.0", "layers.1.blocks.0.attn.qkv"], False) == [
        "layers.0.blocks.0", "layers.1.blocks.0.attn.qkv"]
    off = [n for n in _swapped(model) if not model.get_submodule(n).fp8_enabled]
    assert off == [f"layers.0.blocks.0.{n}" for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")] + [
        "layers.1.blocks.0.attn.qkv"]
    with pytest.raises(ValueError, match=r"\['head'\] are not fp8vit blocks"):
        fp8vit.set_block_fp8(model, ["head"], False)


def test_swapped_model_pickles_with_its_summary(tmp_path):
    model = _swin().eval()
    fp8vit.convert_to_te(model, backend="reference", fallback="linear")
    torch.save(model, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=False)
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(back(x), model(x))
    assert fp8vit.conversion_summary(back) == fp8vit.conversion_summary(model)


# --------------------------------------------------------------------------- TE's swapped Linear, on CPU
# SwappedLinear is TE's Linear with a mixin; its row padding, FP8 switch and state dict logic are
# plain torch, checked here on a stand-in base that records what TE's forward would be given.
class _ViewOutLinear(torch.autograd.Function):
    """F.linear whose output is a view made inside the Function, as TE's ``_Linear`` returns."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        out = torch.nn.functional.linear(x, w, b)
        return out.view(out.shape)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        return g @ w, g2.t() @ x2, None if ctx.needs_input_grad[2] is False else g2.sum(0)


class _FakeTELinear(fp8vit.blocks.reference.Linear):
    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cpu"):
        super().__init__(in_features, out_features, bias, params_dtype, device)
        self.in_features, self.out_features = in_features, out_features
        self.seen, self.state = [], torch.empty(0, dtype=torch.uint8)

    def forward(self, x):
        self.seen.append(tuple(x.shape))
        return _ViewOutLinear.apply(x, self.weight, self.bias)

    def get_extra_state(self):
        return self.state

    def set_extra_state(self, state):
        self.state = state


_Swapped = type("_Swapped", (fp8vit._te.SwappedLinear, _FakeTELinear), {})


def _recipe(name):
    import types
    return types.SimpleNamespace(**{pred: (lambda n=n: n == name) for n, pred in fp8vit._te.recipes._PREDICATE.items()})


@pytest.mark.parametrize("recipe,mult", [("delayed", 16), ("current", 16), ("mxfp8", 32)])
def test_swapped_linear_pads_rows_to_the_recipe_multiple(monkeypatch, recipe, mult):
    monkeypatch.setattr(fp8vit._te.module_types, "active_fp8_recipe", lambda: _recipe(recipe))
    torch.manual_seed(0)
    lin = _Swapped(64, 32)
    x = torch.randn(3, 5, 7, 64, requires_grad=True)  # 105 rows, any leading dims
    out = lin(x)
    assert lin.seen == [(-105 % mult + 105, 64)] and out.shape == (3, 5, 7, 32)
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, lin.weight, lin.bias), g)
    want = torch.autograd.grad(ref, (x, lin.weight, lin.bias), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    lin.seen.clear()
    lin(torch.randn(2, 8, 64))  # aligned rows: passed as they are
    assert lin.seen == [(2, 8, 64)] if mult == 16 else lin.seen == [(32, 64)]


def test_swapped_linear_runs_bf16_where_fp8_is_off_or_cannot_run(monkeypatch):
    entered = []
    monkeypatch.setattr(fp8vit._te.module_types, "autocast", lambda enabled, recipe: entered.append(enabled) or contextlib.nullcontext())
    monkeypatch.setattr(fp8vit._te.module_types, "active_fp8_recipe", lambda: _recipe("delayed"))
    lin = _Swapped(64, 32)
    lin(torch.randn(3, 64))
    assert entered == []  # FP8 on: no nested autocast
    lin.fp8_enabled = False
    lin(torch.randn(3, 64))
    assert entered == [False] and lin.seen[-1] == (3, 64)  # off: unpadded, TE's FP8 autocast off
    monkeypatch.setattr(fp8vit._te.module_types, "active_fp8_recipe", lambda: _recipe("mxfp8"))
    odd = _Swapped(48, 32)  # 48 % 32 != 0: MXFP8 cannot run it
    with pytest.warns(RuntimeWarning, match=r"48 -> 32 features\) runs in bf16.*multiples of 32"):
        odd(torch.randn(3, 48))
    assert entered == [False, False]
    monkeypatch.setattr(fp8vit._te.module_types, "active_fp8_recipe", lambda: None)
    lin.fp8_enabled = True
    lin(torch.randn(3, 64))
    assert entered == [False, False] and lin.seen[-1] == (3, 64)  # outside fp8_context: TE as is


def test_swapped_linear_state_dict_is_nn_linears_and_its_fp8_state():
    lin = _Swapped(32, 16)
    assert list(lin.state_dict()) == ["weight", "bias", "_extra_state"]  # before any FP8 state too
    plain = torch.nn.Linear(32, 16)
    lin.load_state_dict(plain.state_dict(), strict=True)  # a timm checkpoint, no _extra_state: fine
    assert torch.equal(lin.weight, plain.weight)
    lin.state = {"scale": torch.ones(2)}  # delayed scaling ran: its state is saved and restored
    sd = lin.state_dict()
    assert list(sd) == ["weight", "bias", "_extra_state"]
    other = _Swapped(32, 16)
    other.load_state_dict(sd, strict=True)
    assert torch.equal(other.state["scale"], torch.ones(2))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        plain.load_state_dict(sd)  # convert_from_te first to load such a checkpoint into timm


def test_swapped_linear_output_may_be_modified_in_place(monkeypatch):
    # BEiT with qkv_bias_separate: qkv = self.qkv(x); qkv += bias. TE's output is a view made inside
    # its autograd Function, which autograd refuses to modify in place: the swapped Linear hands it
    # out as a tensor of its own (no copy), and gradients still flow.
    monkeypatch.setattr(fp8vit._te.module_types, "active_fp8_recipe", lambda: None)
    x = torch.randn(2, 5, 32, requires_grad=True)
    lin = _Swapped(32, 48)
    raw = _FakeTELinear.forward(lin, x)
    with pytest.raises(RuntimeError, match="view.*modified inplace"):
        raw += 1  # what timm's in-place add would meet without the hand-over
    owner = _beit().blocks[0].attn
    fp8vit.blocks.linear.switch_owner(lin, owner, "qkv")
    assert owner.qkv_bias_separate and lin.restore_owner == {"qkv_bias_separate": False}
    out = lin(x)
    out += 1
    out.sum().backward()
    torch.testing.assert_close(x.grad, lin.weight.sum(0).expand_as(x))


@pytest.mark.parametrize("fallback", ["keep", "linear"])
def test_a_model_with_nothing_in_fp8_says_convert_does_not_make_it_faster(fallback):
    # Swin's blocks kept as they are: the conversion changes nothing of the step, and says so
    # (with the way that does: torch.compile); with its Linears swapped, FP8 runs and it does not
    model = _swin()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fp8vit.convert_to_te(model, backend="reference", fallback=fallback)
    said = " ".join(str(w.message) for w in seen)
    assert ("not faster converted: torch.compile(model)" in said) is (fallback == "keep"), said


def _family_blocks():
    """(fp8vit block name, a small timm block of that family): one per family."""
    from timm.models import beit, convnext, eva, swin_transformer, swin_transformer_v2
    return [
        ("TE_Block", lambda cls=Block: cls(32, 2)),
        ("TE_EvaBlock", lambda cls=eva.EvaBlock: cls(32, 2)),
        ("TE_BeitBlock", lambda cls=beit.Block: cls(32, 2, window_size=(4, 4))),
        ("TE_SwinBlock", lambda cls=swin_transformer.SwinTransformerBlock: cls(32, (8, 8), 2, window_size=4)),
        ("TE_SwinV2Block", lambda cls=swin_transformer_v2.SwinTransformerV2Block: cls(32, (8, 8), 2, window_size=4)),
        ("TE_ConvNeXtBlock", lambda cls=convnext.ConvNeXtBlock: cls(32)),
    ]


@pytest.mark.parametrize("fused, make", _family_blocks(), ids=[f for f, _ in _family_blocks()])
def test_from_timm_refuses_subclasses_of_the_block_and_its_attention(fused, make):
    # A subclass may override forward: fusing it would silently run timm's math instead of the user's.
    cls = getattr(fp8vit, fused)
    timm_cls = type(make())
    sub = type(f"My{timm_cls.__name__}", (timm_cls,), {})
    with pytest.raises(ValueError, match=f"My{timm_cls.__name__} cannot be converted to {fused}: it takes "
                                         f"exactly timm's {timm_cls.__module__}.{timm_cls.__qualname__}"):
        cls.from_timm(make(sub), backend="reference")
    block = make()
    assert isinstance(cls.from_timm(block, backend="reference"), cls)  # the exact class converts
    if not hasattr(block, "attn"):  # ConvNeXt: no attention
        return
    attn_cls = type(block.attn)
    block.attn.__class__ = type("MyAttention", (attn_cls,), {})
    with pytest.raises(ValueError, match=f"{timm_cls.__name__}.attn of type .*MyAttention cannot be converted to "
                                         f"{fused}: it takes exactly timm's .*{attn_cls.__qualname__}"):
        cls.from_timm(block, backend="reference")
