"""The Trainer: one compiled step per window, orbit style.

`Trainer` owns one step and nothing else (`train_step`, `micro_batch_step`,
`evaluate`, `save`, `restore`); the outer loop that drives it (epochs,
checkpoints, logs, resume) is `keras_accum.training.train`, in
`controller.py`. Everything runs under a `tf.distribute` strategy: the
default one (one device), `MirroredStrategy` or `MultiWorkerMirroredStrategy`
(see `strategy_from_environment` and `keras_accum.training.multiworker`).

One call of `Trainer.train_step` is one *window*, i.e. one update: a global
batch of B items is distributed over R replicas
(`strategy.experimental_distribute_dataset`), each replica splits its share
into `steps` micro-batches and loops over them inside the graph
(`tf.range`), calling `optimizer.apply` once per micro-batch. The loop over
micro-batches is in cross-replica context around `strategy.run`, so the
optimizer's `merge_call` is never nested in a control-flow body.

Design choices:

* Loss scaling. Each replica passes the gradient of its summed per-item loss
  divided by the *global* item count of that micro-step (sum of sample
  weights, i.e. unmasked tokens, when a mask is given). Summed over replicas
  this is the gradient of the global micro-batch mean (the Keras convention
  the optimizers expect), and with `weight=` that count
  `GradientAccumulation` weights micro-batches by their true size. The counts
  of all `steps` micro-batches are summed over replicas by ONE all-reduce of a
  small vector at the start of the window.
* Short batches. A replica's share is split into `steps` parts as evenly as
  possible (sizes differ by at most one; no padding). With
  `last_batch="weighted"` a short last batch of an epoch is trained, and
  `GradientAccumulation` weights it by its true item count: exactly one step
  of the inner optimizer on that batch. `UpdateAccumulationAdam` and
  `InvariantAdam` take no weights, so their unequal micro-batches count
  equally (a warning says so); `last_batch="drop"` skips short batches.
* Data position: the counters `batches` and `epoch` advance inside the
  compiled step, and a restart replays the stream to them (see
  `keras_accum.training.stream`).
* Multi-worker input. Data is sharded by DATA: every worker runs the whole
  pipeline and keeps its replicas' part of each global batch, so B items per
  step are the same items as on one machine.
* Checkpoints hold the model, the optimizer (its accumulators, moments and
  counters, and each replica's part of its replica-local variables), the
  model's variable list (Keras keeps Dropout's SeedGenerator state there;
  the loop itself draws no random numbers) and the data counters. They are
  written atomically and verified on restore (`keras_accum.training.
  checkpoints`). Every worker saves (reading replica-local state is a
  collective); the chief writes to the workdir, the others to a temporary
  directory deleted after. `micro_step` lets a checkpoint fall inside a
  window.
* Communication per window: one all-reduce of the micro-batch counts, one of
  the logs (loss and metric sums), plus the optimizer's own
  (`GradientAccumulation`: one gradient all-reduce per window).
* BatchNorm: Keras's layer normalizes with, and moves its moving statistics
  towards, each micro-batch. `keras_accum.layers.BatchNormalization` moves
  them once per window, to the window's statistics: the Trainer attaches
  the model's such layers to its optimizer (`keras_accum.layers.attach`).

The step function is traced once: its only argument is the iterator and all
counters live in variables.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_accum import base
from keras_accum import layers as layers_lib
from keras_accum import remat as remat_lib
from keras_accum.training import checkpoints, checks
from keras_accum.training.checks import steps_per_update
from keras_accum.training.distribute import data_sharded, is_chief
from keras_accum.training.losses import resolve_loss, resolve_metrics, weighted
from keras_accum.training.stream import batch_size, peek_batch_size, replay, split_batch

#: What `train` and `Trainer` do with a short last batch: "weighted" trains
#: it weighted by its true size, "drop" leaves it out.
LAST_BATCH_POLICIES = ("weighted", "drop")


class Trainer:
    """Compiled window steps, evaluation and checkpoints for one model.

    Args:
        model: a built Keras model, created inside `strategy.scope()`.
        optimizer: a keras_accum optimizer (a window is its `steps`
            micro-batches per replica) or any Keras optimizer (one update per
            global batch), created inside `strategy.scope()`; built here if
            it is not yet.
        loss_fn: (y_true, y_pred) -> per-item losses, a `keras.losses.Loss`
            (its unreduced `call` is used) or a loss name. Losses of higher
            rank than the sample weight are averaged over the extra axes.
        strategy: the `tf.distribute` strategy; default: the one in scope.
        metrics: names ("accuracy", "mae", ...) or per-item functions; each
            is logged as its sample-weighted mean over the window.
        last_batch: "weighted" or "drop", see the module docstring.
        remat: rematerialization of `model`'s layers, one of
            `keras_accum.remat.MODES`: "none" trains `model` as it is; any
            other mode trains `keras_accum.remat.rematerialize(model,
            remat)` (the `model` attribute), a new model sharing `model`'s
            layers and variables, so `model` ends with the trained weights.
            Checkpoints hold `model` as given: the same as without remat.

    Compiled functions (`tf.function`, traced once), each taking an iterator
    over `distribute(dataset)` and returning a dict of scalar logs:

    * `train_step(iterator)`: one window. The next global batch is split
      into `steps` micro-batches per replica; one `optimizer.apply` each.
    * `micro_batch_step(iterator)`: the next element is ONE micro-batch per
      replica (one `apply`); with a dataset of global micro-batches a window
      then spans `steps` calls, and `save` may fall inside it (the
      optimizer's accumulators are checkpointed).

    Attributes: `steps`, `batches` (non-empty dataset elements trained),
    `epoch` (completed epochs), `batch_in_epoch`, `checkpoint` (model,
    optimizer with its accumulators and counters, model variables incl.
    RNG states, data position).
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        loss_fn: Any,
        *,
        strategy: tf.distribute.Strategy | None = None,
        metrics: Sequence[Any] = (),
        last_batch: str = "weighted",
        remat: str = "none",
    ):
        self.strategy = strategy or tf.distribute.get_strategy()
        if last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(
                f"`last_batch` must be one of {LAST_BATCH_POLICIES}. "
                f"Received: last_batch={last_batch!r}"
            )
        self.last_batch = last_batch
        remat_lib.check_mode(remat, "remat")
        checks.check_scope(self.strategy, model, optimizer)
        self.model, self.optimizer = model, optimizer
        # Its keras_accum BatchNormalization layers follow this optimizer's
        # windows (no compiled optimizer tells them here).
        layers_lib.attach(model, optimizer)
        if remat != "none":
            # In the scope: a compiled model's copy is compiled (its metrics).
            with self.strategy.scope():
                self.model = remat_lib.rematerialize(model, remat)
        self.steps = steps_per_update(optimizer)
        self._loss_fn = resolve_loss(loss_fn)
        self._metric_fns = resolve_metrics(metrics)
        with self.strategy.scope():
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            counter = dict(
                dtype=tf.int64,
                trainable=False,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            self.batches = tf.Variable(0, name="batches", **counter)
            self.epoch = tf.Variable(0, name="epoch", **counter)
            self.batch_in_epoch = tf.Variable(0, name="batch_in_epoch", **counter)
            # Replica-local running sums of the window's logs (loss, weight,
            # metrics): updated without communication, reduced once.
            self._sums = tf.Variable(
                tf.zeros([2 + len(self._metric_fns)]),
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM,
                name="log_sums",
            )
        self.checkpoint = tf.train.Checkpoint(
            # `model` as given, not its rematerialized copy (the same
            # variables): the checkpoint does not depend on `remat`.
            model=model,
            optimizer=optimizer,
            # A Keras model does not expose its SeedGenerator states (Dropout
            # RNG) to tf.train.Checkpoint; its variable list does.
            model_variables=list(model.variables),
            batches=self.batches,
            epoch=self.epoch,
            batch_in_epoch=self.batch_in_epoch,
        )
        self.train_step = tf.function(lambda it: self._run(it, self.steps))
        self.micro_batch_step = tf.function(lambda it: self._run(it, 1))
        self._eval_step = tf.function(self._evaluate_batch)

    def track(self, name, trackable):
        """Adds `trackable` (e.g. a controller's variable) to `checkpoint`."""
        setattr(self.checkpoint, name, trackable)

    # -- data -----------------------------------------------------------------

    def distribute(
        self, dataset: tf.data.Dataset, *, epochs: int = 1, global_batch_size: int | None = None
    ) -> tf.distribute.DistributedDataset:
        """The distributed stream of `epochs` passes over `dataset`, resumed
        after the batches already trained (`self.batches`, `self.epoch`).

        `global_batch_size` (the size of full batches) is only needed with
        `last_batch="drop"`; it is read from the first batch when omitted.
        """
        full = None
        if self.last_batch == "drop":
            full = global_batch_size or peek_batch_size(
                dataset.filter(lambda *b: batch_size(b) > 0)
            )
        return replay(
            dataset, self.strategy, position=self.position, epochs=epochs, full_batch=full
        )

    @property
    def metric_names(self) -> list[str]:
        """Names of the metrics logged beside the loss, in order."""
        return [name for name, _ in self._metric_fns]

    @property
    def position(self):
        """Stream elements consumed: batches trained plus one end-of-epoch
        marker per completed epoch (the checkpoint number)."""
        return int(self.batches.numpy()) + int(self.epoch.numpy())

    # -- the step -------------------------------------------------------------

    def _run(self, iterator, parts):
        """One dataset element: `parts` micro-batches per replica."""
        if parts is None:
            raise ValueError(
                "The optimizer's `steps` is a schedule: its windows change size, "
                "so feed a dataset of micro-batches to `Trainer.micro_batch_step` "
                f"instead of `train_step`. Received: steps={self.optimizer.steps!r}"
            )
        batch = next(iterator)
        totals = self.strategy.run(self._count, args=(batch, parts))
        self.strategy.run(lambda: self._sums.assign(tf.zeros_like(self._sums)))
        items = self.strategy.experimental_local_results(totals)[0][parts]
        # An empty element is the end-of-epoch marker: nothing to train.
        for part in tf.range(tf.where(items > 0, parts, 0)):
            self.strategy.run(self._micro, args=(batch, part, parts, totals))
        sums = self.strategy.experimental_local_results(self.strategy.run(self._reduce_logs))[0]
        opt = self.optimizer
        logs = {
            "loss": tf.math.divide_no_nan(sums[0], sums[1]),
            **{
                name: tf.math.divide_no_nan(sums[2 + i], sums[1])
                for i, (name, _) in enumerate(self._metric_fns)
            },
            "items": items,
            "updates": tf.cast(opt.iterations, tf.float32),
            "skipped_micro_batches": sums[-1],
            "learning_rate": tf.cast(opt.learning_rate, tf.float32),
        }
        if isinstance(opt, base.AccumulationOptimizer):
            logs["micro_step"] = tf.cast(opt.micro_step, tf.float32)
            logs["skipped_updates"] = tf.cast(opt.skipped_updates, tf.float32)
        with tf.control_dependencies(list(logs.values())):
            trained = tf.cast(items > 0, tf.int64)
            updates = [
                self.batches.assign_add(trained),
                self.epoch.assign_add(1 - trained),
                self.batch_in_epoch.assign((self.batch_in_epoch + 1) * trained),
            ]
        with tf.control_dependencies(updates):
            for name in ("batches", "epoch", "batch_in_epoch"):
                logs[name] = tf.cast(getattr(self, name).read_value(), tf.float32)
        return logs

    def _count(self, batch, parts):
        """Replica context: per part, the global item count (sum of sample
        weights when given), then items in the batch; one all-reduce."""
        _, _, sample_weight = split_batch(batch)
        n = batch_size(batch)
        bounds = (tf.range(parts + 1) * n) // parts
        if sample_weight is None:
            counts = tf.cast(bounds[1:] - bounds[:-1], tf.float32)
        else:
            weights = tf.cast(sample_weight, tf.float32)
            per_item = tf.reduce_sum(tf.reshape(weights, [n, -1]), axis=1)
            part_of = tf.searchsorted(bounds[1:], tf.range(n), side="right")
            counts = tf.math.unsorted_segment_sum(per_item, part_of, parts)
        local = tf.concat([counts, [tf.cast(n, tf.float32)]], axis=0)
        return tf.distribute.get_replica_context().all_reduce("sum", local)

    def _micro(self, batch, part, parts, totals):
        """Replica context: one micro-batch, one `optimizer.apply`."""
        n = batch_size(batch)
        lo, hi = (part * n) // parts, ((part + 1) * n) // parts
        x, y, sample_weight = tf.nest.map_structure(
            lambda t: None if t is None else t[lo:hi], split_batch(batch)
        )
        count = totals[part]
        model = self.model
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            sums = self._sums_of(y, y_pred, sample_weight)
            # Summed loss / GLOBAL count of this micro-step: summed over the
            # replicas this is the gradient of the global micro-batch mean,
            # the convention the optimizers (and their all-reduce SUM) use.
            loss = tf.math.divide_no_nan(sums[0], count)
            if model.losses:
                replicas = self.strategy.num_replicas_in_sync
                loss += tf.add_n(model.losses) / replicas
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        if getattr(self.optimizer, "takes_weights", False):
            self.optimizer.apply(grads, variables, weight=count)
        else:
            self.optimizer.apply(grads, variables)
        self._sums.assign_add(sums)

    def _sums_of(self, y, y_pred, sample_weight):
        """[sum w loss, sum w, sum w metric, ...] over one replica's items."""
        per_item, weights = weighted(self._loss_fn, y, y_pred, sample_weight)
        metrics = [weighted(fn, y, y_pred, sample_weight)[0] for _, fn in self._metric_fns]
        return tf.stack(
            [tf.reduce_sum(v * weights) for v in [per_item, tf.ones_like(per_item)] + metrics]
        )

    def _reduce_logs(self):
        """Replica context: this replica's sums plus its skipped micro-batch
        count (replica-local), summed over replicas in one all-reduce."""
        skipped = getattr(self.optimizer, "skipped_micro_batches", None)
        skipped = 0.0 if skipped is None else tf.cast(skipped.value, tf.float32)
        local = tf.concat([tf.convert_to_tensor(self._sums), [skipped]], 0)
        return tf.distribute.get_replica_context().all_reduce("sum", local)

    # -- evaluation -----------------------------------------------------------

    def _evaluate_batch(self, iterator):
        def replica_fn(batch):
            x, y, sample_weight = split_batch(batch)
            sums = self._sums_of(y, self.model(x, training=False), sample_weight)
            return tf.distribute.get_replica_context().all_reduce("sum", sums)

        result = self.strategy.run(replica_fn, args=(next(iterator),))
        return self.strategy.experimental_local_results(result)[0]

    def evaluate(self, dataset: tf.data.Dataset) -> dict[str, float]:
        """Sample-weighted mean loss and metrics over `dataset` (global
        batches, as for training). Runs on every worker."""
        iterator = iter(self.strategy.experimental_distribute_dataset(data_sharded(dataset)))
        total = np.zeros(2 + len(self._metric_fns))
        while True:
            try:
                total += self._eval_step(iterator).numpy()
            except tf.errors.OutOfRangeError:
                break
        names = ["loss"] + [name for name, _ in self._metric_fns]
        means = np.concatenate([total[:1], total[2:]]) / (total[1] or np.nan)
        return dict(zip(names, map(float, means)))

    # -- checkpoints ----------------------------------------------------------

    def save(self, directory: str, max_to_keep: int = 3) -> str:
        """Saves model, optimizer and data position atomically as
        `directory/ckpt-<position>` (see `position`) and keeps the newest
        `max_to_keep`. Every worker must call it (reading the replica-local
        optimizer state is a collective); only the chief writes to
        `directory`, the others to a temporary one deleted after."""
        chief = is_chief(self.strategy)
        target = directory if chief else tempfile.mkdtemp(prefix="ckpt_worker")
        path = checkpoints.write_tf(
            self.checkpoint, target, self.position, max_to_keep, self.optimizer.variables
        )
        if not chief:
            shutil.rmtree(target, ignore_errors=True)
        return path

    def restore(self, directory: str) -> str | None:
        """Restores the newest intact checkpoint in `directory`, if any;
        returns its path or None. Newer unusable ones are named in a
        warning; when none is intact, or the checkpoint does not match the
        model and optimizer (another architecture or `steps`),
        `checkpoints.CheckpointError` names the file."""
        path = checkpoints.newest_tf(directory)
        if path is not None:
            checkpoints.restore_tf(self.checkpoint, path, self.optimizer.variables)
        return path
