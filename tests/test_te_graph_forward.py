"""fp8vit._te.lean_graphed_forward (lever 41) on the CPU, against TE 2.20's own graphed forward.

TE's ``new_fwd`` (transformer_engine/pytorch/graph.py, TE 2.20.2, Apache-2.0) is reproduced below
verbatim with stand-ins for the TE classes it reads, so the lean forward is compared with the code
it replaces: the same modules' FP8 metadata set and registered in the same order, the same inner
call, eval mode and FP8 off handled alike; any other forward is left as it is.
"""

from __future__ import annotations

import collections
import gc
import sys
import types
import weakref

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

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


# TE 2.20.2's make_graphed_autograd_function (transformer_engine/pytorch/graph.py, Apache-2.0), verbatim
# inside a factory for the one variable it reads from make_graphed_callables' scope.
TE_GRAPHED_FUNCTION = '''
def make_factory(cache_quantized_params):
    def make_graphed_autograd_function(
        fwd_graph,
        bwd_graph,
        module_params,
        kwargs_keys,
        len_user_args,
        output_unflatten_spec,
        static_input_surface,
        static_outputs,
        static_grad_outputs,
        static_grad_inputs,
        returned_param_grad_clone_slots,
    ):
        is_reset = False

        def ensure_not_reset():
            """Reject replay after this callable's graph state has been released."""
            if is_reset:
                raise RuntimeError(
                    "This graphed callable has been reset and can no longer be used."
                )

        class Graphed(torch.autograd.Function):
            """Autograd function for graph replay."""

            @staticmethod
            def forward(ctx, skip_fp8_weight_update, cuda_graph_stream, cuda_graph_event, *inputs):
                # pylint: disable=missing-function-docstring
                ensure_not_reset()

                # Set flag for whether to update FP8 weight updates
                ctx.is_first_module = FP8GlobalStateManager.is_first_fp8_module()
                if ctx.is_first_module and skip_fp8_weight_update is not None:
                    FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(skip_fp8_weight_update)
                ctx.cuda_graph_stream = cuda_graph_stream
                ctx.cuda_graph_event = cuda_graph_event
                # Copy values from new tensors into static tensors
                for i in range(len_user_args):
                    if (
                        isinstance(static_input_surface[i], torch.Tensor)
                        and static_input_surface[i].data_ptr() != inputs[i].data_ptr()
                    ):
                        static_input_surface[i].copy_(inputs[i])

                # Replay forward graph
                if cuda_graph_stream != torch.cuda.current_stream():
                    cuda_graph_stream.wait_stream(torch.cuda.current_stream())
                    with cuda_graph_stream:
                        fwd_graph.replay()
                    if cuda_graph_event is not None:
                        torch.cuda.current_stream().wait_event(cuda_graph_event)
                    else:
                        torch.cuda.current_stream().wait_stream(cuda_graph_stream)
                else:
                    fwd_graph.replay()
                if not isinstance(static_outputs, tuple):
                    raise TypeError(
                        "Expected static_outputs to be a tuple, but got"
                        f" {type(static_outputs).__name__}"
                    )
                return tuple(o.detach() if o is not None else o for o in static_outputs)

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, *grads):
                # pylint: disable=missing-function-docstring
                ensure_not_reset()

                # Replay backward graph
                if len(grads) != len(static_grad_outputs):
                    raise ValueError(
                        "Backward graph grad dimension mismatch: "
                        f"received {len(grads)} grads, "
                        f"but expected {len(static_grad_outputs)} static_grad_outputs"
                    )
                for g, grad in zip(static_grad_outputs, grads):
                    if g is not None:
                        # don't copy if autograd gods have been kind and the
                        # incoming grad is already in the right place
                        if g.data_ptr() != grad.data_ptr():
                            g.copy_(grad)
                if ctx.cuda_graph_stream != torch.cuda.current_stream():
                    ctx.cuda_graph_stream.wait_stream(torch.cuda.current_stream())
                    with ctx.cuda_graph_stream:
                        bwd_graph.replay()
                    if ctx.cuda_graph_event is not None:
                        torch.cuda.current_stream().wait_event(ctx.cuda_graph_event)
                    else:
                        torch.cuda.current_stream().wait_stream(ctx.cuda_graph_stream)
                else:
                    bwd_graph.replay()

                # Update FP8 scale factors if needed
                if ctx.is_first_module:
                    FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)

                # Input args that didn't require grad expect a None gradient.
                if not isinstance(static_grad_inputs, tuple):
                    raise TypeError(
                        "Expected static_grad_inputs to be a tuple, but got"
                        f" {type(static_grad_inputs).__name__}"
                    )
                grad_inputs = []
                for idx, grad_input in enumerate(static_grad_inputs):
                    if grad_input is None:
                        grad_inputs.append(None)
                    elif returned_param_grad_clone_slots[idx]:
                        # Returned parameter grads may be installed directly as param.grad.
                        # Clone to avoid exposing CUDA graph static buffers to autograd users.
                        grad_inputs.append(grad_input.detach().clone())
                    else:
                        grad_inputs.append(grad_input.detach())
                return (None, None, None) + tuple(grad_inputs)

        def functionalized(*user_args, **user_kwargs):
            ensure_not_reset()

            # Decide whether to update FP8 weights
            skip_fp8_weight_update = None
            if cache_quantized_params:
                if "is_first_microbatch" not in user_kwargs or not isinstance(
                    user_kwargs["is_first_microbatch"], bool
                ):
                    raise ValueError(
                        "`is_first_microbatch` boolean kwarg must be provided for FP8 weight"
                        " caching."
                    )

                skip_fp8_weight_update = not user_kwargs["is_first_microbatch"]

            # The cuda_graph_stream and cuda_graph_event are used in the TE CUDA graph replay.
            # When replaying the graph in the cuda graph stream, the graph replay could overlap
            # with the work on main stream.
            # When cuda_graph_event is given, it should be an external event recorded
            # in the cuda graph and is used to sync-back to the main stream.
            # If cuda_graph_event is not given, it will be None and the graph replay will block
            # the main stream until it is finished.
            if "cuda_graph_stream" in user_kwargs:
                cuda_graph_stream = user_kwargs["cuda_graph_stream"]
                user_kwargs.pop("cuda_graph_stream")
            else:
                cuda_graph_stream = torch.cuda.current_stream()
            if "cuda_graph_event" in user_kwargs:
                cuda_graph_event = user_kwargs["cuda_graph_event"]
                user_kwargs.pop("cuda_graph_event")
            else:
                cuda_graph_event = None
            # Check that required kwargs are provided
            for key in kwargs_keys:
                if key not in user_kwargs:
                    raise TypeError(
                        f"Graphed callable was initialized with kwarg {key} ,"
                        "but it was not provided in graph replay"
                    )

            # Runs the autograd function with inputs == all inputs to
            # the graph that might require grad (explicit user args +
            # module parameters)
            # Assumes module params didn't change since capture.
            flatten_user_args, _ = _tree_flatten(user_args)
            flatten_user_kwargs, _ = _tree_flatten([user_kwargs[key] for key in kwargs_keys])
            func_args = tuple(flatten_user_args) + tuple(flatten_user_kwargs) + module_params
            out = Graphed.apply(
                skip_fp8_weight_update, cuda_graph_stream, cuda_graph_event, *func_args
            )
            return _tree_unflatten(out, output_unflatten_spec)

        def release_static_state():
            """Release per-callable state captured by replay closures."""
            nonlocal fwd_graph, bwd_graph, is_reset
            nonlocal module_params
            nonlocal static_input_surface, static_outputs
            nonlocal static_grad_outputs, static_grad_inputs

            is_reset = True

            # Drop the per-callable references that can own graph-pool storage.
            fwd_graph = None
            bwd_graph = None
            module_params = ()
            static_input_surface = ()
            static_outputs = ()
            static_grad_outputs = ()
            static_grad_inputs = ()

        helpers = _GraphedCallableHelpers(
            ensure_not_reset=ensure_not_reset,
            release_static_state=release_static_state,
        )
        return functionalized, helpers
    return make_graphed_autograd_function
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

    @classmethod
    def is_first_fp8_module(cls):
        return True

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward):
        cls.added.append(("reduced", forward, None))


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
    stream = object()  # TE's graphed function replays on the current stream: one, without a GPU
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
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


class Graph:
    """A CUDA graph stand-in: ``replay()`` runs ``work`` (what the capture recorded) and counts."""

    def __init__(self, work):
        self.work, self.replays = work, 0

    def replay(self):
        self.replays += 1
        self.work()


def _graphed_function(user_args=1, forward_source=TE_GRAPHED_FUNCTION, input_grad=False):
    """TE's graphed function of ``y = 2 * x * w`` (``w`` a parameter) over static buffers, as
    make_graphed_callables builds it (one per callable), and its two graphs. ``input_grad``: captured
    with an input that needs a gradient (TE's static input is then a leaf that requires grad)."""
    w = nn.Parameter(torch.tensor([1.5, -0.5]))
    static_in = tuple(torch.zeros(2, requires_grad=input_grad) for _ in range(user_args))
    out, grad_out, grad_w = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    fwd = Graph(lambda: out.copy_(2 * static_in[0] * w.detach()))
    bwd = Graph(lambda: grad_w.copy_(2 * static_in[0] * grad_out))
    ns = {"FP8GlobalStateManager": Manager, "torch": torch, "_tree_flatten": tree_flatten,
          "_tree_unflatten": tree_unflatten,
          "_GraphedCallableHelpers": collections.namedtuple("_GraphedCallableHelpers",
                                                            "ensure_not_reset release_static_state")}
    exec(forward_source, ns)  # noqa: S102 - TE's function, defined in a namespace of stand-ins
    make = ns["make_factory"](False)
    _, spec = tree_flatten(out)
    fn, helpers = make(fwd, bwd, (w,), (), user_args, spec, static_in + (w,), (out,), (grad_out,),
                       (None,) * user_args + (grad_w,), (False,) * (user_args + 1))
    return fn, helpers, fwd, static_in[0], w


def _lean_graphed(user_args=1, forward_source=TE_GRAPHED_FUNCTION, input_grad=False):
    """TE's graphed forward of a model around ``_graphed_function``'s, through lean_graphed_forward;
    the model, TE's helpers (as TE hands them to its forward), the forward graph, its static input, ``w``."""
    model, captured = _model()
    fn, helpers, fwd, static_in, w = _graphed_function(user_args, forward_source, input_grad)
    new_fwd = _te_forward(model, captured, helpers, [])
    cells = dict(zip(new_fwd.__code__.co_freevars, new_fwd.__closure__))
    cells["graphed"].cell_contents = fn  # TE's forward calls the graphed function
    return lean_graphed_forward(new_fwd), model, helpers, fwd, static_in, w


def test_a_launched_replay_runs_once_before_the_bookkeeping_and_gives_what_tes_call_gives():
    # lever 58: launch() replays the forward graph on the images at once; call_launched() then does
    # TE's FP8 registrations and builds its autograd node without a second replay
    x = torch.tensor([3.0, 4.0])
    lean, _, _, fwd, static_in, w = _lean_graphed()
    ref = lean(x)  # TE's order: registrations, the input copied into the static input, the replay
    ref.backward(torch.ones(2))
    ref_grad, ref_added, ref_replays = w.grad.clone(), list(Manager.added), fwd.replays
    assert ref.tolist() == [9.0, -4.0] and ref_replays == 1

    w.grad, Manager.added = None, []
    static = lean.launch(x)
    assert static is static_in and static.tolist() == x.tolist() and fwd.replays == ref_replays + 1
    assert Manager.added == []  # nothing of the bookkeeping has run yet
    out = lean.call_launched(static)
    assert fwd.replays == ref_replays + 1  # not replayed again
    assert "replay" not in vars(fwd) and fwd.replay() is None and fwd.replays == ref_replays + 2  # TE's replay back
    out.backward(torch.ones(2))
    assert out.tolist() == ref.tolist() and torch.equal(w.grad, ref_grad) and Manager.added == ref_added


def test_a_launched_call_that_raises_gives_the_graph_its_replay_back(monkeypatch):
    lean, model, _, fwd, _, _ = _lean_graphed()
    static = lean.launch(torch.ones(2))
    monkeypatch.setattr(Manager, "add_fp8_tensors_to_global_buffer", classmethod(lambda cls, meta: 1 / 0))
    with pytest.raises(ZeroDivisionError):
        lean.call_launched(static)
    assert "replay" not in vars(fwd)


def test_no_launch_where_the_graph_has_two_inputs_in_eval_mode_or_for_another_te():
    lean, model, _, fwd, _, _ = _lean_graphed()
    assert lean.launch(torch.ones(2, requires_grad=True)) is None and fwd.replays == 0  # x needs grad
    lean, model, _, fwd, _, _ = _lean_graphed(user_args=2)
    assert lean.launch(torch.ones(2)) is None and fwd.replays == 0
    lean, model, _, fwd, _, _ = _lean_graphed()
    model.eval()
    assert lean.launch(torch.ones(2)) is None and fwd.replays == 0
    # a TE whose Graphed.forward replays elsewhere (another name in its code): no launch, and its
    # own call works as before
    other = TE_GRAPHED_FUNCTION.replace("fwd_graph.replay()", "fwd_graph.replay() or fwd_graph.work")
    lean, model, _, fwd, _, _ = _lean_graphed(forward_source=other)
    model.train()
    assert lean.launch(torch.ones(2)) is None and fwd.replays == 0
    assert lean(torch.ones(2)).tolist() == [3.0, -1.0] and fwd.replays == 1


def test_no_launch_where_the_graph_was_captured_with_an_input_that_needs_grad():
    # blocks captured without their stem (x from a patch embedding that needs grad), then called on
    # a tensor that needs none: TE's static input is a leaf needing grad, into which only TE's
    # autograd function may copy (the GPU suite's two-forwards test hit this with lever 58)
    lean, _, _, fwd, static_in, _ = _lean_graphed(input_grad=True)
    assert static_in.requires_grad and static_in.is_leaf
    assert lean.launch(torch.tensor([3.0, 4.0])) is None and fwd.replays == 0
    out = lean(torch.tensor([3.0, 4.0]))  # TE's own call copies and replays once
    out.backward(torch.ones(2))
    assert out.tolist() == [9.0, -4.0] and fwd.replays == 1 and static_in.grad is None


def test_a_released_graph_is_not_launched_nor_kept_alive():
    # TE's release_static_state drops the graph and its buffers (the graphs' memory pool): the lean
    # forward reads them at each launch, so it neither launches a released graph nor holds it
    lean, _, helpers, fwd, _, _ = _lean_graphed()
    assert lean.launch(torch.ones(2)) is not None and fwd.replays == 1
    alive = weakref.ref(fwd)
    helpers.release_static_state()
    del fwd
    gc.collect()
    assert alive() is None
    with pytest.raises(RuntimeError, match="has been reset"):
        lean.launch(torch.ones(2))
