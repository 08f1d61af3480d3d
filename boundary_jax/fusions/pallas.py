"""Candidates backed by `pallas_kernels`: fused all-reduce + add + RMSNorm, add + RMSNorm, add +
RMSNorm + FP8 quantization (a quantized read), and the MoE finalize + all-reduce + add +
RMSNorm."""

from __future__ import annotations

import dataclasses

import jax

import pallas_kernels as pk

from .. import ops
from ..designs.add_norm import AddNormRead
from ..designs.norm import RMSNorm
from ..designs.quantized import Fp8TokenGroups, Quantized
from ..layout import Topology
from .base import FusionProvider, FusionRequest


def _plain_add_norm(request: FusionRequest, input_format: type | None = None) -> bool:
    """A plain update and add + RMSNorm read of an array already finalized, on the residual's
    rows, whose read hands its stage an input of `input_format`'s type (None: unquantized)."""
    return (
        not request.finalize
        and _plain_update_and_read(request, input_format)
        and request.value.ndim == 2
        and request.value.dtype == request.residual.dtype
        and request.value.shape == request.residual.shape
    )


def _plain_update_and_read(request: FusionRequest, input_format: type | None = None) -> bool:
    read = request.read
    return (
        request.update.plain
        and isinstance(read, AddNormRead)
        and isinstance(request.norm, RMSNorm)
        and (
            read.input_format is None
            if input_format is None
            else isinstance(read.input_format, input_format)
        )
    )


@dataclasses.dataclass(frozen=True)
class AllReduceAddRmsNorm:
    """Completes the sum, adds the residual and normalizes in one kernel.

    Declines without a sum to complete, for a non-plain update or read, and wherever
    `pallas_kernels.all_reduce_add_rms_norm_supported` says the kernel does not take or does not
    pay off for the shape.

    Attributes:
      platform: The platform the stack was bound for.
      impl: The kernel backend; None picks the platform's.
    """

    platform: str
    impl: pk.Impl | None = None

    def __call__(self, request: FusionRequest) -> tuple[jax.Array, jax.Array] | None:
        if not request.sum_axes or not _plain_add_norm(request):
            return None
        rows, hidden = request.value.shape
        supported = pk.all_reduce_add_rms_norm_supported(
            platform=self.platform,
            rows=rows,
            hidden=hidden,
            dtype=request.value.dtype,
            num_devices=request.num_devices,
            impl=self.impl,
        )
        if not supported:
            return None
        norm = request.norm
        return pk.all_reduce_add_rms_norm(
            request.value,
            request.residual,
            norm.weight[...],
            axis_name=request.axis_names,
            eps=norm.eps,
            unit_offset=norm.unit_offset,
            impl=self.impl,
        )


@dataclasses.dataclass(frozen=True)
class AddRmsNorm:
    """Adds the contribution to the residual and normalizes in one Pallas kernel.

    A sum still owed is completed first by the built-in all-reduce, so the kernel replaces only
    XLA's add + norm. Declines for a non-plain update or read, and wherever
    `pallas_kernels.add_rms_norm_supported` declines (CPU, unsupported shapes or dtypes).

    Attributes:
      platform: The platform the stack was bound for.
      impl: The kernel backend; None picks the platform's.
    """

    platform: str
    impl: pk.Impl | None = None

    def __call__(self, request: FusionRequest) -> tuple[jax.Array, jax.Array] | None:
        if not _plain_add_norm(request):
            return None
        rows, hidden = request.value.shape
        supported = pk.add_rms_norm_supported(
            platform=self.platform,
            rows=rows,
            hidden=hidden,
            dtype=request.value.dtype,
            impl=self.impl,
        )
        if not supported:
            return None
        value = ops.run(ops.all_reduce(request.sum_axes, request.topology), request.value)
        norm = request.norm
        return pk.add_rms_norm(
            value,
            request.residual,
            norm.weight[...],
            eps=norm.eps,
            unit_offset=norm.unit_offset,
            impl=self.impl,
        )


