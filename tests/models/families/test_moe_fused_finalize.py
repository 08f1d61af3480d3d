"""The fused MoE finalize kernel as a fusion candidate in a Qwen3-MoE decoder (interpreted on
CPU): it takes the finalize at the next input and at the final norm, the logits still equal
Hugging Face's, and a kernel that skips the sum it owes or doubles a choice is caught."""

import dataclasses
import functools
import json
import pathlib

import numpy as np
import pytest

import boundary_jax as bj
import pallas_kernels as pk
from boundary_jax.fusions import MoeFinalizeAddRmsNorm, platform_fusions
from models.build import load_model
from models.options import BuildOptions
from models.serving.runtime import ShardedCausalLM

GOLDEN = pathlib.Path(__file__).parents[2] / "golden" / "qwen3_moe"
CALLS: list[tuple[str, bool]] = []


@dataclasses.dataclass(frozen=True)
class Counting:
    """Records whether the wrapped candidate took each request, and where it was bound."""

    inner: MoeFinalizeAddRmsNorm
    where: str

    def __call__(self, request):
        result = self.inner(request)
        CALLS.append((self.where, result is not None))
        return result


def fused_provider(topology: bj.Topology) -> bj.fusions.FusionProvider:
    """`platform_fusions(moe_finalize=True)` in the interpreter, its MoE candidate counted."""
    provider = platform_fusions(
        topology, platform="cpu", impl=pk.Impl.PALLAS_INTERPRET, moe_finalize=True
    )
    moe, *rest = provider.ffn_input
    assert isinstance(moe, MoeFinalizeAddRmsNorm)
    return dataclasses.replace(
        provider,
        attn_input=(Counting(moe, "next input"), *rest),
        final_input=(Counting(moe, "final norm"), *rest),
    )


@functools.cache
def runner(tp: int, ep: int, dispatch: bj.MoeDispatch) -> ShardedCausalLM:
    topology = bj.Topology(attn_tp=tp, moe_ep=ep)
    mesh = bj.make_mesh(bj.Topology(attn_tp=tp))
    model = load_model(
        GOLDEN,
        mesh,
        BuildOptions(moe_dispatch=dispatch, fusions=fused_provider(topology)),
        moe_ep=ep,
    )
    return ShardedCausalLM(model, mesh)


def forward(run: ShardedCausalLM) -> tuple[float, list[tuple[str, bool]]]:
    prompts = json.loads((GOLDEN / "prompts.json").read_text())
    want = np.load(GOLDEN / "reference.npz")["logits"]
    CALLS.clear()
    got = run.forward(prompts)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want))), list(CALLS)


@pytest.mark.parametrize(
    "tp,ep,dispatch,final",
    [(2, 1, bj.MoeDispatch.GATHER, 2), (4, 4, bj.MoeDispatch.ALL_TO_ALL, 0)],
    ids=["TP2-gather-sum", "EP4-all-to-all-no-sum"],
)
def test_fused_finalize_matches_transformers_and_runs(tp, ep, dispatch, final):
    """Sparse layers 0 and 2 of 3 (layer 1 dense): the kernel takes layer 0's finalize at layer
    1's attention input (with the TP sum under gather, none owed after the all-to-all), declines
    layer 2's (after the dense FFN: no finalize), and takes layer 2's finalize at the final norm
    where the stack defers it (gather; the all-to-all's own rows fold onto the attention's rows
    first, so that exit finalizes unfused). Logits within 1e-4 of HF's."""
    error, calls = forward(runner(tp, ep, dispatch))
    assert error <= 1e-4
    # The final read is traced twice (its shape, then the cond that skips ranks without tokens).
    assert calls == [("next input", True), ("next input", False), *[("final norm", True)] * final]


@pytest.mark.parametrize("mutant", ["sum skipped", "choice doubled"])
def test_a_kernel_that_skips_the_sum_or_doubles_a_choice_is_caught(monkeypatch, mutant):
    """The same model with a broken kernel: logits move far past the tolerance."""
    honest = pk.moe_finalize_add_rms_norm

    def broken(outputs, weights, residual, norm_weight, *, axis_name=None, **options):
        if mutant == "sum skipped":
            axis_name = None
        else:
            weights = weights.at[:, 0].multiply(2.0)
        return honest(outputs, weights, residual, norm_weight, axis_name=axis_name, **options)

    monkeypatch.setattr(pk, "moe_finalize_add_rms_norm", broken)
    honest_run = runner(2, 1, bj.MoeDispatch.GATHER)
    error, calls = forward(ShardedCausalLM(honest_run.model, honest_run.mesh))
    assert [took for _, took in calls] == [True, False, True, True]
    assert error > 1e-2
