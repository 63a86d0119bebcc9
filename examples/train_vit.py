"""Train a timm ViT in FP8 with fp8vit: the plain training loop, ready to copy.

    python examples/train_vit.py                                        # ViT-B/16, FP8, CUDA-graphed, synthetic data
    python examples/train_vit.py --eager                                # the same without CUDA graphs
    python examples/train_vit.py --model vit_huge_patch14_224
    python examples/train_vit.py --data /path/to/imagenet/train --epochs 1 --checkpoint ckpt.pt
    python examples/train_vit.py --checkpoint ckpt.pt --resume          # continue where it stopped
    torchrun --nproc-per-node 2 examples/train_vit.py                   # DDP, one process per GPU
    torchrun --nproc-per-node 8 examples/train_vit.py --fsdp --model vit_giant_patch14_224   # FSDP2
    torchrun --nproc-per-node 8 examples/train_vit.py --fsdp --fp8-weights ...   # + FP8 all-gathers

The fp8vit lines are marked ``# fp8vit``; everything else is an ordinary PyTorch loop. On a machine
without an FP8 GPU it trains a tiny ViT in bf16 autocast and says why FP8 is off. The printed
ms/step and img/s are GPU time, read once the GPU has finished the steps (``train_epoch``).

On an FP8 GPU the blocks run as CUDA graphs (``fp8vit.make_graphed_blocks``): every batch has the
same shape (synthetic data; an image folder's loader drops the last, smaller batch), and eager FP8
is slower than timm bf16 at ViT-B (the README's table); ``--eager`` turns the graphs off. The run
prints which path it takes and why. A checkpoint is written so that a process killed while saving
leaves the previous one loadable (``save_atomically``; ``fp8vit.save_checkpoint`` with ``--fsdp``).
"""

