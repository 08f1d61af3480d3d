"""The bad inputs of docs/bad-inputs.md (scripts/bad_inputs.py): those refused before any model
is built are run here in-process, each ending in one `boundary-jax: error:` line naming the
problem, exit code 2, without building a model; a closed stdout ends quietly."""

import importlib.util
import os
import pathlib
import re
import sys

import pytest

from models.cli import commands
from models.cli.main import EXIT_BROKEN_PIPE, main

ROOT = pathlib.Path(__file__).parents[3]
_spec = importlib.util.spec_from_file_location("bad_inputs", ROOT / "scripts" / "bad_inputs.py")
bad_inputs = sys.modules.setdefault("bad_inputs", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(bad_inputs)
EARLY = [case for case in bad_inputs.CASES if case.early]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return bad_inputs.make_fixtures(tmp_path_factory.mktemp("bad_inputs"))


def test_the_table_covers_every_kind_of_bad_input():
    """At least thirty cases, of every kind the issue names."""
    kinds = {case.kind for case in bad_inputs.CASES}
    assert {"files", "options", "meshes", "paths", "memory", "interrupts"} <= kinds
    assert len(bad_inputs.CASES) >= 30 and len({c.name for c in bad_inputs.CASES}) == len(
        bad_inputs.CASES
    )


@pytest.mark.parametrize("case", EARLY, ids=lambda case: case.name)
def test_bad_input_is_refused_in_one_line_before_any_model_is_built(
    case, fixtures, capsys, monkeypatch
):
    """The command ends with exit code 2 and one error line matching the case, and never
    reaches building or loading the model."""

    def build(*args, **kwargs):
        raise AssertionError(f"{case.name}: the model was built before the input was refused")

    monkeypatch.setattr(commands, "build", build)
    monkeypatch.setattr(commands, "build_stages", build)
    assert main(bad_inputs.arguments(case, fixtures)) == case.code
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith("boundary-jax: error: "), err
    assert re.search(case.pattern, err[-1]), err[-1]


def test_a_closed_stdout_ends_quietly(monkeypatch, capsys):
    """plan --json into a pipe whose reader has gone ends with exit code 141 and nothing on
    stderr (no BrokenPipeError)."""
    read, write = os.pipe()
    os.close(read)
    stdout = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["plan", "--preset", "tiny-qwen3", "--json"]) == EXIT_BROKEN_PIPE
    stdout.close()
    assert "Error" not in capsys.readouterr().err


def test_what_the_first_process_refuses_every_process_refuses_in_its_line(monkeypatch):
    """A check of what only process 0 uses (its `--out`, its port) runs there alone, and every
    process raises process 0's line: the others do not run on into a collective it left."""
    problem = "--out /proc/x.npy: cannot write in /proc (No such file or directory)"
    checked = []

    def refuse():
        checked.append(True)
        raise commands.InputError(problem)

    monkeypatch.setattr(commands, "is_first_process", lambda: False)
    monkeypatch.setattr(commands, "gather_json", lambda value: [problem, value])
    with pytest.raises(commands.InputError, match=re.escape(problem)):
        commands.check_on_first_process(refuse)
    assert not checked
    monkeypatch.setattr(commands, "is_first_process", lambda: True)
    monkeypatch.setattr(commands, "gather_json", lambda value: [value, None])
    with pytest.raises(commands.InputError, match=re.escape(problem)):
        commands.check_on_first_process(refuse)
    assert checked == [True]
    commands.check_on_first_process(lambda: None)
