"""fp8vit._te.param_cast (lever 42): a block's vector parameters cast to the autocast dtype in one
kernel each way, handed to its TE modules for the forward. On the CPU with stand-in modules that
read their parameters as TE 2.20's do (``getattr``, then ``cast_if_needed``); the GPU tests run
the real blocks with it."""

import contextlib
import types

import pytest
import torch
from torch import nn

from fp8vit._te import param_cast


class _LayerNormLinear(nn.Module):
    """What TE's LayerNormLinear does with its vectors: reads each slot, casts it to the
    activation dtype (``cast_if_needed``), uses it."""

    def __init__(self, d=6, out=5):
        super().__init__()
        self.layer_norm_weight = nn.Parameter(torch.randn(d))
        self.layer_norm_bias = nn.Parameter(torch.randn(d))
        self.weight = nn.Parameter(torch.randn(out, d))
        self.bias = nn.Parameter(torch.randn(out))

    def forward(self, x):
        dt = torch.bfloat16
        w, b = self.layer_norm_weight.to(dt), self.layer_norm_bias.to(dt)
        h = torch.nn.functional.layer_norm(x.to(dt).float(), (x.shape[-1],), w.float(), b.float()).to(dt)
        return h @ self.weight.to(dt).t() + self.bias.to(dt)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = _LayerNormLinear()
        self.other = nn.Linear(5, 5)  # not a TE module: left alone

    def forward(self, x):
        return self.other(self.qkv(x).float())


@pytest.fixture
def te_kinds(monkeypatch):
    kinds = types.SimpleNamespace(LayerNormLinear=_LayerNormLinear, Linear=type("L", (nn.Module,), {}),
                                  LayerNormMLP=type("M", (nn.Module,), {}))
    monkeypatch.setattr(param_cast, "modules", lambda: kinds)


def test_the_casts_and_their_gradients_are_the_ones_each_copy_makes():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n) * 3) for n in (7, 1, 300)]
    params[1].requires_grad_(False)
    casts = param_cast._CastTogether.apply(torch.bfloat16, *params)
    for c, p in zip(casts, params):
        assert c.dtype == torch.bfloat16 and torch.equal(c, p.to(torch.bfloat16))
    assert [c.requires_grad for c in casts] == [True, False, True]
    grads = [torch.randn(7, dtype=torch.bfloat16), None, torch.randn(300, dtype=torch.bfloat16)]
    torch.autograd.backward([casts[0], casts[2]], [grads[0], grads[2]])
    for p, g in ((params[0], grads[0]), (params[2], grads[2])):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, g.float())
    assert params[1].grad is None


def test_slots_are_the_te_modules_vectors_in_another_dtype(te_kinds):
    block = _Block()
    slots = param_cast._slots(block, torch.bfloat16)
    assert [(m is block.qkv, n) for m, n in slots] == [
        (True, "layer_norm_weight"), (True, "layer_norm_bias"), (True, "bias")]
    assert param_cast._slots(block.to(torch.bfloat16), torch.bfloat16) == ()  # nothing to cast
    mixed = _Block()
    mixed.qkv.bias.data = mixed.qkv.bias.data.double()
    assert param_cast._slots(mixed, torch.bfloat16) == ()  # one kernel needs one source dtype


def test_a_step_through_the_swap_gives_the_same_bits_and_puts_the_parameters_back(te_kinds):
    torch.manual_seed(0)
    a, b = _Block(), _Block()
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 6)
    a(x).square().sum().backward()
    before = dict(b.qkv.named_parameters())
    with param_cast._swapped(param_cast._slots(b, torch.bfloat16), torch.bfloat16):
        assert b.qkv.bias.dtype == torch.bfloat16 and b.qkv.bias.grad_fn is not None
        out = b(x)
    assert dict(b.qkv.named_parameters()) == before  # the same Parameter objects
    assert all(type(p) is nn.Parameter for p in b.parameters())
    out.square().sum().backward()
    assert torch.equal(out, a(x))
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad), n


def test_the_parameters_come_back_after_an_exception(te_kinds):
    block = _Block()
    bias = block.qkv.bias
    with pytest.raises(RuntimeError, match="boom"):
        with param_cast._swapped(param_cast._slots(block, torch.bfloat16), torch.bfloat16):
            assert block.qkv.bias is not bias
            raise RuntimeError("boom")
    assert block.qkv.bias is bias


def test_outside_cuda_autocast_nothing_is_swapped(te_kinds):
    block = _Block()
    bias = block.qkv.bias
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with param_cast.cast_small_params(block):
            assert block.qkv.bias is bias


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_forward_without_autograd_casts_and_puts_back_alike(te_kinds, mode):
    block = _Block()
    x = torch.randn(4, 6)
    ref = block(x)
    with mode():
        with param_cast._swapped(param_cast._slots(block, torch.bfloat16), torch.bfloat16):
            assert block.qkv.bias.dtype == torch.bfloat16 and not block.qkv.bias.requires_grad
            out = block(x)
    assert torch.equal(out, ref) and type(block.qkv.bias) is nn.Parameter


def test_a_whole_block_trains_through_the_swap(monkeypatch):
    # fp8vit's own block code around the TE modules (reference stand-ins here, same parameter
    # names) runs with the casts in the slots: every vector parameter gets its gradient, in fp32,
    # close to the one without the swap (the weights rounded to bf16 are the only difference here:
    # CPU autocast runs the reference LayerNorm in fp32; TE casts them to bf16 itself)
    import timm
    import fp8vit
    from fp8vit.blocks import reference
    from fp8vit.training.numerics import snr_db

    monkeypatch.setattr(param_cast, "modules", reference.modules)
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", depth=1, num_classes=4)
    fp8vit.convert_to_te(model, backend="reference")
    block = model.blocks[0]
    x = torch.randn(2, 197, 192)
    grads = {}
    for swap in (False, True):
        block.zero_grad(set_to_none=True)
        slots = param_cast._slots(block, torch.bfloat16) if swap else ()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with param_cast._swapped(slots, torch.bfloat16) if swap else contextlib.nullcontext():
                out = block(x)
        out.float().square().mean().backward()
        grads[swap] = {n: p.grad for n, p in block.named_parameters()}
    assert len(slots) == 8  # norm1, qkv bias, proj bias, norm2, fc1 and fc2 biases
    for n, g in grads[False].items():
        assert grads[True][n] is not None and grads[True][n].dtype == torch.float32, n
        assert snr_db(g, grads[True][n]) > 30, n  # measured: 39 dB and up
    assert all(type(p) is nn.Parameter for p in block.parameters())
