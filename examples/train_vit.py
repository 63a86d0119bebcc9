"""Train a timm ViT with fp8vit: the FP8 ViT-Huge experiment as one clean script.

    python examples/train_vit.py                                   # ViT-H/16, FP8, synthetic data
    python examples/train_vit.py --precision bf16 --compile        # the timm baseline
    python examples/train_vit.py --model vit_base_patch16_224 --data /path/to/imagenet/train
    torchrun --nproc-per-node 2 examples/train_vit.py              # DDP, one process per GPU

On a machine without a GPU it trains a tiny ViT for a few steps and says why FP8 is off.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import fp8vit  # first: imports Transformer Engine before any cuDNN kernel runs
from fp8vit.workload import PRECISIONS, SIZES, build_model, make_optimizer, synthetic_batch, train_step_fn


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help=f"{sorted(SIZES)} or a timm ViT name (default: huge; micro on CPU)")
    p.add_argument("--precision", default="fp8", choices=PRECISIONS)
    p.add_argument("--recipe", default=None, choices=fp8vit.RECIPE_NAMES, help="FP8 recipe (default: the GPU's best)")
    p.add_argument("--batch-size", type=int, default=None, help="per GPU (default 128; 8 on CPU)")
    p.add_argument("--steps", type=int, default=None, help="default 100 (5 on CPU)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    p.add_argument("--lr", type=float, default=None, help="default 0.01 for SGD, 3e-4 for AdamW")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (timm bf16 only: "
                   "TE's delayed scaling does not run under torch.compile)")
    p.add_argument("--data", default=None, help="an image folder (class subfolders) read by timm's loader")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args()


def setup_distributed():
    """(rank, world, device) from torchrun's environment; a single process otherwise."""
    if "LOCAL_RANK" not in os.environ:
        return 0, 1, "cuda" if torch.cuda.is_available() else "cpu"
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    return dist.get_rank(), dist.get_world_size(), "cuda"


def batches(args, wl, device, world):
    """Endless (images, labels) batches: synthetic on the device, or timm's loader over --data."""
    if args.data is None:
        x, y = synthetic_batch(args.batch_size, wl, device=device)
        while True:
            yield x, y
    from timm.data import create_dataset, create_loader
    ds = create_dataset("", root=args.data, split="train", is_training=True)
    loader = create_loader(ds, input_size=(3, args.img_size, args.img_size), batch_size=args.batch_size,
                           is_training=True, num_workers=args.workers, distributed=world > 1,
                           use_prefetcher=device == "cuda", device=torch.device(device))
    while True:
        for x, y in loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def main():
    args = parse_args()
    rank, world, device = setup_distributed()
    cpu = device == "cpu"
    args.model = args.model or ("micro" if cpu else "huge")
    args.batch_size = args.batch_size or (8 if cpu else 128)
    args.steps = args.steps or (5 if cpu else 100)
    lr = args.lr or (0.01 if args.optimizer == "sgd" else 3e-4)
    if rank == 0:
        print(fp8vit.gpu_info().summary())

    torch.manual_seed(0)
    wl = build_model(args.model, precision=args.precision, recipe=args.recipe, img_size=args.img_size,
                     num_classes=args.num_classes, device=device)
    opt = make_optimizer(wl.model.parameters(), args.optimizer, lr=lr, device=device)
    net = wl.model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[torch.cuda.current_device()])
    if args.compile:
        if args.precision == "fp8":
            raise SystemExit("--compile with --precision fp8: TE's FP8 modules do not run under "
                             "torch.compile; use --precision bf16 --compile for the compiled baseline")
        net = torch.compile(net)
    step = train_step_fn(wl, opt, model=net)
    data = batches(args, wl, device, world)

    times, t_last = [], time.perf_counter()
    for i in range(1, args.steps + 1):
        x, y = next(data)
        loss = step(x, y)
        if i % args.log_every == 0 or i == args.steps:
            loss = float(loss)  # synchronizes
            now = time.perf_counter()
            dt = (now - t_last) / (args.log_every if i % args.log_every == 0 else i % args.log_every)
            t_last = now
            if i > args.log_every:  # the first interval includes warm-up
                times.append(dt)
            if rank == 0:
                print(f"step {i:5d}  loss {loss:.4f}  {dt * 1e3:7.1f} ms/step  "
                      f"{args.batch_size * world / dt:8.1f} img/s", flush=True)
    if rank == 0 and times:
        med = sorted(times)[len(times) // 2]
        ran = args.precision
        if ran == "fp8" and not fp8vit.fp8_support()[0]:
            ran = "fp8 requested, ran bf16: FP8 is off here"
        print(f"median after warm-up: {med * 1e3:.1f} ms/step, {args.batch_size * world / med:.1f} img/s "
              f"({world} process{'es' if world > 1 else ''}, {ran})")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
