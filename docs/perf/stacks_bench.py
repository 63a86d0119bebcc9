"""Speed inside the training stacks: bf16 vs fp8vit FP8 in a plain loop, Lightning, accelerate and timm's train.py.

    python docs/perf/stacks_bench.py --models vit_base_patch16_224,vit_huge_patch16_224 \\
        --stacks plain,lightning,lightning-plugin,accelerate,timm-train --batch-size 128 --steps 30 --warmup 10
    python docs/perf/stacks_bench.py --models vit_base_patch16_224 --stacks plain,lightning,lightning-plugin \\
        --repeats 3                                        # 3 interleaved rounds: see Repeats below
    python docs/perf/stacks_bench.py --device cpu          # the CI smoke run (tests/test_stacks_bench.py)

What it measures: the training step time of a timm ViT, bf16 baseline against fp8vit FP8, inside each
stack, with the same optimizer (fp8vit-bench's: fused SGD momentum 0.9, lr 1e-3; ``--optimizer adamw``)
and the same data; then whether each stack keeps the FP8 speed-up of the hand-written loop.

Stacks (the FP8 variant of each is what docs/frameworks.md tells a user to write):

* ``plain``: ``torch.autocast(bf16)`` around forward and loss, ``backward()``, ``step()``,
  ``zero_grad(set_to_none=True)``. FP8: ``convert_to_te(model, autocast=True, cuda_graphs=True)``.
* ``lightning``: ``Trainer(precision="bf16-mixed")``; FP8: the same Trainer, the module converted as
  above in ``configure_model``.
* ``lightning-plugin``: ``Trainer(plugins=[FP8VitPrecision()])``, the module converted in
  ``configure_model`` with ``cuda_graphs=True`` (the plugin enters ``fp8_context`` per step). Its
  bf16 baseline is the ``lightning`` one (the same Trainer without fp8vit), run once.
* ``accelerate``: ``Accelerator(mixed_precision="bf16")``, ``prepare(model, opt, loader)``,
  ``accelerator.backward(loss)``; FP8: converted as for ``plain`` before ``prepare``.
* ``timm-train``: timm's own train.py on a generated folder of JPEGs (the real input pipeline,
  ``--workers`` processes). FP8: examples/timm_train/train.py (``convert_to_te(model, autocast=True,
  cuda_graphs=True)``: the graphs are not visible from outside the script); bf16: timm's original train.py, rebuilt in a temporary folder
  from the vendored one by dropping its header and the two lines marked ``# fp8vit`` and checked
  against the sha256 its header records (the vendored script has no switch to turn fp8vit off).

Data (all stacks but timm-train): 4 batches of ``randn`` images and random labels, made once on the
device with a fixed seed, served round-robin by a ``DataLoader(batch_size=None)`` over a map-style
dataset: no collate and no copy, so the input costs nothing and every stack gets the same tensors.

Timing: each step is bracketed in the stack's own place (plain/accelerate: around the step;
Lightning: a Callback's ``on_train_batch_start``/``on_train_batch_end``) with
``torch.cuda.synchronize()``, and a CUDA event is recorded at each step end, before that
synchronize. A step's time is the interval between consecutive step ends, read two ways: (a) the
host's wall clock, (b) ``elapsed_time`` between the end events. The first ``--warmup`` steps are
skipped (CUDA graphs are captured at the second step of a shape), the median of the next ``--steps``
is reported, with the disagreement of (a) and (b) in %. ``in_step_ms`` is start-to-end of a step; the
rest of the interval is the stack's own work between steps. Synchronizing every step costs both
variants alike. timm-train reads timm's own per-step log instead (``--log-interval 1
--synchronize-step``): ``Time:`` (the step, loader wait included) and ``Data:`` (the wait).

Isolation: every (stack, model, variant) runs in a fresh process (its own CUDA context, no graphs or
compile state left from another run) that prints one line ``RESULT {json}``: the times, the peak
memory and the evidence that FP8 ran (fused blocks from ``fp8vit.conversion_summary``, block calls
under a TE FP8 recipe, the CUDA-graph shapes captured and replays). The parent prints a table: per
model and stack the bf16 and fp8vit medians, the speed-up bf16/fp8vit (wall and events) and that
speed-up relative to the ``plain`` stack's (target >= 0.95, judged on the events where there are
any). A run that fails, or an fp8vit run on a GPU whose blocks never ran under FP8, is a row of the
table with its error, and the parent then exits 1. ``--json`` writes everything.

Repeats: on the H200 the same configuration measures up to ~5% apart from one process to the next
(clocks, placement, the CUDA context), as much as some gaps between stacks (lightning-plugin's ViT-B
fp8vit step at 32.3 ms against lightning's 30.7 ms in one run each). ``--repeats N`` runs the whole
plan N times in interleaved rounds (round 1 runs every configuration once in plan order, then round
2, ...), so a drift over time hits every configuration alike rather than the ones that ran last.
Per configuration the table then shows the median over the repeats of each run's median step (wall
and events) and a ``runs spread %`` column, (max - min) / median of the per-run medians, bf16 /
fp8vit: a gap between two stacks smaller than their spreads is within run-to-run noise. A repeat
that fails is reported as a failed run (its progress line, the note of its rows, ``failures`` in the
JSON, exit 1), and the configuration's numbers come from its successful repeats; it is a FAILED row
only when no repeat succeeded. ``--repeats 1`` (the default) prints the table as without the option.
The JSON keeps every RESULT (``results``, each with its ``repeat``) and, per configuration,
``repeats``: the list of its per-run medians, the repeats that failed, and the median and spread.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMM_TRAIN = ROOT / "examples" / "timm_train" / "train.py"
STACKS = ("plain", "lightning", "lightning-plugin", "accelerate", "timm-train")
VARIANTS = ("bf16", "fp8vit")
NUM_CLASSES = 1000
TARGET = 0.95  # a stack's speed-up over the plain loop's: within 5%
INPUT_BOUND = 0.10  # timm-train: loader wait above this share of the step = input-bound

# Names timm has no entry for. ViT-H/16 (the 1280/32/16 ViT at patch 16 that fp8vit-bench's "huge"
# and docs/performance.md time) is timm's vit_huge_patch14_224 with patch_size=16.
ALIASES = {"vit_huge_patch16_224": ("vit_huge_patch14_224", {"patch_size": 16})}
# --device cpu: a tiny version of whatever model is named, fast enough for CI.
CPU_MODEL_KWARGS = {"img_size": 32, "patch_size": 8, "depth": 2}

# For the up-front time estimate only (no result is computed from these). H200, batch 128
# (docs/performance.md): timm-bf16 and fp8vit-fp8-delayed-graphed step times of ViT-B/16 and ViT-H/16;
# other models are placed on the line through them by training FLOPs. Process start-up (imports,
# CUDA context, model init) per child, and timm-train's extra start-up (loader workers).
PRIOR_MS = {"vit_base_patch16_224": (49.2, 29.2), "vit_huge_patch16_224": (264.7, 159.5)}
STARTUP_S, TIMM_STARTUP_S, CAPTURE_S = 18.0, 12.0, 2.0
CPU_INIT_PARAMS_S, CHECKPOINT_BYTES_S = 80e6, 1e9  # timm's CPU init (Lightning, train.py), torch.save


# ---------------------------------------------------------------------------------------------- models

def model_spec(name: str, device: str) -> tuple[str, dict]:
    """``(timm model name, create_model kwargs)`` for a model name of this script (aliases, CPU size)."""
    timm_name, kwargs = ALIASES.get(name, (name, {}))
    kwargs = dict(kwargs)
    if device == "cpu":
        kwargs.update(CPU_MODEL_KWARGS)
    return timm_name, kwargs


def build_model(name: str, device: str, on: str | None = None):
    """A randomly initialised timm model, sized for ``device``, built on ``on`` (None: the CPU, as
    ``timm.create_model`` builds it; a device: built there, which spares ViT-H ~10 s of CPU init)."""
    import timm
    import torch

    timm_name, kwargs = model_spec(name, device)
    with torch.device(on or "cpu"):
        return timm.create_model(timm_name, pretrained=False, num_classes=NUM_CLASSES, **kwargs)


def image_size(model) -> int:
    size = model.patch_embed.img_size
    return size[0] if isinstance(size, (tuple, list)) else int(size)


# ---------------------------------------------------------------------------------------------- child

@dataclasses.dataclass(frozen=True)
class Config:
    """One child run: a stack, a model, a variant and the common settings."""

    stack: str
    model: str
    variant: str
    device: str
    batch: int
    steps: int
    warmup: int
    optimizer: str
    lr: float

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def fp8(self) -> bool:
        return self.variant == "fp8vit"

    def convert(self, model, *, autocast: bool):
        """``fp8vit.convert_to_te`` as the stack's FP8 variant does it: CUDA graphs on a GPU (they need
        one), TE's modules there and fp8vit's reference modules on the CPU."""
        import fp8vit

        return fp8vit.convert_to_te(model, autocast=autocast, cuda_graphs=self.cuda,
                                    backend=None if self.cuda else "reference")

    def optimizer_for(self, params):
        """fp8vit-bench's optimizer (``make_optimizer``: fused on CUDA), so the ratios compare with its numbers."""
        from fp8vit.tools.workload import make_optimizer

        return make_optimizer(params, self.optimizer, lr=self.lr, device=self.device)


