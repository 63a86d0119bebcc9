"""Data-parallel training of converted models: FSDP2 per block, FP8 primary weights, distributed
checkpoints that keep the FP8 scaling state.

    torch.distributed.init_process_group("nccl")                 # torchrun, one process per GPU
    model = fp8vit.convert_to_te(timm.create_model("vit_huge_patch14_224").cuda())
    fp8vit.shard_model(model)                     # fully_shard per block, then the root; bf16 compute
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for x, y in loader:
        with fp8vit.fp8_context():                # delayed-scaling amaxes reduced over all ranks
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    fp8vit.save_checkpoint("ckpt/step1000", model, opt, extra={"step": 1000})   # each rank its shards

DDP needs nothing from here: wrap the converted (optionally CUDA-graphed) model in
``DistributedDataParallel`` as usual. :func:`save_checkpoint` and :func:`load_checkpoint` serve a
plain, DDP or FSDP2 model alike.

What FSDP2 does here (``torch.distributed.fsdp.fully_shard``, PyTorch 2.6+): each block is one unit
whose parameters are all-gathered before its forward and its backward and whose gradients are
reduce-scattered after its backward; the root (patch embedding, position embedding, norm, head) is
the last unit. Per GPU, parameters, gradients and optimizer state are 1/N of the model.

FP8 primary weights (:func:`fp8_weight_init`): TE's ``quantized_model_init`` builds the TE
modules with FP8 weights, which FSDP2 then all-gathers in FP8 (1 byte per weight instead of bf16's
2: TE's ``Float8Tensor.fsdp_pre_all_gather``), as TE 2.19 and 2.20 test with FSDP2
(``tests/pytorch/distributed/fsdp2_tests/run_fsdp2_model.py``, ``run_fsdp2_fused_adam.py``).

Not together with FSDP2: ``make_graphed_blocks`` (refused both ways, :data:`WHY_NOT_WITH_FSDP2`
says why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from .. import _te
from .detect import gpu_info
from .graphs import WHY_NOT_WITH_FSDP2, graphed_modules
from .._te.recipes import check_recipe_name, recipe_name
from .detect import resolve_recipe

__all__ = ["shard_model", "default_mp_policy", "fp8_weight_init", "fp8_weight_optimizer", "save_checkpoint",
           "load_checkpoint", "WHY_NOT_WITH_FSDP2"]


def _fsdp():
    """``torch.distributed.fsdp`` with ``fully_shard``, or a ``RuntimeError`` naming the torch."""
    if not torch.distributed.is_available():
        raise RuntimeError(f"torch {torch.__version__} was built without torch.distributed: no FSDP2 here")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):  # public there from torch 2.6
        raise RuntimeError(f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2); "
                           "upgrade to torch 2.6 or later")
    return fsdp


def default_mp_policy():
    """fp8vit's FSDP2 mixed precision: bf16 compute parameters (what TE's GEMMs and the bf16
    autocast consume anyway, and half of fp32's all-gather), fp32 gradient reduce-scatter (the
    reduction over ranks keeps fp32's precision), fp32 sharded parameters for the optimizer."""
    return _fsdp().MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _units(model: nn.Module) -> List[nn.Module]:
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)) or len(blocks) == 0:
        raise ValueError(f"shard_model: {type(model).__name__} has no nn.Sequential or nn.ModuleList 'blocks' "
                         f"(found {type(blocks).__name__}); pass units=[...], the modules to shard one by one "
                         "(e.g. every block of a Swin's model.layers[i].blocks)")
    return list(blocks)


