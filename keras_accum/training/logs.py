"""Logs that rewind with the checkpoint: `rewind_csv`, `rewind_jsonl` and
`rewind_events` keep the rows written before it (not a partial last one),
atomically.
"""

import csv
import glob
import json
import os

import tensorflow as tf

from keras_accum.training.atomic import atomic_write_text, commit, temporary_name


def rewind_csv(path, keep):
    """Keeps the header and the complete rows where `keep(row dict)` holds."""
    if not os.path.exists(path):
        return
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return
    header, kept = rows[0], []
    for row in rows[1:]:
        if len(row) == len(header) and keep(dict(zip(header, row))):
            kept.append(row)
    temporary = temporary_name(path)
    with open(temporary, "w", newline="") as f:
        csv.writer(f).writerows([header] + kept)
    commit(temporary, path)


def read_jsonl(path):
    """The complete JSON lines of `path` (a partial last line is dropped)."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def rewind_jsonl(path, keep):
    """Keeps and returns the records of `path` where `keep(record)` holds."""
    kept = [r for r in read_jsonl(path) if keep(r)]
    if os.path.exists(path):
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def _events(path):
    """The events of one event file; a record cut by a kill ends it."""
    try:
        for record in tf.data.TFRecordDataset(path):
            yield tf.compat.v1.Event.FromString(record.numpy())
    except tf.errors.DataLossError:
        return


def rewind_events(logdir, keep):
    """Rewrites `logdir`'s event files as one: the values where `keep(tag,
    step, occurrence)` holds (occurrence from 0), and the first file's other events."""
    files = sorted(glob.glob(os.path.join(glob.escape(str(logdir)), "*tfevents*")))
    files = [f for f in files if not os.path.basename(f).startswith(".")]
    if not files:
        return
    seen, kept = {}, []
    for index, path in enumerate(files):
        for event in _events(path):
            if not event.HasField("summary"):
                if index == 0:
                    kept.append(event)
                continue
            values = []
            for value in event.summary.value:
                occurrence = seen.get(value.tag, 0)
                seen[value.tag] = occurrence + 1
                if keep(value.tag, event.step, occurrence):
                    values.append(value)
            if values:
                del event.summary.value[:]
                event.summary.value.extend(values)
                kept.append(event)
    temporary = temporary_name(files[0])
    with tf.io.TFRecordWriter(temporary) as writer:
        for event in kept:
            writer.write(event.SerializeToString())
    commit(temporary, files[0])
    for path in files[1:]:
        os.remove(path)
