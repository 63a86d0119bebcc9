"""Measure what TE's tanh-approximate GELU changes against timm's exact (erf) GELU.

    python examples/gelu_effect.py [--model vit_base_patch16_224] [--device cpu|cuda]

Converts the same randomly initialised timm model twice, with exact_gelu=False (TE's fused tanh
GELU kernel) and exact_gelu=True (erf GELU, unfused MLP), and prints the elementwise bound and the
relative difference of the logits in fp32. On CPU the PyTorch reference modules compute the same
tanh formula as TE's kernel, so the number is the approximation's, not a kernel's.
"""

import argparse
import copy

import torch

import fp8vit
from fp8vit.tools.cli import at_least


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=at_least(1, "images"), default=8)
    a = p.parse_args()
    import timm

    x = torch.linspace(-10, 10, 200001, dtype=torch.float64)
    bound = (torch.nn.functional.gelu(x) - torch.nn.functional.gelu(x, approximate="tanh")).abs().max()
    print(f"max |gelu_erf(x) - gelu_tanh(x)| = {bound:.2e}")
    torch.manual_seed(0)
    base = timm.create_model(a.model, pretrained=False).to(a.device).eval()
    imgs = torch.randn(a.batch_size, 3, 224, 224, device=a.device)
    with torch.no_grad():
        ref = base(imgs)
        tanh = fp8vit.convert_to_te(copy.deepcopy(base), exact_gelu=False)(imgs)
        erf = fp8vit.convert_to_te(copy.deepcopy(base), exact_gelu=True)(imgs)
    rel = lambda a_, b_: float((a_ - b_).norm() / b_.norm())  # noqa: E731
    print(f"{a.model} ({a.device}, fp32, random init): logits relative L2 difference vs timm: "
          f"exact_gelu=True {rel(erf, ref):.2e}, tanh GELU (default) {rel(tanh, ref):.2e}")


if __name__ == "__main__":
    main()
