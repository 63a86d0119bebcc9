"""Lever 53's numerics: FP8 backward GEMMs with fast accumulation against TE's split accumulator,
as ``fp8vit.diagnose`` measures them (SNR against the same model's bf16 pass), ViT-B/16 and ViT-L/16.

    python3 docs/perf/fast_accum_snr.py        # on the GPU machine, TE installed

Why: TE's forward FP8 GEMMs accumulate in the tensor cores alone ("fast accumulation"); its input-
and weight-gradient GEMMs promote the partial sums to fp32 as K runs (split accumulator), which
costs time. The weight gradient's K is the token count (batch 128 x 197 = 25216), the input
gradient's the layer width (768-4096): the longer K, the more a short accumulator loses.
Lever 53's bench variants (``-fastacc-``: both backward GEMMs, ``-fastdgrad-``: the input
gradient's only) time it; this script says what it costs in accuracy.

What: one converted timm model (random init, seed 0) and one synthetic batch of 128 with labels;
``diagnose`` (two delayed-scaling warm-up passes, then the measured FP8 pass against bf16) with
TE's default recipe and with the two fast variants. Per recipe: the logits' SNR, and over the
blocks the lowest and the median SNR of the weight gradients (``weight_grad_snr_db``: each block's
gradients in the FP8 run against the bf16 run) and of the block's own weight-gradient error
(``local_weight_grad_snr_db``, what ``diagnose``'s recommendation uses; floor 12 dB).

Prediction (written before the run): the input-gradient GEMMs alone lose < 0.5 dB anywhere; with
the weight-gradient GEMMs fast too, the weight-gradient SNRs drop 1-3 dB. Lever 53 is a default
only if they stay within 0.5 dB of TE's default.

Measured (H100, results/levers/fast_accum_snr_lever53_h100.log): fast dgrad within 0.05 dB of the
default everywhere; with wgrad too, the weight gradients' median 0.1-0.25 dB lower and each block's
own weight-gradient error 0.2 dB (ViT-B) and 1.0 dB (ViT-L, median 23.2 -> 22.2) lower; the logits
within 0.03 dB. Time (results/bench/vit_base_patch16_224_b128_lever53_h100.log, steps in turn):
ViT-B 29.3 ms, fast dgrad 29.0, both 28.9; ViT-L (results/bench/vit_large_patch16_224_b128_lever53_h100.log)
84.3 ms, fast dgrad 83.5 (both not timed there: four graphed ViT-L variants beside timm's did not
fit the H100's 80 GB). So fast dgrad is ``make_recipe("delayed")``'s default; both stays a variant.
"""

import statistics

import fp8vit  # noqa: F401  imports TE before torch runs a cuDNN kernel
import timm
import torch

from fp8vit._te.recipes import fast_backward_accumulation, make_recipe

MODELS = ("vit_base_patch16_224", "vit_large_patch16_224")
BATCH = 128


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("fast_accum_snr: needs a CUDA GPU with FP8 (compute capability 8.9 or later)")
    base = make_recipe("delayed")  # fast dgrad since lever 53: each row sets both GEMMs explicitly
    recipes = {"TE default (split)": fast_backward_accumulation(base, dgrad=False, wgrad=False),
               "fast dgrad": fast_backward_accumulation(base, wgrad=False),
               "fast dgrad + wgrad": fast_backward_accumulation(base)}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, timm {timm.__version__}, batch {BATCH}")
    for name in MODELS:
        torch.manual_seed(0)
        model = fp8vit.convert_to_te(timm.create_model(name, num_classes=1000).cuda().train())
        x = torch.randn(BATCH, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (BATCH,), device="cuda")
        print(f"\n{name}: dB against bf16 | logits | weight grads: min, median | own weight-grad error: min, median")
        for label, recipe in recipes.items():
            rep = fp8vit.diagnose(model, x, target=y, recipe=recipe)
            wg = [b.weight_grad_snr_db for b in rep.blocks]
            lw = [b.local_weight_grad_snr_db for b in rep.blocks]
            print(f"  {label:20s} {rep.output_snr_db:6.2f} | {min(wg):6.2f} {statistics.median(wg):6.2f} | "
                  f"{min(lw):6.2f} {statistics.median(lw):6.2f}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
