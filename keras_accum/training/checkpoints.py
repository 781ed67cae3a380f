"""Atomic, verified checkpoint files and logs that rewind with them.

Every file is written under a temporary name in its own folder, fsynced,
checked, and only then renamed to its final name (a rename within a folder is
atomic), and the folder is fsynced. A process killed at any moment therefore
leaves either the previous checkpoint or the new one complete, never a
truncated file under a checkpoint's name; leftovers of an interrupted write
are hidden names (`.<name>.tmp-<pid>...`) that the next save or resume
deletes. Older checkpoints are deleted only after the new one is complete.

On resume, the newest checkpoint that passes verification is used; the ones
skipped (truncated by a crash or disk, or foreign files under a checkpoint's
name) are named in a warning. When none passes, `CheckpointError` names them.

Two formats:

* `.keras` files (the `model.fit` path): `save_keras` / `newest_keras`. The
  zip also carries `keras_accum_state.json`, the caller's extra state (data
  position, callbacks' state) saved atomically with the weights.
* `tf.train.Checkpoint` prefixes `ckpt-<n>` (the custom loop):
  `write_tf` / `newest_tf`. The data files are renamed first and the index
  file last, so a checkpoint exists only once all of it does.

Logs rewind with the checkpoint: see `keras_accum.training.logs`.

The file helpers (temporary names, fsync, commit, the testing hook
`KERAS_ACCUM_CHECKPOINT_HOOK`) are in `keras_accum.training.atomic`; their
names stay importable from here for one release.
"""

import glob
import io
import json
import os
import re
import warnings
import zipfile

import keras
import numpy as np
import tensorflow as tf

from keras_accum.training.atomic import (  # noqa: F401 (moved there; kept here for one release)
    HOOK,
    atomic_write_text,
    commit,
    fsync_dir,
    fsync_file,
    remove_partial,
    temporary_name,
)

STATE_ENTRY = "keras_accum_state.json"
REPLICAS_ENTRY = "keras_accum_replicas.npz"
REPLICAS_SUFFIX = ".replicas.npz"


class CheckpointError(ValueError):
    """A checkpoint file is truncated, foreign or unreadable."""


def _newest_intact(candidates, verify, what):
    """The first of `candidates` (newest first) that `verify` accepts, or
    None when there are none; warns about the ones skipped and raises
    `CheckpointError` naming them all when none is intact."""
    skipped = []
    for path in candidates:
        try:
            verify(path)
        except CheckpointError as error:
            skipped.append(str(error))
            continue
        if skipped:
            warnings.warn(
                f"Skipped {len(skipped)} unusable {what}(s), resuming from "
                f"{path}: " + "; ".join(skipped),
                stacklevel=3,
            )
        return path
    if skipped:
        raise CheckpointError(f"No intact {what} to resume from: " + "; ".join(skipped))
    return None


# -- replica-local state ----------------------------------------------------------


def _replica_local(variables):
    """name -> per-replica components of the sync-on-read variables among
    `variables` (keras or tf variables), on one worker."""
    found = {}
    for variable in variables:
        value = getattr(variable, "value", variable)
        if not isinstance(value, tf.distribute.DistributedValues):
            continue
        if value.synchronization != tf.VariableSynchronization.ON_READ:
            continue
        found[getattr(variable, "path", value.name)] = value.values
    return found


def replica_arrays(variables):
    """Each replica's part of the replica-local (sync-on-read) variables
    among `variables`, stacked: name -> array [replicas, ...].

    A checkpoint stores such a variable as the sum of its parts and a
    restore splits that sum evenly; the parts then add up to the same total
    but round differently afterwards. Saving the parts as well makes a
    resume bit-exact. Single-worker strategies only: under a multi-worker
    strategy the other workers' parts are not here (returns {})."""
    found = _replica_local(variables)
    for variable in variables:
        value = getattr(variable, "value", variable)
        if isinstance(value, tf.distribute.DistributedValues):
            if value.distribute_strategy.num_replicas_in_sync != len(value.values):
                return {}  # other workers hold some of the replicas
    return {name: np.stack([part.numpy() for part in parts]) for name, parts in found.items()}