class StepClock:
    """Step boundaries: the host clock after ``torch.cuda.synchronize()``, and CUDA events.

    ``end()`` records the event first (it completes when the step's kernels have), then synchronizes
    and reads the host clock, so both readings close the same step.
    """

    def __init__(self, cuda: bool):
        import torch

        self.torch, self.cuda = torch, cuda
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.events: list = []

    def start(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
        self.starts.append(time.perf_counter())

    def end(self) -> None:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
            self.torch.cuda.synchronize()
        self.ends.append(time.perf_counter())

    def summary(self, warmup: int) -> dict:
        """Medians (ms) over the steps after ``warmup``: step-end to step-end, wall and events."""
        n = len(self.ends)
        if n <= warmup or len(self.starts) != n:
            raise RuntimeError(f"{n} step ends and {len(self.starts)} step starts recorded, warm-up {warmup}: "
                               "the stack ran fewer steps than asked")
        idx = range(warmup, n)
        wall = [1e3 * (self.ends[i] - self.ends[i - 1]) for i in idx]
        inside = [1e3 * (self.ends[i] - self.starts[i]) for i in idx]
        out = {"steps": len(wall), "median_ms_wall": statistics.median(wall),
               "in_step_ms": statistics.median(inside), "spread_pct_wall": spread(wall),
               "median_ms_events": None, "disagreement_pct": None}
        if self.cuda:
            events = [self.events[i - 1].elapsed_time(self.events[i]) for i in idx]
            out["median_ms_events"] = statistics.median(events)
            out["disagreement_pct"] = 100.0 * (out["median_ms_wall"] / out["median_ms_events"] - 1)
        return out


def spread(xs: list[float]) -> float:
    """(p90 - p10) / median, in %: how steady the steps were."""
    q = statistics.quantiles(xs, n=10) if len(xs) > 1 else [xs[0]] * 9
    return 100.0 * (q[8] - q[0]) / statistics.median(xs)


class FP8Spy:
    """Forward pre-hook on ``model.blocks``: counts its calls and those made with TE's FP8 on.

    On ``model.blocks`` because that is the graphed module: fp8vit runs its hooks around every call,
    replays included (hooks inside a graph run only while it is captured).
    """

    def __init__(self):
        self.calls, self.fp8_calls, self.autocast = 0, 0, set()

    def __call__(self, module, args) -> None:
        import torch

        from fp8vit import _te

        kind = args[0].device.type
        self.calls += 1
        self.fp8_calls += _te.active_fp8_recipe() is not None
        self.autocast.add(str(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else "off")

    def watch(self, model) -> None:
        model.blocks.register_forward_pre_hook(self)


def synthetic_loader(cfg: Config, img: int):
    """4 fixed batches made once on the device, served round-robin for warm-up + steps, no collate."""
    import torch

    g = torch.Generator(device=cfg.device).manual_seed(0)
    batches = [(torch.randn(cfg.batch, 3, img, img, device=cfg.device, generator=g),
                torch.randint(0, NUM_CLASSES, (cfg.batch,), device=cfg.device, generator=g)) for _ in range(4)]

    class Batches(torch.utils.data.Dataset):
        def __len__(self):
            return cfg.warmup + cfg.steps  # one epoch: Lightning's max_steps ends with it

        def __getitem__(self, i):
            return batches[i % len(batches)]

    # batch_size=None: each item is a batch; the collate is default_convert, a no-op on tensors
    return torch.utils.data.DataLoader(Batches(), batch_size=None, shuffle=False, num_workers=0)


def run_plain(cfg: Config) -> dict:
    import torch
    import torch.nn.functional as F

    model = build_model(cfg.model, cfg.device, on=cfg.device).train()
    if cfg.fp8:
        cfg.convert(model, autocast=True)
    spy, clock = FP8Spy(), StepClock(cfg.cuda)
    spy.watch(model)
    opt = cfg.optimizer_for(model.parameters())
    loss = None
    for x, y in synthetic_loader(cfg, image_size(model)):
        clock.start()
        with torch.autocast(cfg.device, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.end()
    return measured(cfg, model, spy, clock, loss)


def run_accelerate(cfg: Config) -> dict:
    import accelerate
    import torch.nn.functional as F

    import fp8vit

    accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=not cfg.cuda)
    model = build_model(cfg.model, cfg.device, on=cfg.device).train()
    if cfg.fp8:
        cfg.convert(model, autocast=True)  # before prepare, as docs/frameworks.md says
    spy, clock = FP8Spy(), StepClock(cfg.cuda)
    spy.watch(model)
    opt = cfg.optimizer_for(model.parameters())
    # prepare wraps model.forward (its autocast) around fp8vit's FP8 forward, after which
    # conversion_summary(model).fp8_forward reads None although FP8 still runs: noted before
    carried = fp8vit.conversion_summary(model).fp8_forward if cfg.fp8 else None
    net, opt, loader = accelerator.prepare(model, opt, synthetic_loader(cfg, image_size(model)))
    loss = None
    for x, y in loader:
        clock.start()
        loss = F.cross_entropy(net(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.end()
    res = measured(cfg, model, spy, clock, loss)
    res["fp8_forward_before_prepare"] = carried
    res["versions"]["accelerate"] = accelerate.__version__
    return res


def run_lightning(cfg: Config) -> dict:
    """``lightning`` and ``lightning-plugin``: the module builds the model in ``__init__`` (CPU) and
    converts it in ``configure_model``; the Trainer then moves it to the GPU and makes the optimizer."""
    import lightning as L
    import torch.nn.functional as F

    plugin = cfg.stack == "lightning-plugin"
    seen: dict[str, str] = {}
    spy, clock = FP8Spy(), StepClock(cfg.cuda)
    losses: list = []

    class LitViT(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(cfg.model, cfg.device)

        def configure_model(self):
            seen["device_at_configure_model"] = str(next(self.model.parameters()).device)
            if cfg.fp8:
                # the plugin enters fp8_context itself; with precision="bf16-mixed" the model carries FP8
                cfg.convert(self.model, autocast=not plugin)

        def on_fit_start(self):
            seen["device_at_fit_start"] = str(next(self.model.parameters()).device)
            spy.watch(self.model)

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return cfg.optimizer_for(self.parameters())

    class Clocked(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            clock.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.end()
            losses.append(outputs["loss"])

    if plugin:
        from fp8vit.integrations.lightning import FP8VitPrecision

        if not cfg.fp8:
            raise ValueError("lightning-plugin's bf16 baseline is the lightning stack's (run that one)")
        precision = {"plugins": [FP8VitPrecision(cuda_graphs=cfg.cuda)]}  # its default on a GPU
    else:
        precision = {"precision": "bf16-mixed"}
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="gpu" if cfg.cuda else "cpu", devices=1, max_steps=cfg.warmup + cfg.steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
                            callbacks=[Clocked()], **precision)
        lit = LitViT()
        trainer.fit(lit, train_dataloaders=synthetic_loader(cfg, image_size(lit.model)))
    res = measured(cfg, lit.model, spy, clock, losses[-1] if losses else None)
    res.update(seen)
    res["versions"]["lightning"] = L.__version__
    return res


def measured(cfg: Config, model, spy: FP8Spy, clock: StepClock, loss) -> dict:
    """The RESULT of a run: times, peak memory, and what shows that FP8 (and CUDA graphs) ran."""
    import timm
    import torch

    import fp8vit
    from fp8vit.training.graphs import GraphedBlocks

    res = {"stack": cfg.stack, "model": cfg.model, "batch": cfg.batch, "variant": cfg.variant,
           "device": cfg.device, "optimizer": cfg.optimizer, "warmup": cfg.warmup, **clock.summary(cfg.warmup)}
    try:
        summary = fp8vit.conversion_summary(model)
        res["fused"], res["fp8_forward"] = summary.num_fused, summary.fp8_forward
    except ValueError:  # not converted: the bf16 baseline
        res["fused"], res["fp8_forward"] = 0, None
    res.update(block_calls=spy.calls, fp8_calls=spy.fp8_calls, autocast=sorted(spy.autocast))
    graphs = GraphedBlocks.of(model)
    res["graphs"] = None if graphs is None else {
        "shapes": [list(s.shape) for s in graphs.shapes], "recipes": [s.recipe_name for s in graphs.shapes],
        "replays": graphs.replays, "eager_calls": graphs.eager_calls, "eager_reasons": dict(graphs.eager_reasons),
        "memory_gib": graphs.memory_bytes / 2**30}
    res["loss_last"] = None if loss is None else float(loss.detach().float().item())
    res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cfg.cuda else None
    res["versions"] = {"torch": torch.__version__, "timm": timm.__version__, "fp8vit": fp8vit.__version__}
    if cfg.cuda:
        res["gpu"] = torch.cuda.get_device_name()
        res["fp8_available"] = fp8vit.gpu_info().fp8.ok
    res["data"] = "4 synthetic batches on the device, DataLoader(batch_size=None): no collate, no copy"
    return res


RUNNERS: dict[str, Callable[[Config], dict]] = {
    "plain": run_plain, "lightning": run_lightning, "lightning-plugin": run_lightning, "accelerate": run_accelerate}


def child_main(a: argparse.Namespace) -> int:
    import warnings

    import torch

    stack, model, variant = a.child
    cfg = Config(stack, model, variant, a.device, a.batch_size, a.steps, a.warmup, a.optimizer, a.lr)
    if cfg.cuda and not torch.cuda.is_available():
        raise RuntimeError("--device cuda, and torch sees no GPU")
    warnings.filterwarnings("once")  # a warning per step would bury the log
    torch.manual_seed(0)
    res = RUNNERS[stack](cfg)
    print("RESULT " + json.dumps(res), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------- timm-train

def timm_original_train_py() -> str:
    """timm's own train.py: the vendored one without its header and the lines marked ``# fp8vit``
    (as tests/test_timm_train.py rebuilds it), checked against the sha256 its header records."""
    text = TIMM_TRAIN.read_text()
    found = re.search(r"sha256 of the original file\n# ([0-9a-f]{64})", text)
    if found is None:
        raise RuntimeError(f"{TIMM_TRAIN} no longer records the sha256 of timm's original file")
    lines = text.splitlines(keepends=True)
    header = [line for line in lines[1:] if line.startswith("# ")][:7]
    marked = [line for line in lines if "# fp8vit" in line and line not in header]
    original = "".join(line for line in lines if line not in header and line not in marked)
    if hashlib.sha256(original.encode()).hexdigest() != found.group(1):
        raise RuntimeError(f"{TIMM_TRAIN} minus its header and '# fp8vit' lines is not timm's original file "
                           "(sha256 differs): the bf16 baseline cannot be rebuilt from it")
    return original


def _write_images(job: tuple[str, int, int, int]) -> int:
    """One worker's share of the image folder: smooth random colours plus noise, JPEG quality 90
    (about the decode work of a photo of that size)."""
    import numpy as np
    from PIL import Image

    folder, start, count, size = job
    total = 0
    for i in range(start, start + count):
        rng = np.random.default_rng(i)
        small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((size, size), Image.BILINEAR)
        pixels = np.asarray(small, dtype=np.int16) + rng.normal(0, 12, (size, size, 3)).astype(np.int16)
        path = os.path.join(folder, f"{i:06d}.jpg")
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
        total += os.path.getsize(path)
    return total


def make_image_folder(root: Path, per_class: int, size: int, classes: int = 2) -> dict:
    """``root/train/<class>/*.jpg``, written by one process per core; returns what was made."""
    start = time.perf_counter()
    jobs = []
    procs = os.cpu_count() or 1
    for c in range(classes):
        folder = root / "train" / f"class{c}"
        folder.mkdir(parents=True, exist_ok=True)
        chunk = math.ceil(per_class / procs)
        jobs += [(str(folder), c * per_class + s, min(chunk, per_class - s), size) for s in range(0, per_class, chunk)]
    with multiprocessing.Pool(procs) as pool:
        total = sum(pool.map(_write_images, jobs))
    n = classes * per_class
    return {"images": n, "size": size, "mean_kb": total / n / 1024, "seconds": time.perf_counter() - start}


TIMM_LINE = re.compile(r"Train: \d+ \[\s*(\d+)/\d+.*?Time: ([\d.]+)s,.*?Data: ([\d.]+) \(")


def parse_timm_log(text: str, warmup: int, steps: int) -> dict:
    """Median step and loader-wait times (ms) from train.py's per-step lines: ``steps`` after ``warmup``."""
    rows = [(int(m[1]), float(m[2]), float(m[3])) for m in TIMM_LINE.finditer(text)]
    rows = [r for r in rows if warmup <= r[0] < warmup + steps]  # the epoch's last (spare) step left out
    if not rows:
        raise RuntimeError(f"no 'Train: ... Time: ... Data: ...' line after step {warmup} in train.py's output")
    step = statistics.median(1e3 * r[1] for r in rows)
    data = statistics.median(1e3 * r[2] for r in rows)
    return {"steps": len(rows), "median_ms_wall": step, "median_ms_events": None, "disagreement_pct": None,
            "median_ms_data": data, "data_share": data / step if step else None,
            "bound": "input" if step and data / step > INPUT_BOUND else "GPU"}


def run_timm_train(cfg: Config, script: Path, data: Path, out: Path, workers: int,
                   timeout: float) -> tuple[dict, str]:
    """One train.py run (one epoch of warm-up + steps + 1 batches): its RESULT as a child's, and its log."""
    import torch

    timm_name, kwargs = model_spec(cfg.model, cfg.device)
    img = kwargs.get("img_size", 224)
    cmd = [sys.executable, str(script), "--data-dir", str(data), "--val-split", "", "--model", timm_name,
           "--num-classes", str(NUM_CLASSES), "--img-size", str(img), "-b", str(cfg.batch), "--epochs", "1",
           "--warmup-epochs", "0", "--opt", cfg.optimizer, "--lr", str(cfg.lr), "--amp", "--amp-dtype", "bfloat16",
           "--log-interval", "1", "--synchronize-step", "--workers", str(workers), "--device", cfg.device,
           "--seed", "0", "--checkpoint-hist", "1", "--output", str(out), "--experiment", cfg.variant]
    if kwargs:
        cmd += ["--model-kwargs", *(f"{k}={v}" for k, v in kwargs.items())]
    # a failed earlier repeat may have left its checkpoint: this run's evidence must be its own
    shutil.rmtree(out / cfg.variant, ignore_errors=True)
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, cwd=out,
                          env=child_env())
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise ChildFailed(last_error(log), log)
    res = {"stack": cfg.stack, "model": cfg.model, "batch": cfg.batch, "variant": cfg.variant, "device": cfg.device,
           "optimizer": cfg.optimizer, "warmup": cfg.warmup, "workers": workers,
           **parse_timm_log(log, cfg.warmup, cfg.steps)}
    # Evidence of the conversion: fp8vit's parameter names in the checkpoint train.py wrote
    ckpt = torch.load(out / cfg.variant / "last.pth.tar", map_location="cpu", mmap=True, weights_only=False)
    res["fused"] = sum(1 for k in ckpt["state_dict"] if re.fullmatch(r"blocks\.\d+\.qkv\.layer_norm_weight", k))
    res["fp8_off_warning"] = "fp8vit: FP8 is off" in log
    res["graphs"] = None  # inside train.py's process: its log's step times are the evidence
    res["script"] = ("examples/timm_train/train.py" if script == TIMM_TRAIN
                     else "timm's original train.py (rebuilt from the vendored one, sha256 checked)")
    shutil.rmtree(out / cfg.variant, ignore_errors=True)  # ViT-H's checkpoint is 5 GB
    return res, log


# ---------------------------------------------------------------------------------------------- parent

class ChildFailed(Exception):
    """A run that gave no result: its error in one line, and its whole output."""

    def __init__(self, error: str, log: str):
        super().__init__(error)
        self.log = log


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def last_error(log: str) -> str:
    """The exception line of a traceback (else the last line) of a child's output."""
    lines = [line for line in log.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt|Failed)\b.*:", line)
              or line.startswith("ERROR")]
    return (errors or lines or ["(no output)"])[-1].strip()[:300]


def run_key(stack: str, model: str, variant: str) -> tuple[str, str, str]:
    """The run that measures ``variant`` of ``stack``: lightning-plugin's bf16 is lightning's."""
    if stack == "lightning-plugin" and variant == "bf16":
        return "lightning", model, variant
    return stack, model, variant


def plan(models: list[str], stacks: list[str]) -> list[tuple[str, str, str]]:
    runs: list[tuple[str, str, str]] = []
    for model in models:
        for stack in stacks:
            for variant in VARIANTS:
                key = run_key(stack, model, variant)
                if key not in runs:
                    runs.append(key)
    return runs


def run_child(key: tuple[str, str, str], a: argparse.Namespace) -> tuple[dict, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *key, "--device", a.device,
           "--batch-size", str(a.batch_size), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--optimizer", a.optimizer, "--lr", str(a.lr)]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=a.timeout, env=child_env())
    except subprocess.TimeoutExpired as err:
        log = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        raise ChildFailed(f"timed out after {a.timeout:.0f} s", log) from None
    log = proc.stdout + proc.stderr
    results = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise ChildFailed(last_error(log) + (f" (exit {proc.returncode})" if proc.returncode else ""), log)
    return json.loads(results[-1]), log


def check_evidence(res: dict) -> str | None:
    """Why an fp8vit run on a GPU does not count (None: it does): no fused block, or no FP8 call."""
    if res["variant"] != "fp8vit":
        return None
    if not res.get("fused"):
        return "fp8vit variant: no fused block (the conversion did not happen)"
    if res["device"] == "cuda":
        if res["stack"] == "timm-train" and res.get("fp8_off_warning"):
            return "fp8vit variant: train.py warned 'FP8 is off'"
        if res["stack"] != "timm-train" and not res.get("fp8_calls"):
            return "fp8vit variant: the blocks never ran under a TE FP8 recipe"
    return None


def fmt(x: float | None, spec: str = "7.1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def pair(wall: float | None, events: float | None, spec: str) -> str:
    """``wall / events``, or ``wall`` alone where there are no events (CPU, timm-train)."""
    return fmt(wall, spec) + ("" if events is None else " / " + fmt(events, spec))


def runs_spread(xs: list[float]) -> float | None:
    """(max - min) / median of the per-run medians, in %: how far apart the repeats of a run landed."""
    return 100.0 * (max(xs) - min(xs)) / statistics.median(xs) if xs and statistics.median(xs) else None


def combine(runs: list[dict]) -> dict:
    """One configuration's result over its successful repeats (in round order).

    The times are the median over the runs of each run's median (a run is one process: its steps
    are not pooled with another's, whose clocks may sit ~5% apart); the evidence (fused blocks,
    graphs, versions) is the first run's, as every run converts the same model the same way.
    ``run_ms_*`` keep the per-run medians and ``runs_spread_pct_*`` their (max - min) / median.
    """
    out = dict(runs[0])
    for kind in ("wall", "events"):
        xs = [r[f"median_ms_{kind}"] for r in runs if r.get(f"median_ms_{kind}") is not None]
        out[f"run_ms_{kind}"] = xs or None
        out[f"median_ms_{kind}"] = statistics.median(xs) if xs else None
        out[f"runs_spread_pct_{kind}"] = runs_spread(xs)
    if "median_ms_data" in out:  # timm-train: the loader wait, judged again on the combined step
        out["median_ms_data"] = statistics.median(r["median_ms_data"] for r in runs)
        step = out["median_ms_wall"]
        out["data_share"] = out["median_ms_data"] / step if step else None
        out["bound"] = "input" if step and out["data_share"] > INPUT_BOUND else "GPU"
    out["repeats"] = [r.get("repeat", 1) for r in runs]
    return out


def key_errors(variant: str, errors: list[tuple[int, str]], repeats: int) -> str:
    """A key's failed repeats in one line: ``variant: error`` as without repeats; with repeats, each
    distinct error once, followed by the repeats that gave it (a broken stack fails them all alike)."""
    if repeats == 1:
        return f"{variant}: " + "; ".join(e for _, e in errors)
    by_error: dict[str, list[int]] = {}
    for r, e in errors:
        by_error.setdefault(e, []).append(r)
    return f"{variant}: " + "; ".join(
        f"{e} (repeat{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))} of {repeats})" for e, rs in by_error.items())


def table(models: list[str], stacks: list[str], results: dict, failures: dict,
          repeats: int = 1) -> tuple[list[str], list[dict]]:
    """The summary lines and rows: per model and stack, bf16 and fp8vit medians and speed-ups.

    Args:
        models: Model names, in the table's order.
        stacks: Stack names, in the table's order.
        results: ``run_key -> [RESULT, ...]``: each successful repeat's RESULT, in round order.
        failures: ``run_key -> [(repeat, error), ...]``: each failed repeat.
        repeats: Repeats asked for (``--repeats``). Above 1 the table gains a ``runs spread %``
            column; at 1 it is the table of a single run per configuration.

    Returns:
        The printed lines and the rows (``--json``'s ``table``). A row FAILS when a key it needs
        has no successful repeat; failed repeats of a key that has some are listed in its note.
    """
    many = repeats > 1
    head = (f"{'model':22s} {'stack':16s} {'bf16 ms':>15s} {'fp8vit ms':>15s} {'speed-up':>15s} "
            f"{'vs plain':>15s}" + (f" {'runs spread %':>15s}" if many else "") + "  note")
    lines, rows = [head, "-" * (len(head) + 20)], []
    for model in models:
        plain: dict[str, float | None] = {}
        for stack in stacks:
            keys = [run_key(stack, model, v) for v in VARIANTS]
            # a key fails when none of its repeats gave a result; otherwise its failed repeats are a note
            errs = [key_errors(k[2], failures[k], repeats) for k in keys if failures.get(k) and not results.get(k)]
            partial = [key_errors(k[2], failures[k], repeats) for k in keys if failures.get(k) and results.get(k)]
            b, f = (combine(results[k]) if results.get(k) else None for k in keys)
            row = {"model": model, "stack": stack, "failed": errs or None}
            if many:
                row["failed_repeats"] = partial or None
            rows.append(row)
            if errs or b is None or f is None:
                lines.append(f"{model:22s} {stack:16s} FAILED  " + "; ".join(errs or ["not run"]))
                continue
            r_wall = ratio(b["median_ms_wall"], f["median_ms_wall"])
            r_ev = ratio(b["median_ms_events"], f["median_ms_events"])
            if stack == "plain":
                plain = {"wall": r_wall, "events": r_ev}
            rel_wall, rel_ev = ratio(r_wall, plain.get("wall")), ratio(r_ev, plain.get("events"))
            notes = []
            rel = rel_ev if rel_ev is not None else rel_wall
            if rel is not None and stack != "plain":
                notes.append("ok" if rel >= TARGET else f"BELOW {TARGET}")
            if stack == "timm-train":
                notes.append(f"FP8 cuda_graphs=True; loader wait {fmt(b['median_ms_data'], '.1f')} / "
                             f"{fmt(f['median_ms_data'], '.1f')} ms: {b['bound']} / {f['bound']}-bound")
            elif f["device"] == "cuda" and not (f.get("graphs") or {}).get("shapes"):
                notes.append("no CUDA graph captured")
            if stack == "lightning-plugin":
                notes.append("bf16 = lightning's")
            if partial:
                notes.append("failed " + "; ".join(partial))
            row.update(bf16_ms_wall=b["median_ms_wall"], bf16_ms_events=b["median_ms_events"],
                       fp8_ms_wall=f["median_ms_wall"], fp8_ms_events=f["median_ms_events"], ratio_wall=r_wall,
                       ratio_events=r_ev, vs_plain_wall=rel_wall, vs_plain_events=rel_ev, note="; ".join(notes))
            spread_col = ""
            if many:
                row.update(repeats_ok={"bf16": len(b["repeats"]), "fp8vit": len(f["repeats"])},
                           bf16_runs_spread_pct_wall=b["runs_spread_pct_wall"],
                           bf16_runs_spread_pct_events=b["runs_spread_pct_events"],
                           fp8_runs_spread_pct_wall=f["runs_spread_pct_wall"],
                           fp8_runs_spread_pct_events=f["runs_spread_pct_events"])
                # on the events where there are any, as the verdict is: the wall adds the host's jitter
                sb, sf = (x["runs_spread_pct_events"] if x["median_ms_events"] is not None
                          else x["runs_spread_pct_wall"] for x in (b, f))
                spread_col = f" {fmt(sb, '.1f') + ' / ' + fmt(sf, '.1f'):>15s}"
            lines.append(f"{model:22s} {stack:16s} {pair(b['median_ms_wall'], b['median_ms_events'], '.1f'):>15s} "
                         f"{pair(f['median_ms_wall'], f['median_ms_events'], '.1f'):>15s} "
                         f"{pair(r_wall, r_ev, '.3f'):>15s} {pair(rel_wall, rel_ev, '.3f'):>15s}{spread_col}  "
                         + "; ".join(notes))
    return lines, rows


def repeat_summary(results: dict, failures: dict) -> list[dict]:
    """``--json``'s ``repeats``: per run key, its per-run medians, failed repeats, median and spread."""
    out = []
    for key in dict.fromkeys([*results, *failures]):
        runs = results.get(key) or []
        entry = {"stack": key[0], "model": key[1], "variant": key[2], "ok": [r.get("repeat", 1) for r in runs],
                 "failed": [{"repeat": r, "error": e} for r, e in failures.get(key, [])]}
        if runs:
            c = combine(runs)
            entry.update({k: c[k] for k in ("run_ms_wall", "run_ms_events", "median_ms_wall", "median_ms_events",
                                            "runs_spread_pct_wall", "runs_spread_pct_events")})
        out.append(entry)
    return out


def estimate_s(models: list[str], stacks: list[str], a: argparse.Namespace) -> float:
    """Seconds the run should take on an H200 (the priors above; FLOPs place other models): every
    run ``--repeats`` times, timm-train's image folder written once."""
    total = 0.0
    for stack, model, variant in plan(models, [s for s in stacks if s != "timm-train"]):
        ms = step_priors(model, a.batch_size)[variant == "fp8vit"]
        cpu_init = meta_model(model)[1] / CPU_INIT_PARAMS_S if stack.startswith("lightning") else 0.0
        total += STARTUP_S + cpu_init + (a.warmup + a.steps) * ms / 1e3 + (CAPTURE_S if variant == "fp8vit" else 0)
    images_s = 0.0
    if "timm-train" in stacks:
        images_s = 2 * timm_images(a)[0] / (300 * (os.cpu_count() or 1))  # ~300 JPEGs/s a core
        for model in models:
            bf16 = step_priors(model, a.batch_size)[0]
            params = meta_model(model)[1]
            for ms in (bf16, 0.6 * bf16):  # graphed FP8: about 0.6 of the bf16 step (docs/performance.md)
                total += (STARTUP_S + TIMM_STARTUP_S + params / CPU_INIT_PARAMS_S + (a.warmup + a.steps + 1) * ms / 1e3
                          + params * 8 / CHECKPOINT_BYTES_S)  # the end-of-epoch checkpoint: weights + momentum
    return a.repeats * total + images_s


@functools.cache
def meta_model(name: str) -> tuple[float | None, int]:
    """(training FLOPs per image, parameters) of a model at its GPU size, built on the meta device."""
    from fp8vit.tools.workload import train_flops

    net = build_model(name, "cuda", on="meta")
    return train_flops(net, 1, image_size(net)), sum(p.numel() for p in net.parameters())


def step_priors(model: str, batch: int) -> tuple[float, float]:
    """(bf16 ms, fp8vit ms) of a step at ``batch``: on the line through :data:`PRIOR_MS` by training FLOPs."""
    (b_name, b_ms), (h_name, h_ms) = PRIOR_MS.items()
    fb, fh = (128 * meta_model(n)[0] for n in (b_name, h_name))
    flops = batch * (meta_model(model)[0] or 0.0)
    return tuple(lo + (hi - lo) * (flops - fb) / (fh - fb) for lo, hi in zip(b_ms, h_ms))


def timm_images(a: argparse.Namespace) -> tuple[int, int]:
    """(images per class, image side) so that the epoch holds warm-up + steps + 1 full batches."""
    per_class = math.ceil((a.warmup + a.steps + 1) * a.batch_size / 2)
    return per_class, 256 if a.device == "cuda" else 40


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None, help="comma-separated timm names (default: ViT-B/16 and ViT-H/16; "
                   "CPU: vit_tiny_patch16_224); vit_huge_patch16_224 = vit_huge_patch14_224 at patch 16")
    p.add_argument("--stacks", default="plain,lightning,lightning-plugin,accelerate",
                   help=f"comma-separated, of {','.join(STACKS)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: tiny models (depth 2, 32 px), fp8vit's reference modules, no CUDA graphs or events")
    p.add_argument("--batch-size", type=int, default=None, help="default 128 (CPU: 4)")
    p.add_argument("--steps", type=int, default=30, help="measured steps")
    p.add_argument("--warmup", type=int, default=10, help="steps skipped first (at least 1)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=None, help="default fp8vit-bench's: 1e-3 (sgd), 1e-4 (adamw)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run (timm-train: twice that)")
    p.add_argument("--workers", type=int, default=12, help="timm-train: loader processes")
    p.add_argument("--timm-data", default=None, help="timm-train: an image folder to use (else one is generated)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every configuration N times, in interleaved rounds; the table shows the median of the "
                   "runs' medians and their spread (cross-process drift is ~5%% on the H200)")
    p.add_argument("--json", default=None, help="write the config, every RESULT, the failures and the table here")
    p.add_argument("--child", nargs=3, metavar=("STACK", "MODEL", "VARIANT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.batch_size = a.batch_size or (128 if a.device == "cuda" else 4)
    a.lr = a.lr if a.lr is not None else (1e-3 if a.optimizer == "sgd" else 1e-4)
    if a.warmup < 1 or a.steps < 1:
        p.error("--warmup and --steps must be at least 1 (a step's time is measured from the previous step's end)")
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    if a.child:
        return child_main(a)
    models = (a.models or ("vit_base_patch16_224,vit_huge_patch16_224" if a.device == "cuda"
                           else "vit_tiny_patch16_224")).split(",")
    stacks = a.stacks.split(",")
    unknown = [s for s in stacks if s not in STACKS]
    if unknown:
        p.error(f"unknown stacks {unknown}; choose from {list(STACKS)}")
    return parent(a, models, stacks)


def parent(a: argparse.Namespace, models: list[str], stacks: list[str]) -> int:
    """Run the plan ``--repeats`` times in interleaved rounds, print each run and the table; 1 if any run failed."""
    many = a.repeats > 1
    print(f"stacks_bench: {', '.join(models)} x {', '.join(stacks)} on {a.device}, batch {a.batch_size}, "
          f"{a.warmup} warm-up + {a.steps} measured steps, optimizer {a.optimizer} lr {a.lr}"
          + (f", {a.repeats} interleaved rounds" if many else ""))
    print("data: 4 synthetic batches made once on the device, DataLoader(batch_size=None) over them: no collate, "
          "no copy, identical in every stack" + ("; timm-train: generated JPEGs through train.py's loader"
                                                 if "timm-train" in stacks else ""))
    if a.device == "cuda":
        try:
            est = estimate_s(models, stacks, a)
            print(f"estimate: about {est / 60:.1f} min on an H200 (~{STARTUP_S:.0f} s start-up a run"
                  + (f", {a.repeats} runs of each)" if many else ")"))
        except Exception as err:  # noqa: BLE001 - an estimate must not stop the run
            print(f"estimate: none ({type(err).__name__}: {err})")
    results: dict[tuple, list[dict]] = {}  # run key -> the RESULT of each successful repeat, in round order
    failures: dict[tuple, list[tuple[int, str]]] = {}  # run key -> (repeat, error) of each failed repeat
    runs = plan(models, [s for s in stacks if s != "timm-train"])
    timm_runs = [("timm-train", m, v) for m in models for v in VARIANTS] if "timm-train" in stacks else []
    n = (len(runs) + len(timm_runs)) * a.repeats
    t0 = time.perf_counter()
    done = 0

    def record(key: tuple, repeat: int, fn: Callable[[], tuple[dict, str]]) -> None:
        nonlocal done
        done += 1
        tag = f"[{done}/{n}] {' '.join(key)}" + (f" (repeat {repeat}/{a.repeats})" if many else "")
        start = time.perf_counter()
        try:
            res, _ = fn()
            why = check_evidence(res)
            if why:
                raise ChildFailed(why, "")
        except ChildFailed as err:
            failures.setdefault(key, []).append((repeat, str(err)))
            print(f"{tag}: FAILED after {time.perf_counter() - start:.0f} s: {err}")
            tail = "\n".join(err.log.strip().splitlines()[-25:])
            if tail:
                print("    " + tail.replace("\n", "\n    "))
            return
        except Exception as err:  # noqa: BLE001 - the harness itself (timm-train's data, a parse): a row too
            failures.setdefault(key, []).append((repeat, f"{type(err).__name__}: {err}"))
            print(f"{tag}: FAILED: {failures[key][-1][1]}")
            return
        res["repeat"] = repeat
        results.setdefault(key, []).append(res)
        extra = ""
        if res.get("graphs"):
            g = res["graphs"]
            extra = f", graphs {g['shapes']} replays {g['replays']} eager {g['eager_calls']}"
        if "median_ms_data" in res:
            extra = f", data {res['median_ms_data']:.1f} ms ({res['bound']}-bound)"
        events = ("" if res["median_ms_events"] is None else
                  f", {res['median_ms_events']:.1f} ms events ({res['disagreement_pct']:+.1f}%)")
        print(f"{tag}: {res['median_ms_wall']:.1f} ms wall{events}, {res['steps']} steps, "
              f"fused {res.get('fused')}, FP8 calls {res.get('fp8_calls', '-')}/{res.get('block_calls', '-')}, "
              f"peak {fmt(res.get('peak_mem_gib'), '.1f')} GiB{extra} ({time.perf_counter() - start:.0f} s)",
              flush=True)

    timm = TimmStack(a) if timm_runs else None
    try:
        # Interleaved rounds: every key once per round, in plan order, so that a drift of the GPU's speed
        # over the session (~5% between processes on the H200) lands on every configuration alike.
        for repeat in range(1, a.repeats + 1):
            for key in runs:
                record(key, repeat, lambda key=key: run_child(key, a))
            for key in timm_runs:
                record(key, repeat, lambda key=key: timm.run(key))
    finally:
        if timm is not None:
            timm.close()
    lines, rows = table(models, stacks, results, failures, a.repeats)
    print(f"\nmedian step times (ms) of {a.steps} steps after {a.warmup}, as 'wall / CUDA events' (events: GPU only, "
          f"not timm-train); speed-up = bf16 / fp8vit; vs plain = a stack's speed-up over the plain loop's "
          f"(target >= {TARGET})")
    if many:
        print(f"{a.repeats} runs of each configuration in interleaved rounds: each time is the median over the "
              "successful runs of each run's median; runs spread % = (max - min) / median of those per-run medians, "
              "bf16 / fp8vit, on the CUDA events where there are any (else wall): a gap between stacks within "
              "their spreads is run-to-run noise")
    print("\n".join(lines))
    failed = sum(len(e) for e in failures.values())
    print(f"done in {(time.perf_counter() - t0) / 60:.1f} min; {failed} failed run(s)"
          + (f" of {n}" if many else ""))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({
            "config": {k: v for k, v in vars(a).items() if k != "child"} | {"models": models, "stacks": stacks},
            "results": [res for runs_ in results.values() for res in runs_],
            "failures": [{"stack": k[0], "model": k[1], "variant": k[2], "repeat": r, "error": e}
                         for k, errs in failures.items() for r, e in errs],
            "repeats": repeat_summary(results, failures),
            "table": rows}, indent=1))
    return 1 if failures else 0


class TimmStack:
    """timm-train's runs: the image folder (made, or ``--timm-data``) and both scripts, made at the
    first run and kept for every repeat; ``close()`` removes them."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.tmp = Path(tempfile.mkdtemp(prefix="stacks_bench_timm_"))
        self.scripts: dict[str, Path] | None = None
        self.data: Path | None = None
        self.error: str | None = None
        self.workers = a.workers if a.device == "cuda" else 0

    def setup(self) -> None:
        """Both scripts and the image folder; once (a failure then fails every timm-train run)."""
        a = self.a
        try:
            original = self.tmp / "timm_original" / "train.py"
            original.parent.mkdir()
            original.write_text(timm_original_train_py())
            self.data = Path(a.timm_data) if a.timm_data else self.tmp / "data"
            if not a.timm_data:
                per_class, size = timm_images(a)
                made = make_image_folder(self.data, per_class, size)
                print(f"timm-train data: {made['images']} JPEGs {size}x{size} (mean {made['mean_kb']:.0f} KB; "
                      f"ImageNet's are ~110 KB at ~400x350, so the loader's work here is a lower bound), "
                      f"written in {made['seconds']:.0f} s")
            self.scripts = {"bf16": original, "fp8vit": TIMM_TRAIN}
        except Exception as err:  # noqa: BLE001 - reported as the failure of every timm-train run
            self.error = f"timm-train setup: {type(err).__name__}: {err}"

    def run(self, key: tuple[str, str, str]) -> tuple[dict, str]:
        """One train.py run of ``key`` (its RESULT and log), the setup done first if not yet."""
        if self.scripts is None and self.error is None:
            self.setup()
        if self.error is not None:
            raise ChildFailed(self.error, "")
        a = self.a
        cfg = Config(*key, a.device, a.batch_size, a.steps, a.warmup, a.optimizer, a.lr)
        try:
            return run_timm_train(cfg, self.scripts[cfg.variant], self.data, self.tmp, self.workers, 2 * a.timeout)
        except subprocess.TimeoutExpired:
            raise ChildFailed(f"timed out after {2 * a.timeout:.0f} s", "") from None

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
