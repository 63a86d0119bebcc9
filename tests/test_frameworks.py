"""What every framework integration relies on (docs/frameworks.md), on the CPU: a timm model inside
a framework's own module converts as the model alone does, and ``torch.compile`` of a converted model
trains as the model does uncompiled (graph breaks allowed). The frameworks themselves:
tests/test_timm_train.py, tests/test_lightning.py, tests/test_accelerate.py."""

from __future__ import annotations

import warnings

import pytest
import timm
import torch
from torch import nn

import fp8vit


def tiny_vit(num_classes=32, depth=2):
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=depth, num_classes=num_classes)


class Wrapper(nn.Module):  # as a LightningModule holds the timm model
    def __init__(self):
        super().__init__()
        self.model = tiny_vit()
        self.extra = nn.Linear(32, 32)  # a Linear of the wrapper's own, outside every block


@pytest.mark.parametrize("fallback", ["keep", "linear"])
def test_a_model_inside_a_wrapper_converts_as_the_model_alone(fallback):
    wrapper, alone = Wrapper(), tiny_vit()
    fp8vit.convert_to_te(wrapper, fallback=fallback)
    fp8vit.convert_to_te(alone, fallback=fallback)
    # its classifier head stays a plain Linear (never FP8) and the model is not a "block" kept or swapped
    assert type(wrapper.model.head) is nn.Linear and type(alone.head) is nn.Linear
    s = fp8vit.conversion_summary(wrapper)
    assert s.num_fused == 2 and s.num_swapped == 0 and not s.kept
    assert set(s.outside) == {"model.head", "extra"}


def compiled_against_eager(autocast: bool, backend: str):
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 0, 1])
    results = []
    for compile_it in (False, True):
        model = fp8vit.convert_to_te(tiny_vit(num_classes=2), autocast=autocast)
        run = torch.compile(model, backend=backend) if compile_it else model
        losses = []
        for _ in range(2):  # the second call runs the compiled code without compiling
            if autocast:
                out = run(x)
            else:
                with fp8vit.fp8_context():
                    out = run(x)
            loss = nn.functional.cross_entropy(out.float(), y)
            loss.backward()
            losses.append(loss.detach())
        results.append((losses, {n: p.grad.clone() for n, p in model.named_parameters()}))
    return results


@pytest.mark.parametrize("autocast", [False, True], ids=["fp8_context", "autocast=True"])
def test_torch_compile_of_a_converted_model_trains_as_uncompiled(autocast):
    (eager_losses, eager_grads), (losses, grads) = compiled_against_eager(autocast, "aot_eager")
    torch.testing.assert_close(losses, eager_losses, rtol=1e-2, atol=1e-3)
    assert grads.keys() == eager_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=5e-2, atol=1e-3, msg=name)


def test_torch_compile_around_eager_blocks_says_to_capture_them(monkeypatch):
    # Eager fused blocks between compiled regions made a ViT-B/16 FP8 step slower on the H200
    # (docs/frameworks.md): the compiled model says so once and names cuda_graphs=True; the same
    # model uncompiled says nothing.
    from fp8vit._warn import _seen
    from fp8vit.blocks import base

    monkeypatch.setitem(base._COMPILED, "traced", False)
    _seen.discard(base.COMPILED_EAGER_BLOCKS)
    torch._dynamo.reset()
    model = fp8vit.convert_to_te(tiny_vit(num_classes=2))
    x = torch.randn(2, 3, 32, 32)

    def said(run):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                run(x)
        return [w for w in caught if str(w.message) == base.COMPILED_EAGER_BLOCKS]

    assert not said(model)
    compiled = said(torch.compile(model, backend="eager"))
    assert len(compiled) == 1 and "cuda_graphs=True" in str(compiled[0].message)
    _seen.discard(base.COMPILED_EAGER_BLOCKS)
    assert not said(model), "the compiled run's mark leaked into a later uncompiled one"


def test_torch_compile_leaves_the_fused_blocks_to_their_kernels():
    # TE's kernels are fused already and its modules break dynamo's graphs (torch 2.11): traced, each
    # block became frames of its own, recompiled per block past dynamo's limit of 8, and the step
    # was 15% slower than uncompiled on the H200. The blocks run eagerly; the rest is compiled.
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = fp8vit.convert_to_te(tiny_vit(num_classes=2, depth=12))
    run = torch.compile(model, backend=backend)
    x = torch.randn(4, 3, 32, 32)
    with fp8vit.fp8_context():
        for _ in range(2):
            run(x).float().sum().backward()
    # the stem (up to the blocks) and the rest after them: nothing per block
    assert 1 <= len(graphs) <= 3, [len(g.graph.nodes) for g in graphs]
    # the module paths each node was traced in ("L['self'].patch_embed.proj"): no block's (the
    # stack's class names hold "blocks" too: fp8vit.blocks.patch_embed.PatchGemmConv2d)
    paths = [path for g in graphs for n in g.graph.nodes for path, _ in n.meta.get("nn_module_stack", {}).values()]
    assert paths and not any("blocks" in path for path in paths), paths
