"""The one exception family the CLI turns into a single line on stderr."""


class CortiqError(Exception):
    """Bad input or a failed precondition; the message names the file and the problem."""
