"""The paged step and the engine on a tiny model: greedy tokens through chunked prefill, mixed
decode, prefix reuse and preemption equal `ShardedCausalLM.generate` of each prompt alone."""

import dataclasses
import functools
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import boundary_jax as bj
from models.build import build_model, load_model
from models.config import PRESETS
from models.config.registry import read_hf_config
from models.inputs.rows import RowsPhase
from models.layers.attention.kv_cache import KVCache
from models.layers.attention.self_attention import Attention, AttentionImpl
from models.options import BuildOptions
from models.serving.engine import Engine
from models.serving.paged import PagedRunner, SlotSampling
from models.serving.runtime import ShardedCausalLM
from models.serving.sampling import sample_rows
from models.serving.scheduler import Finish, Request

NEW_TOKENS = 8


def _prompts() -> list[list[int]]:
    """Mixed lengths (1 to 40 tokens, past the sliding window of 16), half sharing a prefix."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 18).tolist()
    lengths = [1, 3, 40, 17, 9, 26]
    own = [rng.integers(0, 256, n).tolist() for n in lengths]
    return own + [shared + tail[:5] for tail in own]


def _serve(engine: Engine, prompts, new_tokens=NEW_TOKENS, **fields) -> list[Request]:
    """Runs the prompts to the end; each request's `logprobs` are those its tokens came with."""
    requests = [Request(str(i), p, new_tokens, **fields) for i, p in enumerate(prompts)]
    logprobs = {request.id: [] for request in requests}
    for request in requests:
        engine.submit(request, lambda token: logprobs[token.request.id].append(token.logprob))
    while engine.run_once():
        pass
    for request in requests:
        request.logprobs = logprobs[request.id]
    return requests


def golden_config(name: str):
    """The config of the golden checkpoint `tests/golden/<name>` (its weights are not read)."""
    path = pathlib.Path(__file__).parents[2] / "golden" / name / "config.json"
    return read_hf_config(json.loads(path.read_text()))


_NEXT = PRESETS["tiny-qwen3-next"]
SHORT_HYBRID = dataclasses.replace(
    _NEXT,
    num_layers=3,
    linear_attention=dataclasses.replace(_NEXT.linear_attention, layers=(True, True, False)),
    moe=dataclasses.replace(_NEXT.moe, mlp_only_layers=(1,)),
)
"""Tiny Qwen3-Next's layers 0, 1 and 2 (delta rule with a MoE, delta rule with a dense MLP,
attention with a MoE): every kind of layer it has, at three fifths of the compile time."""


@functools.cache
def _served(preset: str, dp: int, tp: int, scan: bool = False):
    """A runner of the preset (5 layers when scanned), the prompts, `generate`'s tokens for
    them, and a paged runner of 64 pages per rank shared by the tests (each with its own
    engine)."""
    topology = bj.Topology(attn_dp=dp, attn_tp=tp)
    mesh = bj.make_mesh(topology)
    config = {"short-hybrid": SHORT_HYBRID}.get(preset) or PRESETS.get(preset)
    config = config or golden_config(preset)
    if scan:
        config = dataclasses.replace(config, num_layers=5)
    model = build_model(config, topology, BuildOptions(scan_layers=scan), mesh=mesh)
    runner = ShardedCausalLM(model, mesh)
    prompts = [[token % config.vocab_size for token in p] for p in _prompts()]
    roomy = PagedRunner(runner, page_size=4, pages_per_rank=64, slots_per_rank=4, max_rows=16)
    return runner, prompts, runner.generate(prompts, NEW_TOKENS), roomy


@functools.cache
def _pool(case: tuple, pages: int) -> PagedRunner:
    """The case's shared paged runner of `pages` pages per rank (the roomy one at 64)."""
    runner, _, _, roomy = _served(*case)
    if pages == roomy.pages_per_rank:
        return roomy
    return PagedRunner(runner, page_size=4, pages_per_rank=pages, slots_per_rank=4, max_rows=16)


