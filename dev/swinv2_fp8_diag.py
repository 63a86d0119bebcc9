"""Swin V2's fused block under FP8: where does it lose SNR against the generic path (TE Linears in
timm's own V2 blocks)? The model and step of tests/gpu/test_swin_gpu.py::test_v2_fp32_matches_timm_and_fp8_snr_vs_bf16.

    . docs/perf/te_env.sh; python3 dev/swinv2_fp8_diag.py      # on the GPU machine

Prints, for the fused and the generic model on the same batch: bf16 against fp32, then FP8 against
bf16 (delayed and current) with FP8 in every block, then with FP8 in one block at a time (the others
bf16), and the fused model with TE's biased attention instead of torch's. Per line: logits SNR and
the worst weight-gradient SNRs (cpb_mlp, qkv, proj, fc1/fc2), in dB.
"""
import copy
import sys

import fp8vit  # noqa: F401  TE before torch's first cuDNN kernel
import timm
import torch

sys.path[:0] = ["tests", "tests/gpu"]
from helpers import fp8_step, kept_swin_blocks  # noqa: E402
from test_swin_gpu import _timm_named  # noqa: E402
from fp8vit.training.numerics import snr_db  # noqa: E402

BLOCKS = ["layers.0.blocks.0", "layers.0.blocks.1", "layers.1.blocks.0", "layers.1.blocks.1"]


def snrs(m, ref, test):
    a, b = _timm_named(m, ref[1]), _timm_named(m, test[1])
    out = {"logits": snr_db(ref[0], test[0])}
    out.update({k: snr_db(a[k], b[k]) for k in a if ".blocks." in k and k.endswith("weight")})
    worst = min((k for k in out if k != "logits"), key=out.get)
    # where a gradient is far off: |test| / |ref| says zero (0), doubled (2) or another value
    print(f"    worst {worst}: {out[worst]:.1f} dB, |test|/|ref| = {float(b[worst].norm() / a[worst].norm()):.3f}")
    return out


def line(tag, s):
    groups = {"cpb": "cpb_mlp", "qkv": "qkv.weight", "proj": "proj.weight", "mlp": "mlp.fc"}
    worst = {g: min((v for k, v in s.items() if pat in k), default=float("nan")) for g, pat in groups.items()}
    print(f"{tag:42s} logits {s['logits']:5.1f} | " + "  ".join(f"{g} {v:5.1f}" for g, v in worst.items()), flush=True)


def fp8_vs_bf16(m, x, recipe, only=None):
    if only is not None:
        fp8vit.set_block_fp8(m, BLOCKS, False)
        fp8vit.set_block_fp8(m, only, True)
    ref = fp8_step(m, x, recipe, enabled=False)
    for _ in range(2):
        fp8_step(m, x, recipe)
    out = snrs(m, ref, fp8_step(m, x, recipe))
    fp8vit.set_block_fp8(m, BLOCKS, True)
    return out


def main():
    torch.manual_seed(0)
    model = timm.create_model("swinv2_tiny_window8_256", pretrained=False, depths=(2, 2), num_heads=(3, 6),
                              num_classes=100, drop_path_rate=0.0)  # no random masks between the steps
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model = model.cuda().train()
    x = torch.randn(8, 3, 256, 256, device="cuda")
    fp32 = copy.deepcopy(model)
    generic = fp8vit.convert_to_te(kept_swin_blocks(copy.deepcopy(model)), fallback="linear")
    fused = fp8vit.convert_to_te(copy.deepcopy(model), exact_gelu=True)
    # bf16 against fp32 (timm's model in fp32 as the reference of both)
    fp32.zero_grad()
    out = fp32(x)
    out.float().square().mean().backward()
    ref = (out.detach().float(), {k: p.grad.float().clone() for k, p in fp32.named_parameters() if p.grad is not None})
    for name, m in (("generic", generic), ("fused", fused)):
        low = fp8_step(m, x, "delayed", enabled=False)
        s = {"logits": snr_db(ref[0], low[0])}
        b = _timm_named(m, low[1])
        s.update({k: snr_db(ref[1][k], b[k]) for k in b if k in ref[1] and ".blocks." in k and k.endswith("weight")})
        line(f"{name}: bf16 vs fp32", s)
    for recipe in ("delayed", "current"):
        for name, m in (("generic", generic), ("fused", fused)):
            line(f"{name}: {recipe} vs bf16, FP8 everywhere", fp8_vs_bf16(m, x, recipe))
    for blk in BLOCKS:
        for name, m in (("generic", generic), ("fused", fused)):
            line(f"{name}: delayed, FP8 in {blk} only", fp8_vs_bf16(m, x, "delayed", only=blk))
    for mod in fused.modules():
        if isinstance(mod, fp8vit.TE_SwinV2Block):
            mod.bias_attention = "te"
    line("fused, TE's biased attention: delayed", fp8_vs_bf16(fused, x, "delayed"))
    # a fresh copy, never toggled: is the toggled model's last line its own or set_block_fp8's doing?
    fresh = fp8vit.convert_to_te(copy.deepcopy(fp32), exact_gelu=True)
    line("fused, fresh copy: delayed", fp8_vs_bf16(fresh, x, "delayed"))


if __name__ == "__main__":
    main()
