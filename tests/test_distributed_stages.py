"""Models whose fused blocks sit in stages (Swin's ``layers[i].blocks``, ConvNeXt's ``stages[i].blocks``)
under DDP and FSDP2 on 2 gloo processes (CPU, reference backend, fp32): training on half the
batch per rank equals one process on the whole batch; FSDP2's default units are every stage's
blocks (no ``units=`` needed)."""

import functools
import warnings

import pytest
import timm
import torch

import fp8vit
from helpers import FP32_ATOL, dp_batches, dp_train, full_params, max_diff, perturbed, rank_results, run_ranks

# tiny models on the 32 px images of helpers.dp_batches (labels in [0, 3)); no drop path (Swin-T's default
# 0.2 draws per image: half a batch per rank draws other masks than the whole batch)
MODELS = {
    # 8 x 8 map in 4 x 4 windows, the second block shifted; then 4 x 4 in one window
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=32, patch_size=4, window_size=4, embed_dim=32,
                                                  depths=(2, 2), num_heads=(2, 4), drop_path_rate=0.0)),
    "convnext": ("convnext_tiny", dict(depths=(2, 1, 1, 1), dims=(16, 32, 48, 64))),
}


def _converted(key):
    name, kw = MODELS[key]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference-backend note
        model = perturbed(timm.create_model(name, pretrained=False, num_classes=5, **kw))
        return fp8vit.convert_to_te(model, backend="reference", exact_gelu=True).train()


def _case_fsdp_fp32(rank, tmp, key):
    from torch.distributed.fsdp import MixedPrecisionPolicy
    batches = dp_batches()
    ref = _converted(key)
    dp_train(ref, batches)
    model = fp8vit.shard_model(_converted(key), mp_policy=MixedPrecisionPolicy())
    units = [type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP")]
    dp_train(model, batches, rank)
    return {"diff": max_diff(full_params(ref), full_params(model)), "units": units}


def _case_ddp(rank, tmp, key):
    batches = dp_batches()
    ref, model = _converted(key), _converted(key)
    dp_train(ref, batches)
    dp_train(torch.nn.parallel.DistributedDataParallel(model), batches, rank)
    return {"diff": max_diff(full_params(ref), full_params(model))}


def _case_dcp(rank, tmp, key):
    import os
    from torch.distributed.fsdp import MixedPrecisionPolicy
    batches = dp_batches() * 2
    path = os.path.join(tmp, f"ckpt_{key}")
    model = fp8vit.shard_model(_converted(key), mp_policy=MixedPrecisionPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_train(model, batches[:2], rank, opt)
    saved = full_params(model)
    fp8vit.save_checkpoint(path, model, opt, extra={"step": 2})
    dp_train(model, batches[2:], rank, opt)
    fresh = fp8vit.shard_model(_converted(key), mp_policy=MixedPrecisionPolicy())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    extra = fp8vit.load_checkpoint(path, fresh, fresh_opt)
    loaded = full_params(fresh)
    dp_train(fresh, batches[2:], rank, fresh_opt)
    return {"loaded_diff": max_diff(saved, loaded), "continued_diff": max_diff(full_params(model), full_params(fresh)),
            "extra": extra}


CASES = {f"{name[len('_case_'):]}/{key}": functools.partial(fn, key=key)
         for name, fn in dict(globals()).items() if name.startswith("_case_") for key in MODELS}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(CASES, str(tmp_path_factory.mktemp("dist_stages")))


@pytest.mark.parametrize("key", list(MODELS))
def test_fsdp2_shards_every_stage_block_and_trains_as_one_process(ranks, key):
    r0, r1 = (rank_results(ranks, f"fsdp_fp32/{key}"))
    print(f"{key}: FSDP2 fp32 vs one process: max |diff| {r0['diff']:.2e}; FSDP units {r0['units']}")
    blocks = {"swin": 4, "convnext": 5}[key]
    assert len(r0["units"]) == blocks + 1  # every block, then the root
    assert r0["diff"] < FP32_ATOL and r1["diff"] < FP32_ATOL


@pytest.mark.parametrize("key", list(MODELS))
def test_ddp_trains_as_one_process_on_the_whole_batch(ranks, key):
    for r in rank_results(ranks, f"ddp/{key}"):
        assert r["diff"] < FP32_ATOL


@pytest.mark.parametrize("key", list(MODELS))
def test_dcp_round_trip_into_a_fresh_sharded_model_is_exact(ranks, key):
    # the checkpoint (weights, AdamW state) of a sharded stage model loads into a fresh one, which
    # then trains on exactly as the original
    for r in rank_results(ranks, f"dcp/{key}"):
        assert r["loaded_diff"] == 0 and r["continued_diff"] == 0 and r["extra"]["step"] == 2
