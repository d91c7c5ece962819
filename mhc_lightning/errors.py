"""The one base class for problems a user can fix (a bad input, a missing file, an unreachable server).

`mhc` prints such an error as one line naming the field or file and the fix, and exits with status 2,
instead of a traceback. Raise it (or a subclass) before anything is written: no run, no folder, no file.
"""

import re

EXIT_USER_ERROR = 2  # what argparse uses for usage errors, so scripts treat both alike


class UserError(Exception):
    """An input or environment problem the user can fix; the message is the whole story, shown as one line."""


class ConfigError(UserError, ValueError):
    """A configuration value that cannot work; the message names the key (e.g. data.batch_size) and what is allowed.

    Also a ValueError, so that code which builds the classes directly (tests, notebooks) can catch it as one.
    """


def one_line(text: str) -> str:
    """The message with its line breaks and runs of spaces folded into single spaces."""
    return re.sub(r"\s+", " ", str(text)).strip()
