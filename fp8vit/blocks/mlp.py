"""The MLP of a block, for every timm MLP kind, on TE's modules: config, modules, weight layout.

Shared by the block families: a family reads an :class:`MlpConfig` from its timm block's ``mlp``
(:func:`mlp_config_from_timm`) or from the keywords timm would build it with
(:func:`mlp_config_from_kwargs`), builds the modules with :func:`build_mlp` (given the block's
pre-MLP norm, which TE fuses into fc1, or none in a post-norm block, and the backend's modules), runs them with
``FP8Block._run_mlp(built.mlp, x, mult, gelu_gemm)``, and maps weights with
:func:`mlp_ties` (in :mod:`fp8vit.blocks.weights`' form).

timm's MLPs (``C`` in features, ``H`` hidden units feeding fc2) and what runs for them:

============  ==========================================  ===========================================
timm          timm's forward                              fp8vit (fused case)
============  ==========================================  ===========================================
``Mlp``       ``fc2(norm(act(fc1(x))))``                  ``LayerNormMLP(act)``
``SwiGLU``    ``fc2(norm(act(fc1_g(x)) * fc1_x(x)))``     ``LayerNormMLP("swiglu")``, fc1 =
                                                          ``[fc1_g; fc1_x]``
``GluMlp``    ``x1, x2 = fc1(x).chunk(2)``;               TE's gated kernel for ``act`` (``glu`` for
              ``x1 * act(x2)`` (``gate_last``, default)   Sigmoid, ``swiglu``, ``geglu``, ``reglu``,
              or ``act(x1) * x2``; then ``fc2(norm(.))``  ``qgeglu``), fc1 halves as [gate; value]
``GeGluMlp``  ``w2(act(w0(n(x))) * w1(n(x)))``, ``n`` its  the block's norm in torch, then
              own LayerNorm over ``C`` (ViTamin)          ``LayerNormMLP("geglu")`` with ``n`` fused
============  ==========================================  ===========================================

TE's gated kernels apply the activation to the FIRST half of fc1's output and multiply by the
second (``swiglu(a, b) = silu(a) * b``; TE 2.20, ``LayerNormMLP``), so the gate's rows come first
in TE's fc1; for ``GluMlp(gate_last=True)`` the halves are swapped on conversion. TE's GELU is
the tanh approximation: timm's erf GELU maps to it with a warning (``GELU_TANH_NOTE``) unless
``exact_gelu``, which keeps it exact in torch.

**Fused or unfused.** One ``LayerNormMLP`` (norm, fc1, activation and fc2 in TE's kernels,
recompute native) needs a TE kernel for the activation, no dropout inside the MLP, no norm
between the activation and fc2, one bias flag for fc1 and fc2 and ``out == in``. Otherwise
(:class:`UnfusedMlp`): TE ``LayerNormLinear`` (norm + fc1), the activation in torch (gated: on
the two halves), dropout, then fc2 as a TE ``LayerNormLinear`` with the inner norm fused (exact),
or a TE ``Linear``. Every path is exact: nothing is approximated but a GELU the user let map.

**Padding for FP8.** FP8 GEMMs need both inner dims to be multiples of 16 (TE 2.20); EVA02-L's
SwiGLU has ``H = 2730``. fp8vit rounds ``H`` up to ``Hp``, a multiple of :data:`HIDDEN_MULTIPLE`,
ALWAYS (every backend, FP8 on or off), so parameter shapes do not depend on the machine and a
checkpoint moves between machines unchanged; :mod:`fp8vit.blocks.weights` pads and slices on conversion
(bit-exact). Each padded unit has zero fc1 rows (in each half) and bias, and a zero fc2 column:
its pre-activations are 0, its output ``act(0) * 0 = 0`` when gated (also for ``glu``'s
``sigmoid(0) = 0.5``) or ``act(0)`` otherwise, multiplied by the zero fc2 column either way, so
it adds exactly zero. Gradients: ``d(output)/d(unit) = fc2 column = 0``, so the fc1 rows' and
biases' gradients are exactly zero, and fc2's column gets ``dy * unit`` = 0 where the unit is 0
(gated, or ``act(0) = 0``: every TE kernel). A torch activation with ``act(0) != 0`` (Sigmoid,
Softplus, ...) in an ungated MLP has its padded units sliced off before fc2 (exact, one copy).
The inner norm normalizes the real units only: when padded, it runs in torch on ``h[..., :H]``
and the result is zero-padded for fc2 (TE's fused norm would count the padding). With zero
gradients, SGD, Adam(W) and weight decay keep the padding zero; so do fp8vit's init (also TE's
``reset_parameters``: the padded modules' init methods zero it) and weight loading.
:func:`fp8vit.blocks.weights.te_to_timm` checks it. MXFP8 needs multiples of 32: a padded width that is
not one runs that MLP with FP8 off, warned once (:meth:`MlpConfig.fp8_widths_ok`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Callable, List, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from timm.layers import GluMlp, Mlp, SwiGLU, get_act_layer
from timm.models.vitamin import GeGluMlp
from torch import nn
from torch.autograd.function import once_differentiable

from .._te.kernels import kernel_takes, padded_norm_backward, padded_norm_forward
from .timm_layers import resolve_activation, resolve_norm_module
from .weights import Part, Tie, rename

__all__ = ["HIDDEN_MULTIPLE", "MLP_KINDS", "MlpConfig", "mlp_config_from_timm", "mlp_config_from_kwargs",
           "BuiltMlp", "build_mlp", "UnfusedMlp", "PaddedNorm", "torch_norm", "norm_in_dtype", "mlp_ties"]

HIDDEN_MULTIPLE = 16  # what every FP8 recipe on Hopper needs of a GEMM's inner dims (TE 2.20)

MLP_KINDS = ("Mlp", "SwiGLU", "GluMlp", "GeGluMlp")

# timm's GluMlp with the gate first, as a constant so that configs compare equal.
_GLU_GATE_FIRST = functools.partial(GluMlp, gate_last=False)
_TIMM_LAYERS = {"Mlp": Mlp, "SwiGLU": SwiGLU, "GeGluMlp": GeGluMlp}
# Constructors read back from built modules, as constants for the same reason.
_GELUS = {"none": nn.GELU, "tanh": functools.partial(nn.GELU, approximate="tanh")}

NormSpec = Tuple[str, float]  # (TE normalization name, eps)


@dataclasses.dataclass(frozen=True)
class MlpConfig:
    """One timm MLP, in the terms fp8vit builds it from.

    Attributes:
        kind: the timm module: ``"Mlp"``, ``"SwiGLU"``, ``"GluMlp"`` or ``"GeGluMlp"``.
        in_features, out_features: ``C`` in and out.
        hidden: the real hidden units ``H``, those feeding fc2 (each half of fc1 has ``H`` rows
            in the gated kinds).
        act_layer: the torch activation constructor (the unfused path runs it; timm rebuilds with it).
        te_activation: TE's kernel (gated kinds: a gated kernel), or None: the torch activation
            runs. The unfused MLP runs only gated kernels, and only exact ones (an erf GELU stays
            torch's there).
        gate_last: ``GluMlp`` only: timm's gate is the second half of fc1 (timm's default).
        bias: fc1's and fc2's bias flags.
        drop: dropout after the activation and after fc2.
        norm: the norm over the hidden units before fc2 (timm's ``norm``), or None.
        in_norm: ``GeGluMlp``'s own norm over ``C`` before fc1, or None.
        block_norm: the block normalizes the MLP's input (pre-norm blocks). False in a post-norm
            block (``EvaBlockPostNorm``): with no norm to fuse (and no ``in_norm``), fc1 is a TE
            ``Linear`` and the MLP runs unfused, since TE's ``LayerNormMLP`` always normalizes.
    """

    kind: str
    in_features: int
    hidden: int
    out_features: int
    act_layer: Callable
    te_activation: Optional[str]
    gate_last: bool = False
    bias: Tuple[bool, bool] = (True, True)
    drop: Tuple[float, float] = (0.0, 0.0)
    norm: Optional[NormSpec] = None
    in_norm: Optional[NormSpec] = None
    block_norm: bool = True

    @property
    def gated(self) -> bool:
        return self.kind != "Mlp"

    @property
    def hidden_padded(self) -> int:
        """``Hp``: ``hidden`` rounded up to :data:`HIDDEN_MULTIPLE` (the TE parameters' width)."""
        return -(-self.hidden // HIDDEN_MULTIPLE) * HIDDEN_MULTIPLE

    @property
    def pad(self) -> int:
        """Zero hidden units added for FP8 (``Hp - H``)."""
        return self.hidden_padded - self.hidden

    @property
    def timm_hidden(self) -> int:
        """timm's ``hidden_features`` argument: fc1's width (both halves for ``GluMlp``)."""
        return 2 * self.hidden if self.kind == "GluMlp" else self.hidden

    @property
    def fused(self) -> bool:
        """One TE ``LayerNormMLP``: a TE kernel for the activation, a norm before fc1 to fuse, no
        dropout or norm inside the MLP, one bias flag, ``out == in`` (LayerNormMLP's contract)."""
        return (self.te_activation is not None and (self.block_norm or self.in_norm is not None)
                and self.drop == (0.0, 0.0) and self.norm is None
                and self.bias[0] == self.bias[1] and self.out_features == self.in_features)

    @property
    def timm_layer(self) -> Callable:
        """The ``mlp_layer`` that timm's ``Block`` rebuilds this MLP with (given its ``act_layer``)."""
        if self.kind == "GluMlp":
            return GluMlp if self.gate_last else _GLU_GATE_FIRST
        return _TIMM_LAYERS[self.kind]

    def fp8_widths_ok(self, multiple: int) -> bool:
        """Whether the GEMM widths are multiples of ``multiple`` (the active recipe's; 32 for MXFP8)."""
        return not (self.in_features % multiple or self.out_features % multiple or self.hidden_padded % multiple)

    def describe(self) -> str:
        """A short summary, for ``extra_repr``."""
        act = self.te_activation or f"torch {getattr(self.act_layer, '__name__', 'activation')}"
        width = f"{self.hidden}" + (f" padded to {self.hidden_padded}" if self.pad else "")
        extra = (", norm before fc2" if self.norm else "") + (", own input norm" if self.in_norm else "")
        return f"{self.kind}({act}, hidden {width}{extra}, {'fused' if self.fused else 'unfused'})"


def _layer_name(layer) -> str:
    if isinstance(layer, functools.partial):
        kw = ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in layer.keywords.items())
        return f"partial({_layer_name(layer.func)}, {kw})"
    return getattr(layer, "__name__", repr(layer))


def _act_constructor(act: nn.Module) -> Callable:
    """A constructor that rebuilds ``act`` exactly (class, or a copy where it holds settings)."""
    if isinstance(act, nn.GELU) and act.approximate in _GELUS:
        return _GELUS[act.approximate]
    cls = type(act)
    try:
        same = cls().extra_repr() == act.extra_repr()
    except TypeError:  # a constructor with required arguments
        same = False
    return cls if same else functools.partial(copy.deepcopy, act)


def mlp_config_from_timm(mlp: nn.Module, *, exact_gelu: bool = False, block_norm: bool = True) -> MlpConfig:
    """Read a built timm MLP (``Mlp``, ``SwiGLU``, ``GluMlp``/``SwiGLUPacked``, ``GeGluMlp``).

    Args:
        mlp: the module.
        exact_gelu: keep an erf GELU exact in torch (unfused) instead of TE's tanh kernel.
        block_norm: the block normalizes the MLP's input (False in a post-norm block:
            :attr:`MlpConfig.block_norm`).

    Raises:
        ValueError: another MLP type, 1x1-convolution MLPs (``use_conv=True``), an activation
            with parameters, a norm TE cannot fuse; named.
    """
    if isinstance(mlp, SwiGLU):
        kind, fc1s, fc2 = "SwiGLU", (mlp.fc1_g, mlp.fc1_x), mlp.fc2
    elif isinstance(mlp, GluMlp):
        kind, fc1s, fc2 = "GluMlp", (mlp.fc1,), mlp.fc2
    elif isinstance(mlp, GeGluMlp):
        kind, fc1s, fc2 = "GeGluMlp", (mlp.w0, mlp.w1), mlp.w2
    elif isinstance(mlp, Mlp):
        kind, fc1s, fc2 = "Mlp", (mlp.fc1,), mlp.fc2
    else:
        raise ValueError(f"mlp of type {type(mlp).__name__} is not supported: fp8vit runs timm's "
                         f"{', '.join(MLP_KINDS)} (and partials of them, e.g. SwiGLUPacked)")
    for lin in fc1s + (fc2,):
        if type(lin) is not nn.Linear:
            raise ValueError(f"{kind} built of {type(lin).__name__} (use_conv=True) is not supported: "
                             "fp8vit runs MLPs over tokens ([..., C]) with nn.Linear layers")
    if len({lin.bias is not None for lin in fc1s}) > 1:
        raise ValueError(f"{kind} whose fc1 halves differ in bias: TE's fc1 has one bias flag")
    act = mlp.act
    if any(True for _ in act.parameters()) or any(True for _ in act.buffers()):
        raise ValueError(f"activation {type(act).__name__} has parameters or buffers, which fp8vit "
                         "does not map: use a stateless activation")
    norm = getattr(mlp, "norm", None)
    inner = in_norm = None
    if kind == "GeGluMlp":
        in_norm = resolve_norm_module(norm)
    elif norm is not None and not isinstance(norm, nn.Identity):
        inner = resolve_norm_module(norm)
    drops = tuple(float(d.p) if d is not None else 0.0
                  for d in (getattr(mlp, "drop1", None), getattr(mlp, "drop2", None)))  # timm 1.0.29's GeGluMlp: none
    cfg = MlpConfig(kind=kind, in_features=fc1s[0].in_features, hidden=fc2.in_features,
                    out_features=fc2.out_features, act_layer=_act_constructor(act), te_activation="",
                    gate_last=bool(mlp.gate_last) if kind == "GluMlp" else False,
                    bias=(fc1s[0].bias is not None, fc2.bias is not None), drop=drops,
                    norm=inner, in_norm=in_norm, block_norm=block_norm)
    if not cfg.fused:
        # Unfused for another reason (a norm or dropout inside, no norm before it, ...). Gated: TE's kernel where it
        # computes exactly timm's activation (SiLU, ReLU, sigmoid, tanh and quick GELU; an erf GELU
        # stays torch's), one contiguous kernel for torch's three strided ones (lever 18).
        te_act = resolve_activation(cfg.act_layer, exact_gelu=True, gated=True)[1] if cfg.gated else None
        return dataclasses.replace(cfg, te_activation=te_act)
    act_layer, te_act = resolve_activation(cfg.act_layer, exact_gelu, gated=cfg.gated)
    return dataclasses.replace(cfg, act_layer=act_layer, te_activation=te_act)


def mlp_config_from_kwargs(in_features: int, hidden_features: int, *, mlp_layer: Callable = Mlp,
                           act_layer: Union[str, Callable] = nn.GELU, norm_layer: Optional[Callable] = None,
                           bias: Union[bool, Tuple[bool, bool]] = True, drop: float = 0.0,
                           exact_gelu: bool = False, **layer_kwargs) -> MlpConfig:
    """The config of ``mlp_layer(in_features, hidden_features, act_layer=..., norm_layer=...,
    bias=..., drop=..., **layer_kwargs)``, as timm's blocks call it.

    The layer is built on the meta device (no memory) and read back with
    :func:`mlp_config_from_timm`, so partials (``SwiGLUPacked``, ``partial(SwiGLU, align_to=64)``)
    mean what they mean in timm.

    Args:
        in_features, hidden_features: timm's arguments (``hidden_features`` is fc1's width:
            both halves for ``GluMlp``).
        mlp_layer: the timm MLP constructor.
        act_layer: the activation constructor or timm's name for it; the config keeps this object.
        norm_layer: the norm before fc2 (timm blocks pass theirs when ``scale_mlp_norm``/``scale_mlp``).
        bias, drop: timm's arguments.
        exact_gelu: see :func:`mlp_config_from_timm`.
        **layer_kwargs: further arguments of ``mlp_layer`` (``align_to``, ``gate_last``, ...).

    Raises:
        ValueError: ``mlp_layer`` cannot be built with these arguments, or is not supported; named.
    """
    if isinstance(act_layer, str):
        act_layer = get_act_layer(act_layer)
    kw = dict(in_features=in_features, hidden_features=hidden_features, act_layer=act_layer,
              norm_layer=norm_layer, bias=bias, drop=drop, **layer_kwargs)
    name = _layer_name(mlp_layer)
    try:
        try:
            module = mlp_layer(**kw, device="meta")
        except TypeError:  # a layer without device= (before timm 1.0.2x)
            module = mlp_layer(**kw)
    except Exception as err:  # noqa: BLE001 - timm's own assertion or argument error, reworded
        raise ValueError(f"mlp_layer={name} cannot be built with {sorted(kw)}: "
                         f"{type(err).__name__}: {err}") from err
    try:
        cfg = mlp_config_from_timm(module, exact_gelu=exact_gelu)
    except ValueError as err:
        raise ValueError(f"mlp_layer={name!r}: {err}") from err
    return dataclasses.replace(cfg, act_layer=act_layer)  # the caller's object: configs compare equal


def norm_in_dtype(norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``norm(h)`` (a :func:`torch_norm` module) with ``h``'s dtype in and out under autocast.

    Autocast runs torch's norms in fp32: a bf16 ``h`` is copied to fp32, normalized to an fp32
    output, and its backward runs in fp32 too; for EVA02-L/14's inner norm over 2730 hidden units
    that is about 14 ms of norm kernels plus the casts in a 104 ms step on an H200 (docs/
    performance.md, lever 23). torch's kernels take bf16 in and out and keep the statistics in
    fp32, so here the norm runs without autocast on ``h`` as it is, with the weight (and bias)
    rounded to ``h``'s dtype (the output is rounded to bf16 before fc2's GEMM either way; the
    weight gradient comes back through that rounding, 2^-9 relative in bf16). A bf16 weight (FSDP2's
    bf16 compute) takes the same path, so a sharded model computes what the unsharded one does.
    On the GPU it runs as :class:`PaddedNorm` with nothing padded: one Triton pass forward and one
    backward, where torch's backward takes three kernels (ViTamin-L's norm before its MLP: lever 38).
    Without autocast, for an fp32 ``h``, or for any module but torch's own ``nn.LayerNorm`` and
    ``nn.RMSNorm`` (``nn.Identity``, a subclass with its own forward), it is ``norm(h)``.
    """
    dev = h.device.type
    if h.dtype not in (torch.bfloat16, torch.float16) or dev not in ("cuda", "cpu") \
            or not torch.is_autocast_enabled(dev) or type(norm) not in (nn.LayerNorm, nn.RMSNorm) \
            or norm.weight is None:
        return norm(h)
    if norm.weight.shape[-1] == h.shape[-1] and _padded_norm_ok(h, norm):  # else torch says what is wrong
        return PaddedNorm.of(norm, h, h.shape[-1])
    with torch.autocast(dev, enabled=False):
        w = norm.weight.to(h.dtype)
        if isinstance(norm, nn.LayerNorm):
            b = None if norm.bias is None else norm.bias.to(h.dtype)
            return F.layer_norm(h, norm.normalized_shape, w, b, norm.eps)
        # eps None: fp32's epsilon, as under autocast (F.rms_norm would take h's dtype's)
        return F.rms_norm(h, norm.normalized_shape, w, _norm_eps(norm))


def torch_norm(kind: str, eps: float, features: int, **tdd) -> nn.Module:
    """A torch norm with TE's semantics for ``kind`` (``"LayerNorm"``/``"RMSNorm"``), for the norms
    TE cannot fuse into a GEMM. ``tdd``: ``device``, ``dtype``."""
    if kind == "LayerNorm":
        return nn.LayerNorm(features, eps=eps, **tdd)
    if kind == "RMSNorm":
        return nn.RMSNorm(features, eps=eps, **tdd)
    raise ValueError(f"norm kind {kind!r}: use 'LayerNorm' or 'RMSNorm'")


class _ZeroPadded:
    """Weight init that keeps padded hidden units zero: TE's default (normal, std 0.023: TE 2.20's
    ``get_default_init_method``), then zeros in each of ``blocks`` chunks of ``padded`` along
    ``dim`` past the first ``real``. TE's ``reset_parameters`` calls its modules' init methods,
    so re-initialising a module (e.g. from a model's ``apply(init_fn)``) keeps the padding exact."""

    def __init__(self, dim: int, blocks: int, real: int, padded: int):
        self.dim, self.blocks, self.real, self.padded = dim, blocks, real, padded

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            nn.init.normal_(w, mean=0.0, std=0.023)
            for i in range(self.blocks):
                w.narrow(self.dim, i * self.padded + self.real, self.padded - self.real).zero_()
        return w


def _fc_inits(cfg: MlpConfig) -> Tuple[dict, dict]:
    """Init-method keywords for fc1 and fc2 (empty: the module's default, nothing padded)."""
    if not cfg.pad:
        return {}, {}
    return ({"init_method": _ZeroPadded(0, 2 if cfg.gated else 1, cfg.hidden, cfg.hidden_padded)},
            {"init_method": _ZeroPadded(1, 1, cfg.hidden, cfg.hidden_padded)})


class BuiltMlp(NamedTuple):
    """What :func:`build_mlp` returns.

    Attributes:
        norm: the block's pre-MLP norm as a torch module, when the MLP fuses a norm of its own
            into fc1 (``GeGluMlp``); the block applies it before the MLP. None: the block's norm
            is fused into fc1.
        mlp: the MLP module, ``[..., C] -> [..., out]``: one TE ``LayerNormMLP`` exactly when
            ``cfg.fused``.
    """

    norm: Optional[nn.Module]
    mlp: nn.Module


def build_mlp(cfg: MlpConfig, norm: Optional[str], norm_eps: float, modules, dd: dict, tdd: dict) -> BuiltMlp:
    """The modules of an MLP and the block's norm before it.

    Args:
        cfg: the MLP.
        norm, norm_eps: the block's pre-MLP norm (``"LayerNorm"``/``"RMSNorm"``), fused into fc1;
            ``norm=None``: the block has none (a post-norm block), and fc1 is a TE ``Linear``.
        modules: the backend's modules (``LayerNormLinear``, ``Linear``, ``LayerNormMLP``).
        dd: TE's ``device``/``params_dtype`` keywords; tdd: torch's ``device``/``dtype``.

    Raises:
        ValueError: ``norm=None`` for a ``cfg`` read with ``block_norm=True`` (or the reverse).
    """
    pre, fc1_norm = None, None if norm is None else (norm, norm_eps)
    if cfg.in_norm is not None:  # two norms in a row: TE fuses the one next to fc1
        pre = None if norm is None else torch_norm(norm, norm_eps, cfg.in_features, **tdd)
        fc1_norm = cfg.in_norm
    if (norm is not None) != cfg.block_norm:
        raise ValueError(f"{cfg.describe()} was read with block_norm={cfg.block_norm}, but the block's norm "
                         f"before it is {norm!r}: read it with block_norm={norm is not None}")
    if not cfg.fused:
        return BuiltMlp(pre, UnfusedMlp(cfg, fc1_norm, modules, dd, tdd))
    init1, init2 = _fc_inits(cfg)
    inits = {**init1, **({"output_layer_init_method": init2["init_method"]} if init2 else {})}
    mlp = modules.LayerNormMLP(cfg.in_features, cfg.hidden_padded, eps=fc1_norm[1], bias=cfg.bias[0],
                               normalization=fc1_norm[0], activation=cfg.te_activation, **inits, **dd)
    return BuiltMlp(pre, mlp)


class UnfusedMlp(nn.Module):
    """An MLP TE cannot run as one ``LayerNormMLP``, in timm's order:

        x -> fc1: TE LayerNormLinear (the norm before the MLP + fc1; a TE Linear if the block has
             no norm there) -> [..., (2x) Hp]
          -> activation (gated: act(first half) * second half, in TE's kernel where it has an
             exact one, else torch's) -> drop1
          -> inner norm: fused into fc2 (TE LayerNormLinear) if nothing is padded, else torch on
             the real units, zero-padded back -> fc2 (TE Linear) -> drop2

    Args:
        cfg: the MLP.
        fc1_norm: (kind, eps) of the norm fused into fc1, or None (no norm before the MLP).
        modules: the backend's modules; dd, tdd: TE's and torch's device/dtype keywords.
    """

    def __init__(self, cfg: MlpConfig, fc1_norm: Optional[NormSpec], modules, dd: dict, tdd: dict):
        super().__init__()
        self.hidden, self.pad, self.gated = cfg.hidden, cfg.pad, cfg.gated
        init1, init2 = _fc_inits(cfg)
        width = (2 if cfg.gated else 1) * cfg.hidden_padded
        if fc1_norm is None:
            self.fc1 = modules.Linear(cfg.in_features, width, bias=cfg.bias[0], **init1, **dd)
        else:
            self.fc1 = modules.LayerNormLinear(cfg.in_features, width, eps=fc1_norm[1], bias=cfg.bias[0],
                                               normalization=fc1_norm[0], **init1, **dd)
        self.act = cfg.act_layer()
        # [..., 2Hp] -> [..., Hp]: TE's gated kernel (first half activated), or None: torch's act.
        self.gated_act = modules.gated_activation(cfg.te_activation) if cfg.gated and cfg.te_activation else None
        self.drop1 = nn.Dropout(cfg.drop[0])
        self.norm = None
        if cfg.norm is not None and not cfg.pad:
            self.fc2 = modules.LayerNormLinear(cfg.hidden, cfg.out_features, eps=cfg.norm[1], bias=cfg.bias[1],
                                               normalization=cfg.norm[0], **dd)
        else:
            if cfg.norm is not None:  # TE's norm would count the padded units: normalize the real ones
                self.norm = torch_norm(cfg.norm[0], cfg.norm[1], cfg.hidden, **tdd)
            self.fc2 = modules.Linear(cfg.hidden_padded, cfg.out_features, bias=cfg.bias[1], **init2, **dd)
        self.drop2 = nn.Dropout(cfg.drop[1])
        # An ungated padded unit outputs act(0); where that is not 0, slice it off before fc2, or
        # fc2's padded column would get gradient act(0) * sum(dy) and stop being zero.
        # (on the CPU explicitly: under a meta device context, as timm's create_model(device="meta")
        # sets, a bare torch.zeros would be a meta tensor without a value)
        zero = torch.zeros(1, device="cpu")
        act0 = self.act(zero) if cfg.pad and not cfg.gated and self.norm is None else zero
        self._slice = bool(act0.ne(0).any())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.gated_act is not None:
            h = self.gated_act(h)
        elif self.gated:
            gate, value = h.chunk(2, dim=-1)  # TE's order: the activated half first
            h = self.act(gate) * value
        else:
            h = self.act(h)
        h = self.drop1(h)
        if self.norm is not None:
            if _padded_norm_ok(h, self.norm):  # one pass on the GPU (lever 35)
                h = PaddedNorm.of(self.norm, h, self.hidden)
            else:
                h = F.pad(norm_in_dtype(self.norm, h[..., :self.hidden]), (0, self.pad))
        elif self._slice:
            h = F.pad(h[..., :self.hidden], (0, self.pad))
        return self.drop2(self.fc2(h))


class PaddedNorm(torch.autograd.Function):
    """``F.pad(norm(h[..., :H]), (0, Hp - H))``: the inner norm of a padded MLP (EVA02-L/14: 2730
    real of 2736 hidden units) on the GPU, forward and backward one Triton pass each
    (:func:`fp8vit._te.kernels.padded_norm_forward`). torch's way slices ``h``, copies the slice
    to normalize it, pads the output into a new tensor, and in backward slices, copies and pads
    the gradient again: 24 blocks of ``[B * 257, 2736]`` copies per EVA02-L step. Statistics in
    fp32, the output rounded once to ``h``'s dtype; the weight gradients are fp32 sums, returned in
    the weights' dtype. With ``H == Hp`` it is :func:`norm_in_dtype`'s norm on the GPU; with
    ``out_dtype`` fp32, a model-level norm under autocast (:mod:`fp8vit.blocks.model_norm`).
    """

    @staticmethod
    def forward(ctx, h, weight, bias, real, eps, rms, out_dtype=None):
        y, mean, rstd = padded_norm_forward(h, real, weight, bias, eps, rms, out_dtype)
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.real, ctx.rms, ctx.bias_dtype = real, rms, None if bias is None else bias.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        h, weight, mean, rstd = ctx.saved_tensors
        dh, dw, db = padded_norm_backward(grad.contiguous(), h, weight, mean, rstd, ctx.real,
                                          ctx.bias_dtype is not None, ctx.rms)
        return dh, dw.to(weight.dtype), (None if db is None else db.to(ctx.bias_dtype)), None, None, None, None

    @staticmethod
    def of(norm: nn.Module, h: torch.Tensor, real: int) -> torch.Tensor:
        """Apply it for ``norm`` (torch's ``nn.LayerNorm`` or ``nn.RMSNorm`` over ``real`` features),
        its weight (and bias) rounded to ``h``'s dtype as :func:`norm_in_dtype` does: GPU and CPU,
        and a model sharded with bf16 compute, use the same weights."""
        rms = isinstance(norm, nn.RMSNorm)
        bias = None if rms or norm.bias is None else norm.bias.to(h.dtype)
        return PaddedNorm.apply(h, norm.weight.to(h.dtype), bias, real, _norm_eps(norm), rms)


def _norm_eps(norm: nn.Module) -> float:
    """``norm.eps``; nn.RMSNorm's eps=None as fp32's epsilon, as resolve_norm_module reads it
    (autocast runs it in fp32)."""
    return norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps


def _padded_norm_ok(h: torch.Tensor, norm: nn.Module) -> bool:
    """:class:`PaddedNorm` takes it: a CUDA half-precision ``h`` (under autocast, or bf16
    compute), contiguous, torch's own affine LayerNorm or RMSNorm over one dimension, and Triton
    runs here."""
    return type(norm) in (nn.LayerNorm, nn.RMSNorm) and norm.weight is not None and norm.weight.dim() == 1 \
        and kernel_takes(h)


def mlp_ties(cfg: MlpConfig, norm: Optional[str], *, timm_mlp: str = "mlp.", te_mlp: str = "mlp.",
             timm_norm: str = "norm2.", te_norm: str = "norm2.") -> List[Tie]:
    """The weight layout (:mod:`fp8vit.blocks.weights`) of an MLP built by :func:`build_mlp`, with the
    block's pre-MLP norm.

    Args:
        cfg: the MLP.
        norm: the block's pre-MLP norm kind (``"LayerNorm"`` has a bias, ``"RMSNorm"`` not), or
            None where the block has no norm before the MLP (as in :func:`build_mlp`).
        timm_mlp, te_mlp: prefixes of the MLP's tensors in timm's block and in fp8vit's.
        timm_norm: prefix of the block's pre-MLP norm in timm; te_norm: in fp8vit's block, where
            it is a module of its own (``BuiltMlp.norm``, GeGluMlp only).
    """
    def norm_ties(src: str, dst: str, kind: str) -> List[Tie]:
        return [rename(src + "weight", dst + "weight")] + (
            [rename(src + "bias", dst + "bias")] if kind == "LayerNorm" else [])

    fused, H, pad = cfg.fused, cfg.hidden, cfg.pad
    ties: List[Tie] = []
    fc1_norm_src, fc1_norm_kind = timm_norm, norm
    if cfg.in_norm is not None:
        if norm is not None:
            ties += norm_ties(timm_norm, te_norm, norm)
        fc1_norm_src, fc1_norm_kind = timm_mlp + "norm.", cfg.in_norm[0]
    if fc1_norm_kind is not None:
        ties += norm_ties(fc1_norm_src, te_mlp + ("layer_norm_" if fused else "fc1.layer_norm_"), fc1_norm_kind)

    def fc1_parts(leaf: str) -> Tuple[Part, ...]:
        if cfg.kind == "SwiGLU":
            return Part(f"{timm_mlp}fc1_g.{leaf}"), Part(f"{timm_mlp}fc1_x.{leaf}")
        if cfg.kind == "GeGluMlp":
            return Part(f"{timm_mlp}w0.{leaf}"), Part(f"{timm_mlp}w1.{leaf}")
        name = f"{timm_mlp}fc1.{leaf}"
        if cfg.kind == "GluMlp":  # one timm tensor, [x1; x2]; TE wants [gate; value]
            first, second = Part(name, 0, H), Part(name, H, H)
            return (second, first) if cfg.gate_last else (first, second)
        return (Part(name),)

    fc1 = te_mlp + ("fc1_" if fused else "fc1.")
    fc2 = te_mlp + ("fc2_" if fused else "fc2.")
    timm_fc2 = timm_mlp + ("w2." if cfg.kind == "GeGluMlp" else "fc2.")
    ties.append(Tie(fc1 + "weight", fc1_parts("weight"), 0, pad))
    if cfg.bias[0]:
        ties.append(Tie(fc1 + "bias", fc1_parts("bias"), 0, pad))
    ties.append(Tie(fc2 + "weight", (Part(timm_fc2 + "weight"),), 1, pad))
    if cfg.bias[1]:
        ties.append(rename(timm_fc2 + "bias", fc2 + "bias"))
    if cfg.norm is not None:
        ties += norm_ties(timm_mlp + "norm.", te_mlp + ("norm." if pad else "fc2.layer_norm_"), cfg.norm[0])
    return ties
