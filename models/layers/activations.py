"""What an expert (or a shared expert, or an ungated MLP) computes between its projections: the
experts' activations, relu^2, and xIELU with its trainable coefficients."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from boundary_jax.initializers import Constant, param

from .buffer import Buffer


class ExpertActivation(enum.Enum):
    """What an expert (or a shared expert, or an ungated MLP) computes between its projections.

    SWIGLU: `silu(gate(x)) * up(x)`; its gate and up projections are two stacked parts.
    RELU2: `relu(up(x))^2`; its up projection is the one part (Nemotron-H).
    """

    SWIGLU = "swiglu"
    RELU2 = "relu2"

    @property
    def parts(self) -> int:
        """The projections stacked in the expert's first weight: gate and up, or up alone."""
        return 2 if self is ExpertActivation.SWIGLU else 1

    def apply(self, projected: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        """[..., parts x width] first-projection output, plus `bias` (broadcast against it)
        where given -> [..., width] activation."""
        if self.parts == 1:
            (up,) = biased_parts(projected, bias, 1)
            return self.function(up)
        gate, up = biased_parts(projected, bias, 2)
        return self.function(gate) * up

    @property
    def function(self) -> Callable[[jax.Array], jax.Array]:
        """The elementwise function: SiLU on the gate, or `relu2` on the up projection."""
        return relu2 if self is ExpertActivation.RELU2 else jax.nn.silu


def biased_parts(projected: jax.Array, bias: jax.Array | None, parts: int) -> list[jax.Array]:
    """The `parts` stacked projections in `projected` [..., parts x width], each plus its slice
    of `bias` (broadcast against it, cast to `projected`'s dtype) where given.

    The bias is added after the split, inside the activation's pass: added to the whole product,
    XLA makes it the matmul's epilogue, and where cuBLAS then wins the tiling search the add runs
    as a pass of its own over the product (GPT-OSS's experts, runs 43-44).
    """
    pieces = jnp.split(projected, parts, axis=-1)
    if bias is None:
        return pieces
    biases = jnp.split(bias, parts, axis=-1)
    return [piece + part.astype(piece.dtype) for piece, part in zip(pieces, biases, strict=True)]


def relu2(x: jax.Array) -> jax.Array:
    """`relu(x)^2`, Nemotron-H's activation."""
    return jnp.square(jax.nn.relu(x))


def inverse_softplus(y: float) -> float:
    """The x with `softplus(x) = y` (> 0): `log(expm1(y))`."""
    if not y > 0:
        raise ValueError(f"softplus takes positive values only; got {y=}")
    return math.log(math.expm1(y))


class Xielu(nnx.Module):
    """xIELU (arXiv 2411.13010), elementwise, as transformers' `XIELUActivation` computes it (its
    Python form, `_xielu_python`), with `a_p = softplus(alpha_p)` and `a_n = beta +
    softplus(alpha_n)`:

        x > 0:   a_p * x^2 + beta * x
        x <= 0:  a_n * (expm1(min(x, eps)) - x) + beta * x

    Both alphas are trained; `beta` and `eps` are checkpoint state that training leaves as it is
    (`Buffer`; Hugging Face holds them as buffers). Each is one value, replicated on every rank,
    so the activation of any split of the columns is that split of the activation.

    Attributes:
      alpha_p: [1] the positive branch's coefficient before its softplus.
      alpha_n: [1] the negative branch's coefficient less `beta`, before its softplus.
      beta: [] (`Buffer`) the linear term's coefficient.
      eps: [] (`Buffer`) the largest input of the negative branch's `expm1` (<= 0).
    """

    def __init__(
        self,
        *,
        alpha_p: float = 0.8,
        alpha_n: float = 0.8,
        beta: float = 0.5,
        eps: float = -1e-6,
        dtype: jnp.dtype = jnp.float32,
    ):
        """Starts as transformers does: the softplus of the alphas gives `alpha_p` and
        `alpha_n - beta`.

        Raises:
          ValueError: `alpha_p <= 0`, `alpha_n <= beta` (no softplus gives them) or `eps > 0`.
        """
        if not (alpha_p > 0 and alpha_n > beta and eps <= 0):
            raise ValueError(
                "xIELU starts from alpha_p > 0, alpha_n > beta and eps <= 0; got "
                f"{alpha_p=}, {alpha_n=}, {beta=}, {eps=}"
            )
        self.alpha_p = _coefficient(alpha_p, dtype)
        self.alpha_n = _coefficient(alpha_n - beta, dtype)
        self.beta = _buffer(beta, dtype)
        self.eps = _buffer(eps, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[..., width] -> [..., width], in `x`'s dtype."""
        beta = self.beta[...].astype(x.dtype)
        alpha_p = jax.nn.softplus(self.alpha_p[...].reshape(())).astype(x.dtype)
        alpha_n = beta + jax.nn.softplus(self.alpha_n[...].reshape(())).astype(x.dtype)
        negative = (jnp.expm1(jnp.minimum(x, self.eps[...].astype(x.dtype))) - x) * alpha_n
        return jnp.where(x > 0, alpha_p * x * x, negative) + beta * x


def _coefficient(value: float, dtype: jnp.dtype) -> nnx.Param:
    """A replicated [1] parameter whose softplus is `value`."""
    return param(Constant(inverse_softplus(value)), (1,), dtype, sharding=(None,))


def _buffer(value: float, dtype: jnp.dtype) -> Buffer:
    """A replicated scalar `Buffer` that keeps its initializer."""
    init = Constant(value)
    return Buffer(init(None, (), dtype), initializer=init, out_sharding=(), eager_sharding=False)
