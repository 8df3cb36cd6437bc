"""The project's dependency arrows, read from the imports themselves (docs/design.md)."""

import ast
import io
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"generate", "serve", "bench", "evaluate"}
FOLDERS = {"models", "kv", "engine", "compression", "weights", "server", "benchmark", "evaluation"}
MODULES = {"errors", "cli", "cli_features"}
LOWER = {"errors", "models", "kv", "compression", "engine", "weights"}

# What each part of the project may import from the others (itself always).
ALLOWED = {
    "errors": set(),
    "models": {"errors"},
    "kv": {"errors", "models"},
    "compression": {"errors", "models", "kv"},
    "engine": {"errors", "models", "kv", "compression"},
    "weights": {"errors", "models"},
    "cli": LOWER,  # which checkpoint, in which form and dtype; every feature's options
    "cli_features": LOWER | {"cli"},  # a feature built from its options
    "server": LOWER | {"cli"},
    "benchmark": LOWER | {"cli", "cli_features", "server"},  # server: a part of serve.py it times in-process (a grammar's mask)
    "evaluation": LOWER | {"cli"},
    "generate": LOWER | {"cli", "cli_features"},
    "serve": LOWER | {"cli", "cli_features", "server"},
    "bench": LOWER | {"cli", "cli_features", "benchmark"},
    "evaluate": LOWER | {"cli", "evaluation"},
}

# The core: what a plain run needs (a safetensors checkpoint, one prompt, no options). Its files
# import one another and nothing else of the project, at module level or inside a function: every
# feature reaches the engine as an object a caller hands in (docs/design.md).
CORE = {
    "errors", "models.config", "models.transformer", "models.rope", "models.linear", "kv", "kv.cache", "kv.compaction",
    "engine.decode", "engine.sampling", "engine.generation", "engine.stop_strings",
    "weights.safetensors_files", "weights.tokenizer", "weights.generation_config", "weights.loader",
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


def imported_modules(path: Path) -> set[str]:
    """Every project module a file imports, wherever the import stands."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}".replace(".", "/") + ".py" in PY_FILES else node.module for a in node.names)
    return {m for m in modules if m.split(".")[0] in FOLDERS | MODULES | SCRIPTS}


PY_FILES = {str(p.relative_to(REPO)) for p in REPO.rglob("*.py") if ".venv" not in p.parts}


def module_of(path: Path) -> str:
    relative = path.relative_to(REPO).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


def test_the_core_names_no_feature():
    core_files = [p for p in project_files() if module_of(p) in CORE]
    assert len(core_files) == len(CORE)
    outside = [f"{p.relative_to(REPO)} imports {m}" for p in core_files for m in imported_modules(p) if m not in CORE]
    assert outside == []


def test_the_core_rule_sees_an_import_inside_a_function(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from kv.paged import PagedKVCache\n    import compression.manager\n")
    assert imported_modules(source) == {"kv.paged", "compression.manager"}


def test_the_rule_catches_a_back_arrow(tmp_path):
    """The reader itself: an import that runs back up is seen, as are both import forms."""
    source = tmp_path / "probe.py"
    source.write_text("import os\nfrom engine.generation import generate\nimport weights.loader as loader\nfrom . import sibling\n")
    assert imported_parts(source) == {"engine", "weights"}


# The files that know how a cache lays out its slots (contiguous rows, or blocks through a table).
CACHE_FILES = {"kv/paged.py", "kv/flash.py"}


def names_used(path: Path) -> set[str]:
    """The identifiers of a file's code, comments and strings left out."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


def test_only_the_cache_files_know_of_a_block_table():
    """Everything else writes, reads, scores and compacts through the caches' verbs
    (write and attend for the model; keys, gather, compact and fit for the engine and compression)."""
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
