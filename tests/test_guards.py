"""NonFiniteGuard: a non-finite step is skipped without touching weights or optimizer state,
and the report names the block that produced it."""

import types

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

import fp8vit


def _setup(optimizer="sgd"):
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=4, num_heads=4, num_classes=5)
    fp8vit.convert_to_te(model, backend="reference")
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, opt


def _poison(block, when, backward=False):
    """Make ``block``'s MLP output (or, with ``backward``, its gradient) infinite while when["now"]."""
    inner = block.mlp.forward

    def forward(x):
        y = inner(x)
        if not when["now"]:
            return y
        if backward:
            y.register_hook(lambda g: g * float("inf"))
            return y
        return y * float("inf")

    block.mlp.forward = forward


def _state(opt):
    return {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in opt.state.items()}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_bad_step_is_skipped_cleanly_and_named(optimizer):
    model, opt = _setup(optimizer)
    when = {"now": False}
    _poison(model.blocks[2], when)
    guard = fp8vit.NonFiniteGuard(model, opt)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))

    def step():
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return guard.step(loss)

    assert step()  # a normal step first, so the optimizer has state to protect
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = _state(opt)
    when["now"] = True
    with pytest.warns(RuntimeWarning, match="first non-finite activation in blocks.2"):
        assert not step()
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
    after = _state(opt)
    for pid, s in state.items():
        for k, v in s.items():
            assert torch.equal(after[pid][k], v) if torch.is_tensor(v) else after[pid][k] == v
    assert all(p.grad is None for p in model.parameters())
    ev = guard.events[0]
    assert ev.step == 1 and ev.first_bad_activation == "blocks.2"
    assert ev.bad_grads == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]  # NaN flowed everywhere
    when["now"] = False
    assert step() and guard.skipped == 1 and guard.steps == 3


def test_backward_overflow_is_traced_to_its_block():
    model, opt = _setup()
    when = {"now": True}
    _poison(model.blocks[2], when, backward=True)
    guard = fp8vit.NonFiniteGuard(model, opt)
    loss = F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.randint(0, 5, (2,)))
    loss.backward()
    with pytest.warns(RuntimeWarning, match="backward first non-finite in blocks.2"):
        assert not guard.step(loss)
    ev = guard.events[0]
    assert ev.first_bad_activation is None and ev.first_bad_gradient == "blocks.2"
    assert ev.bad_grads == ["blocks.0", "blocks.1", "blocks.2"]  # blocks.3 is before the fault in backward


def test_max_consecutive_raises_with_last_event():
    model, opt = _setup()
    _poison(model.blocks[0], {"now": True})
    guard = fp8vit.NonFiniteGuard(model, opt, max_consecutive=1)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 5, (2,))
    with pytest.warns(RuntimeWarning):
        for _ in range(2):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if _ == 0:
                guard.step(loss)
        with pytest.raises(RuntimeError, match="2 consecutive non-finite steps.*blocks.0"):
            guard.step(loss)


def test_repair_clears_non_finite_amax_history():
    model, opt = _setup()
    fake = torch.nn.Module()
    hist = torch.tensor([[1.0, float("inf")], [float("nan"), 2.0]])
    fake.fp8_meta = {"scaling_fwd": types.SimpleNamespace(amax_history=hist)}
    model.extra = fake
    assert fp8vit._te.repair_amax_histories(model) == 1
    assert torch.equal(hist, torch.tensor([[1.0, 0.0], [0.0, 2.0]]))


def test_gradient_accumulation_keeps_the_bad_micro_batch():
    model, opt = _setup()
    when = {"now": False}
    _poison(model.blocks[1], when)
    guard = fp8vit.NonFiniteGuard(model, opt)
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 5, (2,))
    for micro, bad in enumerate((True, False)):  # the first micro-batch overflows, the last is clean
        when["now"] = bad
        loss = F.cross_entropy(model(x), y) / 2
        loss.backward()
    with pytest.warns(RuntimeWarning, match="first non-finite activation in blocks.1"):
        assert not guard.step(loss)
    assert guard.events[0].first_bad_activation == "blocks.1"
