# Throwaway H200 diagnostics (session 20): Swin V2 FP8 SNR, fused vs TE Linears in timm's blocks;
# relpos under compile: per-Linear delayed-scaling state, eager vs compiled.
import sys, time
sys.path.insert(0, "tests")
import fp8vit  # TE first
import timm, torch
from helpers import fp8_step, snr_db, kept_swin_blocks

def v2(kind):
    torch.manual_seed(0)
    m = timm.create_model("swinv2_tiny_window8_256", pretrained=False, depths=(2, 2), num_heads=(3, 6), num_classes=100)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    m = m.cuda()
    if kind == "fused":
        fp8vit.convert_to_te(m, exact_gelu=True)
    elif kind == "linear":
        fp8vit.convert_to_te(kept_swin_blocks(m), fallback="linear")
    return m.train()

xs = torch.randn(8, 3, 256, 256, device="cuda")
for kind in ("fused", "linear"):
    m = v2(kind)
    bf16 = fp8_step(m, xs, "delayed", enabled=False)
    for _ in range(2):
        fp8_step(m, xs, "delayed")
    t = fp8_step(m, xs, "delayed")
    snrs = {k: snr_db(bf16[1][k], t[1][k]) for k in bf16[1] if ".blocks." in k and k.endswith("weight")}
    worst = sorted(snrs, key=snrs.get)[:4]
    print(f"swinv2 {kind}: logits {snr_db(bf16[0], t[0]):.1f} dB; worst " + ", ".join(f"{k} {snrs[k]:.1f}" for k in worst), flush=True)
    # the bf16 run against fp32 (same model, FP8 off, no autocast): how far is bf16 itself
    m.zero_grad(set_to_none=True)
    out = m(xs); out.float().square().mean().backward()
    g32 = {n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None}
    s32 = {k: snr_db(g32[k], bf16[1][k]) for k in snrs}
    w32 = sorted(s32, key=s32.get)[:3]
    print(f"swinv2 {kind}: bf16 vs fp32 logits {snr_db(out.float(), bf16[0]):.1f} dB; worst " + ", ".join(f"{k} {s32[k]:.1f}" for k in w32), flush=True)

# relpos: eager vs compiled FP8 (fallback linear), per swapped Linear amax/scale
sys.path.insert(0, "tests/gpu")
from fp8vit._te import scaling_state
def relpos():
    torch.manual_seed(0)
    m = timm.create_model("vit_relpos_base_patch16_cls_224", pretrained=False, num_classes=100, drop_path_rate=0.0, depth=2, init_values=1.0)
    for mod in m.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    return fp8vit.convert_to_te(m.cuda(), fallback="linear")
x = torch.randn(8, 3, 224, 224, device="cuda")
eager, comp = relpos(), relpos()
fp8vit.convert_to_te(comp, fallback="linear", compile=True)
bf = fp8_step(eager, x, "delayed", enabled=False)
for i in range(3):
    r, t = fp8_step(eager, x, "delayed"), fp8_step(comp, x, "delayed")
    se, sc = scaling_state(eager), scaling_state(comp)
    keys = sorted(set(se) | set(sc))
    diffs = {k: (se.get(k), sc.get(k)) for k in keys if se.get(k) != sc.get(k)}
    print(f"relpos step {i}: logits compiled vs eager {snr_db(r[0], t[0]):.1f} dB, eager vs bf16 {snr_db(bf[0], r[0]):.1f}; "
          f"{len(keys)} scaled modules, {len(diffs)} differ: " + "; ".join(f"{k} {v}" for k, v in list(diffs.items())[:8]), flush=True)
# the same with compile off the table: two eager copies (the run-to-run floor)
e1, e2 = relpos(), relpos()
for i in range(3):
    r, t = fp8_step(e1, x, "delayed"), fp8_step(e2, x, "delayed")
print(f"relpos two eager copies: logits {snr_db(r[0], t[0]):.1f} dB", flush=True)
