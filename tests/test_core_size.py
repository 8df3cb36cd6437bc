"""How much of the project a run of generate.py loads: the project's files among the modules
loaded at the run's exit, and their lines (what a newcomer must read to follow that run).

The goal for the plain run (a safetensors checkpoint, one prompt, no options) and the default run
(the bundled model) is at most 2,500 lines (docs/design.md). The ceilings below are today's
counts: a change that loads more fails here; one that loads less lowers them.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLAIN_RUN_CEILING = 2_917
DEFAULT_RUN_CEILING = 3_407

# Runs generate.py in this process and, at exit, writes the project's loaded files and their lines.
COUNTER = """
import atexit, json, os, runpy, sys
root, out = sys.argv[1], sys.argv[2]

def count():
    files = {os.path.realpath(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
    ours = sorted(f for f in files if f.startswith(root + os.sep) and os.path.exists(f) and os.sep + ".venv" + os.sep not in f)
    with open(out, "w") as handle:
        json.dump({os.path.relpath(f, root): sum(1 for _ in open(f)) for f in ours}, handle)

atexit.register(count)
sys.argv = sys.argv[3:]
sys.path.insert(0, root)
runpy.run_path(os.path.join(root, "generate.py"), run_name="__main__")
"""


def lines_loaded(args: list[str], tmp_path: Path) -> dict[str, int]:
    out = tmp_path / "loaded.json"
    done = subprocess.run([sys.executable, "-c", COUNTER, str(ROOT), str(out), "generate.py", *args], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def test_the_plain_run_loads_no_more_than_today(chat_checkpoint, tmp_path):
    loaded = lines_loaded(["--checkpoint", str(chat_checkpoint), "--max-new-tokens", "2", "Hi"], tmp_path)
    assert "generate.py" in loaded and "models/transformer.py" in loaded  # the counter sees the project
    assert sum(loaded.values()) <= PLAIN_RUN_CEILING, f"{sum(loaded.values())} lines in {len(loaded)} files"


@pytest.mark.real
def test_the_default_run_loads_no_more_than_today(tmp_path):
    lines_loaded(["--max-new-tokens", "1", "Hi"], tmp_path)  # the first run imports the bundled model once
    loaded = lines_loaded(["--max-new-tokens", "2", "Hi"], tmp_path)
    assert sum(loaded.values()) <= DEFAULT_RUN_CEILING, f"{sum(loaded.values())} lines in {len(loaded)} files"
