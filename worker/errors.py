"""Errors a user can cause, and the exit codes the commands give them.

Below the commands and the service alike: the embedded processes of ``pagestream up`` and the
benchmarks raise ``CommandError`` too, and the console script prints it as one line.
"""

from __future__ import annotations

EXIT_ERROR = 1  # the command failed: model not loadable, bad engine setting, ...
EXIT_USAGE = 2  # bad arguments (argparse's own code for usage errors)
EXIT_INTERRUPTED = 130


class CommandError(Exception):
    """An error the user caused: ``main`` prints it as one line and exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code
