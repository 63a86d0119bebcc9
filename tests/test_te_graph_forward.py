"""fp8vit._te.lean_graphed_forward (lever 41) on the CPU, against TE 2.20's own graphed forward.

TE's ``new_fwd`` (transformer_engine/pytorch/graph.py, TE 2.20.2, Apache-2.0) is reproduced below
verbatim with stand-ins for the TE classes it reads, so the lean forward is compared with the code
it replaces: the same modules' FP8 metadata set and registered in the same order, the same inner
call, eval mode and FP8 off handled alike; any other forward is left as it is.
"""

from __future__ import annotations

import sys
import types

import pytest
from torch import nn

from fp8vit._te import lean_graphed_forward

TE_NEW_FWD = '''
def make_graphed_forward(func, graph_training_state, graphed, orig_fwd, te_modules, helpers):
    def new_fwd(*user_args, **user_kwargs):
        helpers.ensure_not_reset()

        # If the module's training-or-eval state matches what we graphed,
        # run the graph, otherwise run the original forward method
        if func.training == graph_training_state:
            # Set the FP8 group from global amax reduction.
            if FP8GlobalStateManager.is_fp8_enabled():
                fp8_recipe = FP8GlobalStateManager.get_fp8_recipe()
                for m in func.modules():
                    if m not in te_modules:
                        # Only Set the FP8 meta for the modules included by forward
                        continue
                    if isinstance(m, TransformerEngineBaseModule):
                        from transformer_engine.pytorch.attention.dot_product_attention import (
                            DotProductAttention,
                        )

                        if (
                            isinstance(m, DotProductAttention)
                            and not fp8_recipe.fp8_mha
                            and not fp8_recipe.fp8_dpa
                        ):
                            # Don't need to update FP8 meta for non-FP8 DPA
                            continue
                        m.fp8_meta["fp8_group"] = FP8GlobalStateManager.get_fp8_group()
                        m.fp8_meta["recipe"] = FP8GlobalStateManager.get_fp8_recipe()
                        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(
                            m.fp8_meta,
                        )
                    elif isinstance(m, BasicOperation):
                        for mode in ("forward", "backward"):
                            if m.num_quantizers(mode):
                                m._fp8_metas[mode][
                                    "fp8_group"
                                ] = FP8GlobalStateManager.get_fp8_group()
                                m._fp8_metas[mode][
                                    "recipe"
                                ] = FP8GlobalStateManager.get_fp8_recipe()
                                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(
                                    m._fp8_metas[mode],
                                )
            return graphed(*user_args, **user_kwargs)
        return orig_fwd(*user_args, **user_kwargs)

    return new_fwd
'''


class Recipe:
    def __init__(self, fp8_dpa=False):
        self.fp8_mha, self.fp8_dpa = False, fp8_dpa


class Manager:
    """FP8GlobalStateManager's calls, recorded."""
    enabled, recipe, group = True, Recipe(), "group0"
    added: list = []

    @classmethod
    def is_fp8_enabled(cls):
        return cls.enabled

    @classmethod
    def get_fp8_recipe(cls):
        return cls.recipe

    @classmethod
    def get_fp8_group(cls):
        return cls.group

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, meta):
        cls.added.append((meta["name"], meta["recipe"], meta["fp8_group"]))


