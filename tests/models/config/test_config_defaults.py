"""A sparse `config.json` reads as transformers reads it: for each golden config and each key
it holds (nested ones too), the file without the key must read as the file transformers' config
class makes of it (`tests/golden/config_defaults.json`, written by
`scripts/make_config_defaults.py`), or be refused with a clear error; never read as another
model."""

import json
from pathlib import Path
from typing import Any

import pytest

from models.config import read_hf_config

GOLDEN = Path(__file__).parents[2] / "golden"
TABLE = json.loads((GOLDEN / "config_defaults.json").read_text())


def without(config: dict[str, Any], path: str) -> dict[str, Any]:
    sparse = json.loads(json.dumps(config))
    *parents, last = path.split(".")
    inner = sparse
    for key in parents:
        inner = inner[key]
    del inner[last]
    return sparse


def reading(config: dict[str, Any]) -> Any:
    """The project's reading of `config`, or the kind of error it refuses it with."""
    try:
        return read_hf_config(config)
    except (ValueError, NotImplementedError, KeyError) as error:
        return type(error)


@pytest.mark.parametrize("golden", sorted(TABLE["goldens"]))
def test_a_key_left_out_reads_as_transformers_fills_it(golden: str) -> None:
    config = json.loads((GOLDEN / golden / "config.json").read_text())
    assert not isinstance(reading(config), type)
    wrong = []
    for path, filled in sorted(TABLE["goldens"][golden].items()):
        if filled is None:  # transformers refuses the file without it
            continue
        kept = {k: v for k, v in config.items() if k not in filled["drop"]}
        expected = reading({**kept, **filled["fill"]})
        got = reading(without(config, path))
        if got in (ValueError, NotImplementedError):  # refused with a clear error
            continue
        if got != expected:
            wrong.append(f"{path}: transformers fills {filled}; read as {got!r:.200}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("golden", sorted(TABLE["aliases"]))
def test_a_key_under_its_other_name_reads_the_same(golden: str) -> None:
    config = json.loads((GOLDEN / golden / "config.json").read_text())
    want = reading(config)
    for one, other in TABLE["aliases"][golden].items():
        for given, renamed in ((one, other), (other, one)):
            if given in config and renamed not in config:
                moved = {renamed if k == given else k: v for k, v in config.items()}
                assert reading(moved) == want, f"{given} written as {renamed}"
