"""The strategy of this process, the chief, data sharding, and lost peers."""

import ctypes
import json
import os
import threading
import time

import tensorflow as tf

from keras_accum import _compat

PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError)

# The peer watch (docs/guides/reliability.md): probe each peer every
# PROBE_INTERVAL s; lost after 2 refused or 3 timed-out (PROBE_TIMEOUT) probes
# in a row; then raise in a busy main thread RAISE_AFTER s later.
PROBE_INTERVAL = 0.5
PROBE_TIMEOUT = 2.0
RAISE_AFTER = 1.0


class WorkerLostError(RuntimeError):
    """A collective failed: a peer worker died, hung or timed out."""


class _Watched:
    """The open `peer_errors` scopes' resume hints, and the peer watch if any."""

    lock = threading.Lock()
    hints: list = []
    watch = None


def _lost_message(cause, hint):
    hint = f" To resume: {hint}" if hint else ""
    return (
        "A collective failed: another worker died, hung or timed out "
        f"(see its log). This worker stops too.{hint} Cause: {cause}"
    )


class peer_errors:  # noqa: N801 (a context manager, used like a function)
    """Turns a failed collective or lost peer into `WorkerLostError` (ending
    with `resume_hint`); the outermost scope ends with one collective all
    workers pass, so a finished worker is never taken for a lost one."""

    def __init__(self, resume_hint: str | None = None):
        self.resume_hint = resume_hint

    def __enter__(self):
        with _Watched.lock:
            _Watched.hints.append(self.resume_hint)
        return self

    def __exit__(self, kind, error, traceback):
        try:
            if error is None and _Watched.watch is not None and len(_Watched.hints) == 1:
                _Watched.watch.all_done()
        except PEER_ERRORS as failure:
            error = failure
        finally:
            with _Watched.lock:
                _Watched.hints.pop()
                if _Watched.watch is not None and not _Watched.hints:
                    _Watched.watch.disarm()
        if type(error) is _PeerLost:  # From the watch: show it as what it is.
            raise WorkerLostError(str(error)).with_traceback(traceback) from None
        watch = _Watched.watch
        lost = watch is not None and watch.lost
        if isinstance(error, WorkerLostError) or not (
            isinstance(error, PEER_ERRORS) or (lost and isinstance(error, Exception))
        ):
            return False
        # Once the watch lost a worker, whatever fails here is a consequence.
        message = lost or str(error).strip()
        cause = message.splitlines()[0] if message else type(error).__name__
        raise WorkerLostError(_lost_message(cause, self.resume_hint)) from error


class _PeerLost(WorkerLostError):
    """What the watch raises in the main thread (it can pass no arguments)."""

    message = ""

    def __init__(self, *args):
        super().__init__(*(args or (self.message,)))


class _PeerWatch:
    """A daemon thread probing the peers; on a loss it aborts the collectives
    and raises `WorkerLostError` in the main thread inside `peer_errors`."""

    def __init__(self, strategy, peers):
        self.strategy, self.peers = strategy, list(peers)
        self.lost, self.raised_at = None, None
        threading.Thread(target=self._run, name="keras_accum_peer_watch", daemon=True).start()

    def _run(self):
        failures = dict.fromkeys(self.peers, 0)
        while self.lost is None:
            time.sleep(PROBE_INTERVAL)
            if not _Watched.hints:
                failures = dict.fromkeys(self.peers, 0)
                continue
            for peer in self.peers:
                try:
                    _compat.eager_context().check_collective_ops_peer_health(
                        peer, timeout_in_ms=int(PROBE_TIMEOUT * 1000)
                    )
                    failures[peer] = 0
                except (tf.errors.UnavailableError, tf.errors.FailedPreconditionError) as e:
                    failures[peer] += 3
                    error = e
                except tf.errors.DeadlineExceededError as e:
                    failures[peer] += 2
                    error = e
                if failures[peer] >= 6:  # 2 refused or 3 timed-out probes in a row
                    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                    self.lost = f"{peer} is lost ({type(error).__name__}: {first})"
                    _compat.eager_context().abort_collective_ops(tf.errors.UNAVAILABLE, self.lost)
                    break
        # A main thread outside a collective gets the error raised (again if swallowed).
        time.sleep(RAISE_AFTER)
        while True:
            with _Watched.lock:
                if not _Watched.hints:
                    return
                if self.raised_at is None or time.monotonic() - self.raised_at > 5:
                    hint = next((h for h in _Watched.hints if h), None)
                    _PeerLost.message = _lost_message(self.lost, hint)
                    _set_async_exc(_PeerLost)
                    self.raised_at = time.monotonic()
            time.sleep(0.2)

    def disarm(self):
        """Drops a pending WorkerLostError (the caller holds `_Watched.lock`)."""
        if self.raised_at is not None:
            _set_async_exc(None)

    def all_done(self):
        """One all-reduce that every worker passes together."""
        strategy = self.strategy

        @tf.function
        def all_reduce_one():
            return strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)

        all_reduce_one()


