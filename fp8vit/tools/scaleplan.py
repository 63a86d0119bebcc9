"""``fp8vit-scaleplan``: per-GPU memory, communication and step-time estimates of data-parallel FP8
training of large ViTs (DDP, FSDP2 with bf16 compute, FSDP2 with FP8 primary weights): the
*computed* tables of docs/scaling.md, which says where each formula comes from.

    fp8vit-scaleplan                              # the docs' tables (markdown)
    fp8vit-scaleplan --models vit_huge_patch14_224 --gpus 8 --batch 64 --optimizer adamw

Nothing here is measured. The models are built on the ``meta`` device (no memory) to count their
parameters exactly; the activation formula was checked against the one measured ViT-H/16 point
(:func:`anchor_check`), and the step time is extrapolated from one measured throughput
(:data:`MEASURED_FLOPS`) by FLOPs.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Dict, List, Optional, Sequence

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from .cli import at_least, more_than
from .workload import _gemm_weights, train_flops

__all__ = ["MODELS", "MODES", "Shape", "shape_of", "activation_bytes", "memory", "comm_bytes", "step_estimate",
           "anchor_check", "main"]

GiB = 2 ** 30

# The models of docs/scaling.md: VisionTransformer keywords (224 px). ViT-22B is not in timm: its
# width, depth and heads from Dehghani et al. 2023, no QKV bias, qk-norm, no class token; its
# parallel attention/MLP layout changes neither parameters nor FLOPs, so timm's sequential block
# stands in for it.
MODELS = {
    "ViT-H/14": dict(patch_size=14, embed_dim=1280, depth=32, num_heads=16),                  # vit_huge_patch14_224
    "ViT-g/14": dict(patch_size=14, embed_dim=1408, depth=40, num_heads=16, mlp_ratio=48 / 11),  # vit_giant_patch14_224
    "ViT-G/14": dict(patch_size=14, embed_dim=1664, depth=48, num_heads=16, mlp_ratio=64 / 13),  # vit_gigantic_patch14_224
    "ViT-22B": dict(patch_size=14, embed_dim=6144, depth=48, num_heads=48, qkv_bias=False, qk_norm=True,
                    class_token=False, global_pool="avg"),
}
# The measured point: ViT-H/16 (patch 16, 1280, 32 blocks), batch 128, SGD, fp8vit-fp8-delayed
# (eager: FSDP2 runs eagerly), H200: 172.4 ms/step, 567.1 TFLOP/s by workload.train_flops, peak
# 33.76 GiB, 139.3 GiB free at start (docs/results/bench/vit_huge_patch16_224_b128_all10_h200.json).
ANCHOR = dict(patch_size=16, embed_dim=1280, depth=32, num_heads=16)
ANCHOR_BATCH, ANCHOR_PEAK_GIB = 128, 33.76
MEASURED_FLOPS = 567.1e12
GPU_GIB = 139.3
RESERVE_GIB = 4.0  # CUDA context, cuBLAS workspaces, allocator fragmentation: an assumption

MODES = ("ddp", "fsdp2", "fsdp2-fp8w")
MODE_NAMES = {"ddp": "DDP", "fsdp2": "FSDP2 bf16", "fsdp2-fp8w": "FSDP2 + FP8 weights"}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the formulas need of a ViT. Counts are parameters (elements), not bytes.

    Attributes:
        params: all parameters.
        block_params: one block's parameters.
        gemm_weights: the GEMM weights of all blocks (what FP8 primary weights hold in FP8).
        root_params: the parameters outside the blocks (patch and position embedding, norm, head).
        depth, dim, mlp, tokens: blocks, width, MLP hidden width, tokens per image.
        flops_per_image: training FLOPs of one image (``workload.train_flops``).
    """

    params: int
    block_params: int
    gemm_weights: int
    root_params: int
    depth: int
    dim: int
    mlp: int
    tokens: int
    flops_per_image: float


