"""The project's dependency arrows, read from the imports themselves (docs/design.md)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"generate", "bench", "evaluate"}
FOLDERS = {"models", "engine", "compression", "weights", "benchmark", "evaluation"}
MODULES = {"errors", "cli"}

# What each part of the project may import from the others (itself always).
ALLOWED = {
    "errors": set(),
    "models": {"errors"},
    "compression": {"errors", "models"},
    "engine": {"errors", "models", "compression"},
    "weights": {"errors", "models"},
    "cli": {"errors", "models", "compression", "engine", "weights"},  # which checkpoint, in which form and dtype
    "benchmark": {"errors", "cli", "models", "compression", "engine", "weights"},
    "evaluation": {"errors", "cli", "models", "compression", "engine", "weights"},
    "generate": {"errors", "cli", "models", "compression", "engine", "weights"},
    "bench": {"errors", "cli", "models", "compression", "engine", "weights", "benchmark"},
    "evaluate": {"errors", "cli", "models", "compression", "engine", "weights", "evaluation"},
}


def part_of(path: Path) -> str:
    relative = path.relative_to(REPO)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_parts(path: Path) -> set[str]:
    parts = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        parts.update(name.split(".")[0] for name in names)
    return parts & (FOLDERS | MODULES | SCRIPTS)


def project_files() -> list[Path]:
    files = [REPO / f"{name}.py" for name in SCRIPTS | MODULES]
    return files + [f for folder in FOLDERS for f in sorted((REPO / folder).rglob("*.py"))]


def test_every_import_follows_the_arrows():
    wrong = []
    for path in project_files():
        part = part_of(path)
        for imported in imported_parts(path) - {part}:
            if imported not in ALLOWED[part]:
                wrong.append(f"{path.relative_to(REPO)} imports {imported}")
    assert wrong == []


def test_the_rule_catches_a_back_arrow(tmp_path):
    """The reader itself: an import that runs back up is seen, as are both import forms."""
    source = tmp_path / "probe.py"
    source.write_text("import os\nfrom engine.generation import generate\nimport weights.loader as loader\nfrom . import sibling\n")
    assert imported_parts(source) == {"engine", "weights"}


def test_every_project_file_is_covered():
    found = {part_of(p) for p in REPO.glob("*.py")} | {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert found <= set(ALLOWED), "a new top-level part needs its arrows in ALLOWED"
