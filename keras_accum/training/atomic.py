"""Atomic file writes: a kill at any moment leaves the old file or the new one.

A file is written under a hidden temporary name in its own folder
(`.<name>.tmp-<pid>`), fsynced, renamed to its final name (a rename within a
folder is atomic) and the folder is fsynced. Leftovers of an interrupted
write keep the hidden name; `remove_partial` deletes them.

Every whole-file write of a run folder goes through here: checkpoints
(`checkpoints.py`), rewound logs (`logs.py`), and the harness's config.json,
final.json, metrics, plots and study and benchmark outputs.

Testing hook: the environment variable `KERAS_ACCUM_CHECKPOINT_HOOK` acts on
every write committed here, counted from 1 in each process:

* `sleep:<seconds>`: pause between writing the temporary file and renaming
  it (a window for an outside SIGKILL);
* `kill:<n>`: truncate the n-th temporary file to half its size and SIGKILL
  the process: a kill in the middle of a write;
* `after:<n>`: SIGKILL the process just after the n-th write is complete: a
  kill between two writes.
"""

import contextlib
import glob
import os
import signal
import time

HOOK = "KERAS_ACCUM_CHECKPOINT_HOOK"
_writes = [0]


def fsync_file(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(directory):
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path, suffix=""):
    """A hidden name beside `path` for writing it: `.<name>.tmp-<pid><suffix>`."""
    head, tail = os.path.split(str(path))
    return os.path.join(head, f".{tail}.tmp-{os.getpid()}{suffix}")


def is_partial(name):
    """Whether the file name `name` is a leftover of an interrupted write."""
    return name.startswith(".") and ".tmp-" in name


def remove_partial(directory):
    """Deletes leftovers of interrupted writes (hidden `*.tmp-*` names)."""
    for path in glob.glob(os.path.join(glob.escape(str(directory)), ".*.tmp-*")):
        try:
            os.remove(path)
        except OSError:
            pass


def _hook(path, done):
    """The testing hook (see the module docstring): before the rename of the
    write of `path` (done=False) and after it (done=True)."""
    action, _, arg = os.environ.get(HOOK, "").partition(":")
    if done:
        if action == "after" and _writes[0] == int(arg):
            os.kill(os.getpid(), signal.SIGKILL)
        return
    _writes[0] += 1
    if action == "sleep":
        time.sleep(float(arg))
    elif action == "kill" and _writes[0] == int(arg):
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)


def commit(temporary, final):
    """fsync `temporary`, rename it to `final`, fsync the folder (with the
    testing hook around the rename)."""
    fsync_file(temporary)
    _hook(temporary, done=False)
    os.replace(temporary, final)
    fsync_dir(os.path.dirname(str(final)))
    _hook(final, done=True)


@contextlib.contextmanager
def replacing(path, mode="w", **kwargs):
    """`with replacing(path) as f:` writes `f` under a temporary name and,
    when the block ends without an error, commits it to `path`; on an error
    the temporary file is removed and `path` is left as it was. `mode` and
    `kwargs` go to `open` ("w", "wb", newline="", ...)."""
    temporary = temporary_name(path)
    try:
        with open(temporary, mode, **kwargs) as f:
            yield f
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    commit(temporary, path)


def atomic_write_text(path, text):
    """Writes `text` to `path` atomically (temporary name, fsync, rename)."""
    with replacing(path) as f:
        f.write(text)
