"""`boundary-jax train`: a short run lowers the loss and writes a checkpoint that forward and
generate load (holding the trained weights); it trains from every family's checkpoint, keeping
its config.json; bad input gets one line and exit code 2; a non-finite loss stops it with
nothing written; SIGTERM stops it like SIGINT, keeping the last --save-every checkpoint."""

import contextlib
import io
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from models.cli.main import main

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
ROOT = pathlib.Path(__file__).parents[3]

TEXT = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "All that glitters is not gold. Where there is smoke there is fire. "
) * 20


def cross_entropy(logits: np.ndarray, ids: list[int]) -> float:
    """Mean next-token cross-entropy of one sequence's [length, vocab] logits."""
    logits = logits[: len(ids) - 1].astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short training run of tiny-qwen3 on DP2 x TP2 over a directory of two text files,
    its layers 1 and 2 scanned (remat per scanned layer): (its summary, its stdout lines, the
    checkpoint directory, its stderr)."""
    tmp = tmp_path_factory.mktemp("train")
    texts = tmp / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text(TEXT[: len(TEXT) // 2])
    (texts / "b.txt").write_text(TEXT[len(TEXT) // 2 :])
    out = tmp / "trained"
    args = ["train", "--preset", "tiny-qwen3", "--mesh", "attn_dp=2,attn_tp=2"]
    args += ["--text", str(texts), "--steps", "30", "--batch-tokens", "256", "--seq-len", "64"]
    args += ["--lr", "1e-2", "--log-every", "10", "--remat", "dots", "--scan-layers"]
    args += ["--out", str(out)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        assert main(args) == 0
    lines = stdout.getvalue().strip().splitlines()
    return json.loads(lines[-1]), lines, out, stderr.getvalue()


def _strict_json(line: str):
    """`line` as JSON, refusing NaN and Infinity (which JSON does not have)."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_train_lowers_the_loss_and_reports_one_json_line(trained):
    """The last stdout line is one strict JSON object; 30 steps at least halve the loss; the
    log says the first step compiled (no tokens/s for it) and names no source line."""
    summary, lines, _, log = trained
    assert _strict_json(lines[-1]) == summary
    assert {"steps", "loss_first", "loss_last", "tokens_per_s"} <= summary.keys()
    assert summary["steps"] == 30 and summary["tokens_per_s"] > 0
    assert summary["loss_last"] < 0.6 * summary["loss_first"], summary
    assert len(lines) == 1  # progress goes to stderr
    first = next(line for line in log.splitlines() if "step 1/30" in line)
    assert "compiled and ran in" in first and "tokens/s" not in first
    assert re.search(r"step 10/30 +loss [\d.]+ +[\d,]+ tokens/s", log)
    assert not re.search(r"\w+\.py:\d+", log), log


def test_forward_and_generate_load_the_trained_checkpoint(trained, tmp_path, capsys):
    """forward loads the written checkpoint (per-layer tensors from the scanned run) unrolled
    on another mesh: its logits give the trained loss (not the initial one) on the training
    text; generate runs on it scanned."""
    summary, _, out, _ = trained
    ids = list(TEXT.encode()[:64])
    prompts = tmp_path / "ids.json"
    prompts.write_text(json.dumps([ids]))
    logits_file = tmp_path / "logits.npy"
    args = ["forward", "--checkpoint", str(out), "--mesh", "attn_tp=4"]
    assert main([*args, "--input-ids", str(prompts), "--out", str(logits_file)]) == 0
    loss = cross_entropy(np.load(logits_file)[0], ids)
    assert loss < 0.6 * summary["loss_first"]
    assert loss == pytest.approx(summary["loss_last"], rel=0.5)
    prompts.write_text(json.dumps([ids[:8]]))
    args = ["generate", "--checkpoint", str(out), "--prompt-ids", str(prompts), "--scan-layers"]
    assert main([*args, "--max-new-tokens", "4"]) == 0
    tokens = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert np.asarray(tokens).shape == (1, 4)


