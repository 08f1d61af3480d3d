"""The boundary-jax command line: forward, generate and plan on checkpoints; bad input."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import boundary_jax as bj
from models.cli.main import main
from models.config import PRESETS
from models.options import BuildOptions
from tests.boundary_jax.test_collectives import expected_layers
from tests.models import MoeLayout
from tests.models.families.test_moe_decoder import MIDDLE_SPARSE_LAYER

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
P = bj.ReductionPolicy
SLOW = pytest.mark.slow


def _golden(name):
    return GOLDEN / name, dict(np.load(GOLDEN / name / "reference.npz"))


@pytest.mark.parametrize(
    "mesh,extra", [("attn_dp=2,attn_tp=2", []), ("attn_tp=4", ["--input-scattered"])]
)
def test_forward_writes_the_logits_of_ragged_sequences(tmp_path, mesh, extra):
    """forward writes float32 [sequences, longest, vocab] logits, zero past each end."""
    checkpoint, reference = _golden("llama")
    out = tmp_path / "logits.npy"
    code = main(
        [
            "forward",
            "--checkpoint",
            str(checkpoint),
            "--mesh",
            mesh,
            "--policy",
            "rs+rsv",
            "--input-ids",
            str(checkpoint / "prompts.json"),
            "--out",
            str(out),
            *extra,
        ]
    )
    assert code == 0
    logits = np.load(out)
    assert logits.dtype == np.float32 and logits.shape == reference["logits"].shape
    scale = np.max(np.abs(reference["logits"]))
    assert np.max(np.abs(logits - reference["logits"])) <= 1e-4 * scale


def test_forward_writes_captured_hidden_states_beside_the_logits(tmp_path):
    """forward --capture-layers writes <out>.hidden_states.npz, one float32 [sequences,
    longest, hidden] array per asked layer, equal to transformers' hidden states."""
    checkpoint = GOLDEN / "qwen3"
    out = tmp_path / "logits.npy"
    args = ["forward", "--checkpoint", str(checkpoint), "--mesh", "attn_dp=2,attn_tp=2"]
    args += ["--input-ids", str(checkpoint / "prompts.json"), "--out", str(out)]
    assert main([*args, "--capture-layers", "3,1"]) == 0
    want = np.load(checkpoint / "hidden_states.npz")["hidden_states"]
    with np.load(tmp_path / "logits.hidden_states.npz") as captured:
        assert sorted(captured.files) == ["layer_1", "layer_3"]
        for layer in (1, 3):
            got = captured[f"layer_{layer}"]
            assert got.dtype == np.float32 and got.shape == want[layer].shape
            scale = np.max(np.abs(want[layer]))
            assert np.max(np.abs(got - want[layer])) <= 1e-4 * scale, layer
    assert np.load(out).shape == (4, 12, 250)


