"""Distributed checkpoints (DCP) of plain, DDP or FSDP2 models that keep the FP8 scaling state, and
survive a process killed while saving.

    fp8vit.save_checkpoint("ckpt", model, opt, extra={"step": 1000})   # every rank, its shards
    extra = fp8vit.load_checkpoint("ckpt", model, opt)                 # the newest complete save

A save goes into a new folder under ``ckpt`` and becomes the one that loads only once it is
complete (a pointer file switched atomically), so a process killed while saving leaves the previous
checkpoint loadable; the sharding may differ between the saving and the loading run (DCP reshards).
"""

from __future__ import annotations

import builtins
import contextlib
import os
import re
import shutil
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .._validate import check_path, check_type

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint"]


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
    hyperparameters, ``extra``; FP8 scaling state is a tensor) with ``torch.load(...,
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
