"""Pieces every fp8vit block family shares: the base class of the blocks (per-block switches, the
FP8 plumbing of ``forward``, timm's attention branch), token-row alignment for FP8 GEMMs, the packed QKV split whose
gradient comes back packed, and timm's attention masks in TE's terms.

Family modules (``block.py`` for timm's classic ``Block``, ...) compose these; none of them
touches Transformer Engine directly (the backend's modules are passed in).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from timm.layers import DropPath
from torch.autograd.function import once_differentiable
from torch import nn

from .._validate import check_bool, check_device, check_dtype, check_type
from .._warn import warn_once
from .backend import Backend, check_backend, get_backend, resolve_backend
from .mlp import norm_in_dtype
from .._te.kernels import column_scale_add, kernel_takes, layerscale_backward, row_scale_add, triton_support
from .._te.recipes import recipe_name, row_multiple

__all__ = ["FP8Block", "check_block_args", "aligned_rows", "SplitQKV", "packed_gradient", "LayerScaleAdd", "DropPathAdd",
           "additive_to_bool", "te_mask_kwargs"]


# torch.compile(model) runs the fused blocks eagerly between compiled regions (their forward is
# ``torch.compiler.disable``d), a graph break at each. With the blocks as CUDA graphs that is as fast
# or faster than not compiling; with eager blocks the added per-block frames made a ViT-B/16 FP8
# step slower (H200: 72.9 against 64.9 ms, docs/frameworks.md). Each block's forward pre-hook
# (:func:`_note_compiled`), traced by dynamo, records that the block is called from compiled code
# (the compiled code replays the store before each such call); the block's eager forward takes the
# mark back and says what to do, once per process.
_COMPILED = {"traced": False}
COMPILED_EAGER_BLOCKS = (
    "fp8vit: torch.compile runs fp8vit's fused blocks eagerly, with a graph break around each; without "
    "CUDA graphs that measured slower than not compiling (ViT-B/16 FP8, H200). Convert with "
    "cuda_graphs=True (convert_to_te(model, cuda_graphs=True) or make_graphed_blocks), with which the "
    "compiled model measured as fast or faster, or leave the model uncompiled (docs/frameworks.md)")


def _note_compiled(block: nn.Module, args) -> None:
    """Forward pre-hook of every fused block: set :data:`_COMPILED` when dynamo traces the call
    (``is_compiling()`` is True only then; the store is replayed with the compiled code)."""
    if torch.compiler.is_compiling():
        _COMPILED["traced"] = True


def check_block_args(fn: str, *, backend: Optional[str], fp32_residual: bool, device, dtype) -> None:
    """The constructor arguments every fp8vit block family takes, checked at its call, before anything
    is built (``fn``: the block class, for the message).

    Raises:
        TypeError: ``backend`` is not a str, ``fp32_residual`` not a bool, ``device`` not a device,
            ``dtype`` not a ``torch.dtype``.
        ValueError: an unknown ``backend``, a device string that names no device, a ``dtype`` that
            is not floating point.
    """
    check_backend(fn, backend)
    check_bool(fn, "fp32_residual", fp32_residual)
    check_device(fn, "device", device, none_ok=True)
    check_dtype(fn, "dtype", dtype, none_ok=True)


_NOT_A_DROP_PATH = object()


def drop_path_mask(drop_path: nn.Module, y: torch.Tensor):
    """timm's drop-path draw for the branch output ``y``, as a mask that broadcasts over ``y``.

    Draws what ``drop_path(y)`` draws (the same RNG calls, the mask in ``y``'s dtype, scaled by
    ``1 / keep`` as timm's), so that ``y * mask`` equals ``drop_path(y)``; ``drop_path`` is timm's
    ``DropPath`` or a module with a ``row_mask(y)`` method (``WindowDropPath``), else
    ``nn.Identity``.

    Returns:
        the mask (``[B, 1, ..., 1]``); None when nothing is dropped (eval, rate 0, identity); or
        ``_NOT_A_DROP_PATH`` for any other module (then call it).
    """
    if isinstance(drop_path, nn.Identity):
        return None
    row_mask = getattr(drop_path, "row_mask", None)
    if row_mask is not None:
        return row_mask(y)
    if type(drop_path) is not DropPath:
        return _NOT_A_DROP_PATH
    if drop_path.drop_prob == 0.0 or not drop_path.training:
        return None
    keep = 1 - drop_path.drop_prob
    mask = y.new_empty((y.shape[0],) + (1,) * (y.ndim - 1)).bernoulli_(keep)
    if keep > 0.0 and drop_path.scale_by_keep:
        mask.div_(keep)
    return mask


class FP8Block(nn.Module):
    """Base class of fp8vit's blocks: the switches every block has, and the FP8 plumbing of forward.

    A family's block (``TE_Block``, ...) sets ``self.cfg`` (with a ``fused_mlp`` property), builds
    its modules and implements ``_forward(x, *args, mult, gelu_gemm)``, where ``mult`` is the
    token-row multiple the active recipe needs (1 with FP8 off) and ``gelu_gemm`` says whether
    fc1's FP8 GEMM computes GELU in its epilogue. Its ``forward`` calls :meth:`_dispatch`; its
    ``_forward`` runs the attention branch with :meth:`_attention` (a family with RoPE overrides
    :meth:`_rope`) and the MLP with :meth:`_run_mlp`.

    Attributes:
        backend: ``"te"`` or ``"reference"``.
        fp8_enabled: False runs the GEMMs in the autocast dtype inside ``fp8_context``
            (``set_block_fp8``).
        grad_checkpointing: the whole block is recomputed in backward (TE's checkpoint).
        recompute_mlp: the MLP activations are recomputed in backward (``set_mlp_recompute``).
        gelu_in_gemm: under delayed scaling, GELU runs in the epilogue of fc1's FP8 GEMM, which
            then writes fc2's FP8 input directly (TE's ``LayerNormMLP.gemm_gelu_fusion``, off in TE
            by default): ViT-H step -2.0 ms, ViT-B -0.5 ms on an H200 (docs/performance.md, lever
            12). TE always fuses it when FP8 is off. False: TE's separate GELU+cast kernel.
        fp32_residual: the residual stream stays fp32 under autocast (timm's behaviour).
        bias_attention: the kernel of attention with a learned logits bias (BEiT's and Swin's
            relative position bias): ``"te"``, TE's attention with the bias as its
            ``post_scale_bias`` (cuDNN computes the bias gradient, summed over the batch), or
            ``"torch"``, torch's ``scaled_dot_product_attention`` (memory-efficient kernel, which
            writes the bias gradient per batch row; autograd sums it). Settable per block, as
            timm's ``attn.fused_attn``; blocks without such a bias ignore it, and a call that also
            has a mask runs TE's. Default: each family's measured faster kernel ("te" for BEiT,
            "torch" for Swin V1/V2).
        rope_kernel: how RoPE rotates q and k (``TE_EvaBlock``; blocks without RoPE ignore it):
            ``"triton"``, one Triton pass over the packed QKV buffer
            (``fp8vit.blocks.eva.RopeQKV``), ``"te"``, TE's fused RoPE kernel on q and k apart, or
            ``"auto"`` (default), the Triton pass wherever it can run, else TE's: measured faster
            on every RoPE model benched (docs/performance.md, lever 43). Settable per block.

    Graphed blocks watch these switches: one changed after capture drops the graphs, which are
    captured again.
    """

    bias_attention: str = "te"
    rope_kernel: str = "auto"

    def _init_switches(self, backend: Optional[str], fp32_residual: bool) -> None:
        self.backend = resolve_backend(backend, fn=type(self).__name__)
        self.grad_checkpointing = False
        self.recompute_mlp = False
        self.fp8_enabled = True
        self.gelu_in_gemm = True
        self.fp32_residual = fp32_residual
        self.register_forward_pre_hook(_note_compiled)

    def _init_from_skeleton(self, cfg, cfg_type: type, cfg_hint: str, timm_skeleton: nn.Module, *, device, dtype,
                            backend: Optional[str], fp32_residual: bool) -> tuple:
        """The start of ``__init__`` of a block built from a timm skeleton (EVA, BEiT, Swin,
        ConvNeXt): the arguments checked (``cfg`` a ``cfg_type``, the skeleton a module, the rest
        as :func:`check_block_args`), ``nn.Module`` set up, ``cfg``, the switches and the skeleton
        kept (not a submodule: no parameters, no state).

        Returns:
            ``(modules, dd, tdd)``: the backend's module classes, TE's ``device``/``params_dtype``
            keywords and torch's ``device``/``dtype`` ones.
        """
        fn = type(self).__name__
        check_type(fn, "cfg", cfg, cfg_type, cfg_hint)
        check_type(fn, "timm_skeleton", timm_skeleton, nn.Module, "the timm block (on the meta device)")
        check_block_args(fn, backend=backend, fp32_residual=fp32_residual, device=device, dtype=dtype)
        nn.Module.__init__(self)
        self.cfg = cfg
        self._init_switches(backend, fp32_residual)
        object.__setattr__(self, "_timm_skeleton", timm_skeleton)
        device = self._impl.default_device if device is None else device
        return self._impl.modules, {"device": device, "params_dtype": dtype}, {"device": device, "dtype": dtype}

    @property
    def _impl(self) -> Backend:
        return get_backend(self.backend)

    def _dispatch(self, x: torch.Tensor, *args) -> torch.Tensor:
        """``self._forward(x, *args, mult, gelu_gemm)`` under this block's FP8 setting, checkpointed
        if asked. Raises on a TE block given CPU input (TE's kernels are CUDA-only)."""
        impl = self._impl  # one backend lookup per forward: it is on the hot path
        if _COMPILED["traced"]:  # consumed here: an uncompiled model run later says nothing
            _COMPILED["traced"] = False
            warn_once(COMPILED_EAGER_BLOCKS, RuntimeWarning, stacklevel=4)
        if impl.fp8 and x.device.type not in ("cuda", "meta"):
            # TE modules may be built on the CPU (timm.create_model -> convert_to_te -> .cuda()),
            # but their kernels are CUDA-only: say so instead of failing deep inside TE.
            raise ValueError(f"{type(self).__name__} got x on {x.device}: Transformer Engine runs on CUDA "
                             "only; move the model and the input to the GPU (model.cuda()), or convert "
                             "with backend='reference'")
        recipe = impl.active_recipe()  # looked up once per forward: it is on the hot path
        fp8_name = recipe_name(recipe) if recipe is not None and self.fp8_enabled else None
        with impl.fp8_off() if recipe is not None and not self.fp8_enabled else contextlib.nullcontext():
            mult = row_multiple(fp8_name)
            gelu_gemm = self.gelu_in_gemm and fp8_name == "delayed"
            if self.grad_checkpointing and torch.is_grad_enabled():
                return impl.checkpoint(self._forward, x, *args, mult, gelu_gemm)
            with impl.cast_small_params(self):  # lever 42: one cast kernel, not one per vector
                return self._forward(x, *args, mult, gelu_gemm)

    def _bool_mask(self, attn_mask: Optional[torch.Tensor], is_causal: bool) -> Optional[torch.Tensor]:
        """timm's ``attn_mask`` as a boolean mask (True = attend): boolean as given, an additive
        float padding mask converted (:func:`additive_to_bool`).

        Raises:
            ValueError: a float mask with other values than 0 and masked, or both a mask and
                ``is_causal``.
        """
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = additive_to_bool(attn_mask)
        if attn_mask is not None and is_causal:
            raise ValueError(f"pass either attn_mask or is_causal=True to {type(self).__name__}, not both")
        return attn_mask

    def _attention(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool, mult: int,
                   rope: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The attention branch of a timm block, on the backend's modules:

            x [B, N, C] -> qkv (norm1 + Linear, fused) -> [B, N, 3 * H * D], timm's row order
              -> :meth:`_split_qkv`: q, k, v [B, N, H, D] (TE's "bshd": views of the GEMM output)
              -> q_norm/k_norm -> :meth:`_rope` -> DotProductAttention (+ bias) -> [B, N, H*D]
              -> (gated: gate_norm(o) * sigmoid(gate)) -> proj -> proj_drop

        The family's block provides ``qkv``, ``q_norm``, ``k_norm`` (used if ``cfg.qk_norm``),
        ``attn``, ``proj``, ``proj_drop`` and ``cfg.num_heads``/``cfg.head_dim``; one whose
        :meth:`_split_qkv` returns a gate also provides ``gate_norm``, the norm between the
        attention and the gate (``nn.Identity`` for none).

        Args:
            x: the block input ``[B, N, C]`` (the residual stream).
            attn_mask: a boolean mask (True = attend, :meth:`_bool_mask`) or None.
            is_causal: causal attention.
            mult: the token-row multiple of the FP8 GEMMs (:func:`aligned_rows`).
            rope: the family's position table, handed to :meth:`_rope` (None: no RoPE).
            bias: an additive bias of the attention logits after scaling, ``[1, H, N, N]``
                (BEiT's relative position bias; TE's ``post_scale_bias``), or None.
        """
        q, k, v, gate = self._qkv_heads(aligned_rows(self.qkv, x, mult), rope)
        kwargs = te_mask_kwargs(attn_mask, is_causal)
        if bias is not None:
            o = self._biased_attention(q, k, v, bias, **kwargs)
        else:
            o = self._impl.attention(self.attn, q, k, v, **kwargs)  # [B, N, H*D]
        if gate is not None:  # timm's order: the (inner) norm, then the gate, then proj
            o = norm_in_dtype(self.gate_norm, o) * torch.sigmoid(gate)  # bf16 in and out (lever 33)
        return self.proj_drop(aligned_rows(self.proj, o, mult))

    def _biased_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                          **kwargs) -> torch.Tensor:
        """Attention of q, k, v ``[B, N, H, D]`` with ``bias`` ``[1, H, N, N]`` added to the scaled
        logits, by the kernel :attr:`bias_attention` names; ``kwargs``: TE's mask keywords.

        Returns:
            ``[B, N, H*D]``.
        """
        if self.bias_attention not in ("te", "torch"):
            raise ValueError(f"{type(self).__name__}.bias_attention={self.bias_attention!r}: expected 'te' or 'torch'")
        if self.bias_attention == "torch" and not kwargs:
            attn = self.attn
            o = F.scaled_dot_product_attention(  # [B, H, N, D] views
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=_sdpa_bias(bias, q.dtype),
                dropout_p=attn.attention_dropout if self.training else 0.0, scale=attn.softmax_scale)
            return o.transpose(1, 2).flatten(2)
        # TE's post_scale_bias: in q's dtype (bf16 under autocast) and contiguous; the families
        # gather it as a permuted view. One copy either way: ``.to`` makes it where the dtype differs,
        # and returns the view unchanged where it matches; then ``.contiguous()`` does.
        bias = bias.to(q.dtype, memory_format=torch.contiguous_format).contiguous()
        kwargs.update(core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
        return self._impl.attention(self.attn, q, k, v, **kwargs)

    def _qkv_heads(self, qkv: torch.Tensor, rope: Optional[torch.Tensor]):
        """Hook of :meth:`_attention`: the qkv GEMM's output ``[B, N, 3 * H * D]`` -> q, k, v
        ``[B, N, H, D]`` as attention takes them (:meth:`_split_qkv`, q/k norm, :meth:`_rope` with
        ``rope`` unless None) and the gate's input (None: no gate)."""
        q, k, v, gate = self._split_qkv(qkv)
        if self.cfg.qk_norm:
            # The norm runs in fp32 under autocast; TE's attention wants one dtype (SDPA casts too).
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        if rope is not None:
            q, k = self._rope(q, k, rope)
        return q, k, v, gate

    def _split_qkv(self, qkv: torch.Tensor):
        """Hook of :meth:`_qkv_heads`: the qkv GEMM's output ``[B, N, 3 * H * D]`` (timm's
        ``(3, H, D)`` row order) -> q, k, v ``[B, N, H, D]`` (views, whose gradient comes back
        packed: :class:`SplitQKV`) and the gate's input (None: no gate). A family with other
        layouts (grouped-query attention, a gate) overrides it."""
        B, N, _ = qkv.shape
        q, k, v = SplitQKV.apply(qkv.view(B, N, 3, self.cfg.num_heads, self.cfg.head_dim))
        return q, k, v, None

    def _rope(self, q: torch.Tensor, k: torch.Tensor, rope: torch.Tensor):
        """Hook of :meth:`_qkv_heads`: rotary position embedding on q and k ``[B, N, H, D]``.
        A family with RoPE overrides it; the classic ViT block has none (identity)."""
        return q, k

    def _stream(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream's dtype: the autocast dtype, unless ``fp32_residual``."""
        dev = x.device.type
        if not self.fp32_residual and dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):  # not 'meta'
            return x.to(torch.get_autocast_dtype(dev))
        return x

    def _add_branch(self, x: torch.Tensor, y: torch.Tensor, gamma: Optional[torch.Tensor],
                    drop_path: nn.Module) -> torch.Tensor:
        """``x + drop_path(gamma * y)``: a residual branch with timm's LayerScale (``gamma`` None:
        none), in ``x``'s dtype.

        With a half-precision stream (``y`` and ``x`` in bf16 under autocast, ``gamma`` an fp32
        parameter or, under FSDP2's bf16 compute, a bf16 one) it is :class:`LayerScaleAdd`, the
        product in the stream's dtype: timm's ``gamma * y`` promotes every branch output to fp32
        and back, about 8 ms of a 42 ms RoPE ViT-B/16 step on an H200 (docs/performance.md,
        lever 22). One path for both gamma dtypes keeps a bf16-sharded model computing what the
        unsharded one does. In fp32, or with ``fp32_residual``, it is timm's expression.
        """
        if gamma is not None and not self.fp32_residual and y.dtype == x.dtype in (torch.bfloat16, torch.float16):
            mask = drop_path_mask(drop_path, y)  # DropPath scales rows: it commutes with gamma
            if mask is _NOT_A_DROP_PATH:
                y = drop_path(y)
            elif mask is not None:
                y = DropPathAdd.apply(None, y, mask)
            return LayerScaleAdd.apply(x, y, gamma)
        if gamma is None and y.dtype == x.dtype:
            mask = drop_path_mask(drop_path, y)
            if mask is not _NOT_A_DROP_PATH:
                # x + y * mask in one pass (timm: a broadcast multiply, then the add), and in
                # backward dy = g * mask in one (lever 34)
                return x + y if mask is None else DropPathAdd.apply(x, y, mask)
        if gamma is not None:
            y = gamma * y  # an fp32 gamma promotes the branch to fp32: keep the stream in x's dtype
        y = drop_path(y)
        return x + (y if self.fp32_residual or y.dtype == x.dtype else y.to(x.dtype))

    def _run_mlp(self, mlp: nn.Module, x: torch.Tensor, mult: int, gelu_gemm: bool) -> torch.Tensor:
        """``mlp(x)`` over aligned rows, with this block's MLP recompute and GELU-in-GEMM switches.
        ``self.cfg.fused_mlp`` says whether ``mlp`` is one TE ``LayerNormMLP`` (it recomputes
        natively and takes the GELU switch)."""
        # Selective recompute (set_mlp_recompute): the MLP holds most of a block's saved activations
        # (fc1's output and the activation's, 4C per token each). Inside a checkpointed block the
        # whole block is recomputed anyway.
        recompute = self.recompute_mlp and not self.grad_checkpointing
        if self._impl.fp8 and self.cfg.fused_mlp:
            # TE's LayerNormMLP does it natively: it saves its input and reruns LayerNorm, fc1 and
            # the activation in backward (not fc2), with the forward's FP8 scales.
            if mlp.checkpoint != recompute:  # a plain read on the hot path; set on change only
                mlp.checkpoint = recompute
            if mlp.gemm_gelu_fusion != gelu_gemm:  # TE ignores it for other activations
                mlp.gemm_gelu_fusion = gelu_gemm
        elif recompute and torch.is_grad_enabled():
            return self._impl.checkpoint(aligned_rows, mlp, x, mult)
        return aligned_rows(mlp, x, mult)


def aligned_rows(module: nn.Module, x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Apply a GEMM module over the token rows of ``x`` [B, N, Cin] -> [B, N, Cout].

    Under FP8 the rows ``B * N`` must be a multiple of 16 (32 for MXFP8): the weight-gradient
    GEMM reduces over them. If they are not, pad with zero rows and slice the result; padded
    rows never reach the output, so their gradient is zero and the weight gradient is exact.
    Cost: one copy of the input (and of its gradient) per GEMM module, only when misaligned.
    """
    B, N, C = x.shape
    pad = -(B * N) % multiple
    if pad == 0:
        return module(x)
    y = module(F.pad(x.reshape(B * N, C), (0, 0, 0, pad)))  # [B*N + pad, Cout]
    return y[: B * N].view(B, N, -1)


def _sdpa_bias(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``bias`` ``[1, H, N, M]`` as torch's memory-efficient attention reads it in place: in
    ``dtype``, every stride but the last a multiple of 16 elements, not expanded over the batch.

    torch's SDPA (``preprocess_mask``) pads a bias whose strides are not multiples of 8 to M rounded
    up to 8 before use: given the batch-expanded bias, that pad is a copy of the whole
    ``[B, H, N, M8]`` (Swin-B stage 1: 8192 x 4 x 49 x 56 bf16, 180 MB) per call, zero-filled
    first, and saved for backward. A non-contiguous bias (the families gather it as a permuted
    view) sends it to its fp32 math kernel instead (H200 Swin-B: 116 ms a step against 69). So the
    bias goes into the first M columns of one small zeroed ``[1, H, N, M16]`` buffer; SDPA
    broadcasts it over the batch, the kernel writes its gradient per row, and autograd sums them.
    """
    m = bias.shape[-1]
    buf = bias.new_zeros(*bias.shape[:-1], -(-m // 16) * 16, dtype=dtype)
    buf[..., :m] = bias  # its gradient flows back through the copy
    return buf[..., :m]


class SplitQKV(torch.autograd.Function):
    """``[B, N, 3, H, D] -> q, k, v`` views ``[B, N, H, D]``, whose gradients come back packed.

    Autograd's own ``unbind``/``select`` backward builds the packed gradient from a zero-filled
    ``[B, N, 3, H, D]`` buffer per view plus strided copies and adds: at ViT-H batch 128 that is
    about 13 ms of a 178 ms FP8 step (docs/performance.md). TE's fused attention already writes
    dq, dk and dv as views of one packed buffer, which is returned here as is; gradients laid out
    any other way (the reference backend's) are stacked, one copy.
    """

    @staticmethod
    def forward(ctx, qkv):
        ctx.packed_stride = qkv.stride()
        return qkv.unbind(2)

    @staticmethod
    def backward(ctx, dq, dk, dv):  # never None: autograd materializes unused gradients as zeros
        return packed_gradient(dq, dk, dv, ctx.packed_stride)


def packed_gradient(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, packed_stride: tuple) -> torch.Tensor:
    """The gradient ``[B, N, 3, H, D]`` of a packed buffer (strides ``packed_stride``) from those of
    its q, k, v views ``[B, N, H, D]``: TE's attention writes them as views of one buffer laid out
    so, which is returned as is; any other layout (the reference backend's) is stacked, one copy.
    Either way a tensor no one else holds (a view's gradient accumulated from two uses is a new
    tensor, not TE's buffer)."""
    B, N, H, D = dq.shape
    step = packed_stride[2]
    if (dq.untyped_storage().data_ptr() == dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr()
            and dk.storage_offset() == dq.storage_offset() + step
            and dv.storage_offset() == dq.storage_offset() + 2 * step
            and dq.stride() == dk.stride() == dv.stride()
            and dq.stride() == packed_stride[:2] + packed_stride[3:]):
        return dq.as_strided((B, N, 3, H, D), packed_stride, dq.storage_offset())
    return torch.stack((dq, dk, dv), dim=2)


class LayerScaleAdd(torch.autograd.Function):
    """``x + gamma * y`` for a bf16 (or fp16) stream ``x``, branch ``y`` ``[..., C]`` and a
    LayerScale ``gamma`` ``[C]`` (fp32, or bf16 under FSDP2's bf16 compute), without fp32
    intermediates.

    timm computes ``gamma * y`` in fp32 (type promotion), casts it back and adds: in a training step
    that is an fp32 ``[B, N, C]`` product, its cast, and in backward fp32 gradients, about 2.4x the
    bytes of the add alone (``docs/perf/layerscale_bench.py``). Here the forward is one
    ``addcmul`` with ``gamma`` rounded to ``y``'s dtype (the sum is taken in fp32 and rounded once;
    timm rounds the product, then the sum), and the backward gives ``dx = g``, ``dy = g * gamma``
    in ``y``'s dtype and ``dgamma`` as an fp32 sum over rows of ``g * y`` (each product rounded to
    ``y``'s dtype: 2^-9 relative in bf16, where timm's products are exact), returned in
    ``gamma``'s dtype. On the GPU the forward is one contiguous Triton pass
    (:func:`fp8vit._te.kernels.column_scale_add`: torch's ``addcmul`` runs the broadcast ``gamma``
    in its non-vectorized kernel) and so is the backward
    (:func:`fp8vit._te.kernels.layerscale_backward`: ``dy`` identical, ``dgamma``'s products exact).
    """

    @staticmethod
    def forward(ctx, x, y, gamma):
        g = gamma.to(y.dtype)
        ctx.save_for_backward(y, g)
        ctx.gamma_dtype = gamma.dtype
        if x.shape == y.shape and g.shape == y.shape[-1:] and kernel_takes(x, y, g):
            return column_scale_add(x, y, g)  # one contiguous pass (lever 36)
        return torch.addcmul(x, y, g)

    @staticmethod
    @once_differentiable  # a second derivative raises instead of coming out wrong
    def backward(ctx, grad):
        y, g = ctx.saved_tensors
        if grad.is_cuda and all(ctx.needs_input_grad[1:]) and grad.shape == y.shape and triton_support().ok:
            # One pass on the GPU (6 passes over [..., C] -> 3; lever 24): dgamma's products exact.
            dy, dgamma = layerscale_backward(grad, y, g)
            return grad, dy, dgamma.to(ctx.gamma_dtype)
        dy = grad * g if ctx.needs_input_grad[1] else None
        dgamma = None
        if ctx.needs_input_grad[2]:
            dgamma = (grad * y).flatten(0, -2).sum(0, dtype=torch.float32).to(ctx.gamma_dtype)
        return grad, dy, dgamma


class DropPathAdd(torch.autograd.Function):
    """``x + y * mask``: the residual add of a branch ``y`` under drop path, whose ``mask``
    ``[S, 1, ..., 1]`` holds one value per sample (0 or ``1 / keep``; :func:`drop_path_mask`);
    ``x`` None: ``y * mask`` alone (drop path before LayerScale's add).

    torch runs ``addcmul`` (or ``mul``) with a broadcast operand, and the backward's ``g * mask``,
    in its non-vectorized kernels: about 2.1 and 1.7 ms of a Swin-B/4 batch-128 step on an H200,
    against 1.2 ms for a plain add of the same bytes (docs/results/profile). On the GPU both are
    one contiguous Triton pass (:func:`fp8vit._te.kernels.row_scale_add`), the same fp32
    arithmetic rounded once; elsewhere, or for tensors it does not take, torch's expressions.
    """

    @staticmethod
    def forward(ctx, x, y, mask):
        ctx.save_for_backward(mask)
        ctx.has_x = x is not None
        if _row_scale_ok(x, y, mask):
            return row_scale_add(x, y, mask)
        return y * mask if x is None else torch.addcmul(x, y, mask)

    @staticmethod
    @once_differentiable  # a second derivative raises instead of coming out wrong
    def backward(ctx, grad):
        mask, = ctx.saved_tensors
        dy = None
        if ctx.needs_input_grad[1]:
            dy = row_scale_add(None, grad, mask) if _row_scale_ok(None, grad, mask) else grad * mask
        return (grad if ctx.has_x else None), dy, None


def _row_scale_ok(x: Optional[torch.Tensor], y: torch.Tensor, mask: torch.Tensor) -> bool:
    """:func:`row_scale_add` takes these: ``x`` (if any) of ``y``'s shape, one mask value per
    leading row in ``y``'s dimensions, and the kernels take the tensors (:func:`kernel_takes`)."""
    return (y.dim() >= 1 and (x is None or x.shape == y.shape) and mask.dim() == y.dim()
            and mask.shape[:1] == y.shape[:1] and mask.numel() == y.shape[0] and kernel_takes(x, y, mask))


def te_mask_kwargs(attn_mask: Optional[torch.Tensor], is_causal: bool) -> dict:
    """``DotProductAttention`` keywords for timm's boolean ``attn_mask`` (True = attend,
    broadcastable to ``[B, H, N, N]``) or ``is_causal``."""
    if attn_mask is not None:
        mask = attn_mask
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        # TE's arbitrary mask is True where attention is *masked out*: the inverse of timm's.
        return {"attention_mask": ~mask, "attn_mask_type": "arbitrary"}
    if is_causal:
        return {"attn_mask_type": "causal"}
    return {}


class LastResult:
    """The last result of a pure function of one tensor, kept while that tensor is unchanged: the
    blocks of one forward share it (timm hands every block the same RoPE table and mask).

    A call hits while the tensor is the same object with the same key:

    * ``_version``: its content; every in-place change (an optimizer step, ``copy_`` by
      ``load_state_dict``, ``mul_`` under ``no_grad``) increments it;
    * device, dtype, shape, stride, ``data_ptr``: ``t.data = other`` (what ``module.to()`` does to a
      parameter) gives the same object other data without a new version;
    * the caller's ``extra`` values, and whether inference mode is on (results made under it are
      inference tensors, which autograd cannot save).

    Computed afresh, never cached: an inference tensor (no version counter: reading ``_version``
    raises, so an in-place change could not be seen), a tensor that requires grad (a cached result
    would carry a graph that the first backward frees), a tensor subclass (``Parameter``,
    ``DTensor``, fake tensors), and anything while a CUDA graph is captured or ``torch.compile``
    traces (the graph must compute from its own input, and no tensor of its pool may stay here).
    Not seen, as by autograd's own saved-tensor check: a change through ``t.data.mul_()``.

    One entry, held through a weak reference to the tensor: dropped when the tensor is freed.
    """

    def __init__(self) -> None:
        self._entry: tuple = (None, None, None)  # (weakref to the tensor, key, result)

    def get(self, t: torch.Tensor, compute, *extra):
        """``compute()``, or its result for ``t`` and ``extra`` from the last call."""
        if (type(t) is not torch.Tensor or t.requires_grad or t.is_inference() or torch.compiler.is_compiling()
                or (t.is_cuda and torch.cuda.is_current_stream_capturing())):
            return compute()
        key = (t._version, t.device, t.dtype, tuple(t.shape), t.stride(), t.data_ptr(), extra,
               torch.is_inference_mode_enabled())
        ref, last_key, result = self._entry
        if ref is not None and ref() is t and last_key == key:
            return result
        result = compute()
        self._entry = (weakref.ref(t, self._forget), key, result)
        return result

    def _forget(self, ref: weakref.ref) -> None:
        if self._entry[0] is ref:
            self._entry = (None, None, None)


# NaFlexViT passes the same mask to every block: its values are checked once per mask, not once per
# block (the check reads the mask on the host, a device sync).
_MASKS = LastResult()


def additive_to_bool(mask: torch.Tensor) -> torch.Tensor:
    """An additive float mask (0 = attend, -inf or very negative = masked) -> the boolean mask
    (True = attend) it is.

    Raises:
        ValueError: a non-float mask, or values neither 0 nor masked, naming one.
    """
    return _MASKS.get(mask, lambda: _additive_to_bool(mask))


def _additive_to_bool(mask: torch.Tensor) -> torch.Tensor:
    if not mask.is_floating_point():
        raise ValueError(f"fp8vit's blocks take a boolean attn_mask (True = attend) or an additive float "
                         f"padding mask; got {mask.dtype}")
    threshold = torch.finfo(mask.dtype).min / 2
    keep = mask == 0
    bad = ~(keep | (mask <= threshold))  # NaN is bad too
    if bool(bad.any()):
        value = float(mask[bad].flatten()[0])
        raise ValueError(f"fp8vit's blocks take an additive float attn_mask only as a padding mask, every value "
                         f"0 (attend) or <= {threshold:.3g} / -inf (masked); this {mask.dtype} mask holds "
                         f"{value!r}: TE has no additive-bias attention kernel. Pass a boolean mask "
                         "(True = attend), or keep timm's block for this model")
    return keep