@pytest.mark.slow
def test_train_continues_from_a_checkpoint_it_wrote(trained, tmp_path, capsys):
    """train --checkpoint (a directory without tokenizer.json: byte-level) starts from the
    trained weights, on another mesh: its first loss is the trained level, not the initial;
    --overwrite replaces an --out holding a sharded checkpoint whole."""
    summary, _, out, _ = trained
    again = tmp_path / "again"
    again.mkdir()
    (again / "model.safetensors.index.json").write_text("{}")
    args = ["train", "--checkpoint", str(out), "--mesh", "attn_tp=2", "--text", _text(tmp_path)]
    args += ["--steps", "2", "--batch-tokens", "128", "--seq-len", "64", "--lr", "1e-4"]
    assert main([*args, "--out", str(again), "--overwrite"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["loss_first"] < 0.6 * summary["loss_first"]
    assert sorted(p.name for p in again.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "text.txt"]


def _word_tokenizer(directory: pathlib.Path) -> None:
    """A word-level tokenizer.json of TEXT's words in `directory` (the goldens' vocabulary of
    250 ids is under the 256 bytes)."""
    words = sorted(set(TEXT.split()))
    vocab = {"[UNK]": 0} | {word: i + 1 for i, word in enumerate(words)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))


@pytest.mark.slow
def test_train_from_a_gemma3_checkpoint_keeps_its_config(tmp_path, capsys):
    """train on a Gemma 3 checkpoint (it crashed writing the config, as on OLMo 2 and EXAONE 4:
    test_save.py writes theirs) writes --out with the source's config.json (but for the dtype),
    generation config and tokenizer, and prints strict JSON."""
    source = tmp_path / "gemma3"
    shutil.copytree(GOLDEN / "gemma3", source)
    _word_tokenizer(source)
    out = tmp_path / "out"
    args = ["train", "--checkpoint", str(source), "--text", _text(tmp_path), "--steps", "1"]
    assert main([*args, "--batch-tokens", "32", "--seq-len", "16", "--out", str(out)]) == 0
    _strict_json(capsys.readouterr().out.strip().splitlines()[-1])
    written = json.loads((out / "config.json").read_text())
    assert written == json.loads((source / "config.json").read_text()) | {"dtype": "float32"}
    for kept in ("generation_config.json", "tokenizer.json"):
        assert (out / kept).read_bytes() == (source / kept).read_bytes(), kept


def test_a_non_finite_loss_stops_training_and_writes_nothing(tmp_path, capsys):
    """An exploding run (--lr 1e30) stops at the first non-finite loss, exit code 2, one line
    naming the step and --lr, and --out is never created."""
    args = _train_args(tmp_path, "--steps", "6", "--warmup", "0", "--lr", "1e30")
    assert main([*args, "--batch-tokens", "64", "--seq-len", "32"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    last = captured.err.strip().splitlines()[-1]
    assert re.search(r"step \d/6: the (loss is nan|parameters are not finite)", last), last
    assert "nothing was written" in last and "--lr" in last
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_sigterm_stops_training_keeping_the_last_saved_checkpoint(tmp_path):
    """SIGTERM during a run with --save-every ends it with one line naming the step and the
    kept checkpoint, exit code 143; --out holds that complete checkpoint, nothing temporary."""
    out = tmp_path / "o"
    args = _train_args(tmp_path, "--steps", "100000", "--save-every", "2", "--log-every", "1")
    args += ["--batch-tokens", "64", "--seq-len", "32"]
    env = os.environ | {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(
        [sys.executable, "-m", "models.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in process.stderr:
        if "checkpoint of step 2" in line:
            process.send_signal(signal.SIGTERM)
            break
    rest = process.stderr.read()
    assert process.wait(timeout=120) == 128 + signal.SIGTERM
    assert process.stdout.read() == ""
    last = rest.strip().splitlines()[-1]
    match = re.fullmatch(
        r"boundary-jax: interrupted by SIGTERM at step \d+/100000; (\S+) holds the checkpoint "
        r"of step (\d+)",
        last,
    )
    assert match and match[1] == str(out), rest
    assert "Traceback" not in rest and int(match[2]) % 2 == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o", "text.txt"]
    prompts = tmp_path / "ids.json"
    prompts.write_text("[[1, 2, 3]]")
    assert main(["forward", "--checkpoint", str(out), "--input-ids", str(prompts), "--out",
                 str(tmp_path / "logits.npy")]) == 0  # fmt: skip


def _text(tmp, content: str = TEXT) -> str:
    path = tmp / "text.txt"
    path.write_text(content)
    return str(path)


def _train_args(tmp, *extra: str, text: str | None = None) -> list[str]:
    text = _text(tmp) if text is None else text
    return ["train", "--preset", "tiny-qwen3", "--text", text, "--out", str(tmp / "o"), *extra]


def _router_loss_args(tmp, family: str, nested: bool) -> list[str]:
    """train from a copy of the golden `family` checkpoint whose config (or its text_config)
    asks for the router's auxiliary loss."""
    checkpoint = tmp / family
    shutil.copytree(GOLDEN / family, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    flag = {"output_router_logits": True, "router_aux_loss_coef": 0.01}
    config = config | ({"text_config": flag} if nested else flag)
    (checkpoint / "config.json").write_text(json.dumps(config))
    args = _train_args(tmp, "--steps", "2", "--seq-len", "8")
    return [*args[:1], "--checkpoint", str(checkpoint), *args[3:]]


BAD_INPUT = {
    "no text file": (
        lambda tmp: _train_args(tmp, "--steps", "2", text=str(tmp / "none")),
        "no text",
    ),
    "empty text": (lambda tmp: _train_args(tmp, "--steps", "2", text=_text(tmp, "")), "no text in"),
    "zero steps": (lambda tmp: _train_args(tmp, "--steps", "0"), "--steps: must be at least 1"),
    "a mesh larger than the devices": (
        lambda tmp: _train_args(tmp, "--steps", "2", "--mesh", "attn_dp=4,attn_tp=4"),
        "needs 16 devices",
    ),
    "a MoE config asking for the router's auxiliary loss": (
        lambda tmp: _router_loss_args(tmp, "gpt_oss", nested=False),
        r"output_router_logits=true, router_aux_loss_coef=0.01\)",
    ),
    "a text_config asking for it": (
        lambda tmp: _router_loss_args(tmp, "mixtral", nested=True),
        "the next-token loss alone",
    ),
    "a mesh the heads do not divide over": (
        lambda tmp: _train_args(tmp, "--steps", "2", "--mesh", "attn_tp=3", "--devices", "3"),
        "heads do not split over 3 ranks",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_ends_with_one_line_and_exit_code_2(tmp_path, capsys, case):
    args, pattern = BAD_INPUT[case]
    assert main(args(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("boundary-jax: error: ")
    assert "Traceback" not in "\n".join(err)
    assert re.search(pattern, err[-1]), err[-1]