DEFAULT = ("tiny-mistral", 2, 2)
SLOW = pytest.mark.slow
CASES = [
    pytest.param(DEFAULT, 64, id="kv-dp2-tp2", marks=SLOW),
    pytest.param(DEFAULT, 14, id="kv-dp2-tp2-preempting"),
    pytest.param(("tiny-deepseek-v3", 2, 2), 64, id="latent-moe-dp2-tp2", marks=SLOW),
    pytest.param(("tiny-deepseek-v3", 2, 2), 14, id="latent-moe-preempting", marks=SLOW),
    pytest.param(("tiny-nemotron-h", 2, 2), 64, id="hybrid-mamba2-dp2-tp2", marks=SLOW),
    pytest.param(("tiny-nemotron-h", 2, 2), 14, id="hybrid-preempting", marks=SLOW),
    pytest.param(("short-hybrid", 2, 2), 64, id="hybrid-delta-dp2-tp2", marks=SLOW),
    pytest.param(("short-hybrid", 2, 2), 14, id="hybrid-delta-preempting", marks=SLOW),
    pytest.param(("kimi_linear", 2, 2), 64, id="kimi-delta-latent-dp2-tp2", marks=SLOW),
    pytest.param(("tiny-longcat-flash", 2, 2), 64, id="longcat-latent-pairs-dp2-tp2", marks=SLOW),
    pytest.param(("tiny-mistral", 1, 1), 64, id="kv-one-device", marks=SLOW),
    pytest.param(("tiny-mistral", 1, 1), 14, id="kv-one-device-preempting", marks=SLOW),
    pytest.param(("tiny-mistral", 1, 2), 64, id="kv-tp2", marks=SLOW),
    pytest.param(("tiny-mistral", 1, 2), 14, id="kv-tp2-preempting", marks=SLOW),
    pytest.param(("tiny-qwen3", 2, 2, True), 64, id="kv-scanned-dp2-tp2", marks=SLOW),
]


@SLOW
def test_extend_rows_carry_each_request_adapter():
    """Requests through LoRA adapter a1, a2 or none (tiny Qwen3 and its golden adapters, DP 2 x
    TP 2) in one engine: prefill chunks and decode rows alike run through the request's adapter,
    so each greedy answer equals `generate` of its prompt with its adapter."""
    golden = pathlib.Path(__file__).parents[2] / "golden"
    adapters = {name: golden / "lora" / "qwen3" / name for name in ("a1", "a2")}
    topology = bj.Topology(attn_dp=2, attn_tp=2)
    mesh = bj.make_mesh(topology)
    model = load_model(golden / "qwen3", mesh, BuildOptions(), adapters=adapters)
    runner = ShardedCausalLM(model, mesh)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 250, n).tolist() for n in (1, 9, 20, 9, 20, 5)]
    names = ["a1", "a2", None, "a2", "a1", None]
    want = runner.generate(prompts, NEW_TOKENS, adapters=names)
    paged = PagedRunner(runner, page_size=4, pages_per_rank=32, slots_per_rank=2, max_rows=8)
    engine = Engine(paged)
    requests = [
        Request(str(i), p, NEW_TOKENS, adapter=runner.options.lora.index(name) if name else 0)
        for i, (p, name) in enumerate(zip(prompts, names, strict=True))
    ]
    for request in requests:
        engine.submit(request, lambda token: None)
    while engine.run_once():
        pass
    assert [r.output for r in requests] == [list(w) for w in want]


