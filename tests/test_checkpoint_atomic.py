"""A process killed while saving a checkpoint leaves the previous one loadable (issue 32, item 4).

Real kills: child processes (tests/checkpoint_child.py) stop in the middle of a save and get
SIGKILL; then a new process resumes from the previous checkpoint, with its weights exactly, and
training on gives the weights of a run that was never interrupted. One file (examples/train_vit.py,
``save_atomically``) and DCP on 2 gloo ranks (``fp8vit.save_checkpoint``); then the layout of a
DCP checkpoint folder and its errors, in this process.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import fp8vit
from helpers import WORLD, free_port, load_example

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "checkpoint_child.py")
REPO = os.path.dirname(HERE)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")


def _env(**kw):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]), **kw)


def _start(args, **env):
    return subprocess.Popen([sys.executable, CHILD, *args], env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _kill_when_stopped(procs, markers, timeout=300):
    """Wait until every marker file exists (the saves stopped halfway), then SIGKILL every process."""
    deadline = time.monotonic() + timeout
    try:
        while not all(os.path.exists(m) for m in markers):
            for p in procs:
                if p.poll() is not None:
                    pytest.fail(f"a child exited ({p.returncode}) before its save stopped:\n{p.stdout.read()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"no stop within {timeout} s: {[m for m in markers if not os.path.exists(m)]}")
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=60)
            p.stdout.close()
    assert all(p.returncode == -signal.SIGKILL for p in procs), [p.returncode for p in procs]


def _equal(a, b):
    """Nested dicts / lists of tensors and values, equal exactly (tensors: torch.equal)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


# --------------------------------------------------------------------------- one file, the example
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU test (the example's CPU model)")
def test_example_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path, capsys):
    out = str(tmp_path)
    ckpt = tmp_path / "ckpt.pt"
    child = _start(["file", out])
    _kill_when_stopped([child], [os.path.join(out, "stopped-0")])
    step1 = torch.load(tmp_path / "step1.pt", weights_only=True)
    assert _equal(torch.load(ckpt, weights_only=True), step1)  # the step-1 checkpoint, whole
    # the kill came in the middle of writing the file: half of it is on disk, beside the checkpoint
    assert [p.name for p in tmp_path.glob("ckpt.pt.tmp-*")] == [f"ckpt.pt.tmp-{child.pid}"]

    ex = load_example("train_vit")
    common = ["--num-classes", "4", "--workers", "0", "--epochs", "2", "--log-every", "1"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the child: the same CPU kernels' sums
    try:
        ex.main(common + ["--steps", "2", "--checkpoint", str(ckpt), "--resume"])
        ex.main(common + ["--steps", "2", "--checkpoint", str(tmp_path / "whole.pt")])
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    assert f"resumed from {ckpt} at step 1, epoch 1" in stdout and f"saved {ckpt} (step 2)" in stdout
    assert not list(tmp_path.glob("ckpt.pt.tmp-*"))  # the next save removed what the killed one left
    resumed, whole = torch.load(ckpt, weights_only=True), torch.load(tmp_path / "whole.pt", weights_only=True)
    assert resumed["step"] == whole["step"] == 2
    assert _equal(resumed["model"], whole["model"]) and _equal(resumed["optimizer"], whole["optimizer"])
    assert not _equal(resumed["model"], step1["model"])  # it trained


def test_save_atomically_keeps_the_old_file_when_the_save_fails(tmp_path):
    ex = load_example("train_vit")
    path = tmp_path / "ckpt.pt"
    ex.save_atomically({"step": 1, "w": torch.ones(3)}, str(path))

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle this")

    with pytest.raises(RuntimeError, match="cannot pickle this"):
        ex.save_atomically({"step": 2, "w": Unpicklable()}, str(path))
    assert torch.load(path, weights_only=True)["step"] == 1 and os.listdir(tmp_path) == ["ckpt.pt"]


# --------------------------------------------------------------------------- DCP, 2 gloo ranks
@pytest.mark.parametrize("stop", ["shards", "publish"])
def test_dcp_save_killed_on_two_ranks_resumes_from_the_previous_checkpoint(tmp_path, stop):
    # shards: both ranks killed with their shard files of step 2 half written; publish: killed with
    # DCP's save of step 2 complete (.metadata written) but not yet published. Either way the
    # checkpoint is step 1's, exactly, and the next save removes what the killed one left.
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip(f"torch {torch.__version__} has no gloo backend for CPU process groups")
    out = str(tmp_path)

    def ranks(*args):
        port = str(free_port())
        return [_start(list(args), RANK=str(r), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                for r in range(WORLD)]

    procs = ranks("dcp", out, stop)
    waits_for = range(WORLD) if stop == "shards" else [0]  # publish: rank 1 waits in a collective
    _kill_when_stopped(procs, [os.path.join(out, f"stopped-{r}") for r in waits_for])
    root = tmp_path / "ckpt"
    assert (root / "save-000002").is_dir()  # what the killed save wrote
    assert (root / "save-000002" / ".metadata").exists() == (stop == "publish")

    procs = ranks("dcp-resume", out)
    for p in procs:
        output = p.communicate(timeout=300)[0]
        assert p.returncode == 0, output[-4000:]
    seen = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert seen["latest"] == str(root / "save-000001")
    assert seen["before"] == ["latest", "save-000001", "save-000002"]
    assert seen["extra"] == {"step": 1}
    assert _equal(seen["loaded"], torch.load(tmp_path / "step1.pt", weights_only=True))
    assert _equal(seen["resumed"], seen["whole"])
    # the new save: save-000003, published; save-000001 kept (keep=2), the killed save-000002 removed
    assert seen["saved"] == str(root / "save-000003")
    assert seen["after"] == ["latest", "save-000001", "save-000003"]
    assert (root / "latest").read_text() == "save-000003\nsave-000001\n"  # the published saves, newest first


# --------------------------------------------------------------------------- DCP folder, one process
def _linear(seed):
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def _weights_from(path, **kw):
    model = nn.Linear(4, 3)
    extra = fp8vit.load_checkpoint(path, model, **kw)
    return model.weight.detach().clone(), extra


def test_each_save_is_a_new_folder_and_the_pointer_names_the_newest(tmp_path):
    root = tmp_path / "ckpt"
    saved = [fp8vit.save_checkpoint(root, _linear(s), extra={"step": s}) for s in range(3)]
    assert saved == [str(root / f"save-{n:06d}") for n in (1, 2, 3)]
    assert sorted(os.listdir(root)) == ["latest", "save-000002", "save-000003"]  # keep=2
    assert (root / "latest").read_text() == "save-000003\nsave-000002\n"
    assert fp8vit.latest_checkpoint(root) == saved[-1]
    weight, extra = _weights_from(root)
    assert extra == {"step": 2} and torch.equal(weight, _linear(2).weight)
    weight, extra = _weights_from(saved[1])  # one save's folder, by its own path
    assert extra == {"step": 1} and torch.equal(weight, _linear(1).weight)
    fp8vit.save_checkpoint(root, _linear(3), keep=1)
    assert sorted(os.listdir(root)) == ["latest", "save-000004"]
    assert (root / "latest").read_text() == "save-000004\n"


def test_a_save_that_did_not_finish_is_ignored_and_removed_by_the_next(tmp_path):
    root = tmp_path / "ckpt"
    fp8vit.save_checkpoint(root, _linear(0), extra={"step": 0})
    (root / "save-000002").mkdir()  # as a killed save leaves it: shards, no .metadata
    (root / "save-000002" / "__0_0.distcp").write_bytes(b"\0" * 10)
    (root / "latest.tmp-12345").write_text("save-000002")  # a pointer write killed before its rename
    weight, extra = _weights_from(root)
    assert extra == {"step": 0} and torch.equal(weight, _linear(0).weight)
    assert fp8vit.save_checkpoint(root, _linear(1), keep=1) == str(root / "save-000003")  # never reused
    assert sorted(os.listdir(root)) == ["latest", "save-000003"]


def test_a_checkpoint_of_the_old_layout_still_loads(tmp_path):
    # fp8vit 0.1.0's save_checkpoint wrote DCP's files into the folder itself
    import torch.distributed.checkpoint as dcp
    root = tmp_path / "old"
    model = _linear(0)
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"model": model.state_dict(), "extra": {"step": 7}}, storage_writer=dcp.FileSystemWriter(root))
    assert fp8vit.latest_checkpoint(root) == str(root)
    weight, extra = _weights_from(root)
    assert extra == {"step": 7} and torch.equal(weight, model.weight)
    fp8vit.save_checkpoint(root, _linear(1))  # a new save beside it, which then loads
    assert torch.equal(_weights_from(root)[0], _linear(1).weight)


