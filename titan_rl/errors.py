"""The errors a run can end with, and how they reach the console.

A `UserError` (a bad config value, run dir, task, prompt, checkpoint folder or GGUF file) is the
user's to fix: one line on stderr, exit code 2, no traceback. A `RunStopped` is the run
refusing to go on to keep bad values out of the weights (a non-finite loss, an engine
that would not compute the trainer's bits): one line, exit code 1. Anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

import sys


class UserError(Exception):
    """Bad input from the user (or the user's task code): one line, exit code 2."""


class ConfigError(UserError, ValueError):
    """A config key with a value it may not take (named with the key, the value and what is allowed)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint folder or state dict that does not match the model it is loaded into."""


class ConversionError(UserError, ValueError):
    """A GGUF file the converter refuses (unreadable, not llama, a type transformers cannot
    dequantize, tensors that do not match its metadata) or an output folder it may not write."""


class RunStopped(Exception):
    """The run stopped itself to keep bad values out of the weights: one line, exit code 1."""


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def report_error(e: BaseException) -> int:
    """Print a UserError or RunStopped as one line on stderr and return its exit code."""
    prefix = "config error" if isinstance(e, ConfigError) else "error"
    print(f"{prefix}: {one_line(e)}", file=sys.stderr, flush=True)
    return 1 if isinstance(e, RunStopped) else 2


# what an entry point catches and reports (everything else is a bug: traceback)
REPORTED = (UserError, RunStopped)