import argparse
import glob
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fp8vit  # fp8vit: import first, so Transformer Engine loads before any cuDNN kernel runs
import timm
from fp8vit.tools.cli import IMAGE_SIDE, RECOMPUTE_EVERY, at_least, more_than
from fp8vit.tools.timing import Stopwatch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a timm ViT name (default vit_base_patch16_224; "
                   "vit_tiny_patch16_224 at 32 px on CPU)")
    p.add_argument("--recipe", default=None, choices=fp8vit.RECIPE_NAMES, help="FP8 recipe (default: the GPU's best)")
    p.add_argument("--no-fp8", action="store_true", help="the timm bf16 baseline: no conversion, no FP8")
    graphs = p.add_mutually_exclusive_group()
    graphs.add_argument("--cuda-graphs", action="store_true", help="capture the blocks as CUDA graphs (fp8vit."
                        "make_graphed_blocks) whatever the other options, or stop saying why not. The default "
                        "where FP8 runs, without --fsdp, --no-fp8 or --fp8-weights: much faster below ViT-H, "
                        "where an eager step is launch-bound")
    graphs.add_argument("--eager", action="store_true", help="run the blocks eagerly, not as CUDA graphs "
                        "(e.g. to compare, or for a batch whose shape changes)")
    p.add_argument("--cudnn-layernorm", action="store_true", help="run TE's LayerNorm on cuDNN's kernels "
                   "(when the blocks are CUDA-graphed: in the graphs only): -4%% step time at ViT-H, none at ViT-B/L")
    p.add_argument("--mlp-recompute", type=RECOMPUTE_EVERY, nargs="?", const=1, default=0, metavar="K",
                   help="recompute the MLP activations in backward in every K-th block (fp8vit."
                   "set_mlp_recompute; K defaults to 1, all blocks). ViT-H on an H200, CUDA-graphed: "
                   "K=1 fits 2.4x timm bf16's batch for +10%% step time, K=2 1.63x for +5%%")
    p.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and optimizer state over "
                   "the processes with FSDP2, one unit per block (fp8vit.shard_model; bf16 compute) instead of "
                   "DDP; --checkpoint is then a folder (torch.distributed.checkpoint)")
    p.add_argument("--fp8-weights", action="store_true", help="keep the blocks' GEMM weights in FP8 only "
                   "(fp8vit.fp8_weight_init) and train them with TE's FusedAdam on fp32 master weights "
                   "(fp8vit.fp8_weight_optimizer); with --fsdp, FSDP2 all-gathers them in FP8. Per-tensor "
                   "recipes only: delayed (Hopper's default) or current")
    p.add_argument("--price-per-hour", type=more_than(0, "a GPU's price per hour"), default=None, metavar="USD",
                   help="the price of one GPU per hour: the summary adds the cost of 1M images")
    p.add_argument("--batch-size", type=at_least(1, "images per GPU and step"), default=None, help="per GPU (default 128; 8 on CPU)")
    p.add_argument("--img-size", type=IMAGE_SIDE, default=None, help="default: the model's (32 on CPU)")
    p.add_argument("--num-classes", type=at_least(1, "classes"), default=1000)
    p.add_argument("--epochs", type=at_least(1, "epochs"), default=1)
    p.add_argument("--steps", type=at_least(1, "training steps"), default=None, help="stop after this many steps (default: 100 "
                   "with synthetic data, 5 on CPU; all epochs with --data)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", default=None, help="an image folder (class subfolders); default synthetic")
    p.add_argument("--workers", type=at_least(0, "data-loading processes"), default=8)
    p.add_argument("--checkpoint", default=None, help="save model, optimizer and step here after each epoch: "
                   "a file, or with --fsdp a folder; a save killed halfway leaves the previous one")
    p.add_argument("--resume", action="store_true", help="load --checkpoint first (with --fsdp: the newest "
                   "complete save in the folder)")
    p.add_argument("--log-every", type=at_least(1, "steps between lines"), default=None, help="print a step line every this many steps, "
                   "and after the last (default 10, or fewer so that a short run prints about five)")
    args = p.parse_args(argv)
    if args.fp8_weights and args.no_fp8:
        p.error("--fp8-weights with --no-fp8: FP8 weights are fp8vit's blocks' weights; drop one of the two")
    if args.fsdp and args.cuda_graphs:
        p.error(f"--fsdp with --cuda-graphs: {fp8vit.training.distributed.WHY_NOT_WITH_FSDP2}")
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint, the checkpoint to resume from")
    return args


def graphs_or_why_not(args, device, fp8_runs):
    """Whether to capture the blocks as CUDA graphs, and the line that says so.

    The default, where FP8 runs on a GPU: graphed (every batch has the captured shape: synthetic
    data, or a loader that drops the last batch), since an eager FP8 step below ViT-H is
    host-bound. Eager: ``--eager``; FSDP2 (it cannot shard graphed blocks); ``--no-fp8``, timm's
    bf16 baseline as the README's speedups measure it; ``--fp8-weights``, not yet run graphed; and
    no FP8 here. ``--cuda-graphs`` graphs whatever the rest, or stops with the reason.
    """
    if args.eager:
        return False, "eager (--eager)"
    if args.cuda_graphs:
        return True, "CUDA-graphed blocks (--cuda-graphs)"
    if device.type != "cuda":
        return False, "eager: CUDA graphs need a GPU"
    why = ("FSDP2 (--fsdp) cannot shard CUDA-graphed blocks" if args.fsdp else
           "--no-fp8 is timm's bf16 baseline, run as it comes (--cuda-graphs graphs it)" if args.no_fp8 else
           "FP8 primary weights (--fp8-weights) have not been run with CUDA graphs (--cuda-graphs tries)"
           if args.fp8_weights else
           "FP8 is off here (--cuda-graphs graphs the blocks in bf16)" if not fp8_runs else None)
    if why:
        return False, f"eager: {why}"
    return True, "CUDA-graphed blocks (the default on an FP8 GPU; --eager runs them eagerly)"