def shape_of(kwargs: dict, img_size: int = 224) -> Shape:
    """Build the ViT on the ``meta`` device and count it."""
    with torch.device("meta"):
        model = VisionTransformer(img_size=img_size, num_classes=1000, **kwargs)
    blocks = model.blocks
    fc1 = blocks[0].mlp.fc1
    return Shape(params=_count(model), block_params=_count(blocks[0]), gemm_weights=sum(_gemm_weights(b) for b in blocks),
                 root_params=_count(model) - _count(blocks), depth=len(blocks), dim=model.embed_dim,
                 mlp=fc1.out_features, tokens=model.patch_embed.num_patches + model.num_prefix_tokens,
                 flops_per_image=train_flops(model, 1, img_size))


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def activation_bytes(s: Shape, mlp_recompute: bool = False) -> float:
    """Saved activations of one image over all blocks, fp8vit's TE_Block under FP8 delayed scaling.

    Per token and block (bytes), from what TE's modules save for backward: qkv's LayerNormLinear
    its bf16 input and FP8 LayerNorm output (3C); attention q, k, v and its output in bf16 (8C);
    proj its FP8 input (C); the LayerNormMLP its bf16 input and FP8 LayerNorm output (3C), fc1's
    bf16 pre-GELU output (2H, GELU in the GEMM's epilogue) and fc2's FP8 input (H): 15C + 3H. With
    MLP recompute the MLP keeps only its bf16 input: 14C.
    """
    per_token = 14 * s.dim if mlp_recompute else 15 * s.dim + 3 * s.mlp
    return float(per_token * s.tokens * s.depth)


def memory(s: Shape, mode: str, n: int, optimizer: str = "adamw") -> Dict[str, float]:
    """Per-GPU bytes of a training step on ``n`` GPUs, by part (activations excluded).

    ``states``: weights, gradients and optimizer state, held through the step. ``transient``:
    what is alive at once besides them: DDP's gradient buckets (DistributedDataParallel's
    default; none with ``gradient_as_bucket_view=True``) and TE's FP8 copies of every weight
    saved for backward (data and transpose); FSDP2's all-gathered root and two blocks (the one
    running and the one prefetched) and one block's gradients before their reduce-scatter (the
    compute dtype's, plus the fp32 copy reduced). Under FSDP2, TE saves no FP8 weight copies
    (TE 2.20 ``layernorm_linear.py``, issue #2681): it quantizes the gathered weight again in
    backward, one block at a time.

    Modes: ``ddp`` (fp32 weights), ``fsdp2`` (fp32 shards, bf16 compute, fp32 reduce:
    ``fp8vit.default_mp_policy``), ``fsdp2-fp8w`` (FP8 primary weights: 1-byte GEMM weight shards,
    fp32 master weights in TE's FusedAdam, fp32 gradients as the weights' nominal dtype is the timm
    model's fp32). ``optimizer``: ``adamw`` (8 bytes of state per parameter, fp32) or ``sgd``
    (momentum, 4).
    """
    opt = {"adamw": 8, "sgd": 4}[optimizer]
    P, G, Pb, Pr, L = s.params, s.gemm_weights, s.block_params, s.root_params, s.depth
    if mode == "ddp":
        return {"states": (4 + 4 + opt) * P, "transient": 4 * P + 2 * G}
    grad_unit = (2 + 4) * Pb
    if mode == "fsdp2":
        return {"states": (4 + 4 + opt) * P / n, "transient": 2 * Pr + 2 * 2 * Pb + grad_unit}
    if mode == "fsdp2-fp8w":
        gemm_per_block = G / L
        weights = 1 * G + 4 * (P - G)
        gathered_block = 2 * gemm_per_block + 2 * (Pb - gemm_per_block)  # FP8 data + transpose; bf16 rest
        return {"states": (weights + (4 + opt + 4) * P) / n, "transient": 2 * Pr + 2 * gathered_block + grad_unit}
    raise ValueError(f"mode={mode!r}; one of {MODES}")


