"""The README's Python examples run as written."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).parents[1] / "README.md"


def test_readme_example_runs(tmp_path):
    """The first ```python block of the README runs in a fresh process and prints its shape."""
    (example,) = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[:1]
    script = tmp_path / "example.py"
    script.write_text(example)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "(16, 16)"


def test_readme_python_api_example_runs():
    """The README's Python block that loads a checkpoint and generates text runs from the
    repository root and prints one continuation per prompt."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (example,) = [block for block in blocks if "import models" in block]
    result = subprocess.run(
        [sys.executable, "-c", example],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=README.parent,
    )
    assert result.returncode == 0, result.stderr
    (texts,) = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert texts.startswith("['") and texts.endswith("']"), texts
