"""The training loop: one compiled step per window, orbit style.

`train(model, optimizer, loss_fn, dataset, ...)` is the importable loop;
`Trainer` holds the reusable pieces (`train_step`, `micro_step`, `evaluate`,
`save`, `restore`). Everything runs under a `tf.distribute` strategy: the
default one (one device), `MirroredStrategy` or `MultiWorkerMirroredStrategy`
(see `strategy_from_environment` and `keras_accum.multiworker`).

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
* Data position. `tf.distribute` iterators cannot be checkpointed, so the
  checkpoint stores counters (batches trained, completed epochs) and a
  restart replays the pipeline up to there:
  `dataset.concatenate(end_marker).repeat(epochs).skip(done)`. Skipped
  batches are read and discarded, so this is exact for any deterministic
  pipeline (shuffles with a fixed seed, `reshuffle_each_iteration` included:
  the same iterator is replayed) and costs re-reading the data already seen.
  The end marker is an empty batch appended to each epoch: a step that sees
  zero items trains nothing and counts an epoch.
* Multi-worker input. Data is sharded by DATA: every worker runs the whole
  pipeline and keeps its replicas' part of each global batch, so B items per
  step are the same items as on one machine.
* Checkpoints hold the model, the optimizer (its accumulators, moments and
  counters), the model's variable list (Keras keeps Dropout's SeedGenerator
  state there; the loop itself draws no random numbers) and the data
  counters. Every worker saves (reading replica-local state is a
  collective); the chief writes to the workdir, the others to a temporary
  directory deleted after. `train` saves at window ends; `micro_step` lets a
  checkpoint fall inside a window.
* Communication per window: one all-reduce of the micro-batch counts, one of
  the logs (loss and metric sums), plus the optimizer's own
  (`GradientAccumulation`: one gradient all-reduce per window).
* BatchNorm statistics are computed per micro-batch (as in any accumulation
  scheme), not over the window.

The step function is traced once: its only argument is the iterator and all
counters live in variables.
"""

import contextlib
import functools
import json
import os
import shutil
import tempfile
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_accum import base
from keras_accum.gradient_accumulation import GradientAccumulation

LAST_BATCH_POLICIES = ("weighted", "drop")
_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                tf.errors.AbortedError)


class WorkerLostError(RuntimeError):
    """A collective failed: a peer worker died, hung or timed out."""


@contextlib.contextmanager
def _peer_errors():
    try:
        yield
    except _PEER_ERRORS as error:
        raise WorkerLostError(
            "A collective failed: another worker died, hung or timed out "
            f"(see its log). This worker stops too. Cause: {error}"
        ) from error


def strategy_from_environment(collective_timeout=None):
    """The strategy this process should use.

    `MultiWorkerMirroredStrategy` when TF_CONFIG names more than one task,
    `MirroredStrategy` on several GPUs, else the default strategy. TF's
    coordination service already aborts collectives a few seconds after a
    peer process dies (missed heartbeats); `collective_timeout` (seconds)
    also bounds each collective, which catches a peer that hangs while alive
    (TF spends one thread per collective on it, so keep it for debugging or
    set it well above the slowest step, checkpoint and evaluation).
    """
    cluster = json.loads(os.environ.get("TF_CONFIG", "{}")).get("cluster", {})
    if sum(len(cluster.get(k, ())) for k in ("chief", "worker")) > 1:
        options = tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=collective_timeout
        )
        return tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=options
        )
    if len(tf.config.list_logical_devices("GPU")) > 1:
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()


def is_chief(strategy):
    """True on the worker that writes checkpoints, logs and summaries."""
    return bool(getattr(strategy.extended, "should_checkpoint", True))


def _split(batch):
    """(x, y, sample_weight or None) from a dataset element."""
    if not isinstance(batch, tuple) or len(batch) not in (2, 3):
        raise ValueError(
            "`dataset` elements must be tuples (x, y) or (x, y, "
            f"sample_weight). Received element: {batch!r}"
        )
    return batch if len(batch) == 3 else (*batch, None)


def _size(batch):
    return tf.shape(tf.nest.flatten(batch)[0])[0]


def _per_item(values, rank):
    """Mean over the axes beyond `rank` (the sample weight's rank)."""
    values = tf.convert_to_tensor(values)
    extra = list(range(rank, values.shape.rank))
    return tf.reduce_mean(values, axis=extra) if extra else values