def comm_bytes(s: Shape, mode: str, n: int) -> float:
    """Bytes each GPU sends per step (ring collectives: a fraction (n-1)/n of the buffer per
    all-gather or reduce-scatter, twice that per all-reduce). DDP all-reduces fp32 gradients;
    FSDP2 all-gathers the blocks in forward and again in backward (``reshard_after_forward``; the
    root stays gathered) and reduce-scatters fp32 gradients; with FP8 weights the GEMM weights
    travel in 1 byte. The delayed-scaling amax all-reduces (two per step, 4 bytes per FP8
    tensor) are left out: a few kB."""
    f = (n - 1) / n
    P, G, Pr = s.params, s.gemm_weights, s.root_params
    if mode == "ddp":
        return 2 * f * 4 * P
    if mode == "fsdp2":
        return f * (2 * P + 2 * (P - Pr) + 4 * P)
    if mode == "fsdp2-fp8w":
        fwd = G + 2 * (P - G)
        return f * (fwd + fwd - 2 * Pr + 4 * P)
    raise ValueError(f"mode={mode!r}; one of {MODES}")


def step_estimate(s: Shape, mode: str, n: int, batch: int, *, intra_gbs: float, inter_gbs: float,
                  gpus_per_node: int = 8) -> Dict[str, float]:
    """Compute and communication time of a step (seconds) and throughput bounds.

    Compute: the FLOPs at :data:`MEASURED_FLOPS`. Communication: :func:`comm_bytes` at
    ``intra_gbs`` GB/s within a node and ``inter_gbs`` across nodes (assumed bus bandwidths, not
    measured). The step lies between both overlapped (``max``) and none overlapped (``sum``).
    """
    compute = s.flops_per_image * batch / MEASURED_FLOPS
    bw = (intra_gbs if n <= gpus_per_node else inter_gbs) * 1e9
    comm = comm_bytes(s, mode, n) / bw
    best, worst = max(compute, comm), compute + comm
    return {"compute_s": compute, "comm_s": comm, "step_best_s": best, "step_worst_s": worst,
            "img_s_per_gpu_best": batch / best, "img_s_per_gpu_worst": batch / worst}


