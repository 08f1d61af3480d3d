"""The MoE layer of a Qwen3-30B-A3B shape on an H200: grouped matmul implementations, and the
fused finalize + all-reduce + add + RMSNorm against the unfused path on two GPUs.

Run from the repository root on a machine with one or two GPUs:
    python3 -m benchmarks.bench_moe
    python3 -m benchmarks.bench_moe --smoke    # CPU: tiny shapes, the Triton kernel interpreted
    python3 -m benchmarks.bench_moe --fp8      # bf16 against FP8 experts (benchmarks.bench_fp8)

Part 1 (one GPU): the layer as the model runs it when it finalizes on the spot (router, top-k,
the gate|up and down grouped matmuls, the combine; `SparseMoe.finalized`) at 8, 64 and 4096
tokens per step, through `jax.lax.ragged_dot`, JAX's Mosaic GPU `ragged_dot` (`PALLAS_GPU`, a
few tilings), the project's gather-by-expert Triton kernel (`grouped_matmul.expert_matmul`,
`PALLAS_TRITON`, a few tilings; each tiling is passed as the layer's `tiling` argument), the
model default (`GPU_BY_SIZE`: Triton at decode sizes, batched matmuls over rows padded to a
capacity at prefill sizes) and the dense per-expert reference. Device time by CUPTI up to
`TRITON_MAX_ROUTED_ROWS` routed rows; above, where the model default runs a `lax.switch` whose
branch kernels CUPTI misses, every variant by the wall clock of back-to-back calls. The median
over rotating token sets (weights are 1.2 GB, far past L2). Rooflines: decode, the expert
weights the step must read (distinct chosen experts x 3 x hidden x width x 2 bytes) over the
measured copy bandwidth; prefill, the routed FLOPs (tokens x top-k x 3 x 2 x hidden x width)
over the measured bf16 matmul rate.

Part 2: 32 boundaries unrolled in one jitted `shard_map` at TP 2 (and TP 1: no sum owed, as
after an all-to-all dispatch), each taking a different [rows, top-k, hidden] deferred finalize:
the fused kernel against the unfused path (finalize, `psum`, XLA's add + RMSNorm), wall clock
per boundary.

Part 3 (`--breakdown`, one GPU): the prefill layer's pieces at 4096 tokens, each jitted and
timed alone on the previous piece's outputs (route; sort and row gather; the gate, fused gate|up
and down matmuls of JAX's Hopper grouped kernel and some of its tilings; the un-sort; the
finalize), the whole layer through the Hopper kernel against the model default (XLA batched
matmuls over the rows padded expert-major to a capacity bucket, `PADDED_BATCHED`), and the
batched matmuls alone on equal groups (their ceiling).
"""

import argparse
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import boundary_jax as bj
from benchmarks import bench_fp8
from benchmarks.common import header, kernel_ms, print_table, relative_error, wall_ms
from models.layers.moe import experts as routed_experts
from models.layers.moe import routing as moe_routing
from models.layers.moe import sparse as moe
from pallas_kernels import Impl, moe_finalize_add_rms_norm, moe_finalize_add_rms_norm_reference
from pallas_kernels.grouped_matmul import (
    TRITON_MAX_ROUTED_ROWS,
    HopperTiling,
    TritonTiling,
    grouped_matmul,
    hopper_ragged_dot,
    hopper_tiling,
)

P = jax.sharding.PartitionSpec
EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2048, 768
DTYPE = jnp.bfloat16
TOKENS = (8, 64, 4096)
FINALIZE_ROWS = (8, 64, 2048)
BOUNDARIES = 32
MGPU_TILINGS = {  # block_m, block_n (where it divides N), block_k, steps, grid_block_n
    "mgpu model default (128x192|128x64 s4 g4)": None,
    "mgpu 64x128x64 s2": (64, 128, 64, 2, 1),
    "mgpu 128x128x64 s4": (128, 128, 64, 4, 1),
    "mgpu 128x192|128 x64 s4": (128, 192, 64, 4, 1),
    "mgpu 128x256x64 s4": (128, 256, 64, 4, 1),
    "mgpu 128x192|128 x64 s4 g4": (128, 192, 64, 4, 4),
}
TRITON_TILINGS = {  # the first is the model's default
    "triton 16x128x64 s4": TritonTiling(16, 128, 64, 4, 4),
    "triton 16x64x128 s4": TritonTiling(16, 64, 128, 4, 4),
    "triton 16x128x128 s3 w8": TritonTiling(16, 128, 128, 8, 3),
    # Prefill-sized row blocks (a warpgroup's 64 rows and more): at 4096 tokens 1.35-2.05 ms
    # for the layer, against 1.15 ms with JAX's Hopper kernel (RESULTS run 15):
    "triton 64x128x64 s4 w4": TritonTiling(64, 128, 64, 4, 4),
    "triton 128x128x64 s3 w8": TritonTiling(128, 128, 64, 8, 3),
    "triton 128x256x64 s3 w8": TritonTiling(128, 256, 64, 8, 3),
}
SMOKE_TRITON_TILINGS = ("triton 16x128x64 s4", "triton 64x128x64 s4 w4")
"""`--smoke`: the model's default and the first prefill-sized tiling (each interpreted call of
the kernel takes tens of ms on CPU, and the smoke run only checks the script)."""