@pytest.mark.parametrize(("case", "pages"), CASES)
def test_paged_greedy_equals_generate(case, pages, monkeypatch):
    """Chunked prefill (16 rows per step), decode rows beside it, shared prefixes and (with a
    small pool) preemption give each prompt's tokens of `generate` alone: grouped-query KV
    pages (with a sliding window), MLA latent pages (with MoE layers; LongCat-Flash's pair per
    layer), Mamba2 and delta-rule states stepped row by row in their slots (Nemotron-H,
    Qwen3-Next, Kimi-Linear), unrolled and scanned layers."""
    runner, prompts, want, _ = _served(*case)
    paged = _pool(case, pages)
    launched = []
    launch = paged.launch

    def record(chunks, sampling, previous=None):
        launched.extend(chunks)
        return launch(chunks, sampling, previous)

    monkeypatch.setattr(paged, "launch", record)
    engine = Engine(paged)
    requests = _serve(engine, prompts)
    np.testing.assert_array_equal([r.output for r in requests], want)
    assert all(r.finish is Finish.LENGTH for r in requests)
    # Steps overlapped: decode tokens read on the device from the step before.
    assert sum(chunk.previous for chunk in launched) > len(prompts)
    # Each token's log-probability is the forward's over the whole sequence (tighter than
    # the argmax: a stale state or a wrong page moves it).
    logits = runner.forward([r.prompt + r.output for r in requests])
    for request, row in zip(requests, logits, strict=True):
        start = len(request.prompt) - 1
        steps = np.arange(start, start + NEW_TOKENS)
        shifted = row[steps] - row[steps].max(axis=-1, keepdims=True)
        logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        np.testing.assert_allclose(
            request.logprobs, logprobs[np.arange(NEW_TOKENS), request.output], atol=2e-4
        )
    scheduler = engine.scheduler
    assert scheduler.used_pages == 0 and scheduler.idle
    # Pages cannot restore a recurrent state: no prefix reuse with Mamba2 layers.
    assert (scheduler.reused_pages > 0) == paged.reuses_prefixes
    if pages == 14:
        assert scheduler.preemptions > 0
    # One program per rows bucket: 16 rows, pages buckets 1..16 at most.
    assert paged.compiled_shapes() <= 5


def test_warm_up_compiles_every_step_the_load_takes():
    """`warm_up` runs one synthetic step per (rows, pages) bucket the prompts can reach (pages
    buckets from `min_pages` up); serving them afterwards compiles nothing new, and the
    synthetic steps leave no trace in the tokens."""
    runner, prompts, want, _ = _served(*DEFAULT)
    paged = PagedRunner(
        runner, page_size=4, pages_per_rank=64, slots_per_rank=4, max_rows=16, min_pages=8
    )
    reach = max(map(len, prompts)) + NEW_TOKENS
    assert paged.step_buckets(reach) == [(16, 8), (16, 16)]
    assert paged.warm_up(reach) == 2 and paged.compiled_shapes() == 2
    assert not paged.tables.any()
    requests = _serve(Engine(paged), prompts)
    np.testing.assert_array_equal([r.output for r in requests], want)
    assert paged.compiled_shapes() == 2


def test_prefix_reuse_off_computes_every_token():
    """Without prefix caching nothing is reused and every prompt token is computed; the
    outputs are the same."""
    _, prompts, want, roomy = _served(*DEFAULT)
    engine = Engine(roomy, prefix_caching=False)
    requests = _serve(engine, prompts)
    np.testing.assert_array_equal([r.output for r in requests], want)
    assert engine.scheduler.reused_pages == 0
    assert engine.metrics.computed_tokens == sum(map(len, prompts)) + len(prompts) * (
        NEW_TOKENS - 1
    )


def test_sampled_tokens_depend_on_seed_not_batch():
    """A request's draws depend on its seed alone: alone or among others, the same tokens;
    top_k=1 is greedy."""
    _, prompts, want, roomy = _served(*DEFAULT)

    def run(batch, sampling):
        return [r.output for r in _serve(Engine(roomy), batch, sampling=sampling)]

    sampling = SlotSampling(temperature=1.0, top_k=40, top_p=0.9, seed=7)
    alone = run(prompts[:1], sampling)
    together = run(prompts[:3], sampling)
    assert together[0] == alone[0]
    assert run(prompts[:2], SlotSampling(temperature=0.7, top_k=1, seed=3)) == want[:2].tolist()
    other = run(prompts[:1], SlotSampling(temperature=1.0, top_k=40, top_p=0.9, seed=8))
    assert other != alone


