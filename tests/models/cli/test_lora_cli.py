"""The command line's LoRA adapters: --lora NAME=DIR / --lora DIR, per-prompt adapters in the
ids file, --adapter for every prompt; bad adapter input refused in one line."""

import argparse
import json
import pathlib

import numpy as np
import pytest

from models.cli.lora import lora_source, prompt_adapters
from models.cli.main import main
from models.cli.options import InputError

GOLDEN = pathlib.Path(__file__).parents[2] / "golden"
LLAMA = GOLDEN / "llama"
ADAPTERS = GOLDEN / "lora" / "llama"


def test_forward_and_generate_run_each_prompt_through_its_adapter(tmp_path, capsys):
    """forward and generate with two --lora adapters (one named after its folder) and a
    per-prompt ids file give peft's logits and greedy tokens."""
    reference = dict(np.load(ADAPTERS / "reference.npz"))
    lora = ["--lora", str(ADAPTERS / "a1"), "--lora", f"a2={ADAPTERS / 'a2'}"]
    out = tmp_path / "logits.npy"
    ids = ["--input-ids", str(ADAPTERS / "prompts.json")]
    args = ["forward", "--checkpoint", str(LLAMA), "--mesh", "attn_tp=2", *lora, *ids]
    assert main([*args, "--out", str(out)]) == 0
    scale = np.max(np.abs(reference["logits"]))
    assert np.max(np.abs(np.load(out) - reference["logits"])) <= 1e-4 * scale
    ids = ["--prompt-ids", str(ADAPTERS / "prompts.json"), "--max-new-tokens", "6"]
    assert main(["generate", "--checkpoint", str(LLAMA), *lora, *ids, "--ignore-eos"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == reference["generated"].tolist()


def test_bad_adapter_input_is_refused_in_one_line(tmp_path, capsys):
    """An adapter that is not loaded, --adapter beside per-prompt adapters, --lora on a preset
    and a folder without adapter_config.json each fail with exit code 2 and a reason."""
    ids = ["--input-ids", str(ADAPTERS / "prompts.json"), "--out", str(tmp_path / "x.npy")]
    base = ["forward", "--checkpoint", str(LLAMA), *ids]
    cases = (
        ([*base, "--lora", str(ADAPTERS / "a1")], "'a2', which is not loaded"),
        ([*base, "--lora", str(ADAPTERS / "a1"), "--adapter", "a1"], "drop one of them"),
        ([*base, "--lora", f"a1={tmp_path}"], "no adapter_config.json"),
        (
            ["plan", "--preset", "tiny-mistral", "--lora", str(ADAPTERS / "a1")],
            "pass --checkpoint, not --preset",
        ),
    )
    for args, message in cases:
        assert main(args) == 2
        assert message in capsys.readouterr().err


def test_adapter_sources_and_prompt_files_name_the_adapters(tmp_path):
    """--lora DIR is named after its folder; a .jsonl prompt file names each prompt's adapter;
    --adapter names every prompt's."""
    assert lora_source("/x/y/my-adapter/") == ("my-adapter", "/x/y/my-adapter/")
    assert lora_source("a=b") == ("a", "b")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi", "adapter": "a1"}\n\n{"prompt": "there"}\n')
    folder = str(ADAPTERS / "a1")
    args = argparse.Namespace(
        input_ids=None,
        prompt_file=str(prompts),
        adapter=None,
        lora=[("a1", folder)],
        checkpoint="c",
    )
    assert prompt_adapters(args, "--input-ids", 2) == ["a1", None]
    args = argparse.Namespace(
        input_ids=None, prompt_file=None, adapter="a1", lora=[("a1", folder)], checkpoint="c"
    )
    assert prompt_adapters(args, "--input-ids", 3) == ["a1"] * 3
    args.adapter = "zz"
    with pytest.raises(InputError, match="'zz', which is not loaded"):
        prompt_adapters(args, "--input-ids", 3)


def test_plan_reports_the_loaded_adapters(capsys):
    """plan --lora reports the adapters it serves, their stacks' rank and targets."""
    assert main(["plan", "--checkpoint", str(LLAMA), "--lora", str(ADAPTERS / "a2"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lora"] == {
        "adapters": ["a2"],
        "rank": 8,
        "targets": ["down_proj", "q_proj", "up_proj", "v_proj"],
    }
