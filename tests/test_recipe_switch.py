"""fp8vit._te.recipe_switch on CPU: when the mixin makes TE forget a module's place in its
delayed-scaling buffers (a fake TE base class; TE's own behaviour is checked on the GPU in
tests/gpu/test_fp8_gpu.py::test_delayed_scaling_updates_after_a_recipe_switch)."""

import pytest

from fp8vit._te import recipe_switch
from fp8vit._te.recipe_switch import BUFFER_KEY, RecipeSwitchFix


class DelayedState:  # stands in for TE's DelayedScalingRecipeState
    pass


class CurrentState:
    pass


class Recipe:
    def __init__(self, delayed):
        self._delayed = delayed

    def delayed(self):
        return self._delayed


class FakeTEModule:
    def __init__(self, meta):
        self.fp8_meta, self.calls = dict(meta), []

    def init_fp8_metadata(self, num_gemms=1):
        self.calls.append(num_gemms)


class Module(RecipeSwitchFix, FakeTEModule):
    pass


@pytest.mark.parametrize("state, recipe, forgets", [
    (CurrentState(), Recipe(True), True),     # delayed after another kind: TE would keep the stale place
    (DelayedState(), Recipe(True), False),    # delayed all along: registered tensors are the live ones
    (CurrentState(), Recipe(False), False),   # still the other kind
    (CurrentState(), None, False),            # FP8 off
    (None, Recipe(True), False),              # no state yet
])
def test_forgets_the_buffer_place_only_when_delayed_meets_a_state_of_another_kind(monkeypatch, state, recipe, forgets):
    monkeypatch.setattr(recipe_switch, "_delayed_state_type", lambda: DelayedState)
    monkeypatch.setattr(recipe_switch, "active_fp8_recipe", lambda: recipe)
    meta = {BUFFER_KEY: (3, "key"), "other": 1}
    if state is not None:
        meta["scaling_fwd"] = state
    mod = Module(meta)
    mod.init_fp8_metadata(num_gemms=2)
    assert (BUFFER_KEY not in mod.fp8_meta) == forgets
    assert mod.fp8_meta["other"] == 1 and mod.calls == [2]  # TE's own setup runs, with its arguments


def test_without_a_registration_nothing_is_looked_up(monkeypatch):
    def fail():
        raise AssertionError("the active recipe was looked up")
    monkeypatch.setattr(recipe_switch, "active_fp8_recipe", fail)
    monkeypatch.setattr(recipe_switch, "_delayed_state_type", lambda: DelayedState)
    Module({"scaling_fwd": CurrentState()}).init_fp8_metadata()
    Module({BUFFER_KEY: 0, "scaling_fwd": DelayedState()}).init_fp8_metadata()