PENALTIES = (
    SlotSampling(),
    SlotSampling(presence_penalty=0.1),
    # Rewards a token's second occurrence, penalizes its third: the count matters.
    SlotSampling(presence_penalty=-0.3, frequency_penalty=0.2),
    SlotSampling(repetition_penalty=0.8),  # < 1 rewards what the sequence holds
    SlotSampling(presence_penalty=0.1, frequency_penalty=-0.1, repetition_penalty=1.3),
    SlotSampling(logit_bias=((17, 0.5), (42, 0.3), (99, -100.0))),
    # Every logit negative: the repetition penalty multiplies them.
    SlotSampling(repetition_penalty=1.3, logit_bias=tuple((t, -1.0) for t in range(256))),
)
"""Each request's logit bias and penalties, round robin; the tiny model's logits are within
0.7 of 0, so these are of the size of its logits' gaps."""


def penalized_choices(
    runner: ShardedCausalLM,
    prompts: list[list[int]],
    outputs: list[list[int]],
    sampling: list[SlotSampling],
) -> list[list[int]]:
    """The greedy choice with `sampling`'s logit bias and penalties at each step of `outputs`,
    from one forward of each whole sequence (each step's logits seeing the tokens before it):
    the bias added, then a token seen in the prompt or generated before the step has its
    logit divided by the repetition penalty where positive (multiplied where not), then each
    generated token's logit drops by the frequency penalty per occurrence and by the presence
    penalty once. Greedy penalized answers are exactly those equal to their choices."""
    logits = runner.forward([p + o for p, o in zip(prompts, outputs, strict=True)])
    choices: list[list[int]] = []
    for index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        draw = sampling[index]
        choices.append([])
        for step in range(len(output)):
            row = logits[index, len(prompt) + step - 1].copy()
            counts = np.bincount(output[:step], minlength=row.shape[0]).astype(np.float32)
            seen = counts > 0
            seen[prompt] = True
            for token, bias in draw.logit_bias:
                row[token] += np.float32(bias)
            scale = np.float32(draw.repetition_penalty)
            row = np.where(seen, np.where(row > 0, row / scale, row * scale), row)
            row = row - np.float32(draw.frequency_penalty) * counts
            row = row - np.float32(draw.presence_penalty) * (counts > 0)
            choices[-1].append(int(np.argmax(row)))
    return choices


@pytest.mark.parametrize("pages", [64, pytest.param(14, id="preempting")])
def test_penalties_equal_the_full_sequence_reference(pages):
    """Greedy requests with presence, frequency and repetition penalties (each alone, and all
    three) and logit biases (alone, and with a penalty) beside plain ones, through chunked
    prefill, decode rows read on the device and (with 14 pages) preemption and recompute, the
    slots passing between requests of each kind: each answer is its greedy penalized choice at
    every step by the forward of its whole sequence, and differs from `generate`'s for most of
    the 12 prompts."""
    runner, prompts, want, _ = _served(*DEFAULT)
    paged = _pool(DEFAULT, pages)
    sampling = [PENALTIES[i % len(PENALTIES)] for i in range(len(prompts))]
    engine = Engine(paged)
    requests = [
        Request(str(i), p, NEW_TOKENS, sampling=draw)
        for i, (p, draw) in enumerate(zip(prompts, sampling, strict=True))
    ]
    for request in requests:
        engine.submit(request, lambda token: None)
    while engine.run_once():
        pass
    outputs = [r.output for r in requests]
    assert outputs == penalized_choices(runner, prompts, outputs, sampling)
    assert sum(o != w for o, w in zip(outputs, want.tolist(), strict=True)) >= 4
    assert (engine.scheduler.preemptions > 0) == (pages == 14)


