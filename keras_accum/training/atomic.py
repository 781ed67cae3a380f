"""Atomic file writes: a kill at any moment leaves the old file or the new one.

Every whole-file write of a run folder goes through here. A file is written
as `.<name>.tmp-<pid>` in its folder, fsynced, renamed and the folder
fsynced. The testing hook `KERAS_ACCUM_CHECKPOINT_HOOK` (`sleep:<s>`,
`kill:<n>`, `after:<n>`) is described in docs/guides/custom_loop.md.
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
    """The testing hook, before (done=False) and after the rename of `path`."""
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
    """fsync `temporary`, rename it to `final`, fsync the folder."""
    fsync_file(temporary)
    _hook(temporary, done=False)
    os.replace(temporary, final)
    fsync_dir(os.path.dirname(str(final)))
    _hook(final, done=True)


@contextlib.contextmanager
def replacing(path, mode="w", **kwargs):
    """`with replacing(path) as f:` writes a temporary file, committed to `path`
    if the block succeeds and removed if not; `mode`, `kwargs` go to `open`."""
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
