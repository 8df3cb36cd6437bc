"""The decode step saved as an AOTInductor package (engine/saved_step.py): the eager tokens, one
package per structure of blocks, and a later session that loads it instead of building it."""

import os
import subprocess
import sys
from pathlib import Path

import torch

import engine.saved_step as saved_step
import engine.speculative as speculative
from engine.options import RunOptions, generate, open_session
from engine.saved_step import Saved
from kv.cache import KVCache
from weights.loader import load_model

CPU = torch.device("cpu")


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


def test_the_saved_step_gives_the_eager_tokens_and_is_built_once(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(saved_step, "inductor_cache", lambda: str(tmp_path))
    built = []
    build = saved_step.build_package
    monkeypatch.setattr(saved_step, "build_package", lambda path, *rest: built.append(path) or build(path, *rest))
    model = load_model(tiny_checkpoint("qwen2")[0], torch.float32, CPU)
    prompts = prompts_of([9, 30, 17], seed=1)

    eager = generate(model, prompts, 12, eos_ids=frozenset())
    assert not saved_step.saved_already(model, len(prompts))
    first = generate(model, prompts, 12, eos_ids=frozenset(), options=RunOptions(compile=True))
    assert first.tokens == eager.tokens
    assert len(built) == 1 and built[0].is_file()  # every group of the model runs the one package
    assert saved_step.saved_already(model, len(prompts)) and not saved_step.saved_already(model, 2)

    # A new session, of another cache size and prompt lengths: the package is loaded, not built.
    later = generate(model, prompts_of([5, 40, 3], seed=2), 20, eos_ids=frozenset(), options=RunOptions(compile=True))
    assert later.tokens == generate(model, prompts_of([5, 40, 3], seed=2), 20, eos_ids=frozenset()).tokens
    assert len(built) == 1


def test_only_the_plain_step_is_saved(tiny_checkpoint):
    """A cache of another kind or a KV policy keeps torch.compile's groups, which serve them all."""
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    plain = open_session(model, 1, 32, RunOptions(compile=True), eos_ids=frozenset())
    assert isinstance(plain.runner, Saved) and type(plain.cache) is KVCache
    quantized = open_session(model, 1, 32, RunOptions(compile=True, kv_dtype="int8"), eos_ids=frozenset())
    assert not isinstance(quantized.runner, Saved)


def test_a_new_process_runs_the_saved_step_without_importing_the_compiler(tiny_checkpoint, tmp_path):
    """Loading a saved package needs neither dynamo nor inductor, whose imports cost a second."""
    script = (
        "import sys, torch; from pathlib import Path; from weights.forms import load_model; from engine.generation import generate\n"
        "from engine.saved_step import Saved, saved_already\n"
        f"model = load_model(Path({str(tiny_checkpoint('llama')[0])!r}), torch.float32, torch.device('cpu'))\n"
        "with torch.inference_mode(): out = generate(model, [[5, 6, 7]], 6, eos_ids=frozenset(), runner=Saved()).tokens\n"
        "print(out, saved_already(model, 1), 'torch._inductor' in sys.modules, 'torch._dynamo' in sys.modules)\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent) for _ in range(2)]
    assert all(done.returncode == 0 for done in runs), runs[-1].stderr[-2000:]
    first, later = (done.stdout.strip().rsplit(" ", 3) for done in runs)
    assert first[1:3] == ["True", "True"]  # built: the compiler was imported
    assert later == [first[0], "True", "False", "False"]  # loaded: the same tokens, no compiler


class Guesses:
    """Drafts the last token again, k times: a verify every round, its drafts mostly rejected."""

    def draft(self, history: list[int], k: int) -> tuple[list[int], int]:
        return [history[-1]] * k, 1


def test_speculation_verifies_with_a_saved_package_of_its_own_and_gives_the_plain_tokens(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(saved_step, "inductor_cache", lambda: str(tmp_path))
    monkeypatch.setattr(speculative, "PromptLookup", Guesses)
    monkeypatch.setattr(speculative.Widths, "choose", lambda self, n_drafts, match, room: max((j for j in self.allowed if j <= room), default=0))
    model = load_model(tiny_checkpoint("qwen2")[0], torch.float32, CPU)
    prompt = prompts_of([13], seed=3)
    plain = generate(model, prompt, 16, eos_ids=frozenset()).tokens
    result = generate(model, prompt, 16, eos_ids=frozenset(), options=RunOptions(compile=True, speculation=speculative.Speculation(max_draft=2)))
    assert result.tokens == plain and result.speculation.rounds > 3
    assert len(list((tmp_path / "saved_steps").glob("*.pt2"))) == 2  # the step's and the verify's (3 tokens fed)


def test_a_damaged_package_is_built_again(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(saved_step, "inductor_cache", lambda: str(tmp_path))
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    prompts = prompts_of([7], seed=4)
    eager = generate(model, prompts, 8, eos_ids=frozenset()).tokens
    assert generate(model, prompts, 8, eos_ids=frozenset(), options=RunOptions(compile=True)).tokens == eager
    (package,) = (tmp_path / "saved_steps").glob("*.pt2")
    package.write_bytes(package.read_bytes()[:1000])  # cut short
    assert generate(model, prompts, 8, eos_ids=frozenset(), options=RunOptions(compile=True)).tokens == eager
    assert package.stat().st_size > 1000