def peek_batch_size(dataset):
    """Size of the first batch of `dataset` (the global batch size), or a
    ValueError when `dataset` is empty."""
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            "`dataset` must be a `tf.data.Dataset` of global batches. "
            f"Received: dataset={dataset!r}"
        )
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "`dataset` must be finite (one epoch); the loop repeats it "
            f"`epochs` times. Received: dataset={dataset!r}"
        )
    first = next(iter(dataset.take(1)), None)
    if first is None:
        raise ValueError(f"`dataset` is empty. Received: dataset={dataset!r}")
    return int(_size(_split(first)))


def _data_sharded(dataset):
    """Multi-worker: every worker reads the whole pipeline and keeps its
    replicas' part of each global batch (unless the user chose a policy)."""
    default = tf.data.Options().experimental_distribute.auto_shard_policy
    if dataset.options().experimental_distribute.auto_shard_policy != default:
        return dataset
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA
    )
    return dataset.with_options(options)


def _window(optimizer):
    """Micro-batches per replica per update: a Keras optimizer updates on
    every micro-batch, so it gets one micro-batch per global batch."""
    if isinstance(optimizer, base.AccumulationOptimizer):
        return optimizer.steps
    return 1


def _resolve_loss(loss_fn):
    if isinstance(loss_fn, str):
        loss_fn = keras.losses.get(loss_fn)
    if isinstance(loss_fn, keras.losses.Loss):
        return loss_fn.call  # per-item values, no reduction
    if not callable(loss_fn):
        raise ValueError(
            "`loss_fn` must be a callable (y_true, y_pred) -> per-item "
            f"losses, a keras Loss or its name. Received: loss_fn={loss_fn!r}"
        )
    return loss_fn


def _accuracy(y_true, y_pred):
    if y_pred.shape[-1] == 1:
        return keras.metrics.binary_accuracy(y_true, y_pred)
    if y_true.shape.rank == y_pred.shape.rank and y_true.shape[-1] != 1:
        return keras.metrics.categorical_accuracy(y_true, y_pred)
    return keras.metrics.sparse_categorical_accuracy(y_true, y_pred)


def _resolve_metrics(metrics):
    """(name, per-item function) pairs. Keras metrics that are means of a
    per-item function (MeanMetricWrapper: accuracies, mae, ...) are used
    through that function; the loop keeps its own replica-local sums."""
    resolved = []
    for metric in metrics:
        if metric in ("accuracy", "acc"):
            resolved.append(("accuracy", _accuracy))
            continue
        if isinstance(metric, str):
            metric = keras.metrics.get(metric)
        if isinstance(metric, keras.metrics.MeanMetricWrapper):
            resolved.append((metric.name, functools.partial(
                metric._fn, **metric._fn_kwargs)))
        elif callable(metric) and not isinstance(metric, keras.metrics.Metric):
            resolved.append((metric.__name__, metric))
        else:
            raise ValueError(
                "Each metric must be a name, a keras MeanMetricWrapper or a "
                "per-item function (y_true, y_pred) -> values. "
                f"Received: metric={metric!r}"
            )
    return resolved


