"""Gradients for the kernels: each differentiates as its reference does."""

from collections.abc import Callable

import jax


def with_reference_vjp(kernel: Callable, reference: Callable) -> Callable:
    """`kernel`, differentiable: a `jax.custom_vjp` that runs `kernel` forward and, backward,
    the VJP of `reference` at the same inputs (recomputing the reference's forward).

    Args:
      kernel: A function of arrays (pytrees; None allowed) computing what `reference` does;
        static options are closed over.
      reference: The kernel's specification, a function of the same arguments with outputs of
        the same structure, shapes, dtypes and varying axes.

    Returns:
      A function of the same arguments: `kernel`'s values, `reference`'s gradients.
    """

    @jax.custom_vjp
    def op(*args):
        return kernel(*args)

    def forward(*args):
        return kernel(*args), args

    def backward(args, cotangents):
        return jax.vjp(reference, *args)[1](cotangents)

    op.defvjp(forward, backward)
    return op
