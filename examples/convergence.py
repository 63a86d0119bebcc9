"""Does FP8 train like bf16? Several seeds, paired differences, and a verdict.

    python examples/convergence.py --json digits.json --plot digits.png          # small ViT, 5 seeds
    python examples/convergence.py --setup vit-b --json vitb.json --plot vitb.png  # ViT-B geometry
    python examples/convergence.py --outlier-block 2 --json outlier.json         # diagnose demo
    python examples/convergence.py --outlier-block 0 1 2 3 4 5 --outlier-factor 1e7  # every block

Data: scikit-learn's bundled handwritten digits (1797 8x8 grey images, 10 classes; no download),
split 80/20 with a fixed seed and upsampled per batch to the setup's image size.

Setups:
  digits      ViT dim 192, depth 6, 3 heads, 32 px, patch 4 (65 tokens), batch 64, 690 steps (30 epochs)
  eva-digits  the same geometry with EVA02-L's block (timm ``Eva``: 2D RoPE on the patch tokens,
              SwiGLU with a norm before fc2, separate q/k/v projections with q and v biases),
              hidden 512: fp8vit's TE_EvaBlock
  vit-b       ViT-B/16 geometry: dim 768, depth 12, 12 heads, 224 px, patch 16 (197 tokens), batch 64,
              1000 steps
All: AdamW (lr 5e-4 digits, 3e-4 vit-b; weight decay 0.05), linear warm-up over 10% of the steps
then cosine decay to 0, gradient clipping at norm 1. At lr 2e-3 without warm-up the digits run
diverged in bf16 as often as in FP8 (docs/numerics.md), so it could not measure FP8.

Variants (each seed: the same initial weights and the same batch order for every variant):
  timm-bf16       timm's blocks under bf16 autocast: the baseline
  fp8vit-bf16     fp8vit's TE_Blocks with FP8 off: TE's kernels and tanh GELU, no FP8
  fp8-<recipe>    fp8vit's TE_Blocks in fp8_context(recipe), for every recipe this GPU runs
With ``--outlier-block K [K ...]`` every variant's blocks K get constructed activation outliers (below), and
``fp8-<recipe>-diagnosed`` adds the variant that runs ``fp8vit.diagnose`` on the first batch and
applies its recommendation (recommended blocks in bf16) before training.

Reported: mean and std over seeds of final test accuracy, test loss and train loss; per seed, the
paired difference from timm-bf16; a 95% t-interval of the mean paired difference; and a verdict on
whether the default recipe is within 1 accuracy point of bf16. "Tracking": the mean absolute gap
between a variant's and timm-bf16's seed-mean training-loss curves, against timm-bf16's own
seed-to-seed standard deviation at the same steps.

Runs are independent processes (``--workers``), so a GPU runs several small jobs at once.
"""

import argparse
import dataclasses
import json
import math
import statistics

import torch
import torch.nn.functional as F

import fp8vit  # first: imports Transformer Engine before any cuDNN kernel runs
from fp8vit.tools.cli import at_least


@dataclasses.dataclass(frozen=True)
class Setup:
    img: int
    patch: int
    dim: int
    depth: int
    heads: int
    batch: int
    steps: int
    lr: float
    seeds: int
    evals: int  # test-set evaluations over the run
    arch: str = "vit"  # "vit": timm's VisionTransformer; "eva": timm's Eva with EVA02-L's block options

    @property
    def warmup(self) -> int:
        return self.steps // 10


SETUPS = {
    "digits": Setup(img=32, patch=4, dim=192, depth=6, heads=3, batch=64, steps=690, lr=5e-4, seeds=5, evals=30),
    "eva-digits": Setup(img=32, patch=4, dim=192, depth=6, heads=3, batch=64, steps=690, lr=5e-4, seeds=5,
                        evals=30, arch="eva"),
    "vit-b": Setup(img=224, patch=16, dim=768, depth=12, heads=12, batch=64, steps=1000, lr=3e-4, seeds=2, evals=10),
}


