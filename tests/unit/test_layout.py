"""The tree stays the architecture diagram: one package per role, no module grown past ~600 lines,
every module on docs/architecture.md's map, and at the top of mindft/ only the package's face
and the ground the roles stand on."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # not harness's: this test imports nothing of mindft
TESTS = ROOT / "tests"
PACKAGE = ROOT / "mindft"
MAX_LINES = 600  # the style guide's ~550, with room to finish a change before splitting
# The package's face (__init__) and the ground every role stands on; everything else is in its role's package.
TOP_LEVEL = {"__init__.py", "config.py", "exitcodes.py", "preflight.py", "mindformers.py", "units.py"}


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _too_long(paths: list[Path]) -> list[str]:
    return [f"{path.relative_to(ROOT)}: {count} lines" for path in paths if (count := _lines(path)) > MAX_LINES]


def test_no_module_of_mindft_passes_600_lines() -> None:
    too_long = _too_long(sorted(PACKAGE.rglob("*.py")))
    assert not too_long, f"split these by what they do (STYLE.md: one job per file): {too_long}"


def test_no_test_module_passes_600_lines() -> None:
    too_long = _too_long(sorted(TESTS.rglob("test_*.py")))
    assert not too_long, f"split these, one module per concern (a helpers module beside them if they share): {too_long}"


def test_the_top_of_mindft_holds_only_the_face_and_the_ground() -> None:
    extra = sorted(path.name for path in PACKAGE.glob("*.py") if path.name not in TOP_LEVEL)
    assert not extra, f"move these into their role's package (docs/architecture.md): {extra}"


def test_docs_architecture_maps_every_module() -> None:
    """The map names each module by its path under mindft/ in backticks (`flow/job.py`,
    `config.py`); the packages' __init__ modules need not be listed (the map names the packages)."""
    named = {name.removeprefix("mindft/")
             for name in re.findall(r"`([\w/]+\.py)`", (ROOT / "docs" / "architecture.md").read_text())}
    modules = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if path.name != "__init__.py")
    missing = [module for module in modules if module not in named]
    assert not missing, f"docs/architecture.md's map does not name: {missing}"
