"""The tree stays the architecture diagram: one package per role, no module grown past ~600 lines,
every module on docs/architecture.md's map, and at the top of mindft/ only the package's face
and the ground the roles stand on."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # not harness's: this test imports nothing of mindft
TESTS = ROOT / "tests"
PACKAGE = ROOT / "mindft"
MAX_LINES = 600  # the style guide's ~550, with room to finish a change before splitting
# The package's face (__init__) and the ground every role stands on; everything else is in its role's package.
TOP_LEVEL = {"__init__.py", "config.py", "exitcodes.py", "preflight.py", "mindformers.py"}


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


def test_every_test_module_has_a_name_of_its_own() -> None:
    # The tiers' folders are no packages: pytest imports each test module by its file name, so two
    # of one name make the second a collection error (only in the run that collects both).
    seen: dict[str, list[str]] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_the_top_of_mindft_holds_only_the_face_and_the_ground() -> None:
    extra = sorted(path.name for path in PACKAGE.glob("*.py") if path.name not in TOP_LEVEL)
    assert not extra, f"move these into their role's package (docs/architecture.md): {extra}"


def _mapped_modules() -> set[str]:
    """The modules docs/architecture.md's map names: its first code block draws the tree, a
    package as ``  pkg/`` and its modules indented under it, the ground's modules at the top."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("```", 2)[1]
    named: set[str] = set()
    package = ""
    for line in block.splitlines()[1:]:
        entry = line.split()[0] if line.strip() else ""
        indent = len(line) - len(line.lstrip())
        if entry.endswith("/") and indent == 2:
            package = entry
        elif entry.endswith(".py"):
            named.add((package if indent > 2 else "") + entry)
    return named


def test_docs_architecture_maps_every_module() -> None:
    """The packages' __init__ modules need not be listed (the map names the packages)."""
    named = _mapped_modules()
    modules = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"}
    assert not sorted(modules - named), f"docs/architecture.md's map does not name: {sorted(modules - named)}"
    assert not sorted(named - modules - {"__init__.py"}), f"docs/architecture.md's map names what is gone: {sorted(named - modules)}"


def test_the_tiers_hold_no_module_of_their_own() -> None:
    """A module or conftest directly in tests/unit/ or tests/integration/ would put that folder on
    sys.path, and its package-named folders (mindio/, mindspore/) would answer imports such as
    MindSpore's optional ``import mindio``. Tests live in a folder named after what they test."""
    stray = sorted(str(path.relative_to(ROOT)) for tier in ("unit", "integration")
                   for path in (TESTS / tier).glob("*.py"))
    assert not stray, f"move these into a folder of their tier: {stray}"