def _set_async_exc(exception):
    """Raises `exception` (a class; None cancels) in the main thread."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(threading.main_thread().ident),
        ctypes.py_object(exception) if exception is not None else None,
    )


def _peers(cluster, task):
    """TF task names of every task of `cluster` but `task`."""
    own = (task.get("type"), int(task.get("index", 0)))
    return [
        f"/job:{job}/replica:0/task:{i}"
        for job in ("chief", "worker")
        for i in range(len(cluster.get(job, ())))
        if (job, i) != own
    ]


def check_tf_config(text: str | None) -> dict:
    """The parsed TF_CONFIG ({} when unset): `cluster` and a `task` within it."""
    if not text:
        return {}
    example = '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}'
    try:
        tf_config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON ({e}). Expected {example}") from None
    cluster = tf_config.get("cluster") if isinstance(tf_config, dict) else None
    task = tf_config.get("task") if isinstance(tf_config, dict) else None
    jobs_ok = (
        isinstance(cluster, dict)
        and cluster
        and all(
            isinstance(v, list) and v and all(isinstance(a, str) and ":" in a for a in v)
            for v in cluster.values()
        )
    )
    if not jobs_ok or not isinstance(task, dict):
        raise ValueError(f"TF_CONFIG must look like {example}. Received: TF_CONFIG={text!r}")
    job, index = task.get("type"), task.get("index")
    if job not in cluster:
        raise ValueError(
            f"TF_CONFIG task type must be one of {', '.join(map(repr, cluster))}. "
            f"Received: type={job!r}"
        )
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(cluster[job]):
        raise ValueError(
            f"TF_CONFIG task index must be an integer in [0, {len(cluster[job]) - 1}]. "
            f"Received: index={index!r}"
        )
    return tf_config


def multi_worker_environment() -> bool:
    """True when TF_CONFIG names more than one chief or worker task."""
    cluster = check_tf_config(os.environ.get("TF_CONFIG")).get("cluster", {})
    return sum(len(cluster.get(k, ())) for k in ("chief", "worker")) > 1


def strategy_from_environment(collective_timeout: float | None = None) -> tf.distribute.Strategy:
    """The strategy this process should use.

    `MultiWorkerMirroredStrategy` when TF_CONFIG names more than one task
    (a peer watch then stops this worker with `WorkerLostError` inside
    `peer_errors`), `MirroredStrategy` on several GPUs, else the default.
    Build the model after, in its scope. See docs/guides/custom_loop.md.

    Args:
        collective_timeout: seconds after which a collective fails, or None.
            Costs a thread per collective: for debugging.

    Returns:
        The `tf.distribute.Strategy`.
    """
    if multi_worker_environment():
        config = check_tf_config(os.environ["TF_CONFIG"])
        cluster = config["cluster"]
        options = tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=collective_timeout
        )
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        _Watched.watch = _PeerWatch(strategy, _peers(cluster, config.get("task", {})))
        return strategy
    if len(tf.config.list_logical_devices("GPU")) > 1:
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """True on the worker that writes checkpoints, logs and summaries.

    Args:
        strategy: the `tf.distribute` strategy of this process.

    Returns:
        `strategy.extended.should_checkpoint`: True on the chief or a lone worker.
    """
    return bool(getattr(strategy.extended, "should_checkpoint", True))


def data_sharded(dataset):
    """`dataset` sharded by DATA, unless it sets its own auto-shard policy."""
    default = tf.data.Options().experimental_distribute.auto_shard_policy
    if dataset.options().experimental_distribute.auto_shard_policy != default:
        return dataset
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)
