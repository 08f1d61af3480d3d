"""`boundary-jax serve` refuses what it cannot serve in one error line (exit 2): pipeline
stages, a model whose cache has no paged form, a KV cache budget that holds no page, `--lora`
as `generate` refuses it (on a preset, a folder without an adapter config)."""

import pytest

from models.cli.main import main

CASES = [
    (["--preset", "tiny-mistral", "--mesh", "pp=2"], "serve runs the model as one program"),
    (["--preset", "tiny-longcat-flash"], "LongcatCache"),
    (["--preset", "tiny-mistral", "--kv-cache-gb", "0.0000001"], "holds no page of 16 tokens"),
    (["--preset", "tiny-mistral", "--mesh", "attn_cp=2"], "not built under attention CP"),
    (["--preset", "tiny-mistral", "--lora", "a=tests"], "pass --checkpoint, not --preset"),
    (["--checkpoint", "tests/golden/qwen3", "--lora", "a=tests"], "no adapter_config.json"),
]


@pytest.mark.parametrize(("args", "message"), CASES, ids=[m for _, m in CASES])
def test_serve_refuses_in_one_line(args, message, capsys):
    assert main(["serve", *args, "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("boundary-jax: error: ") and message in err[-1], err