def _end_marker(dataset):
    """A one-element dataset holding an empty batch shaped like `dataset`'s."""

    def empty(spec):
        if not isinstance(spec, tf.TensorSpec) or spec.shape.rank is None:
            raise ValueError(
                "`dataset` elements must be dense tensors of known rank. "
                f"Received: element_spec={dataset.element_spec!r}"
            )
        shape = [0] + [d or 0 for d in spec.shape[1:]]
        if spec.dtype == tf.string:
            return tf.fill(shape, "")
        return tf.zeros(shape, spec.dtype)

    return tf.data.Dataset.from_tensors(
        tf.nest.map_structure(empty, dataset.element_spec)
    )


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

    Compiled functions (`tf.function`, traced once), each taking an iterator
    over `distribute(dataset)` and returning a dict of scalar logs:

    * `train_step(iterator)`: one window. The next global batch is split
      into `steps` micro-batches per replica; one `optimizer.apply` each.
    * `micro_step(iterator)`: the next element is ONE micro-batch per
      replica (one `apply`); with a dataset of global micro-batches a window
      then spans `steps` calls, and `save` may fall inside it (the
      optimizer's accumulators are checkpointed).

    Attributes: `steps`, `batches` (non-empty dataset elements trained),
    `epoch` (completed epochs), `batch_in_epoch`, `checkpoint` (model,
    optimizer with its accumulators and counters, model variables incl.
    RNG states, data position).
    """

    def __init__(self, model, optimizer, loss_fn, *, strategy=None,
                 metrics=(), last_batch="weighted"):
        self.strategy = strategy or tf.distribute.get_strategy()
        if last_batch not in LAST_BATCH_POLICIES:
            raise ValueError(
                f"`last_batch` must be one of {LAST_BATCH_POLICIES}. "
                f"Received: last_batch={last_batch!r}"
            )
        self.last_batch = last_batch
        self._check_scope(model, optimizer)
        self.model, self.optimizer = model, optimizer
        self.steps = _window(optimizer)
        self._loss_fn = _resolve_loss(loss_fn)
        self._metrics = _resolve_metrics(metrics)
        with self.strategy.scope():
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            counter = dict(
                dtype=tf.int64, trainable=False,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.batches = tf.Variable(0, name="batches", **counter)
            self.epoch = tf.Variable(0, name="epoch", **counter)
            self.batch_in_epoch = tf.Variable(0, name="batch_in_epoch",
                                              **counter)
            # Replica-local running sums of the window's logs (loss, weight,
            # metrics): updated without communication, reduced once.
            self._sums = tf.Variable(
                tf.zeros([2 + len(self._metrics)]), trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.SUM, name="log_sums",
            )
        self.checkpoint = tf.train.Checkpoint(
            model=model, optimizer=optimizer,
            # A Keras model does not expose its SeedGenerator states (Dropout
            # RNG) to tf.train.Checkpoint; its variable list does.
            model_variables=list(model.variables),
            batches=self.batches, epoch=self.epoch,
            batch_in_epoch=self.batch_in_epoch,
        )
        self._managers = {}
        self.train_step = tf.function(lambda it: self._run(it, self.steps))
        self.micro_step = tf.function(lambda it: self._run(it, 1))
        self._eval_step = tf.function(self._evaluate_batch)

    def _check_scope(self, model, optimizer):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "`optimizer` must be a keras Optimizer. "
                f"Received: optimizer={optimizer!r}"
            )
        for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            if opt is None or opt._distribution_strategy is self.strategy:
                continue
            raise ValueError(
                "`optimizer` was created outside `strategy.scope()` (under "
                f"{type(opt._distribution_strategy).__name__}, not "
                f"strategy={type(self.strategy).__name__}); create and "
                f"build it inside the scope. Received: optimizer={opt!r}"
            )
        if not model.built or not model.trainable_variables:
            raise ValueError(
                "`model` must be built (give it an `Input` or call it on a "
                f"batch inside `strategy.scope()`). Received: model={model!r}"
            )
        for v in model.variables:
            if not self.strategy.extended.variable_created_in_scope(
                getattr(v, "value", v)
            ):
                raise ValueError(
                    f"`model` variable {v.path!r} was created outside "
                    "`strategy.scope()`; create the model inside it. "
                    f"Received: model={model!r}"
                )

    # -- data -----------------------------------------------------------------

    def distribute(self, dataset, *, epochs=1, global_batch_size=None):
        """The distributed stream of `epochs` passes over `dataset`, resumed
        after the batches already trained (`self.batches`, `self.epoch`).

        `global_batch_size` (the size of full batches) is only needed with
        `last_batch="drop"`; it is read from the first batch when omitted.
        """
        dataset = dataset.filter(lambda *b: _size(b) > 0)
        if self.last_batch == "drop":
            full = global_batch_size or peek_batch_size(dataset)
            dataset = dataset.filter(lambda *b: _size(b) == full)
        done = self.batches + self.epoch  # one end marker per epoch done
        stream = dataset.concatenate(_end_marker(dataset)).repeat(epochs)
        return self.strategy.experimental_distribute_dataset(
            _data_sharded(stream.skip(done))
        )

    # -- the step -------------------------------------------------------------

    def _run(self, iterator, parts):
        """One dataset element: `parts` micro-batches per replica."""
        batch = next(iterator)
        totals = self.strategy.run(self._count, args=(batch, parts))
        self.strategy.run(lambda: self._sums.assign(tf.zeros_like(self._sums)))
        items = self.strategy.experimental_local_results(totals)[0][parts]
        # An empty element is the end-of-epoch marker: nothing to train.
        for part in tf.range(tf.where(items > 0, parts, 0)):
            self.strategy.run(self._micro, args=(batch, part, parts, totals))
        sums = self.strategy.experimental_local_results(
            self.strategy.run(self._reduce_logs)
        )[0]
        opt = self.optimizer
        logs = {
            "loss": tf.math.divide_no_nan(sums[0], sums[1]),
            **{name: tf.math.divide_no_nan(sums[2 + i], sums[1])
               for i, (name, _) in enumerate(self._metrics)},
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
            updates = [self.batches.assign_add(trained),
                       self.epoch.assign_add(1 - trained),
                       self.batch_in_epoch.assign(
                           (self.batch_in_epoch + 1) * trained)]
        with tf.control_dependencies(updates):
            for name in ("batches", "epoch", "batch_in_epoch"):
                logs[name] = tf.cast(getattr(self, name).read_value(),
                                     tf.float32)
        return logs

    def _count(self, batch, parts):
        """Replica context: per part, the global item count (sum of sample
        weights when given), then items in the batch; one all-reduce."""
        _, _, sample_weight = _split(batch)
        n = _size(batch)
        bounds = (tf.range(parts + 1) * n) // parts
        if sample_weight is None:
            counts = tf.cast(bounds[1:] - bounds[:-1], tf.float32)
        else:
            weights = tf.cast(sample_weight, tf.float32)
            per_item = tf.reduce_sum(
                tf.reshape(weights, [n, -1]), axis=1
            )
            part_of = tf.searchsorted(bounds[1:], tf.range(n), side="right")
            counts = tf.math.unsorted_segment_sum(per_item, part_of, parts)
        local = tf.concat([counts, [tf.cast(n, tf.float32)]], axis=0)
        return tf.distribute.get_replica_context().all_reduce("sum", local)

    def _micro(self, batch, part, parts, totals):
        """Replica context: one micro-batch, one `optimizer.apply`."""
        n = _size(batch)
        lo, hi = (part * n) // parts, ((part + 1) * n) // parts
        x, y, sample_weight = tf.nest.map_structure(
            lambda t: None if t is None else t[lo:hi], _split(batch)
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
        if isinstance(self.optimizer, base.AccumulationOptimizer):
            self.optimizer.apply(grads, variables, weight=count)
        else:
            self.optimizer.apply(grads, variables)
        self._sums.assign_add(sums)

    def _sums_of(self, y, y_pred, sample_weight):
        """[sum w loss, sum w, sum w metric, ...] over one replica's items."""
        per_item, weights = self._weighted(self._loss_fn, y, y_pred,
                                           sample_weight)
        metrics = [self._weighted(fn, y, y_pred, sample_weight)[0]
                   for _, fn in self._metrics]
        return tf.stack([tf.reduce_sum(v * weights)
                         for v in [per_item, tf.ones_like(per_item)] + metrics])

    @staticmethod
    def _weighted(fn, y, y_pred, sample_weight):
        """Per-item values of `fn` at the sample weight's rank, and weights."""
        values = tf.cast(fn(y, y_pred), tf.float32)
        if sample_weight is None:
            if values.shape.rank == 0:
                raise ValueError(
                    "The loss and metrics must return per-item values, not "
                    f"a reduced scalar. Received: {fn!r}")
            values = _per_item(values, 1)
            return values, tf.ones_like(values)
        weights = tf.cast(sample_weight, tf.float32)
        if values.shape.rank < weights.shape.rank:
            raise ValueError(
                "The loss and metrics must return per-item values of at "
                f"least the sample weight's rank {weights.shape.rank}. "
                f"Received: values of shape {values.shape} from {fn!r}"
            )
        return _per_item(values, weights.shape.rank), weights

    def _reduce_logs(self):
        """Replica context: this replica's sums plus its skipped micro-batch
        count (replica-local), summed over replicas in one all-reduce."""
        skipped = getattr(self.optimizer, "skipped_micro_batches", None)
        skipped = (0.0 if skipped is None
                   else tf.cast(skipped.value, tf.float32))
        local = tf.concat([tf.convert_to_tensor(self._sums), [skipped]], 0)
        return tf.distribute.get_replica_context().all_reduce("sum", local)

    # -- evaluation -----------------------------------------------------------

    def _evaluate_batch(self, iterator):
        def replica_fn(batch):
            x, y, sample_weight = _split(batch)
            sums = self._sums_of(y, self.model(x, training=False),
                                 sample_weight)
            return tf.distribute.get_replica_context().all_reduce("sum", sums)

        result = self.strategy.run(replica_fn, args=(next(iterator),))
        return self.strategy.experimental_local_results(result)[0]

    def evaluate(self, dataset):
        """Sample-weighted mean loss and metrics over `dataset` (global
        batches, as for training). Runs on every worker."""
        iterator = iter(self.strategy.experimental_distribute_dataset(
            _data_sharded(dataset)
        ))
        total = np.zeros(2 + len(self._metrics))
        while True:
            try:
                total += self._eval_step(iterator).numpy()
            except tf.errors.OutOfRangeError:
                break
        names = ["loss"] + [name for name, _ in self._metrics]
        means = np.concatenate([total[:1], total[2:]]) / (total[1] or np.nan)
        return dict(zip(names, map(float, means)))

    # -- checkpoints ----------------------------------------------------------

    def save(self, directory, max_to_keep=3):
        """Saves model, optimizer and data position as
        `directory/ckpt-<batches>`. Every worker must call it (reading the
        replica-local optimizer state is a collective); only the chief
        writes to `directory`, the others to a temporary one deleted after.
        """
        chief = is_chief(self.strategy)
        target = (directory if chief
                  else tempfile.mkdtemp(prefix="ckpt_worker"))
        if target not in self._managers:
            self._managers[target] = tf.train.CheckpointManager(
                self.checkpoint, target, max_to_keep=max_to_keep
            )
        path = self._managers[target].save(checkpoint_number=self.batches)
        if not chief:
            del self._managers[target]
            shutil.rmtree(target, ignore_errors=True)
        return path

    def restore(self, directory):
        """Restores the latest checkpoint in `directory`, if any; returns its
        path or None. A checkpoint that does not match the model and
        optimizer (another architecture or `steps`) raises."""
        path = tf.train.latest_checkpoint(directory)
        if path is not None:
            self.checkpoint.restore(path).assert_consumed()
        return path


# -- the loop -----------------------------------------------------------------


def _check_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. "
            f"Received: {name}={value!r}"
        )


