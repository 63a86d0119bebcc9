"""Does FP8 converge like bf16? Train one small ViT from one seed in bf16 and in FP8 on real images.

    python examples/convergence.py --plot convergence.png --json convergence.json

Data: scikit-learn's bundled handwritten digits (1797 8x8 grey images, 10 classes; no download),
upsampled to 32x32 and split 80/20 with a fixed seed. Model: timm VisionTransformer, patch 4 (65
tokens, so batch x tokens is rarely a multiple of 16: the FP8 row padding is exercised), dim 192,
depth 6, 3 heads. AdamW with cosine decay. Every variant starts from the same weights and sees
the same batches in the same order. bf16 runs timm's blocks; each FP8 recipe this GPU supports runs
fp8vit's TE_Blocks in ``fp8_context(recipe)``. Without FP8 (CPU), only bf16 runs, with the reason.
"""

import argparse
import copy
import json
import math

import torch
import torch.nn.functional as F

import fp8vit  # first: imports Transformer Engine before any cuDNN kernel runs


def load_digits(device, img_size=32, seed=0):
    """(x_train, y_train, x_test, y_test): images [N, 3, img_size, img_size], standardized."""
    from sklearn.datasets import load_digits as sk_digits
    d = sk_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0     # [N, 1, 8, 8] in [0, 1]
    x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(y))
    tr, te = perm[:n_train], perm[n_train:]
    return x[tr].to(device), y[tr].to(device), x[te].to(device), y[te].to(device)


def make_model(device, img_size):
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    return VisionTransformer(img_size=img_size, patch_size=4, embed_dim=192, depth=6, num_heads=3,
                             num_classes=10, qkv_bias=True).to(device)


@torch.no_grad()
def accuracy(model, x, y, recipe, fp8):
    model.eval()
    correct = 0
    for i in range(0, len(y), 256):
        with fp8vit.fp8_context(recipe, enabled=fp8):
            correct += int((model(x[i:i + 256]).argmax(-1) == y[i:i + 256]).sum())
    model.train()
    return correct / len(y)


def train(base, data, *, recipe, fp8, epochs, batch, lr, seed=0):
    """Train a copy of ``base``; returns {"loss": [per step], "acc": [per epoch]}."""
    model = copy.deepcopy(base)
    if fp8:
        fp8vit.convert_to_te(model)
    x, y, xt, yt = data
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = epochs * math.ceil(len(y) / batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    g = torch.Generator(device="cpu").manual_seed(seed)  # same batch order for every variant
    hist = {"loss": [], "acc": []}
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g).to(y.device)
        for i in range(0, len(y), batch):
            idx = perm[i:i + batch]
            with fp8vit.fp8_context(recipe, enabled=fp8):
                loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            hist["loss"].append(float(loss.detach()))
        hist["acc"].append(accuracy(model, xt, yt, recipe, fp8))
    return hist


def plot(results, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, h in results.items():
        k = 10
        sm = [sum(h["loss"][max(0, i - k + 1):i + 1]) / len(h["loss"][max(0, i - k + 1):i + 1])
              for i in range(len(h["loss"]))]
        a.plot(sm, label=name)
        b.plot(range(1, len(h["acc"]) + 1), [100 * v for v in h["acc"]], marker=".", label=name)
    a.set(xlabel="step", ylabel="training loss (10-step mean)", yscale="log", title="loss")
    b.set(xlabel="epoch", ylabel="test accuracy, %", title="accuracy")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--recipes", nargs="*", default=None, help="FP8 recipes (default: all this GPU supports)")
    p.add_argument("--plot", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = fp8vit.gpu_info()
    print(info.summary())
    data = load_digits(device)
    base = make_model(device, 32)
    results = {"bf16": train(base, data, recipe=None, fp8=False, epochs=a.epochs, batch=a.batch_size, lr=a.lr)}
    for r in a.recipes if a.recipes is not None else fp8vit.RECIPE_NAMES:
        ok, why = info.recipes[r]
        if not ok:
            print(f"fp8-{r}: not run: {why}")
            continue
        results[f"fp8-{r}"] = train(base, data, recipe=r, fp8=True, epochs=a.epochs, batch=a.batch_size, lr=a.lr)
    ref = results["bf16"]
    summary = {}
    print(f"\n{'variant':14s} {'final loss':>10s} {'test acc':>9s} {'gap vs bf16':>12s}")
    for name, h in results.items():
        final_loss = sum(h["loss"][-10:]) / len(h["loss"][-10:])
        gap = 100 * (h["acc"][-1] - ref["acc"][-1])
        summary[name] = {"final_loss": final_loss, "test_accuracy": h["acc"][-1], "gap_pct_points": gap}
        print(f"{name:14s} {final_loss:10.4f} {100 * h['acc'][-1]:8.2f}% {gap:+11.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": info.name, "epochs": a.epochs, "summary": summary, "history": results}, f)
    if a.plot:
        plot(results, a.plot, f"digits 32x32, ViT dim 192 depth 6, {a.epochs} epochs, {info.name}")


if __name__ == "__main__":
    main()
