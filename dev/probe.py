"""What the GPU probes dev/step_timeline.py and dev/host_costs.py share: their command line (model,
batch, image size, variant, steps) and the bench's workload built from it (model, fused SGD, one
synthetic batch), as fp8vit-bench builds it."""

import argparse
import warnings

import torch

from fp8vit.tools.workload import build_workload, make_optimizer, synthetic_batch


def parse_args(doc: str, tool: str, steps: int, why: str, **more: int) -> argparse.Namespace:
    """The probe's arguments (``more``: further integer options and their defaults); exits where no
    CUDA GPU is visible, saying ``why`` the probe needs one."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--variant", default="fp8vit-fp8-delayed-graphed")
    p.add_argument("--steps", type=int, default=steps)
    for flag, default in more.items():
        p.add_argument(f"--{flag}", type=int, default=default)
    a = p.parse_args()
    warnings.simplefilter("ignore")  # conversion notes: the probe's table is its output
    if not torch.cuda.is_available():
        raise SystemExit(f"{tool}: needs a CUDA GPU ({why})")
    return a


def build(a: argparse.Namespace):
    """``(workload, optimizer, images, labels)`` for the parsed arguments, seeded as the bench is."""
    torch.manual_seed(0)
    wl = build_workload(a.model, a.variant, batch_size=a.batch_size, img_size=a.img_size)
    opt = make_optimizer(wl.model.parameters(), "sgd", lr=1e-3)
    x, y = synthetic_batch(a.batch_size, wl)
    return wl, opt, x, y