# ----------------------------------------------------------------------------------- data, model
def load_digits(device, seed=0):
    """(x_train, y_train, x_test, y_test): images [N, 1, 8, 8] standardized, labels [N]."""
    from sklearn.datasets import load_digits as sk_digits
    d = sk_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [N, 1, 8, 8] in [0, 1]
    x = (x - x.mean()) / x.std()
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    tr, te = perm[:int(0.8 * len(y))], perm[int(0.8 * len(y)):]
    return x[tr].to(device), y[tr].to(device), x[te].to(device), y[te].to(device)


def images(x, size):
    """[B, 1, 8, 8] -> [B, 3, size, size] (bilinear), done per batch to keep memory small."""
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).expand(-1, 3, -1, -1)


def make_model(s: Setup, seed: int, device):
    torch.manual_seed(seed)
    if s.arch == "eva":
        from timm.models.eva import Eva
        grid = s.img // s.patch
        return Eva(img_size=s.img, patch_size=s.patch, embed_dim=s.dim, depth=s.depth, num_heads=s.heads,
                   num_classes=10, mlp_ratio=4 * 2 / 3, qkv_fused=False, swiglu_mlp=True, scale_mlp=True,
                   use_rot_pos_emb=True, ref_feat_shape=(grid, grid)).to(device)  # eva02_large_patch14_224's block
    from timm.models.vision_transformer import VisionTransformer
    return VisionTransformer(img_size=s.img, patch_size=s.patch, embed_dim=s.dim, depth=s.depth,
                             num_heads=s.heads, num_classes=10, qkv_bias=True).to(device)


def add_outliers(model, block: int, factor: float = 1e5, channels=(0, 1)):
    """Give block ``block``'s MLP input a few channels ``factor`` times larger than the rest.

    LayerNorm's gain on ``channels`` is multiplied by ``factor`` and fc1's matching input columns
    (both of SwiGLU's fc1 halves) divided by it: the same function in exact arithmetic, but
    per-tensor FP8 scaling of fc1's input now pushes every other channel towards E4M3's
    subnormals. These tensors are frozen so that the outliers persist during training, as outlier
    features in trained models do.
    """
    blk = model.blocks[block]
    fc1s = [getattr(blk.mlp, n) for n in ("fc1", "fc1_g", "fc1_x") if hasattr(blk.mlp, n)]
    with torch.no_grad():
        for c in channels:
            blk.norm2.weight[c] *= factor
            blk.norm2.bias[c] *= factor
            for fc1 in fc1s:
                fc1.weight[:, c] /= factor
    for p in (blk.norm2.weight, blk.norm2.bias, *(fc1.weight for fc1 in fc1s)):
        p.requires_grad_(False)


# ----------------------------------------------------------------------------------- training
def parse_variant(variant):
    """-> (convert to TE, FP8 recipe or None, apply diagnose's recommendation)."""
    if variant == "timm-bf16":
        return False, None, False
    if variant == "fp8vit-bf16":
        return True, None, False
    if variant.startswith("fp8-"):
        recipe = variant[4:].removesuffix("-diagnosed")
        return True, recipe, variant.endswith("-diagnosed")
    raise ValueError(f"unknown variant {variant!r}: timm-bf16, fp8vit-bf16, fp8-<recipe>[-diagnosed]")


@torch.no_grad()
def evaluate(model, s, x, y, recipe):
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(y), 256):
        with fp8vit.fp8_context(recipe, enabled=recipe is not None):
            out = model(images(x[i:i + 256], s.img)).float()
        correct += int((out.argmax(-1) == y[i:i + 256]).sum())
        loss += float(F.cross_entropy(out, y[i:i + 256], reduction="sum"))
    model.train()
    return correct / len(y), loss / len(y)


