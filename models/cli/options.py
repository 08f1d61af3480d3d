"""The command line's options: parsing each value, and checking them together against the
model's config and the machine before anything is built, in the words the user typed."""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import jax
from jax import lax

import boundary_jax as bj

from ..config import DecoderConfig, family_of
from ..layers.attention.context_parallel import CpAttentionMode
from ..layers.attention.self_attention import AttentionImpl
from ..layers.fp8_linear import Fp8Quantization
from ..layers.hyper_connections import HyperConnections
from ..options import BuildOptions, Remat
from ..pipeline import PipelineSplit


class InputError(ValueError):
    """A problem with what the user passed: reported in one line, exit code 2."""


MATMUL_PRECISIONS = ("default", "high", "highest")
QUANTIZATIONS = ("fp8",)
FUSIONS = ("none", "pallas")
"""The values of `--quantize`."""


def parse_mesh(text: str) -> dict[str, int]:
    """`--mesh`: comma-separated `name=size` pairs over the mesh axes."""
    names = [axis.value for axis in bj.MeshAxis]
    sizes: dict[str, int] = {}
    for item in text.split(","):
        name, _, value = (part.strip() for part in item.partition("="))
        if name not in names or not value.isdigit():
            raise argparse.ArgumentTypeError(
                f"takes name=size pairs over {names}, e.g. attn_dp=2,attn_tp=4; got {text!r}"
            )
        if name in sizes:
            raise argparse.ArgumentTypeError(f"names {name} twice; got {text!r}")
        sizes[name] = int(value)
        if sizes[name] < 1:
            raise argparse.ArgumentTypeError(f"sizes must be positive; got {text!r}")
    return sizes


def mesh_text(sizes: dict[str, int]) -> str:
    """`--mesh` as the user would type it (`1` for no axis)."""
    return ",".join(f"{name}={size}" for name, size in sizes.items()) or "1"


def policy(text: str) -> bj.ReductionPolicy:
    """`--policy`: a reduction policy by name."""
    try:
        return bj.ReductionPolicy.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_int(text: str) -> int:
    """An int >= 1 (so no option divides by zero)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {text}")
    return value


def port(text: str) -> int:
    """A TCP port to listen on: 1 to 65535."""
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 1 to 65535; got {text}")
    return value


def sequence_length(text: str) -> int:
    """`--seq-len`: an int >= 2 (a sequence of one token has no next token to predict)."""
    value = _int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be at least 2 (a one-token sequence has no next token to predict); got {text}"
        )
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0; got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0 (`nan` and `inf` are refused)."""
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0; got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite float >= 0."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0; got {text}")
    return value


def probability(text: str) -> float:
    """A float in (0, 1]."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]; got {text}")
    return value


def matmul_precision(text: str) -> lax.Precision:
    """`--matmul-precision`: default, high or highest."""
    if text not in MATMUL_PRECISIONS:
        raise argparse.ArgumentTypeError(f"must be one of {list(MATMUL_PRECISIONS)}; got {text!r}")
    return lax.Precision[text.upper()]


def capture_layers(text: str) -> list[int]:
    """`--capture-layers`: comma-separated layer indices."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() for item in items):
        raise argparse.ArgumentTypeError(
            f"takes comma-separated layer indices, e.g. 2,5; got {text!r}"
        )
    return [int(item) for item in items]


def pp_split(text: str) -> tuple[int, ...]:
    """`--pp-split`: the layers of each pipeline stage, comma-separated."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isdigit() for item in items):
        raise argparse.ArgumentTypeError(
            f"takes the layers of each pipeline stage, e.g. 10,14,8; got {text!r}"
        )
    return tuple(int(item) for item in items)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number; got {text}")
    return value


def topology(args: argparse.Namespace, num_experts: int | None = None) -> bj.Topology:
    """The topology of `--mesh` and `--moe-ep`, checked against the model's `num_experts`
    (None: no experts), its errors in the options' words."""
    try:
        topology = bj.Topology.from_axis_sizes(args.mesh, moe_ep=args.moe_ep)
        if num_experts is not None:
            topology.experts_per_rank(num_experts)
        return topology
    except ValueError as error:
        raise InputError(
            f"--moe-ep {args.moe_ep} on --mesh {mesh_text(args.mesh)}: {error}"
        ) from None