def save_atomically(obj, path):
    """``torch.save(obj, path)`` such that ``path`` holds a complete checkpoint at every instant: a
    process killed while saving (a preemption, an OOM kill, a node failure) leaves the previous
    file, not a truncated one.

    Written beside it (``<path>.tmp-<pid>``), fsynced, then renamed over it (``os.replace`` is
    atomic) and the folder fsynced, so that the rename survives a power loss too. Files that killed
    saves left beside it are removed.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):  # Windows cannot open a folder to fsync it
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for stale in glob.glob(glob.escape(path) + ".tmp-*"):
        os.remove(stale)


def default_log_every(steps):
    """Every 10 steps, or often enough that a run of ``steps`` steps prints about five step lines."""
    return max(1, min(10, steps // 5))


def setup_distributed():
    """(rank, world, device) from torchrun's environment (NCCL on GPUs, gloo on CPUs); one process otherwise."""
    cuda = torch.cuda.is_available()
    if "LOCAL_RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda" if cuda else "cpu")


def make_loader(args, device, world):
    """timm's loader over --data, or the same number of synthetic batches per epoch."""
    if args.data is None:
        g = torch.Generator(device).manual_seed(0)
        x = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=device, generator=g)
        y = torch.randint(0, args.num_classes, (args.batch_size,), device=device, generator=g)
        return [(x, y)] * (args.steps or 100)
    from timm.data import create_dataset, create_loader
    ds = create_dataset("", root=args.data, split="train", is_training=True)
    # is_training drops the last, smaller batch (timm: drop_last=is_training): every batch has the
    # shape the CUDA graphs were captured for, so none runs eagerly.
    return create_loader(ds, input_size=(3, args.img_size, args.img_size), batch_size=args.batch_size,
                         is_training=True, num_workers=args.workers, distributed=world > 1,
                         use_prefetcher=False)


def train_epoch(net, opt, batches, *, device, recipe=None, fp8=True, epoch=0, step=0, max_steps=None,
                log_every=10, images_per_step, log=print):
    """One pass over ``batches`` (or up to step ``max_steps``), with a step line every ``log_every``
    steps and one after the last step.

    A line's ms/step and img/s are GPU time over the steps since the previous line: a CUDA kernel
    launch returns before the kernel runs, so the clock is read only once the GPU has finished
    those steps (:class:`fp8vit.tools.timing.Stopwatch`), never when the host has merely queued them.

    Args:
        net: the model (or its DDP wrapper).
        opt: its optimizer.
        batches: ``(images, labels)`` pairs.
        device: where the model runs.
        recipe: the FP8 recipe name (None: the GPU's best).
        fp8: run FP8 (False: bf16 autocast only).
        epoch: the epoch number, for the step lines.
        step: steps done before this call.
        max_steps: stop after this step (None: the whole of ``batches``).
        log_every: step-line interval.
        images_per_step: images of one step over all processes, for img/s.
        log: prints a step line; None: no lines and no timing (e.g. on DDP ranks other than 0).

    Returns:
        ``(step, loss, readouts)``: the last step, its loss (detached), and per step line a dict
        with ``step``, ``loss``, ``steps`` (the steps it timed), ``ms_per_step`` and ``images_per_s``.
    """
    watch = Stopwatch(device).start()
    loss, seen, readouts = torch.tensor(float("nan")), 0, []

    def readout():
        ms = watch.lap_ms() / seen  # waits for the GPU: GPU time, not the host's queueing speed
        r = {"step": step, "loss": loss.item(), "steps": seen, "ms_per_step": ms,
             "images_per_s": images_per_step / ms * 1e3}
        log(f"epoch {epoch} step {step:6d}  loss {r['loss']:.4f}  {ms:7.1f} ms/step  "
            f"{r['images_per_s']:8.1f} img/s")
        readouts.append(r)

    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with fp8vit.fp8_context(recipe, enabled=fp8):  # fp8vit: bf16 autocast + FP8
            loss = F.cross_entropy(net(x), y)
        loss.backward()
        loss = loss.detach()  # logged later: no autograd graph, no "requires_grad to a scalar" warning
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, seen = step + 1, seen + 1
        done = max_steps is not None and step >= max_steps
        if log is not None and (step % log_every == 0 or done):
            readout()
            seen = 0
        if done:
            break
    if log is not None and seen:  # the epoch ended between two lines: its last steps get one too
        readout()
    return step, loss, readouts


