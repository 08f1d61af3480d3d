"""`boundary-jax train`: a short run lowers the loss and writes a checkpoint that forward and
generate load (holding the trained weights); bad input gets one line and exit code 2; the
Hugging Face config it writes reads back to the same config for every preset."""

import contextlib
import io
import json
import re

import numpy as np
import pytest

from models.cli.main import main
from models.config import PRESETS, read_hf_config, write_hf_config

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
    its layers 1 and 2 scanned (remat per scanned layer): (its summary, its stdout, the
    checkpoint directory)."""
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
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(args) == 0
    lines = stdout.getvalue().strip().splitlines()
    return json.loads(lines[-1]), lines, out


def test_train_lowers_the_loss_and_reports_one_json_line(trained):
    """The last stdout line is one JSON object; 30 steps at least halve the loss."""
    summary, lines, _ = trained
    assert {"steps", "loss_first", "loss_last", "tokens_per_s"} <= summary.keys()
    assert summary["steps"] == 30 and summary["tokens_per_s"] > 0
    assert summary["loss_last"] < 0.5 * summary["loss_first"], summary
    assert len(lines) == 1  # progress goes to stderr


def test_forward_and_generate_load_the_trained_checkpoint(trained, tmp_path, capsys):
    """forward loads the written checkpoint (per-layer tensors from the scanned run) unrolled
    on another mesh: its logits give the trained loss (not the initial one) on the training
    text; generate runs on it scanned."""
    summary, _, out = trained
    ids = list(TEXT.encode()[:64])
    prompts = tmp_path / "ids.json"
    prompts.write_text(json.dumps([ids]))
    logits_file = tmp_path / "logits.npy"
    args = ["forward", "--checkpoint", str(out), "--mesh", "attn_tp=4"]
    assert main([*args, "--input-ids", str(prompts), "--out", str(logits_file)]) == 0
    loss = cross_entropy(np.load(logits_file)[0], ids)
    assert loss < 0.5 * summary["loss_first"]
    assert loss == pytest.approx(summary["loss_last"], rel=0.5)
    prompts.write_text(json.dumps([ids[:8]]))
    args = ["generate", "--checkpoint", str(out), "--prompt-ids", str(prompts), "--scan-layers"]
    assert main([*args, "--max-new-tokens", "4"]) == 0
    tokens = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert np.asarray(tokens).shape == (1, 4)


def test_train_continues_from_a_checkpoint_it_wrote(trained, tmp_path, capsys):
    """train --checkpoint (a directory without tokenizer.json: byte-level) starts from the
    trained weights, on another mesh: its first loss is the trained level, not the initial."""
    summary, _, out = trained
    args = ["train", "--checkpoint", str(out), "--mesh", "attn_tp=2", "--text", _text(tmp_path)]
    args += ["--steps", "2", "--batch-tokens", "128", "--seq-len", "64", "--lr", "1e-4"]
    assert main([*args, "--out", str(tmp_path / "again")]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["loss_first"] < 0.5 * summary["loss_first"]
    assert (tmp_path / "again" / "model.safetensors").is_file()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_written_config_reads_back(name):
    config = PRESETS[name]
    assert read_hf_config(json.loads(json.dumps(write_hf_config(config)))) == config
    assert config.vocab_size >= 256  # every preset trains on bytes


def _text(tmp, content: str = TEXT) -> str:
    path = tmp / "text.txt"
    path.write_text(content)
    return str(path)


def _train_args(tmp, *extra: str, text: str | None = None) -> list[str]:
    text = _text(tmp) if text is None else text
    return ["train", "--preset", "tiny-qwen3", "--text", text, "--out", str(tmp / "o"), *extra]


def _checkpoint_with_tokenizer(tmp) -> str:
    directory = tmp / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(write_hf_config(PRESETS["tiny-qwen3"])))
    (directory / "tokenizer.json").write_text("{}")
    return str(directory)


BAD_INPUT = {
    "no text file": (
        lambda tmp: _train_args(tmp, "--steps", "2", text=str(tmp / "none")),
        "no text",
    ),
    "empty text": (lambda tmp: _train_args(tmp, "--steps", "2", text=_text(tmp, "")), "no text in"),
    "zero steps": (lambda tmp: _train_args(tmp, "--steps", "0"), "--steps must be at least 1"),
    "a mesh larger than the devices": (
        lambda tmp: _train_args(tmp, "--steps", "2", "--mesh", "attn_dp=4,attn_tp=4"),
        "needs 16 devices",
    ),
    "a mesh the heads do not divide over": (
        lambda tmp: _train_args(tmp, "--steps", "2", "--mesh", "attn_tp=3", "--devices", "3"),
        "must be a multiple",
    ),
    "a tokenizer.json without the tokenizers package": (
        lambda tmp: [
            "train",
            "--checkpoint",
            _checkpoint_with_tokenizer(tmp),
            "--text",
            _text(tmp),
            "--steps",
            "2",
            "--out",
            str(tmp / "o"),
        ],
        "needs the `tokenizers` package",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_ends_with_one_line_and_exit_code_2(tmp_path, capsys, case):
    args, pattern = BAD_INPUT[case]
    if case.startswith("a tokenizer.json") and _has_tokenizers():
        pytest.skip("the tokenizers package is installed here")
    assert main(args(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("boundary-jax: error: ")
    assert "Traceback" not in "\n".join(err)
    assert re.search(pattern, err[-1]), err[-1]


def _has_tokenizers() -> bool:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True
