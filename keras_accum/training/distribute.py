"""Distribution helpers: the strategy of this process, the chief, data
sharding for multi-worker input, and the error a lost peer raises."""

import contextlib
import json
import os

import tensorflow as tf

PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError)


class WorkerLostError(RuntimeError):
    """A collective failed: a peer worker died, hung or timed out."""


@contextlib.contextmanager
def peer_errors(resume_hint=None):
    """Turns a failed collective (a lost peer) into `WorkerLostError`, whose
    message ends with `resume_hint` (how to resume) when given."""
    try:
        yield
    except PEER_ERRORS as error:
        cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        hint = f" To resume: {resume_hint}" if resume_hint else ""
        raise WorkerLostError(
            "A collective failed: another worker died, hung or timed out "
            f"(see its log). This worker stops too.{hint} Cause: {cause}"
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
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    if len(tf.config.list_logical_devices("GPU")) > 1:
        return tf.distribute.MirroredStrategy()
    return tf.distribute.get_strategy()


def is_chief(strategy):
    """True on the worker that writes checkpoints, logs and summaries."""
    return bool(getattr(strategy.extended, "should_checkpoint", True))


def data_sharded(dataset):
    """Multi-worker: every worker reads the whole pipeline and keeps its
    replicas' part of each global batch (unless the user chose a policy)."""
    default = tf.data.Options().experimental_distribute.auto_shard_policy
    if dataset.options().experimental_distribute.auto_shard_policy != default:
        return dataset
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)
