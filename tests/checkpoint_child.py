"""The processes of tests/test_checkpoint_atomic.py, which SIGKILLs them in the middle of a save.

    python tests/checkpoint_child.py file OUT
        examples/train_vit.py on the CPU: a run of 1 step that saves its checkpoint (copied to
        OUT/step1.pt), then a resumed run to step 2 whose save stops halfway through the file.
    python tests/checkpoint_child.py dcp OUT STOP          (one of 2 gloo ranks: RANK, WORLD_SIZE, MASTER_*)
        a ViT sharded with FSDP2: a step, fp8vit.save_checkpoint (its full weights to OUT/step1.pt),
        a step, and a save that stops at STOP: "shards" (each rank has written one item of its
        shard file) or "publish" (DCP's save is complete, the checkpoint not yet published).
    python tests/checkpoint_child.py dcp-resume OUT        (one of 2 gloo ranks)
        load_checkpoint into a fresh sharded model, train on to step 2, beside a model trained 2
        steps without a break; save again; rank 0 writes what it saw to OUT/resumed.pt.

A stopped save writes OUT/stopped-<rank> and sleeps until the test kills the process. The stops are
this script's own: it replaces torch.save or DCP's writer functions in its own process, so that
the library and the example hold no code for the test.
"""

import contextlib
import datetime
import io
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import fp8vit  # noqa: E402
from helpers import dp_batches, dp_train, exit_without_shutdown, full_params, load_example  # noqa: E402


def stop(out, rank, stream=None):
    """Make what was written so far reach the disk, say so, and wait to be killed."""
    if stream is not None:
        stream.flush()
        os.fsync(stream.fileno())
    open(os.path.join(out, f"stopped-{rank}"), "w").close()
    time.sleep(600)
    sys.exit("not killed within 600 s")


def file_run(out):
    torch.set_num_threads(1)  # as the test's own runs: the same CPU kernels' sums
    ex = load_example("train_vit")
    ckpt = os.path.join(out, "ckpt.pt")
    common = ["--num-classes", "4", "--workers", "0", "--epochs", "2", "--log-every", "1", "--checkpoint", ckpt]
    ex.main(common + ["--steps", "1"])
    with open(ckpt, "rb") as src, open(os.path.join(out, "step1.pt"), "wb") as dst:
        dst.write(src.read())
    real_save = torch.save

    def half_save(obj, f, *args, **kwargs):  # the example's next torch.save: half of the bytes, then stop
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        stream = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f
        stream.write(data[:len(data) // 2])
        stop(out, 0, stream)

    torch.save = half_save
    ex.main(common + ["--steps", "2", "--resume"])


def _vit():
    from timm.models.vision_transformer import VisionTransformer
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=64, depth=2, num_heads=4, num_classes=3)
    return fp8vit.convert_to_te(model, backend="reference", exact_gelu=True)


def _sharded():
    from torch.distributed.fsdp import MixedPrecisionPolicy
    model = fp8vit.shard_model(_vit(), mp_policy=MixedPrecisionPolicy())  # fp32: exact comparisons
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _stop_dcp_at(where, out, rank):
    from torch.distributed.checkpoint import filesystem
    if where == "shards":
        real_write_item = filesystem._write_item
        written = []

        def write_item(transforms, stream, *args, **kwargs):  # one item into the shard file, then stop
            if written:
                stop(out, rank, stream)
            written.append(real_write_item(transforms, stream, *args, **kwargs))
            return written[-1]

        filesystem._write_item = write_item
    elif where == "publish":
        real_finish = filesystem._FileSystemWriter.finish

        def finish(self, *args, **kwargs):  # the coordinator (rank 0): .metadata written, then stop
            real_finish(self, *args, **kwargs)
            stop(out, rank)

        filesystem._FileSystemWriter.finish = finish
    else:
        raise SystemExit(f"unknown stop {where!r}")


def dcp_run(out, where):
    rank = torch.distributed.get_rank()
    root = os.path.join(out, "ckpt")
    batches = dp_batches()
    model, opt = _sharded()
    dp_train(model, batches[:1], rank, opt)
    fp8vit.save_checkpoint(root, model, opt, extra={"step": 1})
    saved = full_params(model)
    if rank == 0:
        torch.save(saved, os.path.join(out, "step1.pt"))
    dp_train(model, batches[1:2], rank, opt)
    _stop_dcp_at(where, out, rank)
    fp8vit.save_checkpoint(root, model, opt, extra={"step": 2})
    sys.exit("the save was not stopped")


def dcp_resume(out):
    rank = torch.distributed.get_rank()
    root = os.path.join(out, "ckpt")
    batches = dp_batches()
    seen = {"latest": fp8vit.latest_checkpoint(root), "before": sorted(os.listdir(root))}
    model, opt = _sharded()
    seen["extra"] = fp8vit.load_checkpoint(root, model, opt)
    seen["loaded"] = full_params(model)
    dp_train(model, batches[seen["extra"]["step"]:2], rank, opt)
    seen["resumed"] = full_params(model)
    ref, ref_opt = _sharded()
    dp_train(ref, batches[:2], rank, ref_opt)
    seen["whole"] = full_params(ref)
    seen["saved"] = fp8vit.save_checkpoint(root, model, opt, extra={"step": 2})
    seen["after"] = sorted(os.listdir(root))
    if rank == 0:
        torch.save(seen, os.path.join(out, "resumed.pt"))


def main():
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "file":
        return file_run(out)
    torch.set_num_threads(1)  # two processes on two cores
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    with contextlib.ExitStack() as stack:
        stack.callback(torch.distributed.destroy_process_group)
        if mode == "dcp":
            dcp_run(out, sys.argv[3])
        elif mode == "dcp-resume":
            dcp_resume(out)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        torch.distributed.barrier()  # both ranks finish before either tears gloo down
    return "gloo"


if __name__ == "__main__":
    if main() == "gloo":
        exit_without_shutdown()