def test_steps_without_adjusted_requests_skip_the_token_history():
    """Steps whose requests have no penalty, bias or held stops run none of it (the history
    stays empty); a penalized request's steps record its prompt and answer. The state takes
    10 bytes per slot and token id on each device."""
    runner, prompts, _, roomy = _served(*DEFAULT)
    assert roomy.slot_bytes() == 10 * roomy.slots_per_rank * runner.config.vocab_size
    roomy.reset()
    _serve(Engine(roomy), prompts[:2])
    assert not any(np.asarray(part).any() for part in roomy._history)
    _serve(Engine(roomy), prompts[2:3], sampling=SlotSampling(presence_penalty=0.5))
    counts, prompted = (np.asarray(part) for part in roomy._history)
    assert counts.sum() == NEW_TOKENS - 1 and prompted.any()


def test_min_tokens_holds_the_stop_ids_back():
    """A request whose greedy answer's first two tokens are its stop ids, with min_tokens 5:
    its first five tokens are the argmax over the other ids, then it runs greedily until the
    first stop id drawn ends it (checked step by step against the forward of its whole
    sequence); another request with the same stop ids and min_tokens 0 beside it ends at
    once (the held ids are each slot's own)."""
    runner, prompts, want, roomy = _served(*DEFAULT)
    prompt, stops = prompts[2], frozenset(int(t) for t in want[2][:2])
    engine = Engine(roomy)
    held = Request("held", prompt, NEW_TOKENS, stops, sampling=SlotSampling(min_tokens=5))
    plain = Request("plain", prompt, NEW_TOKENS, stops)
    for request in (held, plain):
        engine.submit(request, lambda token: None)
    while engine.run_once():
        pass
    assert plain.output == [int(want[2][0])] and plain.finish is Finish.STOP
    output = held.output
    assert len(output) > 5 and not stops & set(output[:5])
    assert held.finish is Finish.LENGTH or output[-1] in stops and not stops & set(output[:-1])
    logits = runner.forward([prompt + output])[0, len(prompt) - 1 :]
    for step, token in enumerate(output):
        row = logits[step].copy()
        if step < 5:
            row[sorted(stops)] = -np.inf
        assert token == int(np.argmax(row)), step


def test_sample_rows_mixes_greedy_and_sampled_rows():
    """Per row: temperature 0 is the argmax; top_k keeps only the k largest."""
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 50)), jnp.float32)
    tokens = sample_rows(
        logits,
        jnp.asarray([0.0, 1.0, 1.0, 2.0]),
        jnp.asarray([0, 1, 3, 0]),
        jnp.asarray([1.0, 1.0, 1.0, 0.5]),
        jnp.arange(4, dtype=jnp.uint32),
        jnp.zeros(4, jnp.int32),
    )
    order = np.argsort(-np.asarray(logits), axis=-1)
    assert tokens[0] == order[0, 0] and tokens[1] == order[1, 0]
    assert tokens[2] in order[2, :3]


def test_warm_up_stopped_between_buckets_restores_the_tables():
    """What `between` raises after a bucket ends the warm-up (a signal a compile held back),
    with the page tables as they were."""
    runner = _served(*DEFAULT)[0]
    paged = PagedRunner(
        runner, page_size=4, pages_per_rank=64, slots_per_rank=4, max_rows=16, min_pages=8
    )
    paged.tables[0, 1, :3] = [5, 6, 7]
    before = paged.tables.copy()
    ran = []

    def stop():
        ran.append(paged.compiled_shapes())
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        paged.warm_up(40, between=stop)
    assert ran == [1]
    np.testing.assert_array_equal(paged.tables, before)


@dataclasses.dataclass(frozen=True)
class UnpagedCache:
    """A cache kind the paged step does not know (a new family's, say)."""

    table: object


