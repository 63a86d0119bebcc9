"""fp8vit.blocks.model_norm on the CPU: convert_to_te switches a model's own LayerNorms (timm's final
``norm``, ``fc_norm``, ``norm_pre``) to their one-pass autocast forward where it fuses blocks, their
class only (the same modules, parameters and state dict), and convert_from_te switches them back.
On the CPU the forward is the LayerNorm's own (the kernel runs on CUDA tensors under autocast); the
kernels' arithmetic is checked in Triton's interpreter (tests/test_mlp.py) and on the GPU
(tests/gpu/test_kernels_gpu.py).
"""

import copy

import pytest
import timm
import torch
from timm.layers import LayerNorm as TimmLayerNorm
from torch import nn

import fp8vit
from fp8vit.blocks.model_norm import AutocastLayerNorm, AutocastTimmLayerNorm, model_norms, set_model_norms

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # TE's tanh GELU, the reference backend


def _pair(name, **kw):
    torch.manual_seed(0)
    ref = timm.create_model(name, num_classes=10, **kw)
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize("name, switched", [("vit_tiny_patch16_224", ["norm"]),
                                            ("eva02_tiny_patch14_224", ["fc_norm"]),
                                            ("swin_tiny_patch4_window7_224", ["norm"])])
def test_convert_switches_the_models_norms_and_back(name, switched):
    ref, model = _pair(name)
    norms = {n: getattr(model, n) for n in switched}
    kinds = {n: type(m) for n, m in norms.items()}
    fp8vit.convert_to_te(model, backend="reference")
    for n, norm in norms.items():
        assert getattr(model, n) is norm  # the same module, its class switched
        want = AutocastTimmLayerNorm if kinds[n] is TimmLayerNorm else AutocastLayerNorm
        assert type(norm) is want and isinstance(norm, kinds[n])
    assert sorted(model_norms(model)) == sorted(switched)
    summary = fp8vit.conversion_summary(model)  # says so
    assert sorted(summary.model_norms) == sorted(switched) and "in one pass each way" in summary.short()
    assert "the model's norms in one Triton pass each way under autocast" in summary.table()
    assert summary.to_dict()["model_norms"] == list(summary.model_norms)
    for n, p in ref.named_parameters():  # nothing else of the norms changed
        if n.split(".")[0] in switched:
            assert torch.equal(model.get_parameter(n), p), n
    fp8vit.convert_from_te(model)
    for n, norm in norms.items():
        assert type(norm) is kinds[n], n
    ref.load_state_dict(model.state_dict())


def test_a_model_with_nothing_fused_keeps_its_norms():
    # CaiT: timm's blocks of no fp8vit family; its norm stays the LayerNorm it was
    _, cait = _pair("cait_xxs24_224")
    kind = type(cait.norm)
    fp8vit.convert_to_te(cait, backend="reference")
    assert type(cait.norm) is kind and fp8vit.conversion_summary(cait).model_norms == ()


def test_the_cpu_forward_is_the_layernorms_own():
    # CPU tensors (fp32, and bf16 under CPU autocast): exactly what the LayerNorm computes
    ref, model = _pair("vit_tiny_patch16_224")
    set_model_norms(model)
    x = torch.randn(2, 197, 192)
    assert torch.equal(model.norm(x), ref.norm(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model.norm(x.bfloat16()), ref.norm(x.bfloat16())
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_which_norms_switch():
    # affine LayerNorms over the last dimension in the model's own slots; timm's fast-norm
    # LayerNorm, a norm without weights, RMSNorm and norms inside blocks are left alone
    model = nn.Module()
    model.norm = nn.LayerNorm(8)
    model.fc_norm = nn.LayerNorm(8, elementwise_affine=False)
    model.norm_pre = nn.RMSNorm(8)
    model.head = nn.Sequential(nn.LayerNorm(8))
    assert list(model_norms(model)) == ["norm"]
    fast = TimmLayerNorm(8)
    fast._fast_norm = True
    model.norm = fast
    assert model_norms(model) == {}
    model.norm = nn.LayerNorm((4, 8))
    assert model_norms(model) == {}
    model.norm = TimmLayerNorm(8)
    assert set_model_norms(model) == ["norm"] and type(model.norm) is AutocastTimmLayerNorm
    assert set_model_norms(model) == ["norm"] and type(model.norm) is AutocastTimmLayerNorm  # twice: the same
    assert set_model_norms(model, False) == ["norm"] and type(model.norm) is TimmLayerNorm
