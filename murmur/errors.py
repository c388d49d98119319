"""The one error type a user sees as a single line: what went wrong and what to do."""


class MurmurError(Exception):
    """An error a user can act on. The CLI prints its message on one line (traceback with --debug)."""