@dataclasses.dataclass(frozen=True)
class AddRmsNormQuantize:
    """A quantized read in one Pallas kernel: adds the contribution to the residual, normalizes
    and quantizes the stage's input to FP8 per token group.

    Takes only a plain update with an add + RMSNorm read declaring an `Fp8TokenGroups` input
    format; a sum still owed is completed first by the built-in all-reduce. Declines for a
    nonlinear update (an MHC or post-norm update: the read then applies it, normalizes and
    quantizes unfused), another read, and wherever `pallas_kernels.add_rms_norm_quantize_supported`
    declines (CPU for the platform default).

    Attributes:
      platform: The platform the stack was bound for.
      impl: The kernel backend; None picks the platform's.
    """

    platform: str
    impl: pk.Impl | None = None

    def __call__(self, request: FusionRequest) -> tuple[Quantized, jax.Array] | None:
        if not _plain_add_norm(request, Fp8TokenGroups):
            return None
        rows, hidden = request.value.shape
        group = request.read.input_format.group
        supported = pk.add_rms_norm_quantize_supported(
            platform=self.platform,
            rows=rows,
            hidden=hidden,
            dtype=request.value.dtype,
            group=group,
            impl=self.impl,
        )
        if not supported:
            return None
        value = ops.run(ops.all_reduce(request.sum_axes, request.topology), request.value)
        norm = request.norm
        values, scales, residual = pk.add_rms_norm_quantize(
            value,
            request.residual,
            norm.weight[...],
            eps=norm.eps,
            unit_offset=norm.unit_offset,
            group=group,
            impl=self.impl,
        )
        return Quantized(values, scales), residual


@dataclasses.dataclass(frozen=True)
class MoeFinalizeAddRmsNorm:
    """Takes a sparse FFN's deferred finalize: combine, sum, add and normalize in one kernel.

    Applies only to a request carrying a `DeferredFinalize` (`request.finalize`) whose outputs
    are on the residual's rows in the residual's dtype, with a plain update and an add + RMSNorm
    read. Declines wherever `pallas_kernels.moe_finalize_add_rms_norm_supported` declines (CPU
    for the platform default, shapes or device counts its kernels don't take).

    Attributes:
      platform: The platform the stack was bound for.
      impl: The kernel backend; None picks the platform's.
    """

    platform: str
    impl: pk.Impl | None = None

    def __call__(self, request: FusionRequest) -> tuple[jax.Array, jax.Array] | None:
        if not request.finalize or not _plain_update_and_read(request):
            return None
        handoff = request.value
        rows, top_k, hidden = handoff.expert_outputs.shape
        if (
            rows,
            hidden,
        ) != request.residual.shape or handoff.expert_outputs.dtype != request.residual.dtype:
            return None
        supported = pk.moe_finalize_add_rms_norm_supported(
            platform=self.platform,
            rows=rows,
            top_k=top_k,
            hidden=hidden,
            dtype=request.residual.dtype,
            num_devices=request.num_devices,
            impl=self.impl,
        )
        if not supported:
            return None
        norm = request.norm
        return pk.moe_finalize_add_rms_norm(
            handoff.expert_outputs,
            handoff.weights,
            request.residual,
            norm.weight[...],
            axis_name=request.axis_names or None,
            eps=norm.eps,
            unit_offset=norm.unit_offset,
            impl=self.impl,
        )


def platform_fusions(
    topology: Topology,
    *,
    platform: str | None = None,
    impl: pk.Impl | None = None,
    moe_finalize: bool = False,
) -> FusionProvider:
    """The Pallas candidates for `platform` (default: where JAX runs now), to opt into.

    The fused all-reduce + add + norm comes first, then psum + the Pallas add + norm, then
    psum + the Pallas add + norm + quantize (which alone takes a read with a quantized input
    format). Each declines where its kernel does not take the shape or does not pay off
    (everywhere on CPU).
    With `moe_finalize`, sparse FFNs also hand their finalize to the next input and to the final
    read (`defer_finalize`, `terminal_finalize`), where `MoeFinalizeAddRmsNorm` comes first.
    Off by default: on 2 x H200 the fused finalize kernel was 3-4x slower than the unfused path
    at TP 2 and gained 1.11x only from 2048 rows without a sum (benchmarks/RESULTS.md run 9),
    so with `impl=None` it declines on GPU except there. The kernels declare how their outputs
    vary, so the model's `shard_map` keeps `check_vma=True`. `topology` picks nothing: each
    candidate reads the axes a request owes a sum over from the request.
    """
    del topology
    platform = platform or jax.default_backend()
    candidates = (
        AllReduceAddRmsNorm(platform, impl),
        AddRmsNorm(platform, impl),
        AddRmsNormQuantize(platform, impl),
    )
    if not moe_finalize:
        return FusionProvider(attn_input=candidates, ffn_input=candidates)
    candidates = (MoeFinalizeAddRmsNorm(platform, impl), *candidates)
    return FusionProvider(
        attn_input=candidates,
        ffn_input=candidates,
        final_input=candidates,
        defer_finalize=True,
        terminal_finalize=True,
    )
