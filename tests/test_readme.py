"""The README is true of the repository: every path it names exists, every ``grkv`` command it names is one of the
real command line's and answers ``--help``, and its test command is the one CI runs. Every command the documents and
scripts give runs from the repository's root as written: a benchmark as a module, never with ``PYTHONPATH``."""

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", re.M)


def code_spans(text: str) -> list[str]:
    """The text of every fenced block and inline code span."""
    return [block or inline for block, inline in CODE.findall(text)]


def top_level() -> set[str]:
    """What a checkout holds at its root: git's tracked entries (a copy without .git: what is there, less what the
    README's own commands create)."""
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode == 0:
        return {line.split("/")[0] for line in listed.stdout.splitlines()}
    return {entry.name for entry in REPO.iterdir()} - {".venv", ".gpu-wheels", "outputs", "results"}


TOP_LEVEL = top_level()


def named_paths(text: str, folder: Path = REPO) -> set[Path]:
    """Link targets inside the repository (relative to ``folder``, the document's), and every token in code whose
    first component is a top-level entry of the repository (``sweeps/configs/smoke.yaml``, ``sweep.py``; not
    ``~/.grkv``, ``$OUT/...`` or a user's ``results/x.json``), relative to the repository."""
    links = {target.split("#")[0] for pair in LINK.findall(text) for target in pair if target}
    paths = {(folder / link).resolve() for link in links if link and not re.match(r"[a-z]+:", link)}
    for span in code_spans(text):
        if span.startswith("git "):  # names git's history, not the tree
            continue
        for line in span.splitlines():
            tokens = re.split(r"[\s\"'(),=:]+", line.split("#")[0].strip())
            if tokens[0] == "cp":  # its destination is what the command creates
                tokens = tokens[:-1]
            for token in tokens:
                token = token.rstrip(".;")
                if token.split("/")[0] in TOP_LEVEL:
                    paths.add(REPO / token)
    return paths


def exists(path: Path) -> bool:
    """A path, a glob (``sweeps/configs/*.yaml``) or a template (``benchmarks/results/<study>/``: its fixed part)."""
    fixed = re.split(r"[<$]", str(path.relative_to(REPO)))[0]
    return any(REPO.glob(fixed)) if "*" in fixed else (REPO / fixed).exists()


