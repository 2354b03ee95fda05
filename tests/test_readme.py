"""README promises: its examples run, and CI runs the test command it shows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", README))))
def test_python_examples_run(index: int) -> None:
    code = re.findall(r"```python\n(.*?)```", README, re.S)[index]
    exec(compile(code, f"README.md example {index}", "exec"), {"__name__": "readme"})


def test_readme_opens_with_the_two_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["./scripts/demo", "./scripts/test"]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "./scripts/test" in [line.strip() for line in ci]
