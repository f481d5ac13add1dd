"""Whether the environment running this holds every direct dependency at the floor pyproject.toml declares for it:
scripts/floors.sh runs it after its lowest-direct install, so a floor that another package's requirement raises (and
that was therefore never run) is named here, and fails the script until pyproject.toml declares what ran."""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

# Extras that are not installed by the floors environment: flash-attn builds against CUDA.
NOT_INSTALLED = {"flash"}


def declared(pyproject: Path) -> list[Requirement]:
    project = tomllib.loads(pyproject.read_text())["project"]
    groups = [group for name, group in project["optional-dependencies"].items() if name not in NOT_INSTALLED]
    return [Requirement(line) for line in project["dependencies"] + sum(groups, []) if not line.startswith("grkv")]


def _padded(version: str) -> tuple[int, ...]:
    """The release numbers, 2.9 as 2.9.0 (a local label such as torch's +cu121 left out)."""
    release = Version(version).release
    return release + (0,) * (3 - len(release))


def main() -> int:
    differing = []
    for requirement in declared(Path(__file__).resolve().parents[1] / "pyproject.toml"):
        floor = next(spec.version for spec in requirement.specifier if spec.operator == ">=")
        installed = importlib.metadata.version(requirement.name)
        if _padded(installed) != _padded(floor):
            differing.append(f"{requirement.name} {installed} (declared >={floor})")
    if differing:
        print(f"floors: installed above the declared floor: {', '.join(differing)}", file=sys.stderr)
        return 1
    print("floors: every direct dependency at its declared floor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
