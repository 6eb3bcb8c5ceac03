"""The one exception type that reaches users as a one-line message.

Raise :class:`LyannaError` for anything the *user* can fix (a missing file, a bad
flag, a mismatched artifact); the CLIs print its message without a traceback and
exit non-zero. Programming errors stay ordinary exceptions.
"""


class LyannaError(Exception):
    """A problem with the user's input, stated in one line."""