@pytest.mark.slow
def test_generate_under_two_batch_overlap_gives_the_greedy_ids(capsys):
    """--two-batch-overlap's prefill and decode give HF's greedy tokens; with pipeline stages
    it is rejected."""
    checkpoint, reference = _golden("qwen3")
    args = ["generate", "--checkpoint", str(checkpoint), "--two-batch-overlap"]
    args += ["--prompt-ids", str(checkpoint / "prompts.json"), "--max-new-tokens", "6"]
    assert main([*args, "--mesh", "attn_tp=2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == reference["generated"].tolist()
    assert main([*args, "--mesh", "pp=3"]) != 0
    assert "pipeline stages already overlap" in capsys.readouterr().err


def test_generate_prints_the_greedy_ids_as_its_last_line(capsys):
    """generate's last stdout line is one JSON list of lists: HF's greedy tokens."""
    checkpoint, reference = _golden("qwen3")
    code = main(
        [
            "generate",
            "--checkpoint",
            str(checkpoint),
            "--mesh",
            "attn_tp=4",
            "--prompt-ids",
            str(checkpoint / "prompts.json"),
            "--max-new-tokens",
            "6",
        ]
    )
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == reference["generated"].tolist()


@pytest.mark.slow
def test_generate_under_context_parallelism_gives_the_greedy_ids(capsys):
    """generate under --mesh attn_cp=2,attn_tp=2 --cp-attention ring (a CP prefill, decode on
    the cache's CP shards) prints HF's greedy tokens; plan reports the mesh."""
    checkpoint, reference = _golden("qwen3")
    mesh = ["--mesh", "attn_cp=2,attn_tp=2", "--cp-attention", "ring"]
    source = ["--checkpoint", str(checkpoint)]
    code = main(
        [
            "generate",
            *source,
            *mesh,
            "--prompt-ids",
            str(checkpoint / "prompts.json"),
            "--max-new-tokens",
            "6",
        ]
    )
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == reference["generated"].tolist()
    assert main(["plan", "--preset", "tiny-qwen3", *mesh, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"] == {"pp": 1, "attn_dp": 1, "attn_cp": 2, "attn_tp": 2}


# By default Qwen3-MoE forward (all-to-all with EP 2 splitting attn_tp); under -m slow the
# gathered dispatch (over EP 4; with EP 2 splitting attn_tp), dense Qwen2's generate, MoE
# generate through the CLI (the same options reaching the runner whose greedy tokens
# tests/models/families/test_moe_decoder.py checks) and the attn_dp mesh (attn_dp reaches
# forward in the ragged-sequences test above).
@pytest.mark.parametrize(
    "name,command,mesh,extra",
    [
        pytest.param("qwen2_moe", "forward", "attn_tp=4", ["--moe-ep", "4"], marks=SLOW),
        pytest.param(
            "qwen2_moe",
            "generate",
            "attn_tp=4",
            ["--moe-ep", "4", "--moe-dispatch", "all-to-all"],
            marks=SLOW,
        ),
        pytest.param("qwen2", "generate", "attn_tp=4", [], marks=SLOW),
    ]
    + [  # --moe-ep splitting a mesh axis: attn_tp 4 as attn_tp_ep 2 x attn_tp 2
        pytest.param(
            name,
            command,
            mesh,
            extra,
            marks=[] if (name, command) == ("qwen3_moe", "forward") else [SLOW],
        )
        for name, mesh, extra in (
            ("qwen3_moe", "attn_tp=4", ["--moe-ep", "2", "--moe-dispatch", "all-to-all"]),
            ("mixtral", "attn_tp=4", ["--moe-ep", "2"]),
            ("qwen2_moe", "attn_dp=2,attn_tp=4", ["--moe-ep", "4"]),
        )
        for command in ("forward", "generate")
    ],
)
def test_checkpoint_runs_with_expert_parallelism(tmp_path, capsys, name, command, mesh, extra):
    """forward and generate take MoE checkpoints with --moe-ep/--moe-dispatch, any expert-parallel
    size dividing the TP group (and dense Qwen2, with q/k/v biases): HF's logits (within 1e-4)
    and greedy tokens."""
    checkpoint, reference = _golden(name)
    args = [command, "--checkpoint", str(checkpoint), "--mesh", mesh, *extra]
    prompts = str(checkpoint / "prompts.json")
    if command == "forward":
        out = tmp_path / "logits.npy"
        assert main([*args, "--input-ids", prompts, "--out", str(out)]) == 0
        logits, want = np.load(out), reference["logits"]
        assert np.max(np.abs(logits - want)) <= 1e-4 * np.max(np.abs(want))
    else:
        new = str(reference["generated"].shape[1])
        assert main([*args, "--prompt-ids", prompts, "--max-new-tokens", new]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert json.loads(last) == reference["generated"].tolist()


@pytest.mark.slow  # all-to-all's counts run by default on the Qwen2-MoE checkpoint below
@pytest.mark.parametrize(
    "dispatch,per_layer,scan",
    [
        ("gather", {"all-reduce": 2}, True),
        ("all-to-all", {"all-gather": 1, "reduce-scatter": 1, "all-to-all": 3}, False),
    ],
)
def test_plan_json_reports_a_middle_sparse_layer(capsys, dispatch, per_layer, scan):
    """plan --json on an MoE model counts a middle sparse layer's collectives, all-to-all too
    (with --scan-layers: its scanned run's body, once for the layer)."""
    args = ["plan", "--preset", "tiny-qwen3-moe", "--mesh", "attn_tp=4", "--moe-ep", "4"]
    args += ["--scan-layers"] * scan
    assert main([*args, "--moe-dispatch", dispatch, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["middle_layer"] == 2 and report["moe_ep"] == 4
    assert report["scan_layers"] is scan
    assert report["moe_dispatch"] == dispatch
    counts = {kind: n for kind, n in report["collectives_per_layer"].items() if n}
    assert counts == per_layer


@pytest.mark.slow
def test_plan_json_of_an_expert_parallel_group_splitting_a_mesh_axis(capsys):
    """plan --json with --moe-ep 2 on attn_tp=4 reports the split mesh (attn_tp_ep x attn_tp)
    and the middle sparse layer's collectives as docs/collectives.md documents them."""
    args = ["plan", "--preset", "tiny-qwen3-moe", "--mesh", "attn_tp=4", "--moe-ep", "2"]
    assert main([*args, "--moe-dispatch", "all-to-all", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"] == {"pp": 1, "attn_dp": 1, "attn_cp": 1, "attn_tp_ep": 2, "attn_tp": 2}
    assert report["moe_ep"] == 2
    layout = MoeLayout(1, 4, ep=2, dispatch=bj.MoeDispatch.ALL_TO_ALL)
    middle = report["collectives_by_layer"][report["middle_layer"]]["sequence"]
    assert tuple(middle) == MIDDLE_SPARSE_LAYER[layout]


@pytest.mark.parametrize(
    "dispatch,per_layer",
    [
        pytest.param("gather", {"all-reduce": 2}, marks=SLOW),
        ("all-to-all", {"all-gather": 1, "reduce-scatter": 1, "all-to-all": 3}),
    ],
)
def test_plan_json_of_a_qwen2_moe_checkpoint(capsys, dispatch, per_layer):
    """plan --json on the Qwen2-MoE checkpoint (sparse, dense, sparse, sparse) reports layer 2,
    the middle sparse layer: its shared expert adds no collective in either mode."""
    checkpoint = str(GOLDEN / "qwen2_moe")
    args = ["plan", "--checkpoint", checkpoint, "--mesh", "attn_tp=4", "--moe-ep", "4"]
    assert main([*args, "--moe-dispatch", dispatch, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == "Qwen2MoeForCausalLM"
    assert report["middle_layer"] == 2 and report["moe_dispatch"] == dispatch
    counts = {kind: n for kind, n in report["collectives_per_layer"].items() if n}
    assert counts == per_layer


# By default DP x TP and input-scattered TP; TP, DP and the other policies on DP x TP under
# -m slow (tests/boundary_jax/test_collectives.py checks every policy on every mesh).
PLANS = [
    pytest.param("attn_tp=8", P.AR, False, marks=SLOW),
    ("attn_dp=2,attn_tp=4", P.RS_RSV, False),
    pytest.param("attn_dp=2,attn_tp=4", P.RS, False, marks=SLOW),
    pytest.param("attn_dp=2,attn_tp=4", P.AR, False, marks=SLOW),
    ("attn_tp=4", P.RS_RSV, True),
    pytest.param("attn_dp=8", P.AUTO, False, marks=SLOW),
]


@pytest.mark.parametrize("mesh,policy,scattered", PLANS)
def test_plan_json_counts_equal_the_documented_table(capsys, mesh, policy, scattered):
    """plan --json counts one middle layer's collectives exactly as docs/collectives.md says."""
    args = ["plan", "--preset", "tiny-qwen3", "--mesh", mesh, "--policy", policy.value, "--json"]
    assert main(args + (["--input-scattered"] if scattered else [])) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["batch_tokens"], report["batch_sequences"]) == (29, 4)  # what bytes are for
    sizes = dict(item.split("=") for item in mesh.split(","))
    dp, tp = int(sizes.get("attn_dp", 1)), int(sizes.get("attn_tp", 1))
    layers = len(report["collectives_by_layer"])
    expected = expected_layers(dp, tp, scattered, policy, layers)
    middle = report["middle_layer"]
    counts = report["collectives_per_layer"]
    assert 0 < middle < layers - 1
    for kind in ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute"):
        assert counts[kind] == expected[middle].count(kind)
    assert [layer["sequence"] for layer in report["collectives_by_layer"]] == [
        list(sequence) for sequence in expected
    ]
    assert report["bytes_per_layer"] > 0 or not expected[middle]
    assert len(report["stages"]) == 2 * layers


def test_plan_prints_tables(capsys):
    """Without --json, plan prints the bound plans and per-layer collectives as tables."""
    assert main(["plan", "--preset", "tiny-mistral", "--mesh", "attn_dp=2,attn_tp=2"]) == 0
    out = capsys.readouterr().out
    assert "bound stage plans" in out and "collectives per layer" in out
    assert "bytes for a batch of 29 tokens in 4 sequences" in out


class _Built(Exception):
    """Stops a command once its model builder has been called."""


@pytest.mark.parametrize(
    "mesh, builder", [("attn_tp=2", "build_model"), ("pp=2", "build_pipeline")]
)
def test_fusions_flag_reaches_the_model_builders(monkeypatch, mesh, builder):
    """--fusions pallas hands the platform's Pallas candidates to the builder, of one program
    or of pipeline stages; without it the builder gets none."""
    from models.cli import commands

    seen = []

    def capture(*args, **kwargs):
        (options,) = [arg for arg in args if isinstance(arg, BuildOptions)]
        seen.append(options.fusions)
        raise _Built

    monkeypatch.setattr(commands, builder, capture)
    for flag in ([], ["--fusions", "pallas"]):
        with pytest.raises(_Built):
            main(["plan", "--preset", "tiny-mistral", "--mesh", mesh, *flag])
    assert seen[0] is bj.fusions.NO_FUSIONS
    assert seen[1] == bj.fusions.platform_fusions(bj.Topology())
    assert seen[1].attn_input and seen[1].ffn_input


def _bad_config(tmp_path):
    directory = tmp_path / "gpt2"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    return str(directory)


def _file(tmp_path, text):
    path = tmp_path / "ids.json"
    path.write_text(text)
    return str(path)


BAD_INPUT = {
    "missing checkpoint": (
        lambda tmp: [
            "forward",
            "--checkpoint",
            str(tmp / "nowhere"),
            "--input-ids",
            "x",
            "--out",
            "y",
        ],
        "no checkpoint directory",
    ),
    "unsupported architecture": (
        lambda tmp: ["forward", "--checkpoint", _bad_config(tmp), "--input-ids", "x", "--out", "y"],
        "GPT2LMHeadModel",
    ),
    "mesh that does not divide the heads": (
        lambda tmp: [
            "forward",
            "--checkpoint",
            str(GOLDEN / "llama"),
            "--mesh",
            "attn_tp=3",
            "--devices",
            "3",
            "--input-ids",
            "x",
            "--out",
            "y",
        ],
        "--mesh attn_tp=3: the model's 8 attention heads do not split over 3 ranks",
    ),
    "mesh larger than the devices": (
        lambda tmp: ["plan", "--preset", "tiny-qwen3", "--mesh", "attn_dp=4,attn_tp=4"],
        "needs 16 devices",
    ),
    "malformed ids": (
        lambda tmp: [
            "generate",
            "--checkpoint",
            str(GOLDEN / "qwen3"),
            "--prompt-ids",
            _file(tmp, '[[1, 2], [3, "a"]]'),
            "--max-new-tokens",
            "2",
        ],
        "list of non-empty lists of ints",
    ),
    "sampling without a temperature": (
        lambda tmp: [
            "generate",
            "--checkpoint",
            str(GOLDEN / "qwen3"),
            "--prompt-ids",
            _file(tmp, "[[1, 2]]"),
            "--max-new-tokens",
            "2",
            "--top-k",
            "5",
        ],
        "need --temperature > 0",
    ),
    "ids outside the vocabulary": (
        lambda tmp: [
            "forward",
            "--checkpoint",
            str(GOLDEN / "qwen3"),
            "--input-ids",
            _file(tmp, "[[1, 999]]"),
            "--out",
            str(tmp / "o.npy"),
        ],
        "outside the vocabulary",
    ),
    "expert-parallel size not dividing the TP group": (
        lambda tmp: ["plan", "--preset", "tiny-qwen3-moe", "--mesh", "attn_tp=4", "--moe-ep", "3"],
        "moe_ep must divide the full TP group",
    ),
    "expert-parallel size not dividing the experts": (
        lambda tmp: ["plan", "--preset", "tiny-qwen3-moe", "--mesh", "attn_tp=6", "--moe-ep", "6"],
        "--moe-ep 6 on --mesh attn_tp=6: moe_ep must divide the number of experts",
    ),
    "MoE options for a dense model": (
        lambda tmp: ["plan", "--preset", "tiny-qwen3", "--mesh", "attn_tp=4", "--moe-ep", "4"],
        "has no experts",
    ),
    "MHC layers on a Hugging Face checkpoint": (
        lambda tmp: [
            "forward",
            "--checkpoint",
            str(GOLDEN / "qwen3"),
            "--hc-mult",
            "4",
            "--input-ids",
            "x",
            "--out",
            "y",
        ],
        "holds no MHC weights; use it with --preset",
    ),
    "capture index past the final read": (
        lambda tmp: [
            "forward",
            "--checkpoint",
            str(GOLDEN / "qwen3"),
            "--input-ids",
            str(GOLDEN / "qwen3" / "prompts.json"),
            "--out",
            str(tmp / "o.npy"),
            "--capture-layers",
            "1,7",
        ],
        r"--capture-layers takes indices in \[0, 3\].*got \[7\]",
    ),
    "captures of an MHC decoder": (
        lambda tmp: [
            "forward",
            "--preset",
            "tiny-mistral",
            "--hc-mult",
            "2",
            "--input-ids",
            _file(tmp, "[[1, 2]]"),
            "--out",
            str(tmp / "o.npy"),
            "--capture-layers",
            "1",
        ],
        "captures of a decoder with hyper-connections are not supported",
    ),
    "ids that are not JSON": (
        lambda tmp: [
            "forward",
            "--checkpoint",
            str(GOLDEN / "qwen3"),
            "--input-ids",
            _file(tmp, "1 2 3"),
            "--out",
            str(tmp / "o.npy"),
        ],
        "ids.json is not valid JSON",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_ends_with_one_line_and_exit_code_2(tmp_path, capsys, case):
    """Bad input names the problem in one stderr line, exit code 2, no traceback."""
    args, pattern = BAD_INPUT[case]
    assert main(args(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("boundary-jax: error: ")
    assert "Traceback" not in "\n".join(err)
    import re

    assert re.search(pattern, err[-1]), err[-1]


def test_the_installed_command_reports_bad_input_without_a_traceback(tmp_path):
    """The console script itself exits 2 with one line on stderr."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "models.cli",
            "forward",
            "--checkpoint",
            str(tmp_path / "none"),
            "--input-ids",
            "x",
            "--out",
            "y",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"boundary-jax: error: no checkpoint directory at {tmp_path / 'none'}"
    ]


@pytest.mark.slow
def test_norm_family_checkpoints_run_forward_generate_and_plan(tmp_path, capsys):
    """The post-norm and sandwich-norm checkpoints run on the command line: EXAONE 4.0 forward
    input-scattered (HF's logits within 1e-4), Gemma 3 generate under DP 2 x TP 2 (HF's greedy
    tokens), OLMo 2 plan (its middle layer's two boundary all-reduces and its q/k-norm one)."""
    checkpoint, reference = _golden("exaone4")
    out = tmp_path / "logits.npy"
    args = ["forward", "--checkpoint", str(checkpoint), "--mesh", "attn_tp=4", "--input-scattered"]
    assert main([*args, "--input-ids", str(checkpoint / "prompts.json"), "--out", str(out)]) == 0
    want = reference["logits"]
    assert np.max(np.abs(np.load(out) - want)) <= 1e-4 * np.max(np.abs(want))

    checkpoint, reference = _golden("gemma3")
    args = ["generate", "--checkpoint", str(checkpoint), "--mesh", "attn_dp=2,attn_tp=2"]
    prompts = str(checkpoint / "prompts.json")
    assert main([*args, "--prompt-ids", prompts, "--max-new-tokens", "6"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == reference["generated"].tolist()

    args = ["plan", "--checkpoint", str(GOLDEN / "olmo2"), "--mesh", "attn_tp=4", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["middle_layer"] == 1
    assert {kind: n for kind, n in report["collectives_per_layer"].items() if n} == {
        "all-reduce": 3
    }


def test_help_lists_the_presets(capsys, monkeypatch):
    """Each command's --help names every preset --preset takes."""
    monkeypatch.setenv("COLUMNS", "1000")  # no line wraps inside a preset's name
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert all(name in help_text for name in PRESETS), help_text
