"""What transformers fills in for each key a golden `config.json` might leave out.

Released checkpoints often write sparse configs (an older transformers, an image-text model's
text part, a hand-written file); transformers then runs the model with its config class's
defaults, some of them derived (`layer_types` from `full_attention_interval`, `rope_parameters`
from the class's `default_theta`). For every golden checkpoint in `tests/golden/*/config.json`
and every key of it (and every key inside a nested dict such as `rope_parameters`), this script
removes the key, lets transformers' config class read the rest, and records the keys of the
original file whose value transformers' reading then differs from the file's (with transformers'
values) or that it drops; and the pairs of names transformers takes for one key
(`attribute_map`). `tests/models/config/test_config_defaults.py` reads the result
(`tests/golden/config_defaults.json`) and checks that the project reads each sparse file as
transformers does.

Run from the repository root with transformers (no torch needed), for example:

    python3.11 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install transformers==5.25.0
    /tmp/hfenv/bin/python scripts/make_config_defaults.py
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import transformers
from transformers import CONFIG_MAPPING

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden"
OUT = GOLDEN / "config_defaults.json"
BOOKKEEPING = {"architectures", "model_type", "transformers_version", "dtype", "torch_dtype"}


def special_float(value: dict[str, Any]) -> Any:
    """transformers' JSON form of a float JSON cannot hold (`{"__float__": "Infinity"}`)."""
    return float(value["__float__"]) if set(value) == {"__float__"} else value


def read(config: dict[str, Any]) -> dict[str, Any] | None:
    """transformers' reading of `config`, as `to_dict` writes it; None where it refuses."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fresh = json.loads(json.dumps(config), object_hook=special_float)  # edited in place
            return CONFIG_MAPPING[config["model_type"]].from_dict(fresh).to_dict()
    except Exception:  # noqa: BLE001 - any refusal is recorded as such
        return None


def filled(original: dict[str, Any], sparse: dict[str, Any]) -> dict[str, Any] | None:
    """transformers' reading of `sparse` against `original`: `fill`, the keys of `original`
    whose value it reads otherwise, with that value (and the `rope_parameters` it makes of the
    legacy `rope_theta` / `rope_scaling`), and `drop`, those it does not keep; None where
    transformers refuses `sparse`."""
    result = read(sparse)
    if result is None:
        return None
    keys = [key for key in original if key not in BOOKKEEPING]
    fill = {k: result[k] for k in keys if k in result and result[k] != original[k]}
    if "rope_parameters" not in original and "rope_parameters" in result:  # from legacy keys
        fill["rope_parameters"] = result["rope_parameters"]
    return {"fill": fill, "drop": [k for k in keys if k not in result]}


def removals(config: dict[str, Any]) -> list[tuple[str, ...]]:
    """Each key of `config` and of its nested dicts, as a path."""
    paths = []
    for key, value in config.items():
        if key in BOOKKEEPING:
            continue
        paths.append((key,))
        if isinstance(value, dict):
            paths.extend((key, inner) for inner in value)
    return paths


def without(config: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """`config` without the key at `path`."""
    sparse = json.loads(json.dumps(config))
    parent = sparse
    for key in path[:-1]:
        parent = parent[key]
    del parent[path[-1]]
    return sparse


def main() -> None:
    """Writes `tests/golden/config_defaults.json`: per golden, `{"key" or "key.inner": filled}`
    and its config class's `attribute_map`."""
    table: dict[str, Any] = {"transformers": transformers.__version__, "goldens": {}, "aliases": {}}
    for path in sorted(GOLDEN.glob("*/config.json")):
        config = json.loads(path.read_text())
        if "architectures" not in config or config.get("model_type") not in CONFIG_MAPPING:
            continue
        if read(config) is None:
            continue
        aliases = CONFIG_MAPPING[config["model_type"]].attribute_map
        table["aliases"][path.parent.name] = {a: b for a, b in aliases.items() if a != b}
        table["goldens"][path.parent.name] = {
            ".".join(removed): filled(config, without(config, removed))
            for removed in removals(config)
        }
    OUT.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT} ({len(table['goldens'])} goldens)")


if __name__ == "__main__":
    main()
