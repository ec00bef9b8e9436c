"""What a run prints: our own lines, and the libraries' only when they warn.

Orbax logs every step of an async save at INFO through absl (~45 lines per checkpoint: "Deferred
registration for item", "Scheduling D2H of 47 prioritized jax.Array", "Background save thread
started", ...), JAX logs "Unable to initialize backend 'tpu'" on every CPU host, and XLA's C++
side logs at INFO on accelerator hosts. Interleaved with the progress lines they bury what the
reader wants: the header, the progress, evaluations, checkpoints saved, warnings and errors.

By default (`quiet_library_logs()` at the top of a script's main):
    - INFO lines from our own files (train.py, eval.py, convert.py, bench.py, olmo3/, data/, ...)
      print as the bare message; WARNING and above from anyone print with absl's prefix
      (`W1201 00:35:06.4 ... file.py:12] ...`), so they stand out;
    - INFO lines from every other file (Orbax, JAX, ...) are dropped, and so are the few library
      warnings about what we asked for on purpose (BENIGN_WARNINGS);
    - XLA's C++ INFO logs are off (TF_CPP_MIN_LOG_LEVEL=1, unless the environment sets it).
In a run of several processes (`cluster.start`), processes other than 0 print WARNING and above
only (`quiet_other_processes`), after each one's own `cluster:` line: their INFO lines repeat
process 0's, once per host.
Passing absl's own `--verbosity` (`--verbosity=0` for every INFO line, `--verbosity=1` for
absl's debug lines too; `-v` is its short name) turns all of this off: every library's lines
come back with absl's usual prefix, for debugging.
"""
from __future__ import annotations

import logging as std_logging
import os
import sys

from absl import flags, logging

# Directories whose files are "ours": this package and its siblings in a checkout (data/,
# benchmarks/, tools/); top-level scripts are matched by the __main__ script's directory.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OUR_PACKAGES = tuple(os.path.join(_ROOT, d) + os.sep for d in ("olmo3", "data", "benchmarks", "tools"))


def is_ours(path: str) -> bool:
    """True for a source file of this project (a log record's `pathname`)."""
    path = os.path.abspath(path)
    if path.startswith(_OUR_PACKAGES):
        return True
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return main is not None and os.path.dirname(path) == os.path.dirname(os.path.abspath(main))


# Library warnings about what we asked for on purpose; each would print on every run.
BENIGN_WARNINGS = (
    "Given directory is read only",   # orbax, on every read-only CheckpointManager (eval, convert)
    "Type handler registry overriding type",   # orbax, when convert.py registers its lazy tensor
)


def raised_by_us(exc_info) -> bool:
    """A ValueError (a bad input) raised by this project's code: a library thread that ran our
    code (convert.py's lazy tensors in an Orbax writer) logs it with its traceback, then hands it
    to the main thread, which reports it as one line (olmo3/cli.py)."""
    error = exc_info[1] if exc_info else None
    if not isinstance(error, ValueError) or error.__traceback__ is None:
        return False
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return is_ours(tb.tb_frame.f_code.co_filename)


class _OursOrWarnings(std_logging.Filter):
    """Keeps our records at any level and everyone's at WARNING and above, but BENIGN_WARNINGS
    and Orbax's copy of a bad-input error our code raised in its thread (its futures hand the
    error to the main thread, which reports it)."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        if is_ours(record.pathname):
            return True
        return (record.levelno >= std_logging.WARNING and not str(record.msg).startswith(BENIGN_WARNINGS)
                and not (f"{os.sep}orbax{os.sep}" in record.pathname and raised_by_us(record.exc_info)))


_FILTER = _OursOrWarnings()


def library_logs_requested() -> bool:
    """The user asked for the libraries' logs (absl's --verbosity / -v on the command line)."""
    return flags.FLAGS.is_parsed() and flags.FLAGS["verbosity"].present > 0


def quiet_library_logs() -> bool:
    """Show our lines only (see the module docstring). Call before JAX starts a backend (the C++
    log level is read then). Returns False, changing nothing, when --verbosity was given."""
    if library_logs_requested():
        return False
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")   # C++: WARNING and above
    handler = logging.get_absl_handler()
    if _FILTER not in handler.filters:
        handler.addFilter(_FILTER)
    if flags.FLAGS.is_parsed() and not flags.FLAGS["showprefixforinfo"].present:
        flags.FLAGS.showprefixforinfo = False   # our INFO lines: the message alone
    return True


class _WarningsOnly(std_logging.Filter):
    """Keeps WARNING and above: OLMo-core's default log filter, LogFilterType.rank0_only, on every
    rank but 0 (olmo_core/utils.py setup_logging's rank0_filter: `record.levelno > logging.INFO`)."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return record.levelno > std_logging.INFO


_WARNINGS_ONLY = _WarningsOnly()


def quiet_other_processes(process_index: int) -> bool:
    """On a process other than 0, drop INFO lines (a 64-host job's log would show each 64 times)
    and keep warnings and errors: one host's warning still shows. Call once the processes have
    joined (olmo3.cluster.start). Returns False, changing nothing, on process 0 and when
    --verbosity was given."""
    if process_index == 0 or library_logs_requested():
        return False
    handler = logging.get_absl_handler()
    if _WARNINGS_ONLY not in handler.filters:
        handler.addFilter(_WARNINGS_ONLY)
    return True
