"""The one base class for problems a user can fix (a bad input, a missing file, an unreachable server).

`mhc` prints such an error as one line naming the field or file and the fix, and exits with status 2,
instead of a traceback. Raise it (or a subclass) before anything is written: no run, no folder, no file.
"""


class UserError(Exception):
    """An input or environment problem the user can fix; the message is the whole story, shown as one line."""