def run_job(job):
    """Train one (setup, variant, seed); returns its history. Runs in a worker process."""
    setup_name, s, variant, seed, outlier_blocks, outlier_factor = job
    device = "cuda" if torch.cuda.is_available() else "cpu"
    convert, recipe, diagnosed = parse_variant(variant)
    x, y, xt, yt = load_digits(device)
    model = make_model(s, seed, device)
    for b in outlier_blocks:
        add_outliers(model, b, outlier_factor)
    info = {}
    if convert:
        fp8vit.convert_to_te(model)
    if diagnosed:
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(len(y), generator=g)[:s.batch].to(device)
        report = fp8vit.diagnose(model, images(x[idx], s.img), target=y[idx], recipe=recipe)
        info["recommend_bf16"] = report.apply(model)
        info["output_snr_db_before"] = report.output_snr_db
        info["output_snr_db_after"] = fp8vit.diagnose(model, images(x[idx], s.img), target=y[idx],
                                                      recipe=recipe).output_snr_db
        print(report.table(), flush=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.05)
    def lr_factor(t):  # linear warm-up, then cosine decay to 0
        if t < s.warmup:
            return (t + 1) / s.warmup
        return 0.5 * (1 + math.cos(math.pi * (t - s.warmup) / max(1, s.steps - s.warmup)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    g = torch.Generator().manual_seed(seed)  # batch order: the same for every variant of a seed
    hist = {"setup": setup_name, "variant": variant, "seed": seed, "loss": [], "eval_step": [],
            "test_acc": [], "test_loss": [], **info}
    eval_every = max(1, s.steps // s.evals)
    perm, pos = torch.randperm(len(y), generator=g), 0
    for step in range(1, s.steps + 1):
        if pos + s.batch > len(y):  # a new epoch; the last partial batch is dropped
            perm, pos = torch.randperm(len(y), generator=g), 0
        idx = perm[pos:pos + s.batch].to(device)
        pos += s.batch
        with fp8vit.fp8_context(recipe, enabled=recipe is not None):
            loss = F.cross_entropy(model(images(x[idx], s.img)).float(), y[idx])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        hist["loss"].append(float(loss.detach()))
        if step % eval_every == 0 or step == s.steps:
            acc, tl = evaluate(model, s, xt, yt, recipe)
            hist["eval_step"].append(step)
            hist["test_acc"].append(acc)
            hist["test_loss"].append(tl)
    print(f"{setup_name} {variant:24s} seed {seed}: test acc {100 * hist['test_acc'][-1]:.2f}%, "
          f"test loss {hist['test_loss'][-1]:.4f}", flush=True)
    return hist


# ----------------------------------------------------------------------------------- statistics
def smooth(v, k):
    """Trailing mean over ``k`` values."""
    out, acc = [], 0.0
    for i, a in enumerate(v):
        acc += a - (v[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def t95(n):
    """Two-sided 95% Student-t quantile for ``n`` paired differences (``n - 1`` dof)."""
    from scipy.stats import t  # scipy comes with scikit-learn
    return float(t.ppf(0.975, n - 1)) if n > 1 else float("inf")


def summarize(runs, s: Setup, default_recipe):
    """Per-variant statistics, paired differences vs timm-bf16 and the verdict."""
    by = {}
    for h in runs:
        by.setdefault(h["variant"], {})[h["seed"]] = h
    base = by["timm-bf16"]
    k = max(1, s.steps // 20)  # smoothing window for the loss curves
    curves = {v: {seed: smooth(h["loss"], k) for seed, h in hs.items()} for v, hs in by.items()}
    start = s.warmup  # compare curves after warm-up
    base_sd = [statistics.stdev(c[i] for c in curves["timm-bf16"].values()) if len(base) > 1 else 0.0
               for i in range(start, s.steps)]
    base_mean = [statistics.fmean(c[i] for c in curves["timm-bf16"].values()) for i in range(start, s.steps)]
    out = {}
    for v, hs in by.items():
        finals = {
            "test_acc": [100 * h["test_acc"][-1] for h in hs.values()],
            "test_loss": [h["test_loss"][-1] for h in hs.values()],
            "train_loss": [statistics.fmean(h["loss"][-k:]) for h in hs.values()],
        }
        row = {m: {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                   "per_seed": vals} for m, vals in finals.items()}
        seeds = sorted(set(hs) & set(base))
        diff = [100 * (hs[i]["test_acc"][-1] - base[i]["test_acc"][-1]) for i in seeds]
        dloss = [hs[i]["test_loss"][-1] - base[i]["test_loss"][-1] for i in seeds]
        if v != "timm-bf16" and diff:
            m = statistics.fmean(diff)
            half = t95(len(diff)) * (statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else float("inf"))
            row["paired_acc_diff"] = {"per_seed": diff, "mean": m, "ci95": [m - half, m + half]}
            row["paired_test_loss_diff"] = {"per_seed": dloss, "mean": statistics.fmean(dloss)}
            mean = [statistics.fmean(c[i] for c in curves[v].values()) for i in range(start, s.steps)]
            row["tracking"] = {"mean_abs_gap": statistics.fmean(abs(a - b) for a, b in zip(mean, base_mean)),
                               "timm_bf16_seed_sd": statistics.fmean(base_sd)}
        for h in hs.values():
            if "recommend_bf16" in h:
                row.setdefault("diagnose", []).append({k2: h[k2] for k2 in (
                    "recommend_bf16", "output_snr_db_before", "output_snr_db_after")})
        out[v] = row
    verdict = None
    d = out.get(f"fp8-{default_recipe}", {}).get("paired_acc_diff")
    if d:
        lo, hi = d["ci95"]
        n = len(d["per_seed"])
        answer = ("yes" if -1 <= lo and hi <= 1 else "no" if hi < -1 or lo > 1
                  else f"inconclusive with {n} seeds (the interval is wider than +-1 point)")
        verdict = (f"default recipe fp8-{default_recipe} within 1 point of timm bf16: {answer}; mean paired "
                   f"accuracy difference {d['mean']:+.2f} points, 95% CI [{lo:+.2f}, {hi:+.2f}], {n} seeds")
    return out, verdict


def print_summary(out, verdict, s):
    print(f"\n{'variant':26s} {'test acc % (mean+-std)':>23s} {'test loss':>16s} {'train loss':>16s} "
          f"{'paired acc diff (95% CI)':>30s} {'loss-curve gap / bf16 seed sd':>30s}")
    for v, r in out.items():
        acc, tl, trl = r["test_acc"], r["test_loss"], r["train_loss"]
        line = (f"{v:26s} {acc['mean']:13.2f} +- {acc['std']:5.2f} {tl['mean']:8.4f}+-{tl['std']:.4f} "
                f"{trl['mean']:8.4f}+-{trl['std']:.4f}")
        if "paired_acc_diff" in r:
            d, t = r["paired_acc_diff"], r["tracking"]
            line += (f" {d['mean']:+8.2f} [{d['ci95'][0]:+6.2f}, {d['ci95'][1]:+6.2f}]"
                     f" {t['mean_abs_gap']:12.4f} / {t['timm_bf16_seed_sd']:.4f}")
        print(line)
        for seed_diag in r.get("diagnose", [])[:1]:
            print(f"{'':26s} diagnose: bf16 for {seed_diag['recommend_bf16']}; model-output SNR "
                  f"{seed_diag['output_snr_db_before']:.1f} dB -> {seed_diag['output_snr_db_after']:.1f} dB")
    for v, r in out.items():
        if "paired_acc_diff" in r:
            print(f"  {v:24s} per-seed accuracy difference vs timm-bf16: "
                  + ", ".join(f"{x:+.2f}" for x in r["paired_acc_diff"]["per_seed"]))
    if verdict:
        print("VERDICT:", verdict)


def plot(runs, s: Setup, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    k = max(1, s.steps // 20)
    for v in dict.fromkeys(h["variant"] for h in runs):
        hs = [h for h in runs if h["variant"] == v]
        for ax, xs, series in ((a, range(1, s.steps + 1), [smooth(h["loss"], k) for h in hs]),
                               (b, hs[0]["eval_step"], [[100 * q for q in h["test_acc"]] for h in hs])):
            cols = list(zip(*series))
            mean = [statistics.fmean(c) for c in cols]
            line, = ax.plot(list(xs), mean, label=f"{v} ({len(hs)} seeds)")
            ax.fill_between(list(xs), [min(c) for c in cols], [max(c) for c in cols], alpha=0.2,
                            color=line.get_color())
    a.set(xlabel="step", ylabel=f"training loss ({k}-step mean)", yscale="log", title="loss: seed mean, min-max band")
    b.set(xlabel="step", ylabel="test accuracy, %", title="accuracy: seed mean, min-max band")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", default="digits", choices=sorted(SETUPS))
    p.add_argument("--seeds", type=at_least(1, "seeds"), default=None, help="seeds (default: the setup's)")
    p.add_argument("--steps", type=at_least(1, "training steps"), default=None, help="training steps (default: the setup's)")
    p.add_argument("--evals", type=at_least(1, "evaluations"), default=None,
                   help="test-set evaluations over the run, the last after the final step (default: the setup's)")
    p.add_argument("--variants", nargs="*", default=None,
                   help="default: timm-bf16, fp8vit-bf16 and fp8-<recipe> for each recipe this GPU runs")
    p.add_argument("--outlier-block", type=int, nargs="+", default=[],
                   help="construct activation outliers in these blocks and add fp8-<default>-diagnosed")
    p.add_argument("--outlier-factor", type=float, default=1e5,
                   help="how much larger the outlier channels are (1e5: the rest reach E4M3's subnormals)")
    p.add_argument("--workers", type=at_least(1, "processes"), default=None, help="parallel processes (default: 8 on a GPU, 1 on CPU)")
    p.add_argument("--plot", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    s = SETUPS[a.setup]
    s = dataclasses.replace(s, seeds=a.seeds or s.seeds, steps=a.steps or s.steps, evals=a.evals or s.evals)
    info = fp8vit.gpu_info()
    print(info.summary())
    for b in a.outlier_block:
        if not 0 <= b < s.depth:
            p.error(f"--outlier-block {b}: the model has blocks 0..{s.depth - 1}")
    variants = a.variants
    if variants is None:
        variants = ["timm-bf16", "fp8vit-bf16"]
        for r in fp8vit.RECIPE_NAMES:
            ok, why = info.recipes[r]
            if ok:
                variants.append(f"fp8-{r}")
            else:
                print(f"fp8-{r}: not run: {why}")
        if a.outlier_block and info.default_recipe:
            variants.append(f"fp8-{info.default_recipe}-diagnosed")
    for v in variants:
        try:
            parse_variant(v)  # fail before any training
        except ValueError as err:
            p.error(str(err))
    if "timm-bf16" not in variants:
        p.error("--variants must include timm-bf16: every comparison is paired against it")
    jobs = [(a.setup, s, v, seed, tuple(a.outlier_block), a.outlier_factor) for seed in range(s.seeds) for v in variants]
    workers = a.workers or (min(8, len(jobs)) if torch.cuda.is_available() else 1)
    if workers > 1:
        import torch.multiprocessing as mp
        with mp.get_context("spawn").Pool(workers) as pool:
            runs = pool.map(run_job, jobs, chunksize=1)
    else:
        runs = [run_job(j) for j in jobs]
    out, verdict = summarize(runs, s, info.default_recipe)
    print_summary(out, verdict, s)
    title = (f"{a.setup}: {'EVA' if s.arch == 'eva' else 'ViT'} dim {s.dim}, depth {s.depth}, "
             f"{(s.img // s.patch) ** 2 + 1} tokens, {s.steps} steps"
             + (f", outliers x{a.outlier_factor:g} in block {', '.join(map(str, a.outlier_block))}" if a.outlier_block else "") + f"; {info.name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": info.name, "setup": dataclasses.asdict(s), "setup_name": a.setup,
                       "outlier_blocks": a.outlier_block, "outlier_factor": a.outlier_factor if a.outlier_block else None, "summary": out, "verdict": verdict, "runs": runs}, f)
    if a.plot:
        plot(runs, s, a.plot, title)


if __name__ == "__main__":
    main()