def ceilings() -> tuple[float, float]:
    """(copy bandwidth in TB/s, bf16 matmul rate in TFLOP/s), measured on GPU 0 by JAX."""
    n = 2**30  # 2 GiB of bf16 read and written
    x = jax.random.normal(jax.random.key(0), (n,), DTYPE)
    copy = jax.jit(lambda a: a + jnp.ones((), a.dtype))  # an elementwise pass: read + write
    copy_ms = kernel_ms(copy, [(x,)], repeats=10)
    del x
    size = 8192
    a = jax.random.normal(jax.random.key(1), (size, size), DTYPE)
    b = jax.random.normal(jax.random.key(2), (size, size), DTYPE)
    mm_ms = kernel_ms(jax.jit(jnp.dot), [(a, b)], repeats=10)
    return 2 * n * 2 / copy_ms / 1e9, 2 * size**3 / mm_ms / 1e9


def torch_copy_tb_s() -> float:
    """Device-to-device memcpy bandwidth by PyTorch (read + write), NaN without PyTorch."""
    try:
        import torch
    except ImportError:
        return float("nan")
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(12):
        start.record()
        dst.copy_(src)
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2**30 * 2 / float(np.median(times[2:])) / 1e9


def layer_weights(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    scale = lambda fan_in: 1 / math.sqrt(fan_in)  # noqa: E731
    router = jax.random.normal(keys[0], (HIDDEN, EXPERTS), jnp.float32) * scale(HIDDEN)
    gate = jax.random.normal(keys[1], (EXPERTS, HIDDEN, WIDTH), DTYPE) * scale(HIDDEN)
    up = jax.random.normal(keys[2], (EXPERTS, HIDDEN, WIDTH), DTYPE) * scale(HIDDEN)
    down = jax.random.normal(keys[3], (EXPERTS, WIDTH, HIDDEN), DTYPE) * scale(WIDTH)
    gate_up = jnp.stack([gate, up], axis=2)  # [E, hidden, 2, width], as the model stores them
    return router.astype(DTYPE), gate_up.astype(DTYPE), down.astype(DTYPE)


def token_sets(tokens: int, count: int = 4):
    return [
        (jax.random.normal(jax.random.key(100 + i), (tokens, HIDDEN), jnp.float32).astype(DTYPE),)
        for i in range(count)
    ]


@functools.cache
def layer_fn(impl: moe.GroupedMatmulImpl, variant: str):
    """The jitted MoE layer through `impl` with `variant`'s tiling (`tiling_table`), weights
    closed over by argument."""
    tiling = tiling_table(variant)

    def layer(x, router, gate_up, down):  # as `SparseMoe.finalized` runs it
        routing = moe_routing.route(x, router, top_k=TOP_K, renormalize=True)
        return routed_experts.finalized_expert_outputs(
            x, routing, gate_up, down, impl=impl, tiling=tiling
        )

    return jax.jit(layer)


def tiling_table(variant: str):
    """`variant`'s tiling by shape, as `grouped_matmul` takes it; None for the tuned tables.

    A Hopper variant's block_n and grid_block_n apply where they divide the shape, else the
    tuned table's.
    """
    if variant in TRITON_TILINGS:
        return lambda k, n, dtype: TRITON_TILINGS[variant]
    tiling = MGPU_TILINGS.get(variant)
    if tiling is None:
        return None
    block_m, block_n, block_k, steps, grid_block_n = tiling

    def table(k, n, dtype):
        block = block_n if n % block_n == 0 else hopper_tiling(k, n, dtype).block_n
        grid = grid_block_n if n % (grid_block_n * block) == 0 else 1
        return HopperTiling(block_m, block, block_k, steps, grid)

    return table


def distinct_experts(x, router) -> int:
    routing = moe_routing.route(x, router, top_k=TOP_K, renormalize=True)
    return int(np.unique(np.asarray(routing.experts)).size)


def part1(
    copy_tb_s: float,
    matmul_tflop_s: float,
    tokens_list,
    only: tuple[str, ...] = (),
    smoke: bool = False,
) -> list[tuple]:
    """The layer per grouped matmul variant. `smoke`: on CPU, the `SMOKE_TRITON_TILINGS`
    interpreted, the GPU-only variants left out, every variant by the wall clock."""
    router, gate_up, down = layer_weights()
    table = []
    triton = (
        moe.GroupedMatmulImpl.PALLAS_INTERPRET if smoke else moe.GroupedMatmulImpl.PALLAS_TRITON
    )
    variants = [("ragged_dot (XLA)", moe.GroupedMatmulImpl.RAGGED_DOT)]
    if not smoke:
        variants += [(name, moe.GroupedMatmulImpl.PALLAS_GPU) for name in MGPU_TILINGS]
    variants += [(name, triton) for name in (SMOKE_TRITON_TILINGS if smoke else TRITON_TILINGS)]
    if not smoke:
        variants += [("GPU_BY_SIZE (model default)", moe.GroupedMatmulImpl.GPU_BY_SIZE)]
    variants += [("dense per-expert", moe.GroupedMatmulImpl.DENSE)]
    if only:
        variants = [
            v for v in variants if v[0].startswith("ragged") or any(o in v[0] for o in only)
        ]
    for tokens in tokens_list:
        sets = token_sets(tokens)
        experts = np.mean([distinct_experts(s[0], router) for s in sets])
        weight_bytes = experts * 3 * HIDDEN * WIDTH * 2
        flops = tokens * TOP_K * 3 * 2 * HIDDEN * WIDTH
        reference = layer_fn(moe.GroupedMatmulImpl.RAGGED_DOT, "")(*sets[0], router, gate_up, down)
        # The model default branches (lax.switch) from here up, which CUPTI does not see into:
        # every variant by the wall clock, side by side.
        wall = smoke or tokens * TOP_K > TRITON_MAX_ROUTED_ROWS
        base_ms = None
        for name, impl in variants:
            if impl is moe.GroupedMatmulImpl.DENSE and tokens > 64:
                continue  # every token through all 128 experts: 4.9 PFLOP at 4096 tokens
            fn = layer_fn(impl, name)
            try:
                err = relative_error(fn(*sets[0], router, gate_up, down), reference)
                ms = kernel_ms(
                    fn,
                    [(s[0], router, gate_up, down) for s in sets],
                    warmup=2,
                    repeats=20,
                    wall=wall,
                )
            except Exception as error:  # one failing variant must not end the run
                print(f"  {name} @ {tokens}: {type(error).__name__}: {str(error)[:600]}")
                continue
            base_ms = ms if base_ms is None else base_ms
            hbm = weight_bytes / ms / 1e9 / copy_tb_s
            flop = flops / ms / 1e9 / matmul_tflop_s
            label = f"{name} [wall clock]" if wall else name
            row = (tokens, label, ms * 1e3, tokens / ms * 1e3, base_ms / ms, hbm, flop, err)
            print(f"  {row}")
            table.append(row)
        print(f"  tokens {tokens}: {experts:.1f} distinct experts, {weight_bytes / 1e6:.0f} MB")
    return table


@functools.cache
def finalize_chain(mesh, fused: bool, loop: bool, impl: Impl = Impl.PALLAS_GPU):
    axis = "tp" if mesh.size > 1 else None

    def body(outputs, weights, residual, norm_weight):
        outputs, weights, residual, norm_weight = (
            outputs[0],
            weights[0],
            residual[0],
            norm_weight[0],
        )
        normed = None
        for i in range(BOUNDARIES if loop else 1):
            if fused:
                normed, residual = moe_finalize_add_rms_norm(
                    outputs[i],
                    weights[i],
                    residual,
                    norm_weight,
                    axis_name="tp",
                    impl=impl,
                )
            else:
                normed, residual = moe_finalize_add_rms_norm_reference(
                    outputs[i], weights[i], residual, norm_weight, axis_name=axis
                )
            residual = residual + normed  # the next boundary depends on this one's output
        return normed[None], residual[None]

    spec = P("tp")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def part2(rows_list, devices: int, impl: Impl = Impl.PALLAS_GPU) -> list[tuple]:
    """TP `devices` (1: no sum owed, as after an all-to-all dispatch), the fused kernel through
    `impl`."""
    mesh = jax.sharding.Mesh(jax.devices()[:devices], ("tp",))
    sharding = jax.sharding.NamedSharding(mesh, P("tp"))
    table = []
    for rows in rows_list:
        keys = jax.random.split(jax.random.key(rows), 4)
        outputs = jax.random.normal(keys[0], (devices, BOUNDARIES, rows, TOP_K, HIDDEN), DTYPE)
        weights = jax.random.uniform(keys[1], (devices, BOUNDARIES, rows, TOP_K), jnp.float32)
        residual = jax.random.normal(keys[2], (devices, rows, HIDDEN), DTYPE)
        norm_weight = (1 + jax.random.normal(keys[3], (devices, HIDDEN), jnp.float32)).astype(DTYPE)
        operands = jax.device_put((outputs, weights, residual, norm_weight), sharding)
        try:
            err = relative_error(
                finalize_chain(mesh, True, False, impl)(*operands),
                finalize_chain(mesh, False, False)(*operands),
            )
            fused_us = wall_ms(finalize_chain(mesh, True, True, impl), operands) * 1e3 / BOUNDARIES
        except Exception as error:
            print(f"  fused finalize @ {rows}: {type(error).__name__}: {str(error)[:600]}")
            err = fused_us = float("nan")
        unfused_us = wall_ms(finalize_chain(mesh, False, True), operands) * 1e3 / BOUNDARIES
        row = (devices, rows, TOP_K, HIDDEN, fused_us, unfused_us, unfused_us / fused_us, err)
        print(f"  {row}")
        table.append(row)
    return table


BREAKDOWN_TILINGS = (  # block_m, block_n, block_k, steps, grid_block_n
    (128, 128, 64, 4, 4),
    (128, 192, 64, 4, 4),
    (128, 128, 128, 3, 4),
    (64, 256, 64, 4, 4),
    (64, 256, 128, 3, 4),
    (64, 128, 64, 4, 4),
    (64, 192, 64, 4, 4),
)


def part3(tokens: int, matmul_tflop_s: float) -> list[tuple]:
    """The prefill layer's pieces (GPU_BY_SIZE, the model default), device time each, and the
    Hopper grouped matmul's tilings on the gate and down shapes."""
    router, gate_up, down = layer_weights()
    gate, up = gate_up[:, :, 0], gate_up[:, :, 1]
    fused = gate_up.reshape(EXPERTS, HIDDEN, 2 * WIDTH)  # [E, hidden, 2 x width]
    impl = moe.GroupedMatmulImpl.GPU_BY_SIZE
    x = token_sets(tokens)[0][0]
    rows_n = tokens * TOP_K
    routing = jax.jit(functools.partial(moe_routing.route, top_k=TOP_K, renormalize=True))(
        x, router
    )
    group = routing.experts.reshape(-1)
    argsort = jax.jit(jnp.argsort)
    order = argsort(group)
    group_order = jax.jit(bj.ops.group_order, static_argnums=1)
    positions = group_order(group, EXPERTS)[1]
    gather_rows = jax.jit(lambda x, order: jnp.take(x, order // TOP_K, axis=0))
    rows = gather_rows(x, order)
    sizes = jnp.bincount(group, length=EXPERTS).astype(jnp.int32)
    inverse_by_scatter = jax.jit(
        lambda order: jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    )
    inverse = inverse_by_scatter(order)
    np.testing.assert_array_equal(np.asarray(inverse), np.asarray(positions))
    np.testing.assert_array_equal(np.asarray(argsort(order)), np.asarray(inverse))

    @functools.partial(jax.jit, static_argnames=("tiling", "width"))
    def matmul(rows, weights, sizes, tiling=None, width=None):
        if tiling is None:
            out = grouped_matmul(rows, weights, sizes, impl=impl)
        else:
            out = hopper_ragged_dot(rows, weights, sizes, tiling=HopperTiling(*tiling))
        return out if width is None else jax.nn.silu(out[:, :width]) * out[:, width:]

    g = matmul(rows, gate, sizes)
    h = jax.nn.silu(g) * matmul(rows, up, sizes)
    out = matmul(h, down, sizes)
    un_sort = jax.jit(lambda out, inverse: jnp.take(out, inverse, axis=0))
    finalize = jax.jit(
        lambda outputs, routing: moe_routing.finalize(moe_routing.MoeOutput(outputs, routing, None))
    )
    outputs = un_sort(out, inverse).reshape(tokens, TOP_K, HIDDEN)
    reference = layer_fn(impl, "")(x, router, gate_up, down)
    errors = {"pieces": relative_error(finalize(outputs, routing), reference)}
    hopper = layer_fn(moe.GroupedMatmulImpl.PALLAS_GPU, "")
    largest = int(jnp.max(sizes))
    fits = [c for c in routed_experts.capacity_buckets(rows_n / EXPERTS, rows_n) if c >= largest]
    path = f"padded batched, C {fits[0]}" if fits else "past the buckets: Hopper kernel"
    mm_flops = rows_n * 2 * HIDDEN * WIDTH
    pieces = [
        (
            "route",
            jax.jit(functools.partial(moe_routing.route, top_k=TOP_K, renormalize=True)),
            (x, router),
            0,
        ),
        ("argsort of the expert ids", argsort, (group,), 0),
        (
            "bj.ops.group_order (counting, no sort)",
            group_order,
            (group, EXPERTS),
            0,
        ),
        ("row gather", gather_rows, (x, order), 0),
        ("inverse by argsort", argsort, (order,), 0),
        ("inverse by scatter", inverse_by_scatter, (order,), 0),
        ("un-sort row gather", un_sort, (out, inverse), 0),
        ("finalize", finalize, (outputs, routing), 0),
        ("Hopper gate matmul [K, W]", matmul, (rows, gate, sizes), mm_flops),
        (
            "Hopper fused gate|up [K, 2W] + silu * up",
            matmul,
            (rows, fused, sizes, None, WIDTH),
            2 * mm_flops,
        ),
        ("Hopper down matmul [W, K]", matmul, (h, down, sizes), mm_flops),
        ("layer, Hopper kernel (PALLAS_GPU)", hopper, (x, router, gate_up, down), 3 * mm_flops),
        (
            f"layer (model default: {path}, busiest expert {largest})",
            layer_fn(impl, ""),
            (x, router, gate_up, down),
            3 * mm_flops,
        ),
    ]
    errors["layer, Hopper kernel"] = relative_error(hopper(x, router, gate_up, down), reference)
    per_expert = rows.reshape(EXPERTS, -1, HIDDEN)[:, : rows_n // EXPERTS]  # equal groups
    batched = jax.jit(lambda a, w: jnp.einsum("gck,gkn->gcn", a, w))
    pieces += [
        ("batched gate, equal groups", batched, (per_expert, gate), mm_flops),
        ("batched down, equal groups", batched, (per_expert[..., :WIDTH], down), mm_flops),
    ]
    for tiling in BREAKDOWN_TILINGS:
        name = "{}x{}x{} s{} g{}".format(*tiling)
        for what, args in (
            ("gate", (rows, gate, sizes, tiling)),
            ("down", (h, down, sizes, tiling)),
        ):
            n = args[1].shape[2]
            if n % tiling[1] or args[1].shape[1] % tiling[2] or n % (tiling[1] * tiling[4]):
                continue
            try:
                want = g if what == "gate" else out
                errors[f"{what} {name}"] = relative_error(matmul(*args), want)
            except Exception as error:  # a tiling the kernel rejects must not end the run
                print(f"  {what} {name}: {type(error).__name__}: {str(error)[:400]}")
                continue
            pieces.append((f"{what} matmul {name}", matmul, args, mm_flops))
    table = []
    for name, fn, args, flops in pieces:
        wall = name.startswith("layer")  # the model default branches: see part1
        name = f"{name} [wall clock]" if wall else name
        try:
            ms = kernel_ms(fn, [args], warmup=2, repeats=20, wall=wall)
        except Exception as error:  # one failing tiling must not end the run
            print(f"  {name}: {type(error).__name__}: {str(error)[:400]}")
            continue
        share = flops / ms / 1e9 / matmul_tflop_s if flops else float("nan")
        row = (tokens, name, ms * 1e3, share)
        print(f"  {row}")
        table.append(row)
    print("  rel err against the model's layer / its own matmul:", errors)
    return table


def use_smoke_shapes() -> None:
    """Shrinks this script's layer to CPU size (`--smoke`: a check that the script runs)."""
    global EXPERTS, TOP_K, HIDDEN, WIDTH, BOUNDARIES
    EXPERTS, TOP_K, HIDDEN, WIDTH, BOUNDARIES = 8, 2, 256, 128, 2


def smoke(tokens_list) -> None:
    """Parts 1 and 2 at the smoke shapes on CPU, timed by the wall clock (ceilings of 1), and
    the Hopper variants' tilings for the layer's two matmul shapes (their kernel needs a GPU)."""
    for name in MGPU_TILINGS:
        table = tiling_table(name) or hopper_tiling
        print(
            f"  {name}: {[table(k, n, DTYPE) for k, n in ((HIDDEN, 2 * WIDTH), (WIDTH, HIDDEN))]}"
        )
    print_table(
        ("tokens", "grouped matmul", "us", "tokens/s", "x ragged_dot", "HBM", "FLOP", "rel err"),
        part1(1.0, 1.0, tokens_list, smoke=True),
    )
    print_table(
        ("TP", "rows", "top-k", "hidden", "fused us", "unfused us", "speedup", "rel err"),
        part2((8,), 1, Impl.PALLAS_GPU_INTERPRET),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--finalize-rows", type=int, nargs="+", default=FINALIZE_ROWS)
    parser.add_argument("--finalize-tp", type=int, nargs="*", default=(1, 2))
    parser.add_argument("--only", nargs="*", default=(), help="variant names containing these")
    parser.add_argument("--breakdown", action="store_true", help="part 3 only (4096 tokens)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (parts 1, 2)")
    parser.add_argument(
        "--fp8", action="store_true", help="the layer with bf16 against FP8 experts (bench_fp8)"
    )
    args = parser.parse_args()
    if args.fp8:
        bench_fp8.main(["--parts", "moe", *(["--smoke"] if args.smoke else [])])
        return
    print(header("bench_moe"))
    if args.smoke:
        use_smoke_shapes()
        smoke(args.tokens if args.tokens != TOKENS else (8, 64))
        return
    torch_tb_s = torch_copy_tb_s()
    copy_tb_s, matmul_tflop_s = ceilings()
    print(
        f"ceilings: XLA elementwise copy {copy_tb_s:.2f} TB/s, PyTorch memcpy {torch_tb_s:.2f} "
        f"TB/s, bf16 matmul 8192^3 {matmul_tflop_s:.0f} TFLOP/s"
    )
    hbm_ceiling = torch_tb_s if np.isfinite(torch_tb_s) else copy_tb_s
    if args.breakdown:
        print(f"\nprefill layer pieces, 1 GPU (FLOP ceiling {matmul_tflop_s:.0f} TFLOP/s):")
        print_table(("tokens", "piece", "us", "FLOP roofline"), part3(4096, matmul_tflop_s))
        return
    layer = part1(hbm_ceiling, matmul_tflop_s, args.tokens, tuple(args.only))
    finalize = [
        row
        for devices in args.finalize_tp
        if devices <= len(jax.devices())
        for row in part2(args.finalize_rows, devices)
    ]

    print(
        f"\nMoE layer, {EXPERTS} experts, top-{TOP_K}, hidden {HIDDEN}, width {WIDTH}, bf16, "
        f"1 GPU (HBM ceiling {hbm_ceiling:.2f} TB/s, FLOP ceiling {matmul_tflop_s:.0f} TFLOP/s):"
    )
    print_table(
        (
            "tokens",
            "grouped matmul",
            "us",
            "tokens/s",
            "x ragged_dot",
            "HBM roofline",
            "FLOP roofline",
            "rel err",
        ),
        layer,
    )
    if finalize:
        print("\nfused finalize (+ all-reduce at TP 2) + add + RMSNorm, us per boundary:")
        print_table(
            ("TP", "rows", "top-k", "hidden", "fused us", "unfused us", "speedup", "rel err"),
            finalize,
        )


if __name__ == "__main__":
    main()
