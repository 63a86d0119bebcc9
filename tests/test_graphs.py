"""make_graphed_blocks refuses what it cannot capture, before touching the model (CPU)."""

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import fp8vit


def _vit():
    return fp8vit.convert_to_te(VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4,
                                                  num_classes=3), backend="reference")


def test_needs_a_vit_with_sequential_blocks():
    with pytest.raises(ValueError, match="Linear has no nn.Sequential or nn.ModuleList .blocks."):
        fp8vit.make_graphed_blocks(torch.nn.Linear(4, 4), 8)


def test_needs_the_model_on_a_gpu():
    with pytest.raises(ValueError, match="blocks are on cpu.*model.cuda"):
        fp8vit.make_graphed_blocks(_vit(), 8, fp8=False)


def test_tokens_per_image_without_patch_embed_num_patches_must_be_given():
    model = _vit()
    model.patch_embed = torch.nn.Identity()  # a ViT-like model whose stem says nothing about tokens
    with pytest.raises(ValueError, match="VisionTransformer has no patch_embed.num_patches .*pass tokens="):
        fp8vit.make_graphed_blocks(model, 8, fp8=False)
    with pytest.raises(ValueError, match="blocks are on cpu"):  # given: the next check is reached
        fp8vit.make_graphed_blocks(model, 8, tokens=5, fp8=False)


def test_dtype_must_be_an_autocast_dtype():
    with pytest.raises(ValueError, match="dtype=torch.float32"):
        fp8vit.make_graphed_blocks(_vit(), 8, dtype=torch.float32)


def test_only_gradients_aliasing_the_graph_buffers_are_copied_before_a_replay():
    # The logic that keeps accumulation right when gradients leave the graphs uncopied (the GPU
    # tests check it end to end): a .grad that is a view of a graph buffer is replaced by a copy
    # with the same values; a .grad elsewhere (e.g. a DDP bucket view) and a None stay as they are.
    from fp8vit.training.graphs import _Dispatch
    static = torch.randn(6)                      # stands in for the backward graph's buffer
    aliased, own, none = (torch.nn.Parameter(torch.zeros(6)) for _ in range(3))
    aliased.grad = static.detach()
    own.grad = torch.randn(6)
    own_grad = own.grad
    d = _Dispatch(handle=None, graphed=None, eager=None, params=(aliased, own, none))
    d._record_static((static.detach(), None), ())
    d._copy_aliased_grads()
    assert aliased.grad.data_ptr() != static.data_ptr() and torch.equal(aliased.grad, static)
    static.add_(1.0)                             # the next replay rewrites the buffer
    assert not torch.equal(aliased.grad, static)
    assert own.grad is own_grad and none.grad is None


@pytest.mark.parametrize("switch", ["fp8_enabled", "grad_checkpointing", "recompute_mlp", "gelu_in_gemm"])
def test_every_block_switch_read_by_forward_is_watched_after_capture(switch):
    # The graphs replay what was captured: flipping any block switch that changes the forward must
    # make the next call run eagerly (with a warning), never be silently ignored.
    from fp8vit.training.graphs import _switches
    model = _vit()
    before = _switches(model.blocks)
    setattr(model.blocks[1], switch, not getattr(model.blocks[1], switch))
    assert _switches(model.blocks) != before


class _FakeTELinear(torch.nn.Module):
    """What fp8vit._te.wgrad_into_main_grad reads of a TE GEMM module: its switch and weights."""

    def __init__(self, names=("weight",), list_names=True):
        super().__init__()
        self.fuse_wgrad_accumulation = False
        if list_names:
            self.weight_names = list(names)
        for n in names:
            self.register_parameter(n, torch.nn.Parameter(torch.randn(3, 2)))


def test_wgrad_into_main_grad_gives_trainable_te_gemm_weights_a_buffer_and_restores_the_switch():
    from fp8vit import _te
    linear, mlp, frozen = _FakeTELinear(), _FakeTELinear(("fc1_weight", "fc2_weight"), list_names=False), _FakeTELinear()
    frozen.weight.requires_grad_(False)
    # TE concatenates split weights (te.TransformerLayer's QKV) into a new tensor: no main_grad there
    split = _FakeTELinear(("query_weight", "key_weight", "value_weight"))
    model = torch.nn.Sequential(linear, mlp, frozen, split, torch.nn.Linear(2, 2))  # nn.Linear: not TE's
    with _te.wgrad_into_main_grad([model]) as weights:
        assert [id(w) for w in weights] == [id(linear.weight), id(mlp.fc1_weight), id(mlp.fc2_weight)]
        assert linear.fuse_wgrad_accumulation and mlp.fuse_wgrad_accumulation
        assert not frozen.fuse_wgrad_accumulation and not hasattr(frozen.weight, "main_grad")
        assert not split.fuse_wgrad_accumulation and not hasattr(split.query_weight, "main_grad")
        for w in weights:
            assert w.main_grad.shape == w.shape and w.main_grad.dtype == w.dtype and w.overwrite_main_grad
    # Off again for eager calls; the buffers stay for the graphs captured inside.
    assert not linear.fuse_wgrad_accumulation and not mlp.fuse_wgrad_accumulation
    assert all(hasattr(w, "main_grad") for w in weights)
    _te.release_main_grad(weights)
    assert not any(hasattr(w, a) for w in weights for a in ("main_grad", "overwrite_main_grad"))


def test_main_grads_reach_autograd_uncopied_and_are_copied_before_the_next_replay():
    # The node before the graphed blocks hands each fused weight its main_grad: p.grad becomes a
    # view of it (no copy), accumulation adds to it, and before the next replay (which rewrites
    # main_grad) a p.grad still aliasing it is copied.
    from fp8vit.training.graphs import _Dispatch, _MainGradsToAutograd
    w = torch.nn.Parameter(torch.zeros(4))
    w.main_grad = torch.randn(4)                 # what the backward graph wrote
    x = torch.randn(4, requires_grad=True)
    _MainGradsToAutograd.apply(x, (w.main_grad,), w).sum().backward()
    assert torch.equal(x.grad, torch.ones(4))
    assert w.grad.data_ptr() == w.main_grad.data_ptr()
    d = _Dispatch(handle=None, graphed=None, eager=None, params=(w,), main_grad_weights=(w,))
    d._copy_aliased_grads()
    first = w.grad
    assert first.data_ptr() != w.main_grad.data_ptr() and torch.equal(first, w.main_grad)
    w.main_grad.mul_(-1.0)                       # the next backward graph's gradient
    _MainGradsToAutograd.apply(x, (w.main_grad,), w).sum().backward()
    assert torch.allclose(w.grad, torch.zeros(4))  # accumulated: g + (-g)
