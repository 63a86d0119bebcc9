"""convert_to_te / convert_from_te on real timm models (reference backend on CPU)."""

import functools

import pytest
import timm
import torch
from timm.models.vision_transformer import ResPostBlock, VisionTransformer

import fp8vit

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


def test_unconvertible_block_is_named():
    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4,
                              block_fn=ResPostBlock, num_classes=3)
    with pytest.raises(fp8vit.ConversionError, match=r"blocks\.0 \(ResPostBlock\)"):
        fp8vit.convert_to_te(model, backend="reference")


def test_unsupported_block_option_is_named():
    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4,
                              num_classes=3)
    model.blocks[1].attn.norm = torch.nn.LayerNorm(64)  # what scale_attn_norm=True builds
    with pytest.raises(fp8vit.ConversionError, match=r"blocks\.1: .*scale_attn_norm"):
        fp8vit.convert_to_te(model, backend="reference")


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
        fp8vit.convert_to_te(model, backend="reference")
    assert not any(isinstance(b, fp8vit.TE_Block) for b in model.blocks)
    assert "set_grad_checkpointing" not in vars(model)


def test_model_without_blocks_is_an_error():
    with pytest.raises(fp8vit.ConversionError, match="Sequential holds no timm Block"):
        fp8vit.convert_to_te(torch.nn.Sequential(torch.nn.Linear(4, 4)), backend="reference")


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
        fp8vit.convert_to_te(torch.nn.Sequential(block), backend="reference")


@pytest.mark.parametrize("mode", ["", "jax", "moco"])
@pytest.mark.parametrize("fix_init", [False, True])
def test_block_fn_follows_timm_init_modes(mode, fix_init):
    # The same seed through timm's Block and through TE_Block must give the same statistics per
    # tensor (the draws differ: the modules are created in another order).
    kw = dict(img_size=32, patch_size=16, embed_dim=96, depth=3, num_heads=4, num_classes=5, qkv_bias=True,
              init_values=1e-3, weight_init=mode, fix_init=fix_init)
    torch.manual_seed(0)
    ref = VisionTransformer(**kw)
    torch.manual_seed(0)
    te = VisionTransformer(block_fn=functools.partial(fp8vit.TE_Block, backend="reference"), **kw)
    for i, (a, b) in enumerate(zip(ref.blocks, te.blocks)):
        got, names = b.state_dict(), dict(fp8vit.weights.name_pairs(b.cfg))
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
    with pytest.raises(ValueError, match="has no TE_Block.*convert_to_te"):
        fp8vit.set_mlp_recompute(_model("vit_tiny_patch16_224"))


def test_mlp_recompute_on_the_blocks_a_filter_selects():
    model = fp8vit.convert_to_te(_model("vit_tiny_patch16_224"), backend="reference")
    every_third = lambda m, fqn: int(fqn.rsplit(".", 1)[-1]) % 3 == 0  # noqa: E731
    fp8vit.set_mlp_recompute(model, module_filter_fn=every_third)
    assert [b.recompute_mlp for b in model.blocks] == [i % 3 == 0 for i in range(len(model.blocks))]
    fp8vit.set_mlp_recompute(model, False, module_filter_fn=lambda m, fqn: fqn == "blocks.0")
    assert [i for i, b in enumerate(model.blocks) if b.recompute_mlp] == [3, 6, 9]
    with pytest.raises(ValueError, match=r"selected none of the 12 TE_Blocks \(blocks.0 ... blocks.11\)"):
        fp8vit.set_mlp_recompute(model, module_filter_fn=lambda m, fqn: False)


def test_mlp_recompute_every_kth_block():
    model = fp8vit.convert_to_te(_model("vit_tiny_patch16_224"), backend="reference")
    fp8vit.set_mlp_recompute(model, every=2)
    assert [i for i, b in enumerate(model.blocks) if b.recompute_mlp] == [0, 2, 4, 6, 8, 10]
    fp8vit.set_mlp_recompute(model, False)
    # every counts over the blocks the filter chose: here blocks 6..11, so 6 and 9
    fp8vit.set_mlp_recompute(model, every=3, module_filter_fn=lambda m, fqn: int(fqn.rsplit(".", 1)[-1]) >= 6)
    assert [i for i, b in enumerate(model.blocks) if b.recompute_mlp] == [6, 9]
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"every={bad!r}; it must be an integer >= 1"):
            fp8vit.set_mlp_recompute(model, every=bad)
