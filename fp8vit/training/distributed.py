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
    fp8vit.save_checkpoint("ckpt", model, opt, extra={"step": 1000})   # each rank its shards; crash-safe

DDP needs nothing from here: wrap the converted (optionally CUDA-graphed) model in
``DistributedDataParallel`` as usual. :func:`save_checkpoint` and :func:`load_checkpoint` serve a
plain, DDP or FSDP2 model alike. A save goes into a new folder under ``ckpt`` and becomes the one
that loads only once it is complete (a pointer file switched atomically), so a process killed while
saving leaves the previous checkpoint loadable.

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

import builtins
import contextlib
import dataclasses
import os
import re
import shutil
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import _te
from .._validate import check_bool, check_items, check_number, check_path, check_type
from .detect import gpu_info
from .graphs import WHY_NOT_WITH_FSDP2, graphed_modules
from .._te.recipes import check_recipe, check_recipe_name, recipe_name
from .detect import resolve_recipe

__all__ = ["shard_model", "default_mp_policy", "fp8_weight_init", "fp8_weight_optimizer", "save_checkpoint",
           "load_checkpoint", "latest_checkpoint", "WHY_NOT_WITH_FSDP2"]


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
        TypeError: ``model`` is not a module, ``mesh`` not a ``DeviceMesh``,
            ``reshard_after_forward`` not a bool, ``mp_policy`` not a ``MixedPrecisionPolicy``,
            ``units`` not a list of modules.
        ValueError: ``model`` has CUDA-graphed blocks (:func:`make_graphed_blocks`; the message
            says why they cannot be sharded), is sharded already, or has no ``blocks`` and no
            ``units`` were given.
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
    """DCP's warning about what fp8vit's helpers do on purpose: without a process group DCP
    assumes one process (every save and load says so)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    _, dsd = _dcp()
    if optimizer is None:
        return {"model": dsd.get_model_state_dict(model)}
    model_sd, optim_sd = dsd.get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


# A checkpoint is a root folder with one folder per save and a pointer to the newest complete one:
#
#     ckpt/latest              "save-000003\nsave-000001\n": the published saves still there, newest
#                              first; replaced atomically (os.replace) once a save is complete
#     ckpt/save-000001/        the save published before (kept: keep=2)
#     ckpt/save-000003/        DCP's files: each rank's shards (__<rank>_0.distcp) and .metadata
#
# A save never writes into a folder that a load may read, so a process killed while saving leaves
# the previous checkpoint as it was (the issue was a save into the loaded folder, overwrite=True).
_LATEST = "latest"
_SAVE_DIR = re.compile(r"save-(\d+)\Z")
# DCP's own metadata file: its coordinator writes it (as .metadata.tmp, fsynced, renamed) only after
# every rank has written and fsynced its shards (torch/distributed/checkpoint/filesystem.py,
# _FileSystemWriter.finish, called by state_dict_saver's all_reduce once all ranks' writes are in).
_DCP_METADATA = ".metadata"


def _check_checkpoint_args(fn: str, checkpoint_id, model, optimizer, extra=None) -> None:
    """The arguments of :func:`save_checkpoint` and :func:`load_checkpoint`, checked at the call."""
    check_path(fn, "checkpoint_id", checkpoint_id)
    check_type(fn, "model", model, nn.Module, "a torch.nn.Module")
    check_type(fn, "optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer", none_ok=True)
    check_type(fn, "extra", extra, dict, "a dict of small values", none_ok=True)


def save_checkpoint(checkpoint_id, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                    extra: Optional[Dict[str, Any]] = None, keep: int = 2) -> str:
    """Save ``model`` (and ``optimizer``) with ``torch.distributed.checkpoint`` into a new folder
    under ``checkpoint_id``, then make it the checkpoint :func:`load_checkpoint` reads there; call
    it on every rank.

    A crash while saving (a preemption, an OOM kill, a node failure) loses nothing: at every
    instant ``checkpoint_id`` holds a complete checkpoint that :func:`load_checkpoint` reads (from
    its first save on). Each save writes a new folder, ``checkpoint_id/save-<n>``: every rank
    writes its shards there and DCP fsyncs each file, then DCP's coordinator writes the folder's
    ``.metadata``, after all ranks' shards are written. Then rank 0 fsyncs the folder and switches
    the pointer file ``checkpoint_id/latest`` to it: written beside it (``latest.tmp-<pid>``),
    fsynced, renamed over it (``os.replace``, atomic) and the root folder fsynced. The pointer
    lists the published saves that are kept, newest first. Only after the switch does it remove
    the other save folders, keeping the newest ``keep`` published ones. A process killed before
    the switch leaves the previous checkpoint current and a ``save-<n>`` that the pointer does not
    name (the next save removes it); killed after it, the new one is current. Two jobs must not
    save into one ``checkpoint_id`` at the same time.

    The model's state is ``get_model_state_dict``'s, FP8 scaling state included: fp8vit's TE
    modules store it as plain tensors (``_extra_state``), which DCP writes once (every rank holds
    the same scales when the amaxes are reduced, :func:`fp8_context`). Works for plain, DDP and
    FSDP2 models, in a process group or in a single process.

    Args:
        checkpoint_id: the checkpoint's root folder (made if missing; on a file system every rank
            sees, for several hosts).
        model: the model (sharded or not; a DDP wrapper is fine).
        optimizer: its optimizer, or None.
        extra: small values to keep with it (e.g. ``{"step": 1000}``); :func:`load_checkpoint`
            returns them.
        keep: how many published saves stay in ``checkpoint_id``, this one included (1 or more);
            the one before stays until this one is published either way, so a save needs room
            for ``keep + 1`` checkpoints.

    Returns:
        the folder this save wrote, ``checkpoint_id/save-<n>``, now :func:`latest_checkpoint`'s.

    Raises:
        TypeError: ``checkpoint_id`` is not a path, ``model`` not a module, ``optimizer`` not an
            optimizer, ``extra`` not a dict.
        ValueError: ``keep`` is not a whole number of 1 or more, or ``checkpoint_id`` is a file.
        OSError: the file system refused a write; raised on every rank (on ranks other than 0,
            for rank 0's error, as the same type when it is a built-in one), and the previous
            checkpoint stays the current one.
    """
    _check_checkpoint_args("save_checkpoint", checkpoint_id, model, optimizer, extra)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"save_checkpoint(keep={keep!r}): keep is how many complete saves to keep, 1 or more")
    dcp, _ = _dcp()
    root = os.fspath(checkpoint_id)
    state = _state(model, optimizer)
    if extra:
        state["extra"] = dict(extra)
    name = _on_rank0(lambda: _new_save_dir(root))
    folder = os.path.join(root, name)
    with _dcp_notices_off():
        # a new, empty folder: overwrite=False makes DCP refuse one that has a .metadata already
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, overwrite=False))
    _on_rank0(lambda: _publish(root, name, keep))
    return folder


def latest_checkpoint(checkpoint_id) -> str:
    """The folder of the newest complete checkpoint in ``checkpoint_id``: the one
    :func:`load_checkpoint` loads from there.

    That is the save folder named first in the pointer file ``checkpoint_id/latest``, which
    :func:`save_checkpoint` switches only once a save is complete. A folder without that pointer
    but with DCP's ``.metadata`` is a checkpoint itself: one save's folder
    (``ckpt/save-000003``), or a checkpoint written by fp8vit 0.1.0's ``save_checkpoint``, which
    wrote the shards into ``checkpoint_id`` itself. Reads files only: no process group needed.

    Args:
        checkpoint_id: a root folder that :func:`save_checkpoint` saved into, or a checkpoint's
            own folder.

    Returns:
        the folder's path.

    Raises:
        TypeError: ``checkpoint_id`` is not a path.
        FileNotFoundError: no complete checkpoint there; the message says what is there (nothing,
            a file, save folders that a killed save left without ``.metadata``), or that the
            pointer names a folder that is gone or incomplete.
    """
    check_path("latest_checkpoint", "checkpoint_id", checkpoint_id)
    root = os.fspath(checkpoint_id)
    pointer = os.path.join(root, _LATEST)
    if os.path.isfile(pointer):
        name = (_published(root) or [""])[0]
        folder = os.path.join(root, name)
        if not _SAVE_DIR.match(name) or not os.path.isfile(os.path.join(folder, _DCP_METADATA)):
            raise FileNotFoundError(f"no complete checkpoint in {root!r}: its pointer {pointer!r} names {name!r}, "
                                    f"which is not a save folder with DCP's {_DCP_METADATA} (removed by hand?); "
                                    f"the save folders there: {[n for _, n in _save_dirs(root)]}")
        return folder
    if os.path.isfile(os.path.join(root, _DCP_METADATA)):
        return root
    raise FileNotFoundError(f"no complete checkpoint in {root!r}: {_what_is_in(root)}")


def _what_is_in(root: str) -> str:
    if not os.path.exists(root):
        return "it does not exist"
    if not os.path.isdir(root):
        return "it is a file, not a checkpoint folder (a torch.save file? torch.load reads those)"
    entries = sorted(os.listdir(root))
    out = f"no {_LATEST!r} pointer and no {_DCP_METADATA}; it holds {entries[:8]} ({len(entries)} entries)"
    saves = [n for _, n in _save_dirs(root)]
    partial = [n for n in saves if not os.path.isfile(os.path.join(root, n, _DCP_METADATA))]
    unpublished = [n for n in saves if n not in partial]
    if partial:
        out += f"; {partial} have no {_DCP_METADATA}: saves that did not finish"
    if unpublished:
        out += (f"; {unpublished} are complete but were never published (the save was stopped before it "
                "wrote the pointer): load one by its own folder")
    return out


def _published(root: str) -> List[str]:
    """The save folders that the pointer ``root/latest`` lists, newest first ([] without it)."""
    try:
        with open(os.path.join(root, _LATEST), encoding="utf-8") as f:
            return f.read().split()
    except FileNotFoundError:
        return []


def _save_dirs(root: str) -> List[Tuple[int, str]]:
    """``(n, name)`` of the ``save-<n>`` folders in ``root``, oldest first."""
    found = []
    for name in os.listdir(root):
        m = _SAVE_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), name))
    return sorted(found)


def _new_save_dir(root: str) -> str:
    """Make ``root/save-<n>``, ``n`` one past every save folder there (complete or not: a folder a
    killed save left is never written into again), and return its name."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"save_checkpoint({root!r}): that is a file; a distributed checkpoint is a folder (one "
                         "folder per save, and a pointer to the newest complete one)")
    os.makedirs(root, exist_ok=True)
    name = f"save-{max((n for n, _ in _save_dirs(root)), default=0) + 1:06d}"
    os.mkdir(os.path.join(root, name))  # no exist_ok: a folder of that name is another writer's
    return name


def _publish(root: str, name: str, keep: int) -> None:
    """Make ``root/name`` (complete: DCP's save returned) the checkpoint of ``root``, the pointer
    listing it and the ``keep - 1`` saves published before it that are still there, then remove
    the other save folders."""
    _fsync_dir(os.path.join(root, name))  # its files' names, before the pointer names the folder
    before = [n for n in _published(root) if n != name and os.path.isfile(os.path.join(root, n, _DCP_METADATA))]
    kept = [name] + before[:keep - 1]
    _replace_file(os.path.join(root, _LATEST), "\n".join(kept) + "\n")
    _remove_old_saves(root, name, kept)


def _replace_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that ``path`` holds its old text or its new one at every
    instant, across a crash too: written beside it, fsynced, renamed over it, its folder fsynced."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(os.path.dirname(path) or ".")


def _fsync_dir(path: str) -> None:
    """fsync a folder: the names of the files created or renamed in it then survive a power loss
    too (the files' contents are fsynced by whoever wrote them). Not on Windows, which cannot open
    a folder."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_old_saves(root: str, current: str, kept: List[str]) -> None:
    """Remove the save folders older than ``current`` that are not ``kept`` (older published
    ones, and those of saves killed before they were published, complete or not), and pointer temp
    files that killed saves left. The new checkpoint is published already: a removal that fails
    is a warning."""
    saves = _save_dirs(root)
    seq = dict((name, n) for n, name in saves)[current]
    doomed = [os.path.join(root, name) for n, name in saves if n < seq and name not in kept]
    doomed += [os.path.join(root, n) for n in os.listdir(root) if n.startswith(f"{_LATEST}.tmp-")]
    for path in doomed:
        try:
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except OSError as err:
            warnings.warn(f"save_checkpoint: saved and published {os.path.join(root, current)}, but could not "
                          f"remove {path}, which it replaces: {err}", RuntimeWarning, stacklevel=4)


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` run by rank 0 alone (or by this process, without a process group of several),
    its result handed to every rank. An exception it raises is raised on every rank, so that none
    is left waiting: on the others as the same type if it is a built-in one, else a RuntimeError
    naming it."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return fn()
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - raised on every rank below
            error = err
    box = [(result, None if error is None else (type(error).__name__, str(error)))]
    dist.broadcast_object_list(box, src=0)
    result, failed = box[0]
    if error is not None:
        raise error
    if failed is not None:
        kind, message = failed
        cls = getattr(builtins, kind, None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            raise cls(f"on rank 0: {message}")
        raise RuntimeError(f"on rank 0: {kind}: {message}")
    return result


def load_checkpoint(checkpoint_id, model: nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
    """Load the newest complete checkpoint that :func:`save_checkpoint` wrote into ``model`` (and
    ``optimizer``), in place, on every rank; the sharding may differ from the saving run's (DCP
    reshards). :func:`latest_checkpoint` says which folder that is; in a process group rank 0
    reads it and every rank loads that one.

    FP8 scaling state is restored into a freshly built model too, which has none yet: DCP fills
    only the entries the target state dict already has, so each module's ``_extra_state`` entry is
    laid out as the checkpoint's metadata describes it before loading.

    Load only checkpoints you trust: DCP reads every non-tensor entry (the optimizer's
    hyperparameters, ``extra``, the scaling state's recipe fields) with ``torch.load(...,
    weights_only=False)``, i.e. by unpickling (torch 2.14,
    ``torch/distributed/checkpoint/default_planner.py``, ``DefaultLoadPlanner.load_bytes``), unlike
    ``torch.load(weights_only=True)`` of a ``model.state_dict()`` file.

    Args:
        checkpoint_id: the root folder :func:`save_checkpoint` saved into (its newest complete
            save is loaded), or a checkpoint's own folder (one ``save-<n>`` in it, or a checkpoint
            fp8vit 0.1.0 wrote, with its shards in the folder itself).
        model: the model to load into (sharded or not, as at saving or otherwise).
        optimizer: its optimizer, or None (the checkpoint's optimizer state is then not read).

    Returns:
        the ``extra`` values saved with it (``{}`` if none).

    Raises:
        TypeError: ``checkpoint_id`` is not a path, ``model`` not a module, ``optimizer`` not an
            optimizer.
        FileNotFoundError: no complete checkpoint in ``checkpoint_id``; the message says what is
            there (:func:`latest_checkpoint`).
        RuntimeError: a parameter or buffer of ``model`` is not in the checkpoint, or the
            checkpoint holds ones ``model`` lacks; both are named (FP8 scaling state may be absent
            on either side: a module without it in the checkpoint keeps its own).
    """
    _check_checkpoint_args("load_checkpoint", checkpoint_id, model, optimizer)
    dcp, dsd = _dcp()
    folder = _on_rank0(lambda: latest_checkpoint(checkpoint_id))  # one answer for all ranks
    saved = _saved(dcp.FileSystemReader(folder).read_metadata())
    state = _state(model, optimizer)
    model_sd = state["model"]
    _check_same_keys(folder, model_sd, {p[1] for p in saved if p[0] == "model"})
    for key in [k for k in model_sd if k.endswith("_extra_state")]:
        model_sd.pop(key)  # laid out below as saved, or kept by its module when not saved
    for key in {p[1] for p in saved if p[0] == "model" and p[1].endswith("_extra_state")}:
        model_sd[key] = _layout(saved, ("model", key))
    if any(p[0] == "extra" for p in saved):
        state["extra"] = _layout(saved, ("extra",))
    with _dcp_notices_off():
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder))
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