def assign_replica_arrays(variables, arrays):
    """Assigns the parts saved by `replica_arrays` back, where the variable
    and the replica count match; returns the number of variables set."""
    assigned = 0
    for name, parts in _replica_local(variables).items():
        saved = arrays.get(name)
        if saved is None or saved.shape[0] != len(parts):
            continue
        for part, value in zip(parts, saved):
            part.assign(value)
        assigned += 1
    return assigned


def save_replica_arrays(path, variables):
    """Writes `replica_arrays(variables)` to the .npz file `path` (not
    atomically: the caller commits it); returns False when there are none."""
    arrays = replica_arrays(variables)
    if not arrays:
        return False
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return True


# -- .keras files (model.fit) -----------------------------------------------------


def verify_keras(path):
    """Raises `CheckpointError` naming `path` unless it is a complete
    `.keras` archive (a zip with intact members, config and weights)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as error:
        raise CheckpointError(
            f"{path} is not a complete .keras checkpoint (truncated or not a zip: {error})"
        ) from None
    if bad is not None:
        raise CheckpointError(f"{path} is a damaged .keras checkpoint (bad member {bad!r})")
    missing = {"config.json", "model.weights.h5"} - names
    if missing:
        raise CheckpointError(
            f"{path} is not a Keras model checkpoint (no {', '.join(sorted(missing))})"
        )


def save_keras(model, path, state=None):
    """Saves `model` (with its optimizer) to the `.keras` file `path`
    atomically. The archive also holds `state` (JSON-serialisable) and each
    replica's part of the optimizer's replica-local variables (see
    `replica_arrays`), restored by `load_keras`."""
    # Keras insists on the .keras suffix, so the temporary name keeps it.
    temporary = temporary_name(path, ".keras")
    model.save(temporary)
    optimizer = getattr(model, "optimizer", None)
    arrays = replica_arrays(optimizer.variables) if optimizer is not None else {}
    with zipfile.ZipFile(temporary, "a") as archive:
        if state is not None:
            archive.writestr(STATE_ENTRY, json.dumps(state))
        if arrays:
            buffer = io.BytesIO()
            np.savez(buffer, **arrays)
            archive.writestr(REPLICAS_ENTRY, buffer.getvalue())
    verify_keras(temporary)
    commit(temporary, path)


def load_keras(path):
    """(model, state) from a `.keras` checkpoint written by `save_keras`
    (or by Keras: state None). Call inside the strategy's scope. A file
    Keras cannot load raises `CheckpointError` naming it."""
    verify_keras(path)
    try:
        model = keras.models.load_model(path)
    except Exception as error:  # Keras raises many types for a foreign file
        raise CheckpointError(f"{path} could not be loaded as a Keras model: {error}") from None
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        state = json.loads(archive.read(STATE_ENTRY)) if STATE_ENTRY in names else None
        if REPLICAS_ENTRY in names and getattr(model, "optimizer", None) is not None:
            with np.load(io.BytesIO(archive.read(REPLICAS_ENTRY))) as arrays:
                assign_replica_arrays(model.optimizer.variables, dict(arrays))
    return model, state


def newest_keras(directory, pattern="epoch_*.keras"):
    """The newest intact checkpoint matching `pattern` in `directory` (by
    name, newest last), or None; see `_newest_intact`."""
    remove_partial(directory)
    found = sorted(glob.glob(os.path.join(glob.escape(str(directory)), pattern)), reverse=True)
    return _newest_intact(found, verify_keras, ".keras checkpoint")


# -- tf.train.Checkpoint prefixes (the custom loop) -----------------------------


def tf_checkpoints(directory):
    """Prefixes `directory/ckpt-<n>` that have an index file, newest first."""
    found = []
    for index in glob.glob(os.path.join(glob.escape(str(directory)), "ckpt-*.index")):
        match = re.fullmatch(r"ckpt-(\d+)\.index", os.path.basename(index))
        if match:
            found.append((int(match.group(1)), index[: -len(".index")]))
    return [prefix for _, prefix in sorted(found, reverse=True)]


def verify_tf(prefix):
    """Reads every tensor of the checkpoint `prefix` (checksums included)
    and its replica parts if any; raises `CheckpointError` naming it when
    that fails."""
    try:
        reader = tf.train.load_checkpoint(prefix)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
        if os.path.exists(prefix + REPLICAS_SUFFIX):
            with np.load(prefix + REPLICAS_SUFFIX) as arrays:
                for name in arrays.files:
                    arrays[name]
    except Exception as error:  # noqa: BLE001 (any read failure: unusable)
        reason = str(error).strip().splitlines()[0][:200]
        raise CheckpointError(
            f"{prefix} is not a complete checkpoint (truncated or foreign: {reason})"
        ) from None


def newest_tf(directory):
    """The newest intact `ckpt-<n>` prefix in `directory`, or None."""
    remove_partial(directory)
    return _newest_intact(tf_checkpoints(directory), verify_tf, "checkpoint")


def restore_tf(checkpoint, prefix, variables=()):
    """Restores `checkpoint` from `prefix` (all of it must match: another
    model or optimizer raises `CheckpointError` naming the file), then the
    replica parts of `variables` saved beside it."""
    try:
        checkpoint.restore(prefix).assert_consumed()
    except AssertionError as error:
        reason = str(error).strip().splitlines()[0][:300]
        raise CheckpointError(
            f"{prefix} does not match this model and optimizer ({reason})"
        ) from None
    if os.path.exists(prefix + REPLICAS_SUFFIX):
        with np.load(prefix + REPLICAS_SUFFIX) as arrays:
            assign_replica_arrays(variables, dict(arrays))


def write_tf(checkpoint, directory, number, max_to_keep=3, variables=()):
    """Writes `checkpoint` as `directory/ckpt-<number>` atomically and keeps
    the newest `max_to_keep`; returns the prefix. Each replica's part of the
    replica-local `variables` goes beside it (`ckpt-<n>.replicas.npz`).

    The checkpoint goes to a hidden temporary prefix; its data files are
    fsynced and renamed first, its index last (the index is what makes a
    checkpoint visible). The `checkpoint` state file is updated too, so
    `tf.train.latest_checkpoint` works on the folder.
    """
    os.makedirs(directory, exist_ok=True)
    remove_partial(directory)
    prefix = os.path.join(str(directory), f"ckpt-{number}")
    temporary = temporary_name(prefix)
    checkpoint.save_counter.assign_add(1)  # created here if new; restore expects it
    checkpoint.write(temporary)
    save_replica_arrays(temporary + REPLICAS_SUFFIX, variables)
    parts = glob.glob(glob.escape(temporary) + ".data-*")
    parts += glob.glob(glob.escape(temporary) + REPLICAS_SUFFIX)
    for part in sorted(parts):
        fsync_file(part)
        os.replace(part, prefix + part[len(temporary) :])
    commit(temporary + ".index", prefix + ".index")
    kept = tf_checkpoints(directory)
    for old in kept[max_to_keep:]:
        os.remove(old + ".index")  # first: without it the rest is invisible
        for path in glob.glob(glob.escape(old) + ".data-*") + glob.glob(
            glob.escape(old) + REPLICAS_SUFFIX
        ):
            os.remove(path)
    kept = kept[:max_to_keep]
    tf.compat.v1.train.update_checkpoint_state(
        str(directory), prefix, all_model_checkpoint_paths=list(reversed(kept))
    )
    return prefix
