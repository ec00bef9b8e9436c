"""How train.py, eval.py and convert.py end when something is wrong.

    exit 0   done
    exit 2   a user's error: a flag, a path or an input file, or a program that does not fit in
             device memory before the first step (or in its own first run: `first_run`). One
             line on stderr names the culprit and the fix; no traceback (`--verbosity=1` adds
             it). Never retried by --resume_until_done (olmo3/launch.py): a rerun cannot fix it.
    exit 3   the state became non-finite (NaN / inf loss, parameters or moments). No checkpoint
             of it was written; the line names the last good one. Not retried either: a rerun
             would resume into the same numbers.
    exit 1   anything else (a lost host, an I/O error mid-run, a bug): a traceback, retried.
    exit 143 train.py was sent SIGTERM (a preemption, a time limit) and saved a checkpoint of the
             step it was on first (olmo3/preemption.py). Retried, unless the launcher was sent
             SIGTERM, SIGINT or SIGHUP too. Any script sent SIGTERM elsewhere (preparing data,
             converting, evaluating) ends with one line and 143 too, what it was writing removed
             (`Stopped`: the default action ended it at once, temporaries left behind).
    exit 130 Ctrl-C (SIGINT): in train.py's loop, after saving the step it was on (a second
             Ctrl-C does not wait for that); elsewhere at once, with one line.

What counts as a user's error is decided by the exception's type, at the one place every
script ends (`run`): our own `UserError`, absl's flag and usage errors, and the built-in types
our input checks raise with a message naming the thing and the fix (ValueError, missing or
existing files). Inputs are checked before the first step; once a run has made progress
(`mark_running`, after train.py's first step) a missing or unreadable file is a fault of the
storage, not of the command (a flaky mount, a lost host), and is retried; a ValueError (bad data
deep in the corpus) stays final, as does a remote token file the server refuses for good
(data.storage.FinalRemoteError: a UserError). Out of device memory is the same: before the first step the
shapes that did not fit are the flags' (final, with the advice the script gave `advise`), after
it they ran before, so fragmentation or a leak is more likely and a fresh process may pass.
Except in a program's first run after the first step (`first_run`: the first held-out or
downstream evaluation): its shapes never fitted, and each rerun would train up to it and fail
there again, so it is final too, with that program's advice. A full disk is final whenever it
happens: someone has to free space first. A storage error that a retry can cure (a status code
like UNAVAILABLE or DEADLINE_EXCEEDED anywhere in the exception's chain, a stale NFS handle, a
dropped connection: `storage_error_kind`) is retried whenever it happens, also while resuming.
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import signal
import sys
import traceback
from typing import Any, Callable, Iterable, Iterator, NoReturn

from absl import app, flags, logging

USER_ERROR = 2
NON_FINITE = 3
# Training steps are int32 on the device: a step count or checkpoint label must stay below this.
STEP_LIMIT = 2**31


class UserError(ValueError):
    """A flag, path or input file is wrong; the message names it and the fix. `final`: raised
    where a storage failure was already judged incurable (data.storage.FinalRemoteError), so the
    status words of the storage error it wraps (UNAVAILABLE for an HTTP 308) do not make it a retry."""
    final = False


class NonFiniteError(FloatingPointError):
    """The training state or a loss is NaN / inf; the message names the last good checkpoint."""


class Stopped(BaseException):
    """SIGTERM outside train.py's loop, raised where the process is: the `finally` and `except
    BaseException` cleanups on the way out remove what was being written (a temporary directory,
    a half-written token file). A BaseException, as KeyboardInterrupt: no `except Exception`
    takes it for an error to handle."""


USER_ERRORS = (UserError, app.UsageError, flags.Error, ValueError, FileNotFoundError, FileExistsError,
               IsADirectoryError, NotADirectoryError, PermissionError)


_running = False
_advice = {"memory": "", "disk": ""}
_ran_once: set[str] = set()     # the `first_run` programs that have completed once
_oom_final = False              # an out-of-memory error came from a program's first run

# How XLA says a buffer did not fit: the CPU and GPU allocators at run time, the TPU compiler
# ("Ran out of memory in memory space hbm"), the TPU runtime ("Attempting to allocate ...").
_OUT_OF_MEMORY = ("out of memory", "ran out of memory", "attempting to allocate", "failed to allocate")
# A full disk or quota as the OS says it; TensorStore (Orbax's writer) wraps it in a ValueError.
_DISK_FULL = ("no space left on device", "disk quota exceeded")


# Status codes (TensorStore, Orbax, gRPC, object stores) of a storage failure that a retry can
# cure; Orbax re-raises an array read's failure as a plain Exception, its status in the cause.
_TRANSIENT = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED", "RESOURCE_EXHAUSTED")
_AMBIGUOUS = ("INTERNAL", "UNKNOWN")   # a bug or a hiccup: never evidence of damaged bytes
_CODE = re.compile(r"\b(" + "|".join(_TRANSIENT + _AMBIGUOUS) + r")\b:")
# A network filesystem or connection lost under us (NFS, Lustre, gcsfuse).
_NETWORK_ERRNOS = {errno.ESTALE, errno.ENOTCONN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED,
                   errno.EHOSTUNREACH, errno.ENETUNREACH}


def exception_chain(e: BaseException) -> Iterator[BaseException]:
    """`e`, then its cause (or context), and so on: the storage error under a library's wrapper."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def storage_error_kind(e: BaseException) -> str | None:
    """"transient" when the exception or one in its chain is a storage failure a retry can cure
    (a transient status code, a dropped connection, a stale network-filesystem handle),
    "ambiguous" for an INTERNAL / UNKNOWN status (a bug or a hiccup, not damaged bytes), else None."""
    kinds = set()
    for link in exception_chain(e):
        if isinstance(link, (ConnectionError, TimeoutError)) or (
                isinstance(link, OSError) and link.errno in _NETWORK_ERRNOS):
            return "transient"
        kinds.update(m.group(1) for m in _CODE.finditer(str(link)))
    if kinds & set(_TRANSIENT):
        return "transient"
    return "ambiguous" if kinds else None


def finite(v: float | None) -> bool:
    """A flag's number is given and neither NaN nor infinite."""
    return v is not None and math.isfinite(v)


def require(rules: list[tuple[str, Callable[[Any], bool], str]]) -> None:
    """Each (flag, test, what it must be) is checked as the flags are parsed, before any device
    work: a NaN, inf or impossible value ends the command with '--flag must be ...' (exit 2)
    instead of a poisoned run or a crash that the resubmission loop would retry."""
    for name, ok, want in rules:
        flags.register_validator(name, ok, message=f"--{name} must be {want}")


def refuse_given(names: Iterable[str], reason: str) -> None:
    """Flags a command would ignore, here: the first of `names` given (on the command line or in
    a flagfile) ends it with '--name <reason>' (exit 2), `{flag}` in `reason` spelling the flag.
    A flag that did nothing is worse than an error: the user believes it took effect."""
    for name in names:
        if flags.FLAGS[name].present:
            raise app.UsageError(f"--{name} " + reason.replace("{flag}", f"--{name}"))


def check_model(attention_impl: str, max_positions: int, seq_len: int, platform: str) -> None:
    """The model flags train.py and bench.py check once the config and the devices are known: the
    attention kernel (Config.attention) runs on `platform` with the Splash tile flags given
    (olmo3.attention.unusable_here), and --seq_len fits the model's max_position_embeddings
    (`max_positions`). Exit 2 otherwise."""
    from olmo3 import attention
    tiles = tuple(n for n in ("splash_block_q", "splash_block_kv") if n in flags.FLAGS and flags.FLAGS[n].present)
    problem = attention.unusable_here(attention_impl, platform, tiles)
    if problem is None and seq_len > max_positions:
        problem = f"--seq_len={seq_len} exceeds the model's max_position_embeddings={max_positions}"
    if problem:
        raise app.UsageError(problem)


def mark_running() -> None:
    """The run has made progress: from now on only UserError / NonFiniteError end it for good."""
    global _running
    _running = True


def advise(*, out_of_memory: str | None = None, disk_full: str | None = None) -> None:
    """What the script's user can change (the flags and their values) when a program does not fit
    in device memory, or the disk is full: appended to the line that ending prints."""
    if out_of_memory is not None:
        _advice["memory"] = out_of_memory
    if disk_full is not None:
        _advice["disk"] = disk_full


@contextlib.contextmanager
def first_run(name: str, out_of_memory: str) -> Iterator[None]:
    """Around each run of the program `name`. In its first run (until one completes) running out
    of device memory is a user's error even after the first step, ended with this advice instead
    of the step's: the shapes are the flags', and every rerun would fail at the same point."""
    global _oom_final
    if name in _ran_once:
        yield
        return
    try:
        yield
    except BaseException as e:
        if is_out_of_memory(e):
            _oom_final = True
            _advice["memory"] = f"{name}: {out_of_memory}"
        raise
    _ran_once.add(name)


def is_out_of_memory(e: BaseException) -> bool:
    """XLA ran out of device memory (host memory on a CPU backend), at compile or at run time."""
    text = _first_line(e).lower()
    # jaxlib 0.8's CPU client says it as INTERNAL: "... Out of memory allocating N bytes"
    return isinstance(e, RuntimeError) and (("resource_exhausted" in text and any(w in text for w in _OUT_OF_MEMORY))
                                            or "out of memory allocating" in text)


def is_disk_full(e: BaseException) -> bool:
    """A write found no space left (or the quota spent): a rerun cannot fix it until someone frees
    space, and each rerun would train up to a checkpoint it cannot write."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(e, (OSError, ValueError)) and any(words in str(e).lower() for words in _DISK_FULL)


def exit_status(e: BaseException) -> int:
    """The exit status for an exception that ended a script (see the table above)."""
    if isinstance(e, NonFiniteError):
        return NON_FINITE
    if is_out_of_memory(e):
        return 1 if _running and not _oom_final else USER_ERROR
    if is_disk_full(e) or (isinstance(e, UserError) and e.final):
        return USER_ERROR
    kind = storage_error_kind(e)
    if kind == "transient" or (_running and kind):
        return 1
    if isinstance(e, UserError):   # also an OSError that no retry can cure (data.storage.FinalRemoteError)
        return USER_ERROR
    if _running and isinstance(e, OSError):
        return 1
    return USER_ERROR if isinstance(e, USER_ERRORS) else 1


def one_line(e: BaseException) -> str:
    """The exception's message on one line, with the script's advice for a full disk; out of
    memory: XLA's first line (the rest lists the program's buffers, which --verbosity=1 prints)."""
    if is_out_of_memory(e):
        return _with_advice(f"out of device memory ({_first_line(e).rstrip('.')})", "memory")
    text = " ".join(str(e).split()) or type(e).__name__
    return _with_advice(f"disk full: {text}", "disk") if is_disk_full(e) else text


def _with_advice(line: str, kind: str) -> str:
    return " ".join(f"{line}: {_advice[kind]}".split()) if _advice[kind] else " ".join(line.split())


def _first_line(e: BaseException) -> str:
    return next((line for line in str(e).splitlines() if line.strip()), "")


def fail(prog: str, e: BaseException) -> NoReturn:
    """Print `<prog>: error: <one line>` (and the traceback if --verbosity >= 1) and exit."""
    status = exit_status(e)
    if status == 1 or _verbose():
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    print(f"{prog}: error: {one_line(e)}", file=sys.stderr, flush=True)
    sys.exit(status)


def _verbose() -> bool:
    try:
        return logging.get_verbosity() >= 1
    except Exception:  # noqa: BLE001 -- logging not set up yet
        return False


def refuse_positional(argv: list[str]) -> None:
    """Every setting is a --flag: a word left over after parsing ends the command (exit 2; `run`
    checks it before `main`). When it is a line of a flagfile (`lr=3e-4`, or a first line behind
    a byte-order mark, which absl keeps), the line names that file and what is wrong with the line."""
    if len(argv) <= 1:
        return
    arg = argv[1]
    held = next((name for name, lines in _flagfiles(sys.argv) if lines and arg in lines), None)
    fix = ("it begins with a byte-order mark: save the file as UTF-8 without BOM" if arg.startswith("\ufeff")
           else "write each setting as --name=value" if held else "every setting is a --flag")
    where = f", a line of --flagfile={held!r}" if held else ""
    raise app.UsageError(f"Unknown arguments {argv[1:]}{where}; {fix}")


def _flagfiles(argv: list[str]) -> Iterator[tuple[str, list[str] | None]]:
    """Each flagfile named in `argv`, or in a flagfile it names, once, with its stripped lines
    (None: not UTF-8 text); one that cannot be opened is left out."""
    names, seen = _flagfile_names(argv), set()
    while names:
        name = names.pop(0)
        if name in seen:
            continue
        seen.add(name)
        try:
            lines = _flagfile_lines(name)
        except UnicodeDecodeError:
            yield name, None
            continue
        except OSError:
            continue
        names += _flagfile_names(lines)
        yield name, lines


def _flagfile_lines(name: str) -> list[str]:
    """The stripped lines of flagfile `name`, opened as absl opens it ('~' expanded, as text);
    OSError / UnicodeDecodeError as open and read raise them."""
    with open(os.path.expanduser(name), encoding="utf-8") as f:
        return [line.strip() for line in f]


def _flagfile_loop(args: list[str], chain: tuple[str, ...] = ()) -> list[str] | None:
    """The chain of flagfiles (as written) from one named in `args` back to itself, or None. absl
    skips a flagfile already being read ("Hit circular flagfile dependency", on stderr), so a
    flagfile holding its own name ran on the defaults: the 7B model, on this host."""
    for name in _flagfile_names(args):
        name = os.path.expanduser(name)   # as absl opens it
        real = os.path.realpath(name)
        if real in (os.path.realpath(c) for c in chain):
            return [*chain, name]
        try:
            lines = [line for line in _flagfile_lines(name) if not line.startswith(("#", "//"))]
        except (OSError, UnicodeDecodeError):   # named by absl's own error, or _undecodable_flagfile
            continue
        loop = _flagfile_loop(lines, (*chain, name))
        if loop:
            return loop
    return None


def _undecodable_flagfile(argv: list[str]) -> str:
    """The first flagfile named in `argv`, or in a flagfile it names, that is not UTF-8 text ('' if
    none is)."""
    return next((name for name, lines in _flagfiles(argv) if lines is None), "")


def _flagfile_names(args: Iterable[str]) -> list[str]:
    """The files that `--flagfile=NAME` and `--flagfile NAME` (one dash or two) name in `args`."""
    args, out = list(args), []
    for i, a in enumerate(args):
        m = re.fullmatch(r"--?flagfile(?:=(.*))?", a)
        if m and m.group(1) is not None:
            out.append(m.group(1))
        elif m and i + 1 < len(args):
            out.append(args[i + 1])
    return out


def run(main: Callable[[list[str]], None]) -> None:
    """`absl.app.run(main)`, with flag-parsing errors and the errors above ending as one line; a
    positional argument is one of them (`refuse_positional`)."""
    prog = os.path.basename(sys.argv[0])

    def parse(argv: list[str]) -> list[str]:
        loop = _flagfile_loop(argv[1:])
        if loop:
            fail(prog, flags.Error(f"--flagfile={loop[-1]!r} includes itself ({' -> '.join(loop)}); absl skips such a "
                                   "file and the run would take the default flags. Fix: remove the --flagfile line "
                                   "that closes the loop"))
        try:
            return flags.FLAGS(argv)
        except flags.CantOpenFlagFileError as e:   # absl: "ERROR:: Unable to open flagfile: [Errno 2] ..."
            reason = str(e).removeprefix("ERROR:: ").removeprefix("Unable to open flagfile: ")
            m = re.fullmatch(r"\[Errno \d+\] (.*): ('.*')", reason)   # "[Errno 2] No such file ...: 'x.flags'"
            fail(prog, flags.Error(f"--flagfile={m.group(2) if m else ''}: {m.group(1) if m else reason}; give an "
                                   f"existing flagfile (a relative path is read from the current directory, "
                                   f"{os.getcwd()})"))
        except UnicodeDecodeError as e:   # absl reads each flagfile as text: a binary file given as one
            fail(prog, flags.Error(f"--flagfile={_undecodable_flagfile(argv)!r} is not UTF-8 text ({e.reason} at "
                                   f"byte {e.start}); give a text file of --flag=value lines"))
        except flags.Error as e:
            fail(prog, e)

    def guarded(argv: list[str]) -> None:
        try:
            refuse_positional(argv)   # no script takes one: `python -m data.prepare corpus/` ignored corpus/
            from olmo3 import runtime
            problem = runtime.xla_flags_problem()   # XLA would abort at start-up: exit 1, a C++ log line
            if problem:
                raise app.UsageError(problem)
            main(argv)
        except SystemExit:
            raise
        except (KeyboardInterrupt, Stopped) as e:   # a traceback, and from SIGTERM nothing at all
            if _verbose():
                traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
            sig = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM
            print(f"{prog}: stopped by {'Ctrl-C (SIGINT)' if sig == signal.SIGINT else 'SIGTERM'}",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            # Not sys.exit: the cleanups above have run, and the interpreter's own shutdown, with
            # XLA's threads mid-compile, ended in a segmentation fault (exit 139, retried).
            os._exit(128 + sig)
        except BaseException as e:  # noqa: BLE001 -- every ending goes through fail()
            fail(prog, e)

    signal.signal(signal.SIGTERM, _raise_stopped(os.getpid()))
    app.run(guarded, flags_parser=parse)


def _raise_stopped(owner: int):
    """The SIGTERM handler `run` installs: Stopped in the process that ran `run`. A forked worker
    inherits it and dies of the signal, as before (a pool's terminate sends its workers SIGTERM)."""
    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Stopped()
    return handler
