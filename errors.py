"""The one error type every layer raises for bad input, and how the command-line tools report it."""

import sys
from collections.abc import Callable


class UserError(Exception):
    """A problem with what the user asked for or pointed at (a path, an option, a checkpoint).

    The command-line tools print its message on one line and exit non-zero, without a traceback,
    so the message must say what is wrong and what to do about it.
    """


def run_command(body: Callable[[], None]) -> int:
    """A command-line tool's exit code: 0 when body returns; a UserError prints its one line
    to stderr and gives 2; Ctrl-C gives 130 without a traceback."""
    try:
        body()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
