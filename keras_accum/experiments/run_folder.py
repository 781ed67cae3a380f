"""What a run folder holds, and which folders a new run may take.

A new run writes `checkpoints/config.json`, then `config.json` (each
atomically, see `keras_accum.training.atomic`), then logs, then a checkpoint
per epoch. A folder killed before its first checkpoint holds no training to
protect, so:

* the plain command (a new run) takes an empty folder, or one that holds
  only the files of a run that never reached a checkpoint (`unstarted`): it
  clears them and starts again. It refuses a folder with a checkpoint (pass
  --resume) or with any file a run does not write.
* `--resume` of a folder without a checkpoint starts the folder's run from
  the beginning: its config.json, or `checkpoints/config.json` when a kill
  came before config.json was written; with neither, it says to use the
  plain command.

Nothing here deletes a checkpoint or a file it does not know.
"""

import os
import pathlib
import re
import shutil

from keras_accum.training import atomic

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"
# The files a run writes before its first checkpoint, besides the two
# config.json files: the fit path's logs and the custom loop's folder.
LOGS = ("metrics.csv", "tensorboard", "loop")


def check_path(workdir):
    """Refuses (one line naming `workdir`) a run folder path that is a file
    or lies under one."""
    workdir = pathlib.Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise FileExistsError(f"workdir={str(workdir)!r} is a file, not a folder.")
    for parent in workdir.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(
                    f"`workdir` must be a folder path, but {str(parent)!r} is a file. "
                    f"Received: workdir={str(workdir)!r}"
                )
            break


def has_checkpoint(workdir):
    """Whether the folder holds a checkpoint of either path (an epoch_*.keras
    file, intact or not, or a ckpt-<n>.index of the custom loop)."""
    workdir = pathlib.Path(workdir)
    return any((workdir / CHECKPOINTS).glob("epoch_*.keras")) or any(
        (workdir / "loop" / CHECKPOINTS).glob("ckpt-*.index")
    )


def _is_log(path):
    """A TensorBoard event file, a loop log or an interrupted write's leftover."""
    name = path.name
    return atomic.is_partial(name) or "tfevents" in name


def _loop_leftover(path):
    """A file of the loop's folder written before its first checkpoint: its
    config and log, events, interrupted writes, and the data files of a
    checkpoint whose index was never written."""
    name = path.name
    if path.parent.name == CHECKPOINTS:
        match = re.fullmatch(r"(ckpt-\d+)\.(data-.*|replicas\.npz)", name)
        return atomic.is_partial(name) or (
            match is not None and not (path.parent / f"{match.group(1)}.index").exists()
        )
    return name in (CONFIG, "log.jsonl") or _is_log(path)


def unstarted(workdir):
    """Whether the folder holds only files of a run that never reached a
    checkpoint (see the module docstring); False for an empty folder."""
    workdir = pathlib.Path(workdir)
    if not (workdir / CHECKPOINTS).is_dir() or has_checkpoint(workdir):
        return False
    for entry in workdir.iterdir():
        name = entry.name
        if name == CHECKPOINTS:
            ok = all(
                f.is_file() and (f.name == CONFIG or atomic.is_partial(f.name))
                for f in entry.iterdir()
            )
        elif name in (CONFIG, "metrics.csv") or atomic.is_partial(name):
            ok = entry.is_file()
        elif name == "tensorboard":
            ok = all(f.is_dir() or _is_log(f) for f in entry.rglob("*"))
        elif name == "loop":
            ok = all(f.is_dir() or _loop_leftover(f) for f in entry.rglob("*"))
        else:
            ok = False
        if not ok:
            return False
    return True


def check_new(workdir):
    """Refuses a folder a new run may not take (one line); returns True when
    it holds an unstarted run to clear first (see `clear`)."""
    check_path(workdir)
    workdir = pathlib.Path(workdir)
    if not workdir.exists() or not any(workdir.iterdir()):
        return False
    if unstarted(workdir):
        return True
    if has_checkpoint(workdir):
        raise FileExistsError(
            f"workdir={str(workdir)!r} is not empty: it holds a run with checkpoints; pass "
            "--resume to continue that run or choose a new folder."
        )
    raise FileExistsError(
        f"workdir={str(workdir)!r} is not empty (it holds files that are not those of a "
        "run killed before its first checkpoint); pass --resume to continue that run or "
        "choose a new folder."
    )


def clear(workdir, configs=True):
    """Deletes the files of an unstarted run (after `unstarted` or when
    resuming a folder without a checkpoint): config.json first (with
    `configs`), so that a kill in the middle leaves a folder whose
    `--resume` runs one config or the other, never a mix; then the logs and
    leftovers. The `checkpoints/` folder and unknown files stay."""
    workdir = pathlib.Path(workdir)
    if configs:
        for path in (workdir / CONFIG, workdir / CHECKPOINTS / CONFIG):
            if path.exists():
                path.unlink()
    for name in LOGS:
        path = workdir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    atomic.remove_partial(workdir)
    atomic.remove_partial(workdir / CHECKPOINTS)
    atomic.fsync_dir(str(workdir))


def write_configs(workdir, text, which=(CHECKPOINTS + "/" + CONFIG, CONFIG)):
    """Writes the config `text` atomically, `checkpoints/config.json` (the
    config the checkpoints belong to, which catches an edited config.json)
    first, then `config.json`."""
    workdir = pathlib.Path(workdir)
    os.makedirs(workdir / CHECKPOINTS, exist_ok=True)
    atomic.fsync_dir(str(workdir))
    for name in which:
        atomic.atomic_write_text(str(workdir / name), text)
