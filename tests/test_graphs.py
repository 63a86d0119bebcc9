"""make_graphed_blocks refuses what it cannot capture, before touching the model (CPU)."""

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import fp8vit


def _vit():
    return fp8vit.convert_to_te(VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4,
                                                  num_classes=3), backend="reference")


def test_needs_a_vit_with_sequential_blocks():
    with pytest.raises(ValueError, match="Linear has no nn.Sequential .blocks."):
        fp8vit.make_graphed_blocks(torch.nn.Linear(4, 4), 8)


def test_needs_the_model_on_a_gpu():
    with pytest.raises(ValueError, match="blocks are on cpu.*model.cuda"):
        fp8vit.make_graphed_blocks(_vit(), 8, fp8=False)


def test_dtype_must_be_an_autocast_dtype():
    with pytest.raises(ValueError, match="dtype=torch.float32"):
        fp8vit.make_graphed_blocks(_vit(), 8, dtype=torch.float32)


def test_only_gradients_aliasing_the_graph_buffers_are_copied_before_a_replay():
    # The logic that keeps accumulation right when gradients leave the graphs uncopied (the GPU
    # tests check it end to end): a .grad that is a view of a graph buffer is replaced by a copy
    # with the same values; a .grad elsewhere (e.g. a DDP bucket view) and a None stay as they are.
    from fp8vit.graphs import _Dispatch
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
    from fp8vit.graphs import _switches
    model = _vit()
    before = _switches(model.blocks)
    setattr(model.blocks[1], switch, not getattr(model.blocks[1], switch))
    assert _switches(model.blocks) != before