def steady_state(readouts, images_per_step, price_per_hour=None):
    """The step time over the step lines after the first, whose interval holds the warm-up (TE's
    kernel selection, the first CUDA-graph replay, the allocator growing), as one line ("" if none).

    Args:
        price_per_hour: what all the GPUs of the run cost per hour: the line adds the cost of 1M
            images at that throughput.
    """
    rest = readouts[1:]
    if not rest:
        return ""
    n = sum(r["steps"] for r in rest)
    ms = sum(r["ms_per_step"] * r["steps"] for r in rest) / n
    first = rest[0]["step"] - rest[0]["steps"] + 1
    images_per_s = images_per_step / ms * 1e3
    cost = f", ${price_per_hour / 3600 / images_per_s * 1e6:.2f} per 1M images" if price_per_hour else ""
    return (f"steps {first}-{rest[-1]['step']}: {ms:.1f} ms/step, {images_per_s:.1f} img/s{cost} "
            f"(the {readouts[0]['steps']} step(s) before are left out: warm-up)")


def main(argv=None):
    """Train as the arguments say; returns the distributed backend it ran under (None: one process)."""
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    cpu = device.type == "cpu"
    args.model = args.model or ("vit_tiny_patch16_224" if cpu else "vit_base_patch16_224")
    args.batch_size = args.batch_size or (8 if cpu else 128)
    args.steps = args.steps or (5 if cpu else None)
    if rank == 0:
        print(fp8vit.gpu_info().summary())

    torch.manual_seed(0)
    kw = {"img_size": args.img_size or 32} if cpu or args.img_size else {}
    model = timm.create_model(args.model, num_classes=args.num_classes, **kw).to(device)
    args.img_size = model.patch_embed.img_size[0]
    use_fp8 = not args.no_fp8
    if use_fp8 and args.fp8_weights:
        try:  # fp8vit: the TE modules built inside hold their GEMM weights in FP8 only
            with fp8vit.fp8_weight_init(args.recipe):
                fp8vit.convert_to_te(model)
        except (ValueError, fp8vit.FP8UnavailableError) as err:
            raise SystemExit(f"--fp8-weights: {err}") from err
    elif use_fp8:
        fp8vit.convert_to_te(model)  # fp8vit: timm Blocks -> TE_Blocks, same weights
    if args.mlp_recompute:
        if not use_fp8:
            raise SystemExit("--mlp-recompute needs fp8vit's blocks: drop --no-fp8")
        k = args.mlp_recompute
        fp8vit.set_mlp_recompute(model, every=k)
        n = sum(b.recompute_mlp for b in model.blocks)
        if rank == 0:  # once, not once per process
            print(f"MLP recompute: {n} of {len(model.blocks)} blocks (every {k})")
    if args.cudnn_layernorm and not use_fp8:
        raise SystemExit("--cudnn-layernorm needs fp8vit's blocks: drop --no-fp8")
    fp8_runs = use_fp8 and fp8vit.fp8_support()[0]
    graphed, how = graphs_or_why_not(args, device, fp8_runs)
    if args.cudnn_layernorm and not graphed:
        fp8vit.set_cudnn_layernorm(True)  # process-wide
    if args.fsdp:
        fp8vit.shard_model(model)  # fp8vit: FSDP2 per block, before the optimizer (it must see the shards)
    if args.fp8_weights:  # fp8vit: an update to an FP8 weight needs an fp32 master copy to land in
        opt = fp8vit.fp8_weight_optimizer(model.parameters(), lr=args.lr, weight_decay=0.01)  # AdamW's default
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=not cpu)

    step = epoch0 = 0
    if args.resume:
        if args.fsdp:  # every rank reads its shards; FP8 scaling state included
            source = fp8vit.latest_checkpoint(args.checkpoint)  # fp8vit: the newest complete save in the folder
            extra = fp8vit.load_checkpoint(source, model, opt)
            step, epoch0 = extra["step"], extra["epoch"] + 1
        else:
            source = args.checkpoint  # always complete: save_atomically
            ckpt = torch.load(source, map_location=device, weights_only=True)  # no pickles inside
            model.load_state_dict(ckpt["model"])  # FP8 scaling state included
            opt.load_state_dict(ckpt["optimizer"])
            step, epoch0 = ckpt["step"], ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from {source} at step {step}, epoch {epoch0}")
    if graphed:
        try:  # fp8vit: capture the blocks once (after conversion and resume, before DDP)
            fp8vit.make_graphed_blocks(model, args.batch_size, recipe=args.recipe, fp8=fp8_runs,
                                       cudnn_layernorm=args.cudnn_layernorm)
        except (ValueError, fp8vit.FP8UnavailableError) as err:
            if args.cuda_graphs:
                raise SystemExit(f"--cuda-graphs: {err}") from err
            graphed, how = False, f"eager: {err}"  # e.g. MLP recompute of an unfused MLP
            if args.cudnn_layernorm:
                fp8vit.set_cudnn_layernorm(True)
    if rank == 0:
        print(f"blocks: {how}")
    ddp = world > 1 and not args.fsdp
    net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.index is not None
                                                    else None) if ddp else model
    loader = make_loader(args, device, world)
    log_every = args.log_every or default_log_every(args.steps - step if args.steps else len(loader))

    model.train()
    loss, readouts = torch.tensor(float("nan")), []
    for epoch in range(epoch0, args.epochs):
        step, loss, lines = train_epoch(net, opt, loader, device=device, recipe=args.recipe, fp8=use_fp8,
                                        epoch=epoch, step=step, max_steps=args.steps, log_every=log_every,
                                        images_per_step=args.batch_size * world, log=print if rank == 0 else None)
        readouts += lines
        if args.checkpoint and args.fsdp:  # every rank writes its shards into a new folder, then it is published
            saved = fp8vit.save_checkpoint(args.checkpoint, model, opt, extra={"step": step, "epoch": epoch})
        elif args.checkpoint and rank == 0:
            saved = args.checkpoint
            save_atomically({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                             "epoch": epoch}, saved)
        if args.checkpoint and rank == 0:
            print(f"saved {saved} (step {step})")
        if args.steps and step >= args.steps:
            break
    if rank == 0:
        price = args.price_per_hour * world if args.price_per_hour else None
        summary = steady_state(readouts, args.batch_size * world, price)
        peak = f"; peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if device.type == "cuda" else ""
        print(f"done: {step} steps, last loss {loss.item():.4f}" + (f"; {summary}" if summary else "") + peak
              + (f" ({world} processes, {'FSDP2' if args.fsdp else 'DDP'})" if world > 1 else ""))
    if not dist.is_initialized():
        return None
    backend = dist.get_backend()
    dist.barrier()  # every rank is done before any tears its connections down
    dist.destroy_process_group()
    return backend


if __name__ == "__main__":
    if main() == "gloo":
        # End a gloo run here, without the interpreter's shutdown. destroy_process_group() does not
        # free the process group once FSDP2 has run: DTensor's caches keep its DeviceMesh, hence the
        # group, alive, so gloo's worker threads outlive main(). A worker still releasing the tensors
        # of a finished collective (checkpoint.py's broadcast of rank 0's result) then needs the GIL
        # while Python finalizes, and the process aborts ("terminate called without an active
        # exception", SIGABRT: ProcessGroupGloo::runLoop -> ~AsyncBroadcastWork -> decref -> take_gil
        # in a core dump, now and then on a loaded 2-core machine). Everything is saved and printed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
