"""`serve`: the model of `--checkpoint` or `--preset` behind an OpenAI-compatible HTTP server,
continuously batched over a paged KV cache (`models.serving.server`)."""

from __future__ import annotations

import argparse
import signal
import socket
from pathlib import Path

import jax

from ..distributed import is_first_process
from ..serving.api import sampling_defaults
from ..serving.engine import Engine
from ..serving.lockstep import Channel, follow
from ..serving.paged import PagedRunner
from ..serving.runtime import ShardedCausalLM
from ..serving.server import Server, run_server
from ..serving.text import eos_token_ids, generation_config
from . import options
from .commands import (
    check_on_first_process,
    checkpoint_dir,
    codec,
    console,
    runner,
    source_config,
    status,
)
from .interrupts import SIGNALS, raise_pending
from .lora import lora_sources
from .options import InputError

GIB = 1 << 30


def add_serve_args(command: argparse.ArgumentParser) -> None:
    """`serve`'s own options (the model options are `generate`'s)."""
    command.add_argument("--host", default="127.0.0.1", help="address to listen on")
    command.add_argument("--port", type=options.port, default=8000)
    command.add_argument(
        "--max-running",
        type=options.positive_int,
        default=64,
        help="requests running at once over all attention-DP ranks (default 64)",
    )
    command.add_argument(
        "--max-tokens-per-step",
        type=options.positive_int,
        default=512,
        help="token rows per attention-DP rank in one step: decode tokens plus prefill chunks "
        "(default 512)",
    )
    command.add_argument(
        "--kv-cache-gb",
        type=options.positive_float,
        default=1.0,
        help="GiB of paged KV cache per device (default 1)",
    )
    command.add_argument(
        "--page-size", type=options.positive_int, default=16, help="positions per cache page"
    )
    command.add_argument(
        "--served-model-name", help="the name clients put in `model` (default: the source's)"
    )
    command.add_argument(
        "--warm-up",
        action="store_true",
        help="compile every step program a request can reach before listening (otherwise the "
        "first step of each size waits for its compile)",
    )
    command.add_argument(
        "--grace-period",
        type=options.non_negative_float,
        default=30.0,
        help="seconds SIGTERM lets running requests finish before cancelling them (default 30)",
    )
    command.add_argument(
        "--sampling-defaults",
        choices=("model", "openai"),
        default="model",
        help="what a request leaving out temperature, top_k, top_p, min_p or "
        "repetition_penalty samples with: the checkpoint's generation_config.json where it "
        "sets them (model, the default, as SGLang and vLLM), or OpenAI's defaults",
    )
    command.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="recompute every prompt (default: reuse cached pages of shared prefixes)",
    )