def test_no_complete_checkpoint_is_a_file_not_found_error_saying_what_is_there(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint in .*missing.*: it does not exist"):
        fp8vit.load_checkpoint(tmp_path / "missing", nn.Linear(4, 3))
    (tmp_path / "f.pt").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"it is a file, not a checkpoint folder"):
        fp8vit.latest_checkpoint(tmp_path / "f.pt")
    root = tmp_path / "ckpt"
    (root / "save-000001").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"\['save-000001'\] have no \.metadata: saves that did not finish"):
        fp8vit.latest_checkpoint(root)
    (root / "save-000001" / ".metadata").write_bytes(b"")  # complete, never published (killed before the pointer)
    with pytest.raises(FileNotFoundError, match=r"\['save-000001'\] are complete but were never published"):
        fp8vit.latest_checkpoint(root)
    (root / "latest").write_text("save-000009\n")
    with pytest.raises(FileNotFoundError, match=r"names 'save-000009', which is not a save folder"):
        fp8vit.latest_checkpoint(root)


def test_save_refuses_a_bad_keep_and_a_file(tmp_path):
    for keep in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"keep is how many complete saves to keep, 1 or more"):
            fp8vit.save_checkpoint(tmp_path / "ckpt", _linear(0), keep=keep)
    (tmp_path / "f.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"that is a file; a distributed checkpoint is a folder"):
        fp8vit.save_checkpoint(tmp_path / "f.pt", _linear(0))


def test_a_save_that_cannot_remove_the_one_it_replaces_warns_and_is_published(tmp_path, monkeypatch):
    import shutil
    root = tmp_path / "ckpt"
    fp8vit.save_checkpoint(root, _linear(0))

    def refuse(path, *a, **k):
        raise PermissionError(f"not allowed: {path}")

    monkeypatch.setattr(shutil, "rmtree", refuse)
    with pytest.warns(RuntimeWarning, match=r"saved and published .*save-000002, but could not remove .*save-000001"):
        fp8vit.save_checkpoint(root, _linear(1), keep=1)
    assert fp8vit.latest_checkpoint(root) == str(root / "save-000002")
