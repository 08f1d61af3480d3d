"""cuDNN's causal prefill attention over packed rows, in each form it can take, at model shapes.

Packed prefill rows can reach cuDNN three ways: the ragged layout (one batch row, each
sequence found by its offset and length) and windows (the rows as [sequences, rows each], when
every sequence fills its window from the window's first row) under a plain causal mask, both as
the project runs them (`prefill_attention_cudnn`), and the same windows under a causal padding
mask (each window's length, `jax.nn.dot_product_attention`). Latent attention's value (128
wide) is narrower than its query and key (192): the project's windows take it as it is or
zero-padded to the key's width; its ragged layout and the padding mask only padded. Each form is
timed by CUPTI (every kernel of its call) and checked against XLA's float32 attention of each
sequence alone, forward and (with `--grad`) backward.

Run on the GPU machine from the repository root (one H200):
  python3 -m benchmarks.bench_prefill_attention [--grad]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from models.layers.attention.cudnn import prefill_attention_cudnn

from .common import header, kernel_ms, print_table, relative_error

SHAPES = {
    # name: (query heads, kv heads, query/key width, value width)
    "MLA (DeepSeek-V2-Lite)": (16, 16, 192, 128),
    "GQA (Llama-3-8B)": (32, 8, 128, 128),
}
BATCHES = ((8, 512), (1, 4096), (32, 128))


def ragged(q, k, v, sequences, length, scale):
    """The project's ragged layout (a bound of at least 2 segments keeps one sequence ragged)."""
    segments = jnp.repeat(jnp.arange(sequences, dtype=jnp.int32), length)
    return prefill_attention_cudnn(q, k, v, segments, max_segments=max(sequences, 2), scale=scale)


def windows(q, k, v, sequences, length, scale):
    """The project's windows: [sequences, length] under a plain causal mask."""
    segments = jnp.repeat(jnp.arange(sequences, dtype=jnp.int32), length)
    return prefill_attention_cudnn(
        q, k, v, segments, max_segments=sequences, scale=scale, window_rows=length
    )


def windows_with_lengths(q, k, v, sequences, length, scale):
    """[sequences, length] windows under cuDNN's causal padding mask (each window's length)."""

    def grid(x):
        return x.reshape(sequences, length, *x.shape[1:])

    lengths = jnp.full((sequences,), length, jnp.int32)
    out = jax.nn.dot_product_attention(
        grid(q),
        grid(k),
        grid(v),
        scale=scale,
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation="cudnn",
    )
    return out.reshape(q.shape[0], q.shape[1], v.shape[-1])


def reference(q, k, v, sequences, length, scale):
    """XLA in float32, each sequence alone."""

    def grid(x):
        return x.astype(jnp.float32).reshape(sequences, length, *x.shape[1:])

    width = q.shape[-1]
    value = jnp.pad(v, ((0, 0), (0, 0), (0, width - v.shape[-1])))
    out = jax.nn.dot_product_attention(
        grid(q), grid(k), grid(value), scale=scale, is_causal=True, implementation="xla"
    )
    return out[..., : v.shape[-1]].reshape(q.shape[0], q.shape[1], v.shape[-1])


def forms(width: int, v_width: int):
    """(name, attention(q, k, v, sequences, length, scale)) of every form at these widths."""

    def padded(form):
        def run(q, k, v, *args):
            value = jnp.pad(v, ((0, 0), (0, 0), (0, width - v_width)))
            return form(q, k, value, *args)[..., :v_width]

        return run

    if v_width == width:
        return [
            ("ragged", ragged),
            ("windows causal", windows),
            ("windows padding", windows_with_lengths),
        ]
    # The ragged layout pads a narrower value itself: JAX gives the value's segments the key's
    # row stride (run 26: 1.1 relative error unpadded, and a faulting backward).
    return [
        ("ragged, v padded", ragged),
        ("windows causal, v padded", padded(windows)),
        ("windows padding, v padded", padded(windows_with_lengths)),
        (f"windows causal, v {v_width}", windows),
    ]


def measure(shape: str, sequences: int, length: int, grad: bool) -> list[tuple]:
    """One table row per form at one shape and batch."""
    heads, kv_heads, width, v_width = SHAPES[shape]
    scale = width**-0.5
    tokens = sequences * length
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (tokens, heads, width), jnp.bfloat16)
    k = jax.random.normal(keys[1], (tokens, kv_heads, width), jnp.bfloat16)
    v = jax.random.normal(keys[2], (tokens, kv_heads, v_width), jnp.bfloat16)
    cotangent = jax.random.normal(keys[3], (tokens, heads, v_width), jnp.bfloat16)

    def want_of(*x):
        return reference(*x, sequences, length, scale)

    want, want_vjp = jax.vjp(want_of, q, k, v)
    want_grad = want_vjp(cotangent.astype(jnp.float32))
    rows = []
    for name, form in forms(width, v_width):

        def forward(q, k, v, form=form):
            return form(q, k, v, sequences, length, scale)

        def backward(q, k, v, forward=forward):
            return jax.vjp(forward, q, k, v)[1](cotangent)

        label = f"{shape} {sequences}x{length} {name}"
        try:
            call = jax.jit(forward)
            error = f"{relative_error(call(q, k, v), want):.1e}"
            ms = kernel_ms(call, [(q, k, v)])
        except Exception as failure:  # a form cuDNN or JAX refuses at this shape
            print(f"  {label}: {failure}"[:300])
            error = ms = "refused"
        grad_ms = grad_error = "-"
        if grad and ms != "refused":
            try:
                call = jax.jit(backward)
                grad_error = f"{relative_error(call(q, k, v), want_grad):.1e}"
                grad_ms = kernel_ms(call, [(q, k, v)])
            except Exception as failure:
                print(f"  backward {label}: {failure}"[:300])
                grad_error = grad_ms = "refused"
        rows.append((shape, f"{sequences} x {length}", name, ms, error, grad_ms, grad_error))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grad", action="store_true", help="also time and check the backward")
    args = parser.parse_args()
    print(header("cuDNN prefill attention forms"))
    rows = []
    for shape in SHAPES:
        for sequences, length in BATCHES:
            rows += measure(shape, sequences, length, args.grad)
    print_table(
        ["shape", "batch", "form", "forward ms", "error", "forward + backward ms", "grad error"],
        rows,
    )


if __name__ == "__main__":
    main()
