class UserError(Exception):
    """A problem with what the user asked for or pointed at (a path, an option, a checkpoint).

    The command-line tools print its message on one line and exit non-zero, without a traceback,
    so the message must say what is wrong and what to do about it.
    """