def test_paged_runner_refuses_unpaged_caches_and_layouts(monkeypatch):
    """A cache kind with no paged form, or attention CP: clear errors at construction."""
    runner = _served(*DEFAULT)[0]
    model_type = type(runner.model)
    specs = runner.model.cache_specs()
    monkeypatch.setattr(model_type, "cache_specs", lambda self: (UnpagedCache(None), *specs[1:]))
    with pytest.raises(NotImplementedError, match="UnpagedCache"):
        PagedRunner(runner, page_size=4, pages_per_rank=8, slots_per_rank=2, max_rows=16)
    monkeypatch.undo()
    topology = bj.Topology(attn_cp=2)
    mesh = bj.make_mesh(topology)
    cp = ShardedCausalLM(build_model(PRESETS["tiny-mistral"], topology, mesh=mesh), mesh)
    with pytest.raises(NotImplementedError, match="attention CP"):
        PagedRunner(cp, page_size=4, pages_per_rank=8, slots_per_rank=2, max_rows=16)


def test_extend_rows_need_a_paged_cache():
    """An EXTEND call on a slot-indexed cache is refused, naming the paged runner."""
    config = PRESETS["tiny-mistral"]
    topology = bj.Topology()
    attention = Attention(config.attention_spec(0), topology=topology, rngs=nnx.Rngs(0))
    cache = KVCache.create(config, topology, slots=1, max_len=8)
    rows = jnp.zeros((2, config.hidden_size))
    with pytest.raises(ValueError, match="paged cache"):
        attention(
            rows, jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), cache, phase=RowsPhase.EXTEND
        )


@pytest.mark.parametrize(
    "preset, attention, dtype, page_size, in_place",
    [
        ("tiny-qwen3", AttentionImpl.CUDNN, jnp.bfloat16, 16, True),
        pytest.param("tiny-gpt-oss", AttentionImpl.CUDNN, jnp.bfloat16, 16, True, marks=SLOW),
        ("tiny-qwen3-next", AttentionImpl.CUDNN, jnp.bfloat16, 16, True),
        ("tiny-qwen3", AttentionImpl.XLA, jnp.bfloat16, 16, False),
        ("tiny-qwen3", AttentionImpl.CUDNN, jnp.float32, 16, False),
        ("tiny-qwen3", AttentionImpl.CUDNN, jnp.bfloat16, 12, False),
        ("tiny-mistral", AttentionImpl.CUDNN, jnp.bfloat16, 16, False),
        pytest.param("tiny-deepseek-v3", AttentionImpl.CUDNN, jnp.bfloat16, 16, False, marks=SLOW),
    ],
)
def test_one_wide_pages_bucket_where_every_layer_reads_pages_in_place(
    preset, attention, dtype, page_size, in_place
):
    """Where every paged layer runs on the GPU paged kernel (grouped-query KV, half precision,
    pages and heads it tiles: not Mistral's 8-wide heads; recurrent states have no pages), a
    step's page table is as wide as the context in one bucket: the kernel reads only the pages
    a row reaches. Otherwise (the `jnp` gather, MLA latents) the pages buckets start from 1,
    since the gather reads the table's whole width."""
    topology = bj.Topology()
    mesh = bj.make_mesh(topology)
    options = BuildOptions(attention=attention, dtype=dtype)
    runner = ShardedCausalLM(build_model(PRESETS[preset], topology, options, mesh=mesh), mesh)
    paged = PagedRunner(
        runner, page_size=page_size, pages_per_rank=8, slots_per_rank=2, max_rows=16
    )
    assert paged.reads_pages_in_place() is in_place
    widest = paged.pages_per_sequence
    assert paged.min_pages == (widest if in_place else 1)
    pages_buckets = {pages for _, pages in paged.step_buckets(3 * page_size)}
    assert pages_buckets == ({widest} if in_place else {1, 2, 4})
