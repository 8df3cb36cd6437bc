"""The project's dependency arrows, read from the imports themselves (docs/design.md)."""

import ast
import io
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"generate", "serve", "bench", "evaluate"}
FOLDERS = {"models", "engine", "compression", "weights", "server", "benchmark", "evaluation"}
MODULES = {"errors", "cli"}

# What each part of the project may import from the others (itself always).
ALLOWED = {
    "errors": set(),
    "models": {"errors"},
    "compression": {"errors", "models"},
    "engine": {"errors", "models", "compression"},
    "weights": {"errors", "models"},
    "cli": {"errors", "models", "compression", "engine", "weights"},  # which checkpoint, in which form and dtype
    "server": {"errors", "cli", "models", "compression", "engine", "weights"},
    "benchmark": {"errors", "cli", "models", "compression", "engine", "weights"},
    "evaluation": {"errors", "cli", "models", "compression", "engine", "weights"},
    "generate": {"errors", "cli", "models", "compression", "engine", "weights"},
    "serve": {"errors", "cli", "models", "compression", "engine", "weights", "server"},
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


# The files that know how a cache lays out its slots (contiguous rows, or blocks through a table).
CACHE_FILES = {"engine/kv_cache.py", "engine/paged_cache.py", "models/pages.py", "models/kv_layers.py", "models/flash_attention.py"}


def names_used(path: Path) -> set[str]:
    """The identifiers of a file's code, comments and strings left out."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


def test_only_the_cache_files_know_of_a_block_table():
    """Everything else writes, reads, scores and compacts through the caches' verbs
    (models/kv_layers.py for the model; keys, all_keys, compact for compression)."""
    knowing = [str(p.relative_to(REPO)) for p in project_files() if "block_table" in names_used(p)]
    assert sorted(set(knowing) - CACHE_FILES) == []


def test_the_block_table_rule_reads_code_not_comments(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text('"""a block_table docstring"""\n# block_table\nx = "block_table"\n')
    assert "block_table" not in names_used(source)
    source.write_text("if cache.block_table is None:\n    pass\n")
    assert "block_table" in names_used(source)


def test_every_project_file_is_covered():
    found = {part_of(p) for p in REPO.glob("*.py")} | {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert found <= set(ALLOWED), "a new top-level part needs its arrows in ALLOWED"