def _check_split(global_batch, replicas, opt_steps, steps, micro_batch_size):
    """Validates `steps` / `micro_batch_size` against the batch and the
    optimizer's window; returns the micro-batch size per replica."""
    if steps is not None and micro_batch_size is not None:
        raise ValueError(
            "Give `steps` or `micro_batch_size`, not both (one follows from "
            f"the other). Received: steps={steps!r}, "
            f"micro_batch_size={micro_batch_size!r}"
        )
    if global_batch % replicas:
        raise ValueError(
            f"The global batch size {global_batch} (first batch of `dataset`) "
            f"must be divisible by the {replicas} replicas in sync."
        )
    per_replica = global_batch // replicas
    if steps is not None:
        _check_int("steps", steps)
        if steps != opt_steps:
            raise ValueError(
                f"`steps` must equal the optimizer's window ({opt_steps} "
                f"micro-batches per replica). Received: steps={steps!r}"
            )
    if micro_batch_size is not None:
        _check_int("micro_batch_size", micro_batch_size)
        if per_replica % micro_batch_size:
            raise ValueError(
                "`micro_batch_size` must divide the per-replica batch size "
                f"{per_replica} (global batch {global_batch} / {replicas} "
                f"replicas). Received: micro_batch_size={micro_batch_size!r}"
            )
        if per_replica // micro_batch_size != opt_steps:
            raise ValueError(
                f"`micro_batch_size` gives {per_replica // micro_batch_size} "
                f"micro-batches per replica, but the optimizer's window has "
                f"steps={opt_steps}. Received: "
                f"micro_batch_size={micro_batch_size!r}"
            )
    if per_replica % opt_steps:
        raise ValueError(
            f"The per-replica batch size {per_replica} (global batch "
            f"{global_batch} / {replicas} replicas) is not divisible by the "
            f"optimizer's steps={opt_steps}: micro-batches would differ in "
            "size. Change the batch size or `steps`."
        )
    return per_replica // opt_steps


