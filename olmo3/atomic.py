"""Files written whole or not at all: a temporary sibling, flushed to disk, renamed over the target.

    with replacing("out/report.csv") as tmp:      # tmp = "out/.report.csv.<pid>.<rand>.tmp"
        write_the_file(tmp)                       # any writer that takes a path
    # success: tmp is fsynced and renamed onto out/report.csv (rename is atomic on POSIX)
    # an exception: tmp is removed, out/report.csv is untouched, the exception propagates

Why one helper: a reader of the target (another host, a resumed run, the user) sees the old file
or the new one, never half of one, and a failed write leaves nothing behind. The temporary name
- sits in the target's directory: a rename across file systems is not atomic;
- starts with a dot: `*.npy` / `*.npz` globs over a data directory skip it;
- is unique per process and call: hosts sharing a directory may write the same file at once
  (data/packed.py's cache), and the last rename wins with a whole file;
- is created by the writer itself, so it gets the process's umask (tempfile.mkstemp would make
  it 0600, unreadable by the rest of a cluster's users);
- keeps `suffix` last: np.savez appends ".npz" to a name that does not end with it.
The data is fsynced before the rename, so a machine crash right after it cannot leave an empty
file under the target's name (ext4 and XFS may otherwise commit the rename before the data).

Directories (converted checkpoints, SFT token files) use `olmo3.checkpoint.new_directory`;
Orbax writes its own checkpoints atomically. Both rename a whole directory into place, which not
every filesystem does: `check_directory` tries it once, before a run starts.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import uuid
from typing import Any, Iterator

from olmo3.cli import UserError


@contextlib.contextmanager
def replacing(path: str | os.PathLike, suffix: str = "") -> Iterator[str]:
    """Yields a temporary path beside `path` to write; renamed onto `path` when the block ends
    normally, removed when it raises. `suffix` ends the temporary name (".npz" for np.savez)."""
    path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = temporary_name(path, suffix)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def temporary_name(path: str | os.PathLike, suffix: str = "") -> str:
    """A name beside `path` for writing it: hidden, and unique per process and call (a process id
    alone is not: containers on several hosts all run as pid 1)."""
    directory, name = os.path.split(os.fspath(path))
    return os.path.join(directory, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{suffix}")


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` (UTF-8) at `path`, whole or not at all."""
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj: Any, **dump_kwargs) -> None:
    """json.dump(obj, **dump_kwargs) at `path`, whole or not at all (a trailing newline)."""
    write_text(path, json.dumps(obj, **dump_kwargs) + "\n")


# Said when a directory cannot be renamed. Cloud Storage FUSE renames a folder atomically in a
# bucket with hierarchical namespace; in a flat bucket it copies and deletes every object, and only
# for folders with fewer descendants than the mount option rename-dir-limit, which defaults to 0
# (gcsfuse docs/semantics.md, `--rename-dir-limit`).
RENAME_ADVICE = ("checkpoints are written into a temporary directory that is then renamed into place, so the "
                 "run directory must be on a filesystem that renames directories: a local or shared filesystem, "
                 "or a Cloud Storage FUSE mount of a bucket with hierarchical namespace (or of a flat bucket "
                 "mounted with rename-dir-limit=200000, as launch/tpu_jobset.yaml does)")


def existing_directory(path: str | os.PathLike, flag: str, given: str | None = None) -> str:
    """`path`, or its nearest existing ancestor: where a directory `path` will be made. Stops with
    one line (UserError naming `flag` and its value, `given` or `path`) when that is a file, or when
    `path` starts with a '~' nobody expanded (the shell does not, after --flag=, nor in a flagfile):
    it made a directory named '~' in the working directory."""
    said = f"{flag}={given if given is not None else os.fspath(path)!r}: "
    if os.fspath(path).startswith("~") or (given or "").startswith("~"):   # `given`: before an abspath
        raise UserError(f"{said}'~' is not expanded after --flag= or in a flagfile; write the whole path "
                        f"({os.path.expanduser(given if (given or '').startswith('~') else os.fspath(path))})")
    where = os.path.abspath(os.fspath(path))
    while not os.path.exists(where):
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise UserError(f"{said}{where} is a file, not a directory; move the file away or give another path")
    return where


def _probe_name() -> str:
    """A probe's name, unique per host and process: every host of a job may probe at once."""
    return f".olmo3-probe-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def check_writable(path: str | os.PathLike, flag: str, given: str | None = None) -> None:
    """Stop with one line (UserError naming `flag`) unless files can be written whole where the
    directory `path` is, or will be: a probe file is written, renamed (as write_text does) and
    removed in `path`, else in its nearest existing ancestor. For outputs that are files only; a
    directory of checkpoints needs check_directory."""
    said = f"{flag}={given if given is not None else os.fspath(path)!r}: "
    where = existing_directory(path, flag, given)
    probe = os.path.join(where, _probe_name())
    try:
        try:
            with open(probe, "w") as f:
                f.write("olmo3")
            os.replace(probe, probe + "-renamed")
        finally:
            for p in (probe, probe + "-renamed"):
                with contextlib.suppress(OSError):
                    os.remove(p)
    except OSError as e:
        raise UserError(f"{said}cannot write a file in {where} ({e.strerror or e}); give a directory this process "
                        "can write") from e


def check_directory(path: str | os.PathLike, flag: str, given: str | None = None) -> None:
    """Stop with one line (UserError naming `flag` and its value, `given` or `path`) unless
    directories can be made and renamed where `path` is, or will be: in `path` itself, else in
    its nearest existing ancestor, a probe directory holding one file is created, renamed and
    removed. Checkpoints (Orbax's and `olmo3.checkpoint.new_directory`'s) need exactly that; a
    filesystem that refuses it would otherwise end a run at its first save, after the first
    save interval's steps. The probe's name is unique per host and process, so every host of a
    job may probe at once."""
    said = f"{flag}={given if given is not None else os.fspath(path)!r}: "
    where = existing_directory(path, flag, given)
    name = _probe_name()
    made, renamed = os.path.join(where, name), os.path.join(where, name + "-renamed")
    step = "create a directory"
    try:
        os.mkdir(made)
        try:
            step = "write a file"
            with open(os.path.join(made, "probe"), "w") as f:
                f.write("olmo3")
            step = "rename a directory"
            os.rename(made, renamed)
            with open(os.path.join(renamed, "probe")) as f:
                if f.read() != "olmo3":
                    raise OSError(f"{renamed}/probe does not read back after the rename")
        finally:
            for d in (made, renamed):
                shutil.rmtree(d, ignore_errors=True)
    except OSError as e:
        reason = e.strerror or str(e)
        said += f"cannot {step} in {where} ({reason}); "
        if step == "rename a directory":
            raise UserError(said + RENAME_ADVICE) from e
        raise UserError(said + "give a directory this process can write") from e