DOCUMENTS = [REPO / "README.md", REPO / "infra" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_path_a_document_names_exists(document):
    paths = named_paths(document.read_text(), document.parent)
    assert not [str(path.relative_to(REPO)) for path in sorted(paths) if not exists(path)]


def test_the_readme_names_its_paths():
    named = {str(path.relative_to(REPO)) for path in named_paths(README)}
    assert {"scripts/install.sh", "sweeps/configs/demo.yaml", "docs/results/README.md", ".ci/run"} <= named


def test_the_path_check_catches_a_missing_path():
    (missing,) = named_paths("see `benchmarks/RESULTS.md` §6, `git log -- benchmarks/gone.md`")
    assert not exists(missing) and not exists(REPO / "sweeps/configs/*.json")
    (link,) = named_paths("[the index](results/README.md)", REPO / "docs")
    assert exists(link) and not exists(next(iter(named_paths("[x](results/README.md)"))))
    assert exists(REPO / "benchmarks/results/<study>/") and exists(REPO / "sweeps/configs/*.yaml")


# Where users find commands to run: the documents' code, the scripts (their comments give commands too) and the
# benchmarks' usage lines.
RUN_DOCUMENTS = sorted({*DOCUMENTS, *REPO.glob("benchmarks/**/*.md"), *REPO.glob("infra/**/*.md")})
RUN_SOURCES = [
    *RUN_DOCUMENTS,
    *sorted([*REPO.glob("benchmarks/*.sh"), *REPO.glob("scripts/*.sh"), *REPO.glob("benchmarks/*.py")]),
]
# A command that only runs with the module search path set by hand: ``PYTHONPATH``, or a benchmark run by its path
# (its own folder then replaces the root on the path, and its ``benchmarks.*`` imports fail).
MISRUN = re.compile(r"PYTHONPATH|python3?\s+(?:\\\n\s*)?benchmarks/\w+\.py")
BENCHMARK_MODULE = re.compile(r"-m\s+(?:\\\n\s*)?benchmarks\.(\w+)")


def commands(path: Path) -> str:
    """What ``path`` gives to run: a document's code, a script whole, a benchmark's docstring."""
    if path.suffix == ".md":
        return "\n".join(code_spans(path.read_text()))
    if path.suffix == ".py":
        return ast.get_docstring(ast.parse(path.read_text())) or ""
    return path.read_text()


def misruns(text: str) -> list[str]:
    return [match.group() for match in MISRUN.finditer(text)]


def test_no_command_sets_the_module_search_path():
    found = {str(path.relative_to(REPO)): misruns(commands(path)) for path in RUN_SOURCES}
    assert {path: misrun for path, misrun in found.items() if misrun} == {}


def test_every_benchmark_a_command_runs_is_a_module():
    named = {name for path in RUN_SOURCES for name in BENCHMARK_MODULE.findall(commands(path))}
    assert {"default_rule", "gpu_check", "paired_losses", "prefill_ops"} <= named
    assert {name for name in named if not (REPO / "benchmarks" / f"{name}.py").exists()} == set()


def test_the_command_check_catches_a_set_search_path_and_a_benchmark_run_by_path():
    text = "\n".join(
        [
            "PYTHONPATH=. .venv/bin/python -m benchmarks.x",
            "python3 benchmarks/gpu_check.py --tiny",
            "for i in 1 2; do .venv/bin/python \\",
            "    benchmarks/prefill_cost.py; done",
            "$PY -m \\",
            "    benchmarks.y",
        ]
    )
    assert misruns(text) == [
        "PYTHONPATH",
        "python3 benchmarks/gpu_check.py",
        "python \\\n    benchmarks/prefill_cost.py",
    ]
    assert BENCHMARK_MODULE.findall(text) == ["x", "y"]
    assert misruns(".venv/bin/python -m benchmarks.default_rule benchmarks/results/default-rule") == []
    assert commands(REPO / "benchmarks" / "paired_losses.py").startswith("Per-sample paired comparison")


def console_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    """Run a console script of pyproject.toml as installed, from this checkout's code."""
    module, function = console_scripts()[name].split(":")
    code = f"import sys; from {module} import {function}; sys.exit({function}())"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


GRKV_COMMANDS = sorted(
    {command for span in code_spans(README) for command in re.findall(r"(?<![\w-])grkv ([a-z][a-z-]*)", span)}
)


def test_the_readme_names_the_main_commands():
    assert {"demo", "eval", "sweep", "report", "export"} <= set(GRKV_COMMANDS)


@pytest.mark.parametrize("command", GRKV_COMMANDS)
def test_every_grkv_command_the_readme_names_answers_help(command):
    result = run_script("grkv", command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: grkv {command} ")


def test_grkv_help_and_an_unknown_command():
    assert run_script("grkv", "--help").returncode == 0
    unknown = run_script("grkv", "no-such-command", "--help")
    assert unknown.returncode != 0 and "no-such-command" in unknown.stderr


# The README's test command: lint and format checks, then the tests.
TEST_COMMAND = (
    "bash scripts/install.sh && .venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/python -m pytest"
)


def test_the_readme_test_command_is_what_ci_runs():
    commands = [line.strip() for block in re.findall(r"```bash\n(.*?)```", README, re.S) for line in block.splitlines()]
    assert "bash scripts/install.sh && .venv/bin/grkv demo" in commands
    assert TEST_COMMAND in commands
    assert (REPO / ".ci/run").read_text().splitlines()[-1] == TEST_COMMAND


def test_the_readme_is_at_most_250_lines():
    assert len(README.splitlines()) <= 250
