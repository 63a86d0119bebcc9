"""``fp8vit-diagnose``: per-block FP8 diagnosis of a randomly initialised timm ViT on a synthetic batch.

    fp8vit-diagnose --model base --batch-size 32 --json report.json

Prints :meth:`fp8vit.DiagnosisReport.table`; when blocks are recommended to stay in bf16, applies
the recommendation and prints the model-output SNR with and without it.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..training.diagnostics import diagnose
from ..errors import FP8UnavailableError
from .cli import IMAGE_SIDE, at_least
from .workload import SIZES, build_workload, synthetic_batch

__all__ = ["main"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fp8vit-diagnose", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="base", help=f"{sorted(SIZES)} or a timm model name")
    p.add_argument("--batch-size", type=at_least(1, "images"), default=32)
    p.add_argument("--img-size", type=IMAGE_SIDE, default=224)
    p.add_argument("--recipe", default=None, help="FP8 recipe name (default: the GPU's best)")
    p.add_argument("--threshold", type=float, default=20.0, help="local activation SNR floor, dB")
    p.add_argument("--grad-threshold", type=float, default=12.0, help="weight-gradient SNR floor, dB")
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    wl = build_workload(a.model, "fp8vit-bf16", img_size=a.img_size, device=device)
    x, y = synthetic_batch(a.batch_size, wl, device=device)
    kw = dict(target=y, recipe=a.recipe, threshold_db=a.threshold, grad_threshold_db=a.grad_threshold)
    try:
        rep = diagnose(wl.model.eval(), x, **kw)
    except FP8UnavailableError as err:
        print(f"fp8vit-diagnose: {err}", file=sys.stderr)
        return 1
    print(rep.table())
    if rep.recommend_bf16:
        # Evidence that the recommendation matters: the same pass with those blocks in bf16.
        rep.apply(wl.model)
        after = diagnose(wl.model, x, **kw)
        print(f"model output SNR vs bf16: {rep.output_snr_db:.1f} dB with FP8 in every block, "
              f"{after.output_snr_db:.1f} dB with {', '.join(rep.recommend_bf16)} in bf16")
    if a.json:
        with open(a.json, "w") as f:
            f.write(rep.to_json(indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