class _Log:
    """JSONL lines and TensorBoard scalars in the workdir (chief only)."""

    def __init__(self, workdir, chief, resume_batches, resume_epoch):
        self.path = workdir and os.path.join(workdir, "log.jsonl")
        self.writer = tf.summary.create_noop_writer()
        if not (workdir and chief):
            self.path = None
            return
        self.writer = tf.summary.create_file_writer(
            os.path.join(workdir, "tensorboard")
        )
        if os.path.exists(self.path):
            # A restart: drop what was logged after the restored checkpoint.
            with open(self.path) as f:
                lines = [json.loads(line) for line in f if line.strip()]
            kept = [line for line in lines
                    if line.get("batches", 0) <= resume_batches
                    and line.get("epoch", 0) <= resume_epoch]
            with open(self.path, "w") as f:
                f.writelines(json.dumps(line) + "\n" for line in kept)

    def write(self, record, step, prefix=""):
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        with self.writer.as_default(step=step):
            for name, value in record.items():
                if isinstance(value, float) and name not in (
                        "time", "epoch", "batches", "batch_in_epoch"):
                    tf.summary.scalar(prefix + name, value)
        self.writer.flush()


def train(model, optimizer, loss_fn, dataset, *, epochs=1, steps=None,
          micro_batch_size=None, strategy=None, workdir=None,
          checkpoint_every=100, metrics=(), last_batch="weighted",
          eval_dataset=None, callbacks=(), verbose=1):
    """Trains `model` for `epochs` passes over `dataset`; one update per batch.

    Each global batch of `dataset` is one window: it is split over the
    replicas and, on each, into the optimizer's `steps` micro-batches, all in
    one compiled step (see the module docstring). With a `workdir`, a run
    that is killed resumes from its last checkpoint when called again with
    the same arguments, and ends with the same weights as an uninterrupted
    run (for a deterministic `dataset`).

    Args:
        model: a built Keras model created inside `strategy.scope()`.
        optimizer: a keras_accum optimizer (or any Keras optimizer: one
            update per global batch), created inside `strategy.scope()`.
        loss_fn: (y_true, y_pred) -> per-item losses, a keras Loss or name.
        dataset: a finite `tf.data.Dataset` of GLOBAL batches (x, y) or
            (x, y, sample_weight); sample_weight may be a token mask of the
            loss's shape. Must be deterministic for exact resumption.
        epochs: passes over `dataset`.
        steps: micro-batches per replica per update. The optimizer's `steps`
            decides it; this argument (or `micro_batch_size`, not both) only
            states it, and a mismatch is an error.
        micro_batch_size: items per micro-batch on one replica; must divide
            the per-replica batch into the optimizer's `steps` parts.
        strategy: a `tf.distribute` strategy; default: the one in scope.
        workdir: directory for checkpoints/, log.jsonl, tensorboard/ and
            config.json (written by the chief; every worker restores from
            it, so it must be shared); None: nothing written or resumed.
        checkpoint_every: save every this many updates (windows), and at
            the end of each epoch.
        metrics: names ("accuracy", ...) or per-item functions, logged as
            window means; loss, learning rate, updates and skipped
            micro-batches are always logged.
        last_batch: "weighted" (train a short last batch, weighted by its
            item count) or "drop" (skip batches smaller than the first).
        eval_dataset: optional dataset of global batches evaluated at the end
            of each epoch (keys prefixed with "val_").
        callbacks: callables `fn(logs)` run on every worker after each
            window, `logs` a dict of floats (loss, batches, epoch, ...).
        verbose: 1 for a progress bar on the chief, 0 for none.

    Returns:
        A dict name -> list of per-epoch means (over the windows this process
        trained in that epoch), with the evaluation results.
    """
    strategy = strategy or tf.distribute.get_strategy()
    _check_int("epochs", epochs)
    _check_int("checkpoint_every", checkpoint_every)
    if verbose not in (0, 1):
        raise ValueError(
            f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
    global_batch = peek_batch_size(dataset)
    opt_steps = _window(optimizer)
    micro = _check_split(global_batch, strategy.num_replicas_in_sync,
                         opt_steps, steps, micro_batch_size)
    trainer = Trainer(model, optimizer, loss_fn, strategy=strategy,
                      metrics=metrics, last_batch=last_batch)
    chief = is_chief(strategy)
    checkpoints = workdir and os.path.join(workdir, "checkpoints")
    if checkpoints and trainer.restore(checkpoints) and verbose and chief:
        print(f"Resuming from {tf.train.latest_checkpoint(checkpoints)}")
    if opt_steps > 1 and int(optimizer.micro_step.numpy()) % opt_steps:
        raise ValueError(
            "`optimizer` is in the middle of a window (micro_step="
            f"{int(optimizer.micro_step.numpy())}, steps={opt_steps}); finish "
            "it with `Trainer.micro_step` before training whole windows."
        )
    done = int(trainer.batches.numpy())
    if workdir and chief:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(dict(
                epochs=epochs, steps=opt_steps, micro_batch_size=micro,
                global_batch_size=global_batch, last_batch=last_batch,
                replicas=strategy.num_replicas_in_sync,
                strategy=type(strategy).__name__,
                checkpoint_every=checkpoint_every,
                optimizer=keras.optimizers.serialize(optimizer),
                loss=getattr(loss_fn, "__name__", repr(loss_fn)),
                metrics=[name for name, _ in trainer._metrics],
                model=model.name, parameters=int(model.count_params()),
                resumed_at_batch=done,
            ), f, indent=1, default=repr)
    log = _Log(workdir, chief, done, int(trainer.epoch.numpy()))
    iterator = iter(trainer.distribute(dataset, epochs=epochs,
                                       global_batch_size=global_batch))
    target = int(dataset.cardinality())
    shown = ["loss"] + [name for name, _ in trainer._metrics]
    state = dict(history={}, epoch_logs=[], bar=None, warned=False,
                 saved=done)

    def save(batch):
        if checkpoints:
            state["saved"] = batch
            trainer.save(checkpoints)

    def end_of_epoch(logs):
        epoch_logs, bar = state["epoch_logs"], state["bar"]
        record = {k: float(np.mean([r[k] for r in epoch_logs]))
                  for k in shown if epoch_logs}
        if eval_dataset is not None:
            record.update({f"val_{k}": v for k, v in
                           trainer.evaluate(eval_dataset).items()})
        for k, v in record.items():
            state["history"].setdefault(k, []).append(v)
        log.write({"epoch": logs["epoch"], "batches": logs["batches"],
                   "epoch_end": True, **record},
                  step=int(logs["batches"]), prefix="epoch/")
        save(int(logs["batches"]))
        if bar is not None and bar._seen_so_far != bar.target:
            bar.update(bar._seen_so_far, finalize=True)
        state.update(bar=None, epoch_logs=[])

    def after_window(logs):
        batch = int(logs["batches"])
        if (logs["items"] < global_batch and opt_steps > 1
                and not state["warned"]
                and not isinstance(optimizer, GradientAccumulation)):
            warnings.warn(
                f"A short batch ({int(logs['items'])} < {global_batch} "
                f"items) was trained with {type(optimizer).__name__}, which "
                "takes no item weights: its unequal micro-batches counted "
                "equally. Use last_batch='drop' to skip short batches.")
            state["warned"] = True
        state["epoch_logs"].append(logs)
        log.write(dict(logs, time=time.time()), step=batch)
        for callback in callbacks:
            callback(logs)
        if state["bar"] is None and verbose and chief:
            state["bar"] = keras.utils.Progbar(
                target if target > 0 else None,
                stateful_metrics=["examples/s"])
        if state["bar"] is not None:
            state["bar"].update(
                int(logs["batch_in_epoch"]), [(k, logs[k]) for k in shown]
                + [("examples/s", logs["examples_per_second"])])
        if batch - state["saved"] >= checkpoint_every:
            save(batch)

    # Steps, saves and evaluations all communicate: a dead peer can surface
    # in any of them.
    with _peer_errors():
        while True:
            start = time.perf_counter()
            try:
                logs = trainer.train_step(iterator)
            except tf.errors.OutOfRangeError:
                break
            logs = {k: float(v) for k, v in logs.items()}
            logs["examples_per_second"] = logs["items"] / (
                time.perf_counter() - start)
            if logs["items"] == 0:  # the end-of-epoch marker
                end_of_epoch(logs)
            else:
                after_window(logs)
    return state["history"]
