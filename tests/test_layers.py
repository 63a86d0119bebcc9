"""The package's layering (pyproject.toml's import-linter contracts) and the old import paths.

``lint-imports`` holds the layers; these tests run it the way CI does, show that the contracts
do catch a violation (on a copy of the package with one bad import added), and that code written
against fp8vit 0.1's flat module paths still imports, with a warning naming the new path.
"""

import importlib
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import fp8vit
from fp8vit import _moved

ROOT = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports")
needs_linter = pytest.mark.skipif(LINT is None, reason="import-linter is not installed (pip install '.[test]')")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"}, timeout=300)


@needs_linter
def test_the_package_keeps_its_layer_contracts():
    res = _lint(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "5 kept, 0 broken" in res.stdout


@pytest.mark.parametrize("module, line, contract", [
    # a block family importing TE itself, past the seam
    ("blocks/base.py", "import transformer_engine.pytorch", "only inside the seam"),
    # the training layer importing the conversion API above it
    ("training/graphs.py", "from .. import convert", "Layers"),
    # one family importing another
    ("blocks/eva.py", "from . import vit", "independent"),
    ("blocks/convnext.py", "from . import eva", "independent"),
    # BEiT's block (EVA's extended) importing the classic ViT's
    ("blocks/beit.py", "from . import vit", "BEiT's and Swin's blocks extend"),
    ("blocks/swin.py", "from . import beit", "BEiT's and Swin's blocks extend"),
    # the library importing its tools
    ("training/context.py", "from ..tools import bench", "Layers"),
    # a framework integration reaching past the public API
    ("integrations/lightning.py", "from ..training import context", "public API only"),
])
@needs_linter
def test_a_bad_import_breaks_a_contract(tmp_path, module, line, contract):
    shutil.copytree(ROOT / "fp8vit", tmp_path / "fp8vit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "fp8vit" / module
    path.write_text(path.read_text() + f"\n{line}\n")
    res = _lint(tmp_path)
    assert res.returncode != 0, res.stdout
    broken = res.stdout.split("Broken contracts")[-1]
    assert contract in broken, res.stdout


@pytest.mark.parametrize("old, targets", sorted(_moved.MOVED.items()))
def test_old_module_paths_import_with_a_warning_naming_the_new_one(old, targets):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        alias = importlib.import_module(old)
    assert any(issubclass(w.category, DeprecationWarning) and targets[0] in str(w.message) for w in seen), \
        [str(w.message) for w in seen]
    new = importlib.import_module(targets[0])
    public = [n for n in getattr(new, "__all__", []) if not n.startswith("_")]
    assert public, f"{targets[0]} has no __all__"
    for name in public:
        assert getattr(alias, name) is getattr(new, name)
    with pytest.raises(AttributeError, match=targets[0].replace(".", r"\.")):
        alias.no_such_name


def test_public_classes_are_the_ones_at_their_old_paths():
    # A whole-model pickle written before the move names fp8vit.block.TE_Block etc.
    import pickle
    for name in ("TE_Block", "TE_EvaBlock", "GraphedBlocks", "BlockConfig"):
        cls = getattr(fp8vit, name)
        assert pickle.loads(pickle.dumps(cls)) is cls
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from fp8vit.block import TE_Block
        from fp8vit.eva import TE_EvaBlock
    assert TE_Block is fp8vit.TE_Block and TE_EvaBlock is fp8vit.TE_EvaBlock
