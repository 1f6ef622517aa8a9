"""FerryError: a problem the user can fix; the CLI prints it as one line and exits with code 2."""


class FerryError(Exception):
    """A user-facing error: the message names the problem and the fix, on one line."""