def quantization(args: argparse.Namespace) -> Fp8Quantization | None:
    """`--quantize fp8`: FP8 projections whose products run as the default backend runs them
    fastest; None without it (or on a command that has no `--quantize`, such as train)."""
    if getattr(args, "quantize", None) != "fp8":
        return None
    return Fp8Quantization.for_platform(jax.default_backend())


def fusions(args: argparse.Namespace, topology: bj.Topology) -> bj.fusions.FusionProvider:
    """`--fusions pallas`: the platform's Pallas boundary kernels (`fusions.platform_fusions`),
    each declining where it does not take the shape or does not pay off (everywhere on CPU);
    `none` (the default): the built-in sums and XLA's add + norm."""
    if getattr(args, "fusions", "none") != "pallas":
        return bj.fusions.NO_FUSIONS
    return bj.fusions.platform_fusions(topology)


def build_options(
    args: argparse.Namespace, topology: bj.Topology, *, attention: AttentionImpl | None = None
) -> BuildOptions:
    """The one `BuildOptions` of a command's options (`attention`: a kernel the command
    requires, None for the platform's fastest)."""
    return BuildOptions(
        dtype=args.dtype,
        matmul_precision=args.matmul_precision,
        attention=attention,
        reduction=args.policy,
        fusions=fusions(args, topology),
        remat=getattr(args, "remat", Remat.NONE),
        scan_layers=args.scan_layers,
        quantization=quantization(args),
        cp_attention=args.cp_attention or CpAttentionMode.ALL_GATHER,
        two_batch_overlap=getattr(args, "two_batch_overlap", False),
        hyper_connections=hyper_connections(args.hc_mult),
        moe_dispatch=args.moe_dispatch,
        dense_ffn_dp=args.dense_ffn_dp,
    )


def hyper_connections(hc_mult: int | None) -> HyperConnections | None:
    """`--hc-mult`: MHC hyper-connections of that many streams (None without it)."""
    if hc_mult is None:
        return None
    try:
        return HyperConnections(hc_mult=hc_mult)
    except ValueError as error:
        raise InputError(f"--hc-mult {hc_mult}: {error}") from None


def check_devices(args: argparse.Namespace) -> list[jax.Device]:
    """The devices the mesh goes on: the default backend's, which must hold `--mesh`."""
    needed = math.prod(args.mesh.values())
    if args.devices is not None and args.devices < needed:
        raise InputError(
            f"--devices {args.devices} is fewer than the {needed} --mesh {mesh_text(args.mesh)} "
            "needs"
        )
    devices = jax.devices()
    if len(devices) < needed:
        platform = devices[0].platform
        hint = (
            f"; --devices {needed} simulates them"
            if platform == "cpu"
            else f"; JAX_PLATFORMS=cpu with --devices {needed} simulates them on the CPU"
        )
        raise InputError(
            f"--mesh {mesh_text(args.mesh)} needs {needed} devices; this machine has "
            f"{len(devices)} {platform} device{'s' * (len(devices) != 1)}{hint}"
        )
    return devices


def check_model(args: argparse.Namespace, config: DecoderConfig) -> None:
    """What the model's config and the options must agree on, checked before building."""
    tp = args.mesh.get(bj.MeshAxis.ATTN_TP.value, 1)
    heads, kv_heads = config.num_heads, config.num_kv_heads
    if heads % tp:
        divisors = [n for n in range(1, heads + 1) if heads % n == 0]
        raise InputError(
            f"--mesh attn_tp={tp}: the model's {heads} attention heads do not split over {tp} "
            f"ranks; choose attn_tp among {divisors}"
        )
    if kv_heads % tp and tp % kv_heads:
        raise InputError(
            f"--mesh attn_tp={tp}: the model's {kv_heads} kv heads neither split over {tp} ranks "
            "nor are each shared by a whole number of them"
        )
    if args.input_scattered and tp == 1:
        raise InputError(
            "--input-scattered splits the residual over attention TP; it needs --mesh attn_tp > 1"
        )
    check_context_parallel(args, config)
    experts = config.num_experts is not None
    if not experts and (args.moe_ep != 1 or args.moe_dispatch is not None):
        raise InputError(
            f"{config.architecture} has no experts; --moe-ep and --moe-dispatch are for MoE models"
        )
    if args.hc_mult is not None and getattr(args, "quantize", None) is not None:
        raise InputError(
            f"--quantize {args.quantize} quantizes add + norm reads, and --hc-mult's MHC reads mix "
            "their streams before the norm, so they have no quantized form; use one of them"
        )
    if args.hc_mult is not None and args.checkpoint:
        raise InputError(
            "--hc-mult builds MHC layers with random weights, and a Hugging Face checkpoint holds "
            "no MHC weights; use it with --preset"
        )


