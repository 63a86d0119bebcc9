"""Data-parallel training of converted models: FSDP2 per block and FP8 primary weights
(checkpoints of them: :mod:`fp8vit.training.checkpoint`).

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
    fp8vit.save_checkpoint("ckpt", model, opt, extra={"step": 1000})   # each rank its shards; crash-safe

DDP needs nothing from here: wrap the converted (optionally CUDA-graphed) model in
``DistributedDataParallel`` as usual.

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
from .._validate import check_bool, check_items, check_number, check_type
from .detect import gpu_info
from .graphs import WHY_NOT_WITH_FSDP2, _dispatch_of, _vits_inside, graphed_modules
from .._te.recipes import check_recipe, check_recipe_name, recipe_name
from .detect import resolve_recipe

__all__ = ["shard_model", "default_mp_policy", "fp8_weight_init", "fp8_weight_optimizer", "WHY_NOT_WITH_FSDP2"]


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
    """``model.blocks``' children; for a model whose blocks sit in stages (Swin's ``layers[i].blocks``,
    ConvNeXt's ``stages[i].blocks``), the children of every ``blocks`` container holding fp8vit blocks."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)) and len(blocks):
        return list(blocks)
    staged = [b for m in _vits_inside(model) for b in m.blocks]  # the modules whose blocks hold fp8vit blocks
    if not staged:
        raise ValueError(f"shard_model: {type(model).__name__} has no nn.Sequential or nn.ModuleList 'blocks' "
                         f"(found {type(blocks).__name__}) and no stages whose 'blocks' hold fp8vit blocks; pass "
                         "units=[...], the modules to shard one by one")
    return staged


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
        units: the modules sharded one by one before the root; default ``model.blocks``' children
            (or every stage's, for a Swin or ConvNeXt: ``layers[i].blocks``, ``stages[i].blocks``).

    Returns:
        ``model``, now an ``FSDPModule`` whose parameters are ``DTensor`` shards.

    Raises:
        TypeError: ``model`` is not a module, ``mesh`` not a ``DeviceMesh``,
            ``reshard_after_forward`` not a bool, ``mp_policy`` not a ``MixedPrecisionPolicy``,
            ``units`` not a list of modules.
        ValueError: ``model`` has CUDA-graphed blocks with graphs captured (:func:`make_graphed_blocks`;
            the message says why they cannot be sharded; graphs set up by ``convert_to_te`` and not
            captured yet are released with a warning), is sharded already, or has no ``blocks`` and
            no ``units`` were given.
        RuntimeError: ``torch.distributed`` is not initialized, or this torch has no FSDP2.
    """
    fn = "shard_model"
    check_type(fn, "model", model, nn.Module, "a torch.nn.Module")
    if mesh is not None or mp_policy is not None:
        from torch.distributed.device_mesh import DeviceMesh

        check_type(fn, "mesh", mesh, DeviceMesh, "a torch.distributed DeviceMesh (init_device_mesh)", none_ok=True)
        check_type(fn, "mp_policy", mp_policy, _fsdp().MixedPrecisionPolicy,
                   "a torch.distributed.fsdp.MixedPrecisionPolicy", none_ok=True)
    check_bool(fn, "reshard_after_forward", reshard_after_forward)
    units = None if units is None else check_items(fn, "units", units, nn.Module, "torch.nn.Module")
    graphed = graphed_modules(model)
    dispatches = [_dispatch_of(model.get_submodule(n)) for n in graphed]
    if graphed and all(d.handle is not None and not d.handle.shapes for d in dispatches):
        # set up by convert_to_te (cuda_graphs, or compile=True's default) and never captured: let
        # them go, and say so; the blocks then run eagerly under FSDP2
        for handle in {id(d.handle): d.handle for d in dispatches}.values():
            handle.release()
        names = [n or type(model).__name__ for n in graphed][:4]  # "": the model itself (its stem graphed too)
        warnings.warn(f"fp8vit.shard_model: the CUDA graphs convert_to_te set up for {names} (none captured "
                      f"yet) are released, and the blocks run eagerly: {WHY_NOT_WITH_FSDP2}. Convert with "
                      "cuda_graphs=False to skip them, or train the graphed model with DistributedDataParallel",
                      UserWarning, stacklevel=2)
        graphed = []
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
def fp8_weight_init(recipe: Any = None) -> contextlib.AbstractContextManager:
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

    Returns:
        a context manager; entering it gives the TE recipe object in use.

    Raises:
        TypeError: at the call: ``recipe`` is neither a name nor a TE recipe object.
        ValueError: an unknown recipe name, or a block-scaled recipe (``"block"``, ``"mxfp8"``;
            also the default on Blackwell): TE's FSDP2 all-gather of their FP8 weights needs
            weights built on ``meta``. At the call for a name, on entering for the default.
        FP8UnavailableError: on entering: FP8 cannot run here (FP8 weights need TE and an FP8 GPU).
    """
    check_recipe("fp8_weight_init", recipe)
    if isinstance(recipe, str) and check_recipe_name(recipe) not in _PER_TENSOR:
        raise ValueError(_block_scaled_weights(recipe))
    return _fp8_weight_init(recipe)


@contextlib.contextmanager
def _fp8_weight_init(recipe: Any) -> Iterator[Any]:
    """:func:`fp8_weight_init` once its argument is checked."""
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
        TypeError: ``params`` is not an iterable of tensors or dicts (a single tensor included),
            or ``lr`` not a number.
        ValueError: ``lr`` is negative or NaN.
        TEUnavailableError: TE cannot be imported here.
    """
    fn = "fp8_weight_optimizer"
    params = check_items(fn, "params", params, (torch.Tensor, dict),
                         "parameters or parameter groups (model.parameters())")
    check_number(fn, "lr", lr, min=0)
    kwargs.setdefault("adam_w_mode", True)
    return _te.fused_adam(params, lr=lr, master_weights=True, master_weight_dtype=torch.float32, **kwargs)
