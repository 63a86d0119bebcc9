"""timm's own train.py with fp8vit's one-line change (examples/timm_train/train.py) trains a tiny ViT
on an image folder, with an EMA copy, and resumes from its own checkpoint (CPU: reference modules,
bf16; the GPU twin is tests/gpu/test_frameworks_gpu.py)."""

from __future__ import annotations

import csv
import hashlib
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import fp8vit

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "timm_train" / "train.py"
TIMM_VERSION = "1.0.31"  # the release the tests pin (pyproject.toml)
MODEL_KWARGS = dict(img_size=32, patch_size=8, depth=2)


def image_folder(root: Path, size: int = 32) -> Path:
    """Two classes (a red and a blue image family), train and validation splits, 8 images a split."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split in ("train", "validation"):
        for cls, color in (("a", (200, 30, 30)), ("b", (30, 30, 200))):
            d = root / split / cls
            d.mkdir(parents=True)
            for i in range(4):
                noise = torch.randint(-20, 20, (size, size, 3), generator=g)
                pixels = (torch.tensor(color) + noise).clamp(0, 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(d / f"{i}.png")
    return root


def train(data: Path, out: Path, experiment: str, epochs: int, *extra: str, device: str = "cpu"):
    kwargs = [f"{k}={v}" for k, v in MODEL_KWARGS.items()]
    cmd = [sys.executable, str(TRAIN), "--data-dir", str(data), "--model", "vit_tiny_patch16_224",
           "--model-kwargs", *kwargs, "--num-classes", "2", "--img-size", "32", "--device", device,
           "--workers", "0", "-b", "4", "--opt", "sgd", "--lr", "0.01", "--warmup-epochs", "0", "--no-aug",
           "--epochs", str(epochs), "--output", str(out), "--experiment", experiment, "--checkpoint-hist", "2",
           "--amp", "--amp-dtype", "bfloat16", "--model-ema", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


def summary(exp: Path) -> list:
    with open(exp / "summary.csv") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)  # holds train.py's argparse.Namespace


@pytest.mark.skipif(timm.__version__ != TIMM_VERSION,
                    reason=f"the vendored train.py is tested with timm {TIMM_VERSION}, installed: {timm.__version__}")
def test_timm_train_py_trains_and_resumes_from_its_checkpoint(tmp_path):
    data = image_folder(tmp_path / "data")
    out = tmp_path / "out"
    first = train(data, out, "first", 2)
    assert "fp8vit: FP8 is off" in first.stderr  # the model's own forward entered fp8vit's FP8 context
    rows = summary(out / "first")
    assert [r["epoch"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["eval_loss"]) for r in rows)

    ckpt = checkpoint(out / "first" / "last.pth.tar")
    assert ckpt["epoch"] == 1
    # fp8vit's blocks are in the checkpoint, the EMA copy's too, and load into a converted model
    for key in ("state_dict", "state_dict_ema"):
        assert "blocks.0.qkv.layer_norm_weight" in ckpt[key] and "blocks.0.norm1.weight" not in ckpt[key]
    model = fp8vit.convert_to_te(timm.create_model("vit_tiny_patch16_224", num_classes=2, **MODEL_KWARGS))
    model.load_state_dict(ckpt["state_dict"])  # strict

    resumed = train(data, out, "resumed", 3, "--resume", str(out / "first" / "last.pth.tar"))
    assert "Restoring model state from checkpoint" in resumed.stdout + resumed.stderr
    rows = summary(out / "resumed")
    assert [r["epoch"] for r in rows] == [2]  # carries on after the checkpoint's epoch 1
    assert math.isfinite(rows[0]["train_loss"])
    end = checkpoint(out / "resumed" / "last.pth.tar")
    assert end["epoch"] == 2
    # and it trained
    before = ckpt["state_dict"]
    assert any(v.is_floating_point() and not torch.equal(v, before[k]) for k, v in end["state_dict"].items())


def test_the_vendored_script_is_timms_but_for_its_header_and_the_marked_lines():
    text = TRAIN.read_text()
    recorded = re.search(r"sha256 of the original file\n# ([0-9a-f]{64})", text).group(1)
    lines = text.splitlines(keepends=True)
    header = [line for line in lines[1:] if line.startswith("# ")][:7]
    marked = [line for line in lines if "# fp8vit" in line and line not in header]
    assert [line.strip() for line in marked] == [
        "import fp8vit  # fp8vit",
        "fp8vit.convert_to_te(model, autocast=True, cuda_graphs=True)  # fp8vit: FP8 blocks, run in FP8 by the model's forward"]
    original = "".join(line for line in lines if line not in header and line not in marked)
    assert hashlib.sha256(original.encode()).hexdigest() == recorded
    assert "Apache License" in (TRAIN.parent / "TIMM_LICENSE").read_text()