def pages_per_rank(args: argparse.Namespace, model: ShardedCausalLM, slots: int) -> int:
    """The pages `--kv-cache-gb` buys each attention-DP rank (every paged layer's pool on a
    device takes `page_size` tokens a page; a layer with a recurrent state keeps no pages), at
    most what `slots` sequences of the whole context use (that many where no layer keeps
    pages: they cost nothing).

    Raises:
      InputError: Not one page fits.
    """
    per_token = model.model.cache_bytes_per_token(model.dtype) * model.model.token_cache_layers()
    per_sequence = -(-model.config.max_position_embeddings // args.page_size)
    if per_token == 0:
        return slots * per_sequence
    pages = int(args.kv_cache_gb * GIB) // (per_token * args.page_size)
    if pages < 1:
        raise InputError(
            f"--kv-cache-gb {args.kv_cache_gb} holds no page of {args.page_size} tokens "
            f"({per_token * args.page_size} bytes per device); give it more"
        )
    return min(pages, slots * per_sequence)


def short_pool_note(pages: int, page_size: int, context: int) -> str | None:
    """A note where a rank's pages hold fewer tokens than the model's context: a request
    without `max_tokens` (which asks for the rest of the context) is then always refused."""
    if pages * page_size >= context - 1:
        return None
    return (
        f"note: the cache holds {pages * page_size} tokens per DP rank, less than the context "
        f"of {context}: requests must set max_tokens (without it a request asks for the rest "
        "of the context and is refused); a larger --kv-cache-gb lifts this"
    )


def check_listening(host: str, port: int) -> None:
    """Refuses an address this process cannot listen on (a port in use, a host not its own)
    before the model is built.

    Raises:
      InputError: The address cannot be bound.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:
        raise InputError(
            f"--host {host} --port {port}: cannot listen there ({error.strerror or error}); "
            "choose a free port or an address of this host"
        ) from None


def follow_quietly(paged: PagedRunner, channel: Channel) -> None:
    """A follower's part under `launch`: runs process 0's steps until its server stops.
    SIGINT and SIGTERM are ignored meanwhile: process 0 takes them and stops the group (a
    follower leaving on its own would strand process 0 in a collective); the launcher kills a
    follower left behind when process 0 dies."""
    previous = {signum: signal.signal(signum, signal.SIG_IGN) for signum in SIGNALS}
    try:
        follow(paged, channel)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def serve(args: argparse.Namespace) -> None:
    """`serve`: builds the model, then serves until SIGTERM or SIGINT (exit 0). Under `launch`,
    process 0 serves and sends each step's schedule to the others, which run it in lockstep
    and end when process 0's server stops."""
    if options.pipelined(args):
        raise InputError("serve runs the model as one program; drop pp from --mesh")
    name = args.served_model_name or args.preset or Path(args.checkpoint).resolve().name
    if name in (lora_sources(args) or {}):
        raise InputError(
            f"--lora adapter {name!r} has the served model's name, so a request naming it "
            "would run the base model; name the adapter otherwise (--lora NAME=DIR) or set "
            "--served-model-name"
        )
    check_on_first_process(lambda: check_listening(args.host, args.port))
    out = console()
    config = source_config(args)
    model = runner(args, out, config)
    text = codec(args, config)
    eos = eos_token_ids(checkpoint_dir(args))
    defaults = {}
    if args.sampling_defaults == "model":
        defaults = sampling_defaults(generation_config(checkpoint_dir(args)))
        if defaults:
            out.log(f"sampling defaults from generation_config.json: {defaults}")
    topology = model.topology
    slots = -(-args.max_running // topology.attn_dp)
    pages = pages_per_rank(args, model, slots)
    with status(out, f"allocating {pages} pages of {args.page_size} tokens per DP rank"):
        paged = PagedRunner(
            model,
            page_size=args.page_size,
            pages_per_rank=pages,
            slots_per_rank=slots,
            max_rows=args.max_tokens_per_step,
        )
    page_bytes, state_bytes = paged.cache_bytes()
    states = f", recurrent states {state_bytes / GIB:.3f} GiB" if state_bytes else ""
    out.log(f"KV cache: pages {page_bytes / GIB:.3f} GiB{states}, over all devices")
    out.log(
        f"sampling state (token histories, logit biases): {paged.slot_bytes() / GIB:.3f} GiB "
        "on each device, beside the KV cache"
    )
    short = short_pool_note(pages, args.page_size, model.config.max_position_embeddings)
    if short is not None:
        out.log(short)
    if model.options.scan_layers:
        out.log(
            "note: with --scan-layers each step copies every scanned layer's weight slices "
            "(XLA; benchmarks/RESULTS.md run 15): serve unrolled layers for speed"
        )
    if args.warm_up:
        with status(out, "compiling the step programs"):
            programs = paged.warm_up(model.config.max_position_embeddings, raise_pending)
        out.log(f"warm-up: {programs} step programs compiled")
    channel = Channel() if jax.process_count() > 1 else None
    if channel is not None and not is_first_process():
        follow_quietly(paged, channel)
        return
    engine = Engine(
        paged,
        prefix_caching=not args.no_prefix_caching,
        channel=channel,
        max_running=args.max_running,
    )
    lora = model.options.lora
    adapters = {} if lora is None else {adapter: lora.index(adapter) for adapter in lora.names}
    server = Server(
        engine, text, model_name=name, eos_ids=eos, adapters=adapters, sampling_defaults=defaults
    )
    out.log(f"serving {name} at http://{args.host}:{args.port}/v1 ({text.description})")
    run_server(server, host=args.host, port=args.port, grace=args.grace_period)
    out.log("stopped")
