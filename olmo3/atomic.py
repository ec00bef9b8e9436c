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
Orbax writes its own checkpoints atomically.
"""
from __future__ import annotations

import contextlib
import json
import os
import uuid
from typing import Any, Iterator


@contextlib.contextmanager
def replacing(path: str | os.PathLike, suffix: str = "") -> Iterator[str]:
    """Yields a temporary path beside `path` to write; renamed onto `path` when the block ends
    normally, removed when it raises. `suffix` ends the temporary name (".npz" for np.savez)."""
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{suffix}")
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


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` (UTF-8) at `path`, whole or not at all."""
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj: Any, **dump_kwargs) -> None:
    """json.dump(obj, **dump_kwargs) at `path`, whole or not at all (a trailing newline)."""
    write_text(path, json.dumps(obj, **dump_kwargs) + "\n")
