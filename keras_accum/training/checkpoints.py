"""Atomic, verified checkpoint files: `.keras` files for `model.fit`
(`save_keras` / `newest_keras`) and `tf.train.Checkpoint` prefixes `ckpt-<n>`
for the custom loop (`write_tf` / `newest_tf`). Resume takes the newest that
verifies and warns about newer ones skipped. See docs/guides/custom_loop.md.
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
    """The first of `candidates` (newest first) that `verify` accepts, or None
    if there are none; warns about those skipped, raises if all are."""
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
    """name -> per-replica components of the sync-on-read `variables`."""
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
    """name -> [replicas, ...] array of each replica's part of the sync-on-read
    `variables`, for a bit-exact resume; {} under a multi-worker strategy."""
    found = _replica_local(variables)
    for variable in variables:
        value = getattr(variable, "value", variable)
        if isinstance(value, tf.distribute.DistributedValues):
            if value.distribute_strategy.num_replicas_in_sync != len(value.values):
                return {}  # other workers hold some of the replicas
    return {name: np.stack([part.numpy() for part in parts]) for name, parts in found.items()}


def assign_replica_arrays(variables, arrays):
    """Assigns `replica_arrays` parts back where name and replica count match;
    returns the number of variables set."""
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
    """Writes `replica_arrays(variables)` to `path` (.npz, not committed);
    False when there are none."""
    arrays = replica_arrays(variables)
    if not arrays:
        return False
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return True


# -- .keras files (model.fit) -----------------------------------------------------


def verify_keras(path):
    """`CheckpointError` unless `path` is a complete `.keras` zip."""
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
    """Saves `model` to `path` atomically, with `state` (JSON) and the
    optimizer's `replica_arrays` in the archive."""
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
    """(model, state) from `save_keras`'s file (state None for a plain Keras
    file); call inside the strategy's scope."""
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
    """The newest (by name) intact `pattern` file in `directory`, or None."""
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
    """Reads every tensor of `prefix` and its replica parts; `CheckpointError` if that fails."""
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
    """Restores `checkpoint` from `prefix` (`CheckpointError` unless all of it
    matches), then the replica parts of `variables`."""
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
    """Writes `directory/ckpt-<number>` atomically (data files first, the
    index last), keeps the newest `max_to_keep`; returns the prefix."""
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