def largest_batch(s: Shape, mode: str, n: int, optimizer: str, mlp_recompute: bool) -> int:
    """The largest per-GPU batch whose states, transient buffers and activations fit in
    :data:`GPU_GIB` less :data:`RESERVE_GIB` (0: not even the states fit)."""
    m = memory(s, mode, n, optimizer)
    free = (GPU_GIB - RESERVE_GIB) * GiB - m["states"] - m["transient"]
    return max(0, int(free // activation_bytes(s, mlp_recompute)))


def anchor_check() -> Dict[str, float]:
    """The formulas against the one measured peak: ViT-H/16, batch 128, SGD, DDP's terms without
    its buckets (one process, no DDP), eager FP8 delayed scaling on an H200."""
    s = shape_of(ANCHOR)
    m = memory(s, "ddp", 1, "sgd")
    no_buckets = m["transient"] - 4 * s.params
    computed = (m["states"] + no_buckets + ANCHOR_BATCH * activation_bytes(s)) / GiB
    return {"computed_gib": computed, "measured_gib": ANCHOR_PEAK_GIB,
            "activations_mb_per_image": activation_bytes(s) / 1e6,
            "recompute_activations_mb_per_image": activation_bytes(s, True) / 1e6}


def _fmt_gib(b: float) -> str:
    return f"{b / GiB:.1f}"


def tables(models: Sequence[str], gpus: Sequence[int], batch: int, optimizer: str, intra_gbs: float,
           inter_gbs: float) -> str:
    """The markdown tables of docs/scaling.md."""
    shapes = {m: shape_of(MODELS[m]) for m in models}
    out: List[str] = ["### Models", "",
                      "| model | params | per block | GEMM weights | tokens | activations per image (MB) | with MLP recompute | train GFLOPs per image |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in shapes.items():
        out.append(f"| {name} | {s.params / 1e9:.3f} B | {s.block_params / 1e6:.1f} M | {s.gemm_weights / 1e9:.3f} B | "
                   f"{s.tokens} | {activation_bytes(s) / 1e6:.0f} | {activation_bytes(s, True) / 1e6:.0f} | "
                   f"{s.flops_per_image / 1e9:.0f} |")
    out += ["", f"### Per-GPU memory (GiB; {optimizer}; activations at {batch} images per GPU)", "",
            "| model | mode | GPUs | states | transient | activations | total | largest batch | with MLP recompute |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in shapes.items():
        act = batch * activation_bytes(s)
        for mode in MODES:
            for n in (gpus if mode != "ddp" else gpus[:1]):  # DDP's per-GPU memory does not depend on n
                m = memory(s, mode, n, optimizer)
                total = m["states"] + m["transient"] + act
                fits = total <= (GPU_GIB - RESERVE_GIB) * GiB
                nn_ = "any" if mode == "ddp" else str(n)
                out.append(f"| {name} | {MODE_NAMES[mode]} | {nn_} | {_fmt_gib(m['states'])} | {_fmt_gib(m['transient'])} | "
                           f"{_fmt_gib(act)} | {_fmt_gib(total)}{'' if fits else ' (does not fit)'} | "
                           f"{largest_batch(s, mode, n, optimizer, False)} | {largest_batch(s, mode, n, optimizer, True)} |")
    out += ["", f"### Communication and step time per GPU ({batch} images per GPU; {intra_gbs:g} GB/s within "
            f"a node of 8, {inter_gbs:g} GB/s across nodes: assumed)", "",
            "| model | mode | GPUs | sent per step (GB) | comm (ms) | compute (ms) | img/s per GPU (overlapped .. not) | "
            "$ per 1M images at $1 per GPU-hour |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in shapes.items():
        for mode in MODES:
            for n in gpus:
                if memory(s, mode, n, optimizer)["states"] + memory(s, mode, n, optimizer)["transient"] \
                        + batch * activation_bytes(s) > (GPU_GIB - RESERVE_GIB) * GiB:
                    continue
                e = step_estimate(s, mode, n, batch, intra_gbs=intra_gbs, inter_gbs=inter_gbs)
                # per GPU: $1/h buys 3600 s; 1M images take 1e6 / (img/s per GPU) GPU-seconds
                cost = [1e6 / e[k] / 3600 for k in ("img_s_per_gpu_best", "img_s_per_gpu_worst")]
                out.append(f"| {name} | {MODE_NAMES[mode]} | {n} | {comm_bytes(s, mode, n) / 1e9:.1f} | "
                           f"{e['comm_s'] * 1e3:.0f} | {e['compute_s'] * 1e3:.0f} | "
                           f"{e['img_s_per_gpu_best']:.0f} .. {e['img_s_per_gpu_worst']:.0f} | "
                           f"{cost[0]:.2f} .. {cost[1]:.2f} |")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="fp8vit-scaleplan", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--gpus", nargs="+", type=at_least(1, "GPUs"), default=[8, 16, 32, 64])
    p.add_argument("--batch", type=at_least(1, "images per GPU and step"), default=64, help="images per GPU and step")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    p.add_argument("--intra-gbs", type=more_than(0, "a bandwidth in GB/s"), default=360.0,
                   help="assumed collective bus bandwidth within a node, GB/s (NVLink)")
    p.add_argument("--inter-gbs", type=more_than(0, "a bandwidth in GB/s"), default=40.0,
                   help="assumed collective bus bandwidth across nodes, GB/s per GPU (400 Gb/s InfiniBand)")
    a = p.parse_args(argv)
    chk = anchor_check()
    print(f"anchor: ViT-H/16 batch 128 SGD one H200, peak computed {chk['computed_gib']:.1f} GiB, measured "
          f"{chk['measured_gib']:.1f} GiB; activations {chk['activations_mb_per_image']:.0f} MB per image "
          f"({chk['recompute_activations_mb_per_image']:.0f} with MLP recompute)\n")
    print(tables(a.models, a.gpus, a.batch, a.optimizer, a.intra_gbs, a.inter_gbs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
