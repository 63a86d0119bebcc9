"""Lightning runs for tests/test_lightning.py: a tiny timm ViT trained through ``FP8VitPrecision``.

    python tests/lightning_child.py OUT [DEVICES] [ACCELERATOR]
        ``run(OUT, devices, accelerator)`` (below) in this process; with DEVICES 2 Lightning's "ddp"
        strategy starts the second rank by running this script again (gloo on the CPU, NCCL on
        GPUs). Each rank writes OUT/rank<r>.pt.

``run`` trains 3 steps with a module that the plugin converts (a checkpoint is saved at the end),
then resumes from that checkpoint to step 5 with a module that converts itself in
``configure_model`` (Lightning loads a checkpoint's weights before the plugin's ``convert_module``),
and records what each run saw: the blocks' classes, whether every block forward ran inside
``fp8_context`` (and under which FP8 state), the weights at the end of the first run and at the
start of the second, the global steps, the losses.
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning as L
import timm
import torch

import fp8vit
from fp8vit.integrations.lightning import FP8VitPrecision
from fp8vit.training.context import active_fp8_state

STEPS, RESUMED_STEPS, BATCH = 3, 5, 4


class LitViT(L.LightningModule):
    """A tiny timm ViT; ``convert_self`` converts it in ``configure_model``, the resumable way."""

    def __init__(self, convert_self: bool = False):
        super().__init__()
        self.convert_self = convert_self
        self.model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=2)
        self.seen: list = []  # per block forward: (inside fp8_context, FP8 on, autocast dtype)
        self.losses: list = []
        self.start_weights: dict = {}

    def configure_model(self):
        if self.convert_self:
            fp8vit.convert_to_te(self.model)

    def _spy(self):
        for block in self.model.blocks:
            block.register_forward_pre_hook(self._record)

    def _record(self, module, args):
        state = active_fp8_state()
        dtype = torch.get_autocast_dtype(args[0].device.type) if torch.is_autocast_enabled(args[0].device.type) \
            else None
        self.seen.append((state is not None, bool(state and state.fp8), str(dtype)))

    def on_fit_start(self):  # after the plugin's convert_module and the checkpoint's restore
        self._spy()
        self.start_weights = {k: v.detach().cpu().clone() for k, v in self.state_dict().items()}

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader(devices):
    """An epoch of STEPS batches on each rank (the first run ends with its epoch)."""
    g, n = torch.Generator().manual_seed(0), STEPS * BATCH * devices
    images, labels = torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 2, (n,), generator=g)
    data = torch.utils.data.TensorDataset(images, labels)
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def trainer(out, devices, accelerator, max_steps):
    return L.Trainer(accelerator=accelerator, devices=devices, strategy="ddp" if devices > 1 else "auto",
                     plugins=[FP8VitPrecision()], max_steps=max_steps, default_root_dir=out, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=2, val_check_interval=2, num_sanity_val_steps=0)


def run(out: str, devices: int = 1, accelerator: str = "cpu") -> dict:
    torch.manual_seed(0)
    first = LitViT()
    t1 = trainer(out, devices, accelerator, STEPS)
    t1.fit(first, loader(devices), loader(devices))
    ckpt = os.path.join(out, "first.ckpt")
    t1.save_checkpoint(ckpt)

    torch.manual_seed(1)  # other initial weights: the checkpoint's must replace them
    second = LitViT(convert_self=True)
    t2 = trainer(out, devices, accelerator, RESUMED_STEPS)
    t2.fit(second, loader(devices), loader(devices), ckpt_path=ckpt)
    return {
        "rank": t1.global_rank,
        "world": t1.world_size,
        "blocks": [type(b).__name__ for b in first.model.blocks],
        "resumed_blocks": [type(b).__name__ for b in second.model.blocks],
        "steps": (t1.global_step, t2.global_step),
        "seen": first.seen,
        "resumed_seen": second.seen,
        "losses": first.losses,
        "resumed_losses": second.losses,
        "end_weights": {k: v.detach().cpu() for k, v in first.state_dict().items()},
        "resumed_start_weights": second.start_weights,
        "resumed_end_weights": {k: v.detach().cpu() for k, v in second.state_dict().items()},
        "summary": str(fp8vit.conversion_summary(first)),
    }


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    out = sys.argv[1]
    devices = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    accelerator = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    res = run(out, devices, accelerator)
    torch.save(res, os.path.join(out, f"rank{res['rank']}.pt"))