class TEModule(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.fp8_meta = {"name": name}


class DotProductAttention(TEModule):
    pass


class BasicOperation(nn.Module):
    def __init__(self, name, quantized=("forward",)):
        super().__init__()
        self._fp8_metas = {m: {"name": f"{name}.{m}"} for m in ("forward", "backward")}
        self.quantized = quantized

    def num_quantizers(self, mode):
        return 2 if mode in self.quantized else 0


class Walks(nn.Sequential):
    """A graphed module that counts the walks over its submodules."""
    walks = 0

    def modules(self):
        Walks.walks += 1
        return super().modules()


class Helpers:
    def __init__(self):
        self.reset = False

    def ensure_not_reset(self):
        if self.reset:
            raise RuntimeError("This graphed callable has been reset and can no longer be used.")


def _te_forward(func, te_modules, helpers, calls):
    dpa_module = types.ModuleType("transformer_engine.pytorch.attention.dot_product_attention")
    dpa_module.DotProductAttention = DotProductAttention
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.attention"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules[dpa_module.__name__] = dpa_module
    ns = {"FP8GlobalStateManager": Manager, "TransformerEngineBaseModule": TEModule,
          "BasicOperation": BasicOperation}
    exec(TE_NEW_FWD, ns)  # noqa: S102 - TE's function, defined in a namespace of stand-ins
    return ns["make_graphed_forward"](func, func.training, lambda *a, **k: calls.append(("graph", a, k)) or "out",
                                      lambda *a, **k: calls.append(("eager", a, k)) or "eager", te_modules, helpers)


def _model():
    block = lambda i: Walks(TEModule(f"qkv{i}"), DotProductAttention(f"attn{i}"), nn.Identity(),  # noqa: E731
                            BasicOperation(f"op{i}", ("forward", "backward")), TEModule(f"mlp{i}"),
                            TEModule(f"uncaptured{i}"))
    model = Walks(block(0), block(1), BasicOperation("opx"))
    captured = {m for m in model.modules() if isinstance(m, (TEModule, BasicOperation))
                and not getattr(m, "fp8_meta", {}).get("name", "").startswith("uncaptured")}
    return model, captured


@pytest.fixture(autouse=True)
def _manager_state(monkeypatch):
    monkeypatch.setattr(Manager, "added", [])
    monkeypatch.setattr(Manager, "enabled", True)
    monkeypatch.setattr(Manager, "recipe", Recipe())
    monkeypatch.setattr(Manager, "group", "group0")
    saved = {k: v for k, v in sys.modules.items() if k.startswith("transformer_engine")}
    yield
    for k in [k for k in sys.modules if k.startswith("transformer_engine")]:
        del sys.modules[k]
    sys.modules.update(saved)


def _run(forward, recipes, *, calls):
    """Three calls per recipe; what was registered and what ran."""
    for recipe in recipes:
        Manager.recipe = recipe
        for step in range(3):
            assert forward(step, key="v") in ("out", "eager")
    return list(Manager.added), list(calls)


def test_the_lean_forward_does_what_tes_does_without_walking_the_modules():
    recipes = [Recipe(), Recipe(fp8_dpa=True), Recipe()]
    model, captured = _model()
    te_calls = []
    te = _te_forward(model, captured, Helpers(), te_calls)
    Walks.walks = 0
    te_added, te_ran = _run(te, recipes, calls=te_calls)
    te_walks = Walks.walks

    Manager.added = []
    model2, captured2 = _model()
    lean_calls = []
    lean = lean_graphed_forward(_te_forward(model2, captured2, Helpers(), lean_calls))
    assert type(lean).__name__ == "_LeanForward"
    Walks.walks = 0
    lean_added, lean_ran = _run(lean, recipes, calls=lean_calls)
    lean_walks = Walks.walks
    # every registration, in TE's order, with the recipe and group of its call; the same graph calls
    assert lean_added == te_added
    assert [n for n, _, _ in te_added[:7]] == ["qkv0", "op0.forward", "op0.backward", "mlp0", "qkv1",
                                               "op1.forward", "op1.backward"]
    assert "attn0" in [n for n, _, _ in te_added] and "uncaptured0" not in [n for n, _, _ in te_added]
    assert lean_ran == te_ran == [("graph", (s,), {"key": "v"}) for _ in recipes for s in range(3)]
    # the metadata each module holds afterwards
    for a, b in zip(model.modules(), model2.modules()):
        if isinstance(a, TEModule):
            assert {k: v for k, v in a.fp8_meta.items() if k != "recipe"} == \
                {k: v for k, v in b.fp8_meta.items() if k != "recipe"}
    # TE walks the model on every call (9); the lean forward once per attention setting (2)
    assert (te_walks, lean_walks) == (9, 2)


def test_eval_mode_fp8_off_and_reset_behave_as_in_te():
    model, captured = _model()
    calls, helpers = [], Helpers()
    lean = lean_graphed_forward(_te_forward(model, captured, helpers, calls))
    model.eval()  # captured in training mode: the eager forward
    assert lean(1) == "eager" and calls[-1] == ("eager", (1,), {}) and Manager.added == []
    model.train()
    Manager.enabled = False  # FP8 off: the graph, nothing registered
    assert lean(2) == "out" and Manager.added == []
    helpers.reset = True
    with pytest.raises(RuntimeError, match="has been reset"):
        lean(3)


def test_other_forwards_are_left_as_they_are():
    def plain(x):
        return x
    assert lean_graphed_forward(plain) is plain
    assert lean_graphed_forward(None) is None

    def closure_of_other_names():
        func, graphed = nn.Linear(1, 1), print

        def new_fwd(*a):
            return graphed(func.training, *a)
        return new_fwd
    other = closure_of_other_names()
    assert lean_graphed_forward(other) is other
    # TE's forward with one more name in its code (a later TE doing more per call): left alone
    model, captured = _model()
    changed = TE_NEW_FWD.replace("helpers.ensure_not_reset()", "helpers.ensure_not_reset(); helpers.extra()")
    ns = {"FP8GlobalStateManager": Manager, "TransformerEngineBaseModule": TEModule, "BasicOperation": BasicOperation}
    exec(changed, ns)  # noqa: S102
    newer = ns["make_graphed_forward"](model, True, print, print, captured, Helpers())
    assert lean_graphed_forward(newer) is newer