def check_context_parallel(args: argparse.Namespace, config: DecoderConfig) -> None:
    """`--mesh attn_cp=N` (N > 1) runs dense decoders (forward, generate, train, plan; not as
    pipeline stages); `--cp-attention` needs it."""
    cp = args.mesh.get(bj.MeshAxis.ATTN_CP.value, 1)
    if cp == 1:
        if args.cp_attention is not None:
            raise InputError(
                f"--cp-attention {args.cp_attention.value} picks how a prefill's attention "
                "reaches the other attention-CP ranks' keys; it needs --mesh attn_cp > 1"
            )
        return
    kinds = (
        (config.num_experts is not None, "experts"),
        (config.mla is not None, "latent attention"),
        (config.hybrid is not None, "Mamba2 layers"),
    )
    held = [kind for present, kind in kinds if present]
    if not family_of(config).context_parallel:
        raise InputError(
            f"--mesh attn_cp={cp}: context parallelism is built for dense decoders; "
            f"{config.architecture} has {' and '.join(held) or 'other layers'}; use attn_cp=1 "
            "(split it over attn_dp, attn_tp and pp)"
        )


def pipelined(args: argparse.Namespace) -> bool:
    """The model runs as pipeline stages: under `--mesh pp=N` (N > 1) or `--pp-split`."""
    pp = args.mesh.get(bj.MeshAxis.PP.value, 1)
    return pp > 1 or getattr(args, "pp_split", None) is not None


def check_pipeline(args: argparse.Namespace, config: DecoderConfig) -> PipelineSplit | None:
    """The layers of each pipeline stage under `--mesh pp=N` or `--pp-split` (None without
    them), checked against the model, with the options the pipeline stages do not build."""
    if not pipelined(args):
        if getattr(args, "microbatches", None) is not None:
            raise InputError(
                "--microbatches splits a batch over pipeline stages; it needs --mesh pp=N with "
                "N > 1 (or --pp-split)"
            )
        return None
    pp = args.mesh.get(bj.MeshAxis.PP.value, 1)
    where = f"--mesh {mesh_text(args.mesh)}"
    if args.mesh.get(bj.MeshAxis.ATTN_CP.value, 1) > 1:
        raise InputError(
            f"{where}: context parallelism is not built for pipeline stages; use attn_cp with pp=1"
        )
    if args.scan_layers:
        raise InputError(f"{where}: pipeline stages run their layers unrolled; drop --scan-layers")
    if getattr(args, "quantize", None) is not None:
        raise InputError(f"{where}: --quantize is not built for pipeline stages; use pp=1")
    if getattr(args, "capture_layers", None) is not None:
        raise InputError(f"{where}: --capture-layers is not built for pipeline stages; use pp=1")
    if args.pp_split is not None and len(args.pp_split) != pp:
        raise InputError(f"--pp-split gives {len(args.pp_split)} stages but --mesh has pp={pp}")
    try:
        if args.pp_split is None:
            return PipelineSplit.balanced(config.num_layers, pp)
        return PipelineSplit.of_sizes(args.pp_split, config.num_layers)
    except ValueError as error:
        option = where if args.pp_split is None else f"--pp-split {_sizes_text(args.pp_split)}"
        raise InputError(f"{option}: {error}") from None


def _sizes_text(sizes: tuple[int, ...]) -> str:
    return ",".join(str(size) for size in sizes)


def check_output_file(option: str, path: str | Path) -> None:
    """A file the command will write: not a directory, in a directory it can write in."""
    file = Path(path)
    if file.is_dir():
        raise InputError(f"{option} {file} is a directory; give a file name")
    writable_parent(option, file)


def check_output_directory(option: str, path: str | Path, *, overwrite: bool) -> None:
    """A checkpoint directory the command will write: absent or empty (or `--overwrite`), in a
    directory it can write in."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise InputError(f"{option} {out} is a file; a checkpoint is a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise InputError(f"{option} {out} already holds files; pass --overwrite to replace them")
    writable_parent(option, out)


def writable_parent(option: str, path: Path) -> None:
    """The nearest existing directory above `path` takes new files (tried, not guessed)."""
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InputError(f"{option} {path}: {ancestor} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as error:
        raise InputError(
            f"{option} {path}: cannot write in {ancestor} ({error.strerror})"
        ) from None