def shard_model(
    model: nn.Module,
    *,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
    units: Optional[Sequence[nn.Module]] = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2, in place: ``fully_shard`` on each block, then on the model.

    Call it after :func:`convert_to_te` (and :func:`fp8_weight_init`, if used), with the model on
    its device and ``torch.distributed`` initialized, before building the optimizer (which must
    see the sharded parameters). Build the optimizer right after it, before any forward: a forward
    with no backward after it (an evaluation under ``no_grad``) leaves the root's own parameters
    (embeddings, final norm, head) unsharded until the next backward, and an optimizer built in
    between holds those tensors, so they would never train (FSDP2's behaviour; seen on the CPU).
    Train inside :func:`fp8_context` as usual; the forward must run on the returned model (the
    same object).

    Args:
        model: a converted timm ViT (blocks in ``model.blocks``), or any model with ``units``.
        mesh: a 1-D ``DeviceMesh`` (FSDP) or 2-D (HSDP: replicate, shard); None: all ranks, as
            ``fully_shard`` does by default.
        reshard_after_forward: free each block's all-gathered parameters after its forward and
            gather them again for its backward (less memory, one more all-gather per block);
            False keeps them from forward to backward. The root keeps FSDP2's own choice (it is
            needed first in backward, so it is kept).
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``; None: :func:`default_mp_policy`
            (bf16 compute, fp32 reduce). ``MixedPrecisionPolicy()`` computes in the parameters'
            dtype. Its ``cast_forward_inputs`` applies to the root (the images) only: the units
            take their inputs as the model hands them on (the RoPE table that timm's ``Eva``
            hands every block stays fp32, as it does unsharded).
        units: the modules sharded one by one before the root; default ``model.blocks``' children.

    Returns:
        ``model``, now an ``FSDPModule`` whose parameters are ``DTensor`` shards.

    Raises:
        ValueError: ``model`` has CUDA-graphed blocks (:func:`make_graphed_blocks`; the message
            says why they cannot be sharded), is sharded already, or has no ``blocks`` and no
            ``units`` were given.
        RuntimeError: ``torch.distributed`` is not initialized, or this torch has no FSDP2.
    """
    graphed = graphed_modules(model)
    if graphed:
        raise ValueError(f"shard_model: {[n or type(model).__name__ for n in graphed][:4]} of this "
                         f"{type(model).__name__} are CUDA-graphed by make_graphed_blocks; {WHY_NOT_WITH_FSDP2}. "
                         "Shard a model that is not graphed (call release() on make_graphed_blocks' result "
                         "first), or train the graphed model with DistributedDataParallel")
    fsdp = _fsdp()
    if isinstance(model, fsdp.FSDPModule):
        raise ValueError(f"shard_model: this {type(model).__name__} is sharded already (fully_shard was applied)")
    units = _units(model) if units is None else list(units)
    if not torch.distributed.is_initialized():
        raise RuntimeError("shard_model: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group() first (under torchrun: one process per GPU; "
                           "world size 1 works too)")
    policy = default_mp_policy() if mp_policy is None else mp_policy
    # FSDP2 casts every floating-point input of a unit's forward to param_dtype, keywords included:
    # with bf16 that rounded the RoPE table timm's Eva hands each block (blk(x, rope=...)) to bf16
    # (8 bits of sin and cos; unsharded under fp8_context it stays fp32), so a sharded EVA model
    # computed another function than the unsharded one, and each block recomputed the RoPE angles
    # of its own new table instead of reusing the first block's (eva.forward_rope_angles). The
    # units' x needs no cast: it comes from the root or a unit computing in param_dtype already
    # (and under fp8_context the blocks cast it to the autocast dtype). The root casts the images.
    unit_policy = dataclasses.replace(policy, cast_forward_inputs=False)
    attrs = _param_attrs(model)
    for unit in units:
        fsdp.fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=unit_policy)
    fsdp.fully_shard(model, mesh=mesh, mp_policy=policy)
    _restore_param_attrs(model, attrs)
    return model


def _param_attrs(model: nn.Module) -> Dict[str, dict]:
    """Python attributes set on each parameter (TE sets some, e.g. its tensor-parallel markers).

    ``fully_shard`` replaces every parameter by a new ``DTensor`` one, which has none of them: TE's
    own FSDP2 tests carry them over the same way (``fsdp2_utils.save_custom_attrs``), leaving a
    ``QuantizedTensor``'s private ones, which describe the unsharded tensor.
    """
    out = {}
    for name, p in model.named_parameters():
        private_ok = not _te.is_quantized(p)
        out[name] = {k: v for k, v in vars(p).items() if private_ok or not k.startswith("_")}
    return out


def _restore_param_attrs(model: nn.Module, attrs: Dict[str, dict]) -> None:
    for name, p in model.named_parameters():
        for k, v in attrs.get(name, {}).items():
            setattr(p, k, v)


# --------------------------------------------------------------------------- FP8 primary weights
@contextlib.contextmanager
def fp8_weight_init(recipe: Any = None) -> Iterator[Any]:
    """Within: the TE modules that :func:`convert_to_te` (or ``TE_Block``) builds hold their GEMM
    weights in FP8 only, as TE ``QuantizedTensor`` parameters (TE's ``quantized_model_init``).

    Under :func:`shard_model`, FSDP2 then all-gathers those weights in FP8 (1 byte per weight
    instead of bf16's 2) and keeps 1-byte shards. Use:

        with fp8vit.fp8_weight_init("current"):
            fp8vit.convert_to_te(model)            # the model on its GPU
        fp8vit.shard_model(model)
        opt = fp8vit.fp8_weight_optimizer(model.parameters(), lr=1e-4)
        ...                                        # with fp8vit.fp8_context("current"): same recipe

    What changes: the converted weights are FP8-rounded copies of timm's (not bit-exact); an
    optimizer must keep fp32 master weights (:func:`fp8_weight_optimizer`), since an update
    applied to an FP8 weight rounds most of it away; per-GPU memory is not lower than bf16
    FSDP2's, because those masters and fp32 gradients stay (docs/scaling.md). Under delayed
    scaling a converted weight is quantized with its module's initial scale, 1.0 (TE's
    ``Float8Tensor`` copy uses the module's current scale), until the optimizer's first steps
    update it: E4M3 at scale 1 keeps 29.6 dB of a std-0.02 weight against 31.5 dB at its amax's
    scale (CPU emulation of the cast); ``"current"`` quantizes each weight at its own amax.

    Args:
        recipe: the FP8 recipe (name or TE object) of the training loop's ``fp8_context``.

    Yields:
        the TE recipe object in use.

    Raises:
        ValueError: a block-scaled recipe (``"block"``, ``"mxfp8"``; also the default on Blackwell):
            TE's FSDP2 all-gather of their FP8 weights needs weights built on ``meta``.
        FP8UnavailableError: FP8 cannot run here (FP8 weights need TE and an FP8 GPU).
    """
    if isinstance(recipe, str) and check_recipe_name(recipe) not in _PER_TENSOR:
        raise ValueError(_block_scaled_weights(recipe))
    te_recipe = resolve_recipe(recipe, gpu_info().recipes)
    name = recipe_name(te_recipe)
    if name not in _PER_TENSOR:
        raise ValueError(_block_scaled_weights(name))
    with _te.quantized_model_init(te_recipe):
        yield te_recipe


# Recipes whose FP8 weights FSDP2 can all-gather when the weights are built on the GPU (fp8vit
# converts real weights, never on 'meta').
_PER_TENSOR = ("delayed", "current")


def _block_scaled_weights(name: str) -> str:
    return (f"fp8_weight_init({name!r}): FP8 primary weights of a block-scaled recipe cannot be all-gathered "
            "by FSDP2 when they are built on the GPU, as fp8vit's conversion builds them (TE 2.20, "
            "tests/pytorch/distributed/fsdp2_tests/run_fsdp2_fused_adam.py, _build_model: only per-tensor "
            "FP8, DelayedScaling and Float8CurrentScaling, works without the meta device); use 'current' "
            "or 'delayed', or keep bf16 weights with this recipe")


def fp8_weight_optimizer(params, lr: float = 1e-3, **kwargs) -> torch.optim.Optimizer:
    """AdamW for FP8 primary weights: TE's ``FusedAdam`` with fp32 master weights in its state.

    Args:
        params: the (sharded) model's parameters or parameter groups.
        lr: learning rate.
        **kwargs: ``FusedAdam``'s (``betas``, ``eps``, ``weight_decay``, ...).

    Raises:
        TEUnavailableError: TE cannot be imported here.
    """
    kwargs.setdefault("adam_w_mode", True)
    return _te.fused_adam(params, lr=lr, master_weights=True, master_weight_dtype=torch.float32, **kwargs)


# --------------------------------------------------------------------------- checkpoints (DCP)
def _dcp():
    if not torch.distributed.is_available():
        raise RuntimeError(f"torch {torch.__version__} was built without torch.distributed: no "
                           "torch.distributed.checkpoint here; save model.state_dict() with torch.save")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dsd

    return dcp, dsd


@contextlib.contextmanager
def _dcp_notices_off():
    """Two DCP warnings about what fp8vit's helpers do on purpose: without a process group DCP
    assumes one process (every save and load says so), and a save into an existing checkpoint
    overwrites it, as ``torch.save`` to a path does (DCP says its default may change; the writer
    here asks for it explicitly)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint in")
        yield


def _state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    _, dsd = _dcp()
    if optimizer is None:
        return {"model": dsd.get_model_state_dict(model)}
    model_sd, optim_sd = dsd.get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def save_checkpoint(checkpoint_id, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    extra: Optional[Dict[str, Any]] = None) -> None:
    """Save ``model`` (and ``optimizer``) with ``torch.distributed.checkpoint``: every rank writes
    its own shards into the folder ``checkpoint_id`` (an existing checkpoint there is overwritten);
    call it on every rank.

    The model's state is ``get_model_state_dict``'s, FP8 scaling state included: fp8vit's TE
    modules store it as plain tensors (``_extra_state``), which DCP writes once (every rank holds
    the same scales when the amaxes are reduced, :func:`fp8_context`). Works for plain, DDP and
    FSDP2 models, in a process group or in a single process.

    Args:
        checkpoint_id: a folder path (on a file system every rank sees, for several hosts).
        model: the model (sharded or not; a DDP wrapper is fine).
        optimizer: its optimizer, or None.
        extra: small values to keep with it (e.g. ``{"step": 1000}``); :func:`load_checkpoint`
            returns them.
    """
    dcp, _ = _dcp()
    state = _state(model, optimizer)
    if extra:
        state["extra"] = dict(extra)
    with _dcp_notices_off():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(checkpoint_id, overwrite=True))


def load_checkpoint(checkpoint_id, model: nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
    """Load what :func:`save_checkpoint` wrote into ``model`` (and ``optimizer``), in place, on
    every rank; the sharding may differ from the saving run's (DCP reshards).

    FP8 scaling state is restored into a freshly built model too, which has none yet: DCP fills
    only the entries the target state dict already has, so each module's ``_extra_state`` entry is
    laid out as the checkpoint's metadata describes it before loading.

    Load only checkpoints you trust: DCP reads every non-tensor entry (the optimizer's
    hyperparameters, ``extra``, the scaling state's recipe fields) with ``torch.load(...,
    weights_only=False)``, i.e. by unpickling (torch 2.14,
    ``torch/distributed/checkpoint/default_planner.py``, ``DefaultLoadPlanner.load_bytes``), unlike
    ``torch.load(weights_only=True)`` of a ``model.state_dict()`` file.

    Returns:
        the ``extra`` values saved with it (``{}`` if none).

    Raises:
        RuntimeError: a parameter or buffer of ``model`` is not in the checkpoint, or the
            checkpoint holds ones ``model`` lacks; both are named (FP8 scaling state may be absent
            on either side: a module without it in the checkpoint keeps its own).
    """
    dcp, dsd = _dcp()
    saved = _saved(dcp.FileSystemReader(checkpoint_id).read_metadata())
    state = _state(model, optimizer)
    model_sd = state["model"]
    _check_same_keys(checkpoint_id, model_sd, {p[1] for p in saved if p[0] == "model"})
    for key in [k for k in model_sd if k.endswith("_extra_state")]:
        model_sd.pop(key)  # laid out below as saved, or kept by its module when not saved
    for key in {p[1] for p in saved if p[0] == "model" and p[1].endswith("_extra_state")}:
        model_sd[key] = _layout(saved, ("model", key))
    if any(p[0] == "extra" for p in saved):
        state["extra"] = _layout(saved, ("extra",))
    with _dcp_notices_off():
        dcp.load(state, storage_reader=dcp.FileSystemReader(checkpoint_id))
    # strict=False: a module whose scaling state the checkpoint lacks keeps its own
    dsd.set_model_state_dict(model, model_sd, options=dsd.StateDictOptions(strict=False))
    if optimizer is not None:
        dsd.set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return state.get("extra", {})


def _check_same_keys(checkpoint_id, model_sd: Dict[str, Any], saved: set) -> None:
    """Raise, naming them, where the model's parameters and buffers are not the checkpoint's (DCP
    would say only ``Missing key`` inside a ``CheckpointException``); FP8 scaling state may be
    absent on either side."""
    def state(keys):
        return {k for k in keys if not k.endswith("_extra_state")}

    missing, unexpected = sorted(state(model_sd) - saved), sorted(state(saved) - model_sd.keys())
    if missing or unexpected:
        raise RuntimeError(f"load_checkpoint({str(checkpoint_id)!r}): the model's {missing[:6]} "
                           f"({len(missing)} in all) are not in the checkpoint, whose {unexpected[:6]} "
                           f"({len(unexpected)}) are not in the model; it was saved from another model "
                           "(architecture, conversion or module_filter_fn)")


def _saved(meta) -> Dict[tuple, Any]:
    """``{path: storage metadata}`` of each saved entry, its path being its place in the saved
    (nested) state dict: DCP flattens nested dicts to dotted keys and keeps the mapping in
    ``planner_data`` (a key without one is top level)."""
    mapping = meta.planner_data or {}
    return {tuple(mapping.get(k, (k,))): md for k, md in meta.state_dict_metadata.items()}


def _layout(saved: Dict[tuple, Any], prefix: tuple) -> Any:
    """The saved state-dict subtree under ``prefix``, for DCP to fill: empty tensors of the saved
    shapes and dtypes, None for the saved non-tensor values (DCP replaces them)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    root: Dict[Any, Any] = {}
    for path, md in saved.items():
        if path[:len(prefix)] != prefix:
            continue
        leaf = torch.empty(tuple(md.size), dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        rest = path[len(prefix):]
        if not rest:
            return leaf
        node = root
        for part in rest[:-1]:
            node = node.setdefault(part, {})
        node[rest[-1]] = leaf
    return root
