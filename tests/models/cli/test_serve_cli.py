"""`boundary-jax serve` refuses what it cannot serve in one error line (exit 2): pipeline
stages, a model whose cache has no paged form, a KV cache budget that holds no page, `--lora`
as `generate` refuses it (on a preset, a folder without an adapter config) and an adapter named
as the served model, an address it cannot listen on (checked before the model is built); the
cache budget buys pages for the layers that keep them."""

import argparse
import dataclasses
import socket

import pytest

import boundary_jax as bj
from models.build import build_model
from models.cli.main import main
from models.cli.serve import pages_per_rank, short_pool_note
from models.config import PRESETS
from models.config.hybrid import HybridLayer
from models.serving.paged import PagedRunner
from models.serving.runtime import ShardedCausalLM

CASES = [
    (["--preset", "tiny-mistral", "--mesh", "pp=2"], "serve runs the model as one program"),
    (["--preset", "tiny-mistral", "--kv-cache-gb", "0.0000001"], "holds no page of 16 tokens"),
    (["--preset", "tiny-mistral", "--mesh", "attn_cp=2"], "not built under attention CP"),
    (["--preset", "tiny-mistral", "--lora", "a=tests"], "pass --checkpoint, not --preset"),
    (["--checkpoint", "tests/golden/qwen3", "--lora", "a=tests"], "no adapter_config.json"),
    (
        ["--checkpoint", "tests/golden/qwen3", "--lora", "qwen3=tests/golden/lora/qwen3/a1"],
        "adapter 'qwen3' has the served model's name",
    ),
    (
        ["--checkpoint", "tests/golden/qwen3", "--served-model-name", "a1"]
        + ["--lora", "tests/golden/lora/qwen3/a1"],
        "adapter 'a1' has the served model's name",
    ),
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(("args", "message"), CASES, ids=[m for _, m in CASES])
def test_serve_refuses_in_one_line(args, message, capsys):
    assert main(["serve", *args, "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("boundary-jax: error: ") and message in err[-1], err


def test_serve_refuses_an_address_it_cannot_listen_on(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--preset", "tiny-mistral", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--port {port}: cannot listen there" in err[0], err
    assert main(["serve", "--preset", "tiny-mistral", "--port", "70000"]) == 2
    assert "must be a TCP port" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-next"])
def test_the_cache_budget_buys_pages_for_the_paged_layers_only(preset):
    """`--kv-cache-gb` is divided over the layers that keep pages: every layer of a dense
    model, only the full-attention layers of a hybrid (its Gated DeltaNet layers keep a state
    per slot)."""
    config = PRESETS[preset]
    runner = ShardedCausalLM(build_model(config, bj.Topology()), bj.make_mesh(bj.Topology()))
    paged = sum(1 for spec in runner.model.cache_specs() if "KVCache" in type(spec).__name__)
    assert paged == (config.num_layers if preset == "tiny-qwen3" else 2)
    page_bytes = runner.model.cache_bytes_per_token(runner.dtype) * paged * 16
    args = argparse.Namespace(kv_cache_gb=1000 * page_bytes / 2**30, page_size=16)
    assert pages_per_rank(args, runner, slots=10**6) == 1000


def test_a_model_without_paged_layers_takes_the_pages_of_its_slots():
    """Nemotron-H's layers without its attention layer keep no pages: they cost nothing, so
    every slot gets its whole context's."""
    config = PRESETS["tiny-nemotron-h"]
    kinds = tuple(kind for kind in config.hybrid.layers if kind is not HybridLayer.ATTENTION)
    config = dataclasses.replace(
        config, num_layers=len(kinds), hybrid=dataclasses.replace(config.hybrid, layers=kinds)
    )
    runner = ShardedCausalLM(build_model(config, bj.Topology()), bj.make_mesh(bj.Topology()))
    assert runner.model.token_cache_layers() == 0
    args = argparse.Namespace(kv_cache_gb=1e-9, page_size=16)
    per_sequence = -(-config.max_position_embeddings // 16)
    assert pages_per_rank(args, runner, slots=3) == 3 * per_sequence


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-qwen3-next"])
def test_the_logged_cache_counts_each_devices_pages_and_states(preset):
    """The server's cache line sums every device's pages (a latent pool is whole on each
    attention-TP rank; each DP rank has its own pages) and the recurrent states apart."""
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    mesh = bj.make_mesh(topology)
    runner = ShardedCausalLM(build_model(PRESETS[preset], topology, mesh=mesh), mesh)
    paged = PagedRunner(runner, page_size=4, pages_per_rank=8, slots_per_rank=3, max_rows=8)
    model = runner.model
    pages = model.cache_bytes_per_token(runner.dtype) * model.token_cache_layers() * 4 * 8
    states = model.state_bytes_per_slot(runner.dtype) * paged.slots_per_rank
    assert pages > 0 and (states > 0) == (preset == "tiny-qwen3-next")
    assert paged.cache_bytes() == (4 * pages, 4 * states)


def test_a_pool_shorter_than_the_context_is_noted():
    """Pages for fewer positions than a default request runs (the context less its last
    token) are noted; a pool that holds them is not."""
    note = short_pool_note(pages=4, page_size=16, context=128)
    assert note is not None and "holds 64 tokens" in note and "max_tokens" in note
    assert short_pool_note(pages=8, page_size=16, context=129) is None
    assert short_pool_note(pages=7, page_size=16, context=129) is not None
