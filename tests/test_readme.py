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


def _first_commands() -> list[str]:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]


def test_readme_opens_with_the_commands() -> None:
    """The main job, the fast tier and the whole suite, each setting itself up."""
    assert _first_commands() == ["./scripts/demo", "./scripts/test", "./scripts/test --all"]


def test_readme_says_what_it_is_before_anything_else() -> None:
    """The first screen: the name, what it is with the number that matters, then the commands and install."""
    head = README.split("```bash", 1)[0]
    assert head.startswith("# deltasync\n") and "weight" in head and "bytes" in head.lower()
    assert "pip install" in README[: README.index("## ", README.index("```bash"))]


def test_ci_runs_exactly_the_readme_whole_suite_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "./scripts/test --all" in [line.strip() for line in ci]


def test_no_history_in_the_docs() -> None:
    """The docs describe what is, not how it came to be."""
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]:
        text = doc.read_text().lower()
        for phrase in ("release before", "slower day", "releases ago", "the run before that"):
            assert phrase not in text, f"{doc.name} says {phrase!r}"


def test_errors_table_lists_every_error_a_user_can_catch() -> None:
    """The README's "Errors you can catch" table names every class of deltasync.errors, with its builtin."""
    import builtins

    from deltasync import errors

    section = README.split("## Errors you can catch", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    listed = {name: row for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    for name in errors.__all__:
        if name == "DeltaSyncError":
            continue
        assert name in listed, f"{name} is missing from README's errors table"
        cls = getattr(errors, name)
        builtin = listed[name].split("|")[2].strip().strip("`")
        assert issubclass(cls, getattr(builtins, builtin)), f"README says {name} is a {builtin}"
