"""MultiWorkerMirroredStrategy: 2 local worker processes on 127.0.0.1.

Each worker has one CPU replica; the job (tests/_train_job.py) is linear
regression with GradientAccumulation(Adam), a reshuffled data set and a
short last batch per epoch.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_accum.training import multiworker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = [sys.executable, os.path.join(ROOT, "tests", "_train_job.py")]
ENV = {"PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}


def two_workers_against_one_process(tmp_path, workers_args, process_args):
    """Runs the job on 2 local workers and in one process; asserts both
    finished and that their final weights agree to float32 rounding."""
    codes = multiworker.launch_local_workers(
        2,
        JOB + ["--workdir", str(tmp_path / "multi"), *workers_args],
        env=ENV,
        log_dir=str(tmp_path / "logs"),
        timeout=300,
    )
    assert codes == [0, 0]
    process = subprocess.run(
        JOB + ["--workdir", str(tmp_path / "process"), *process_args],
        env=dict(os.environ, **ENV),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    expected = np.load(tmp_path / "process" / "final.npz")
    actual = np.load(tmp_path / "multi" / "final.npz")
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6)


def test_two_workers_equal_one_process(tmp_path):
    # 2 workers x 1 replica x 2 micro-steps against 1 process x 1 replica x
    # 4 micro-steps: kappa = 4 both ways, and GradientAccumulation with item
    # weights is the big-batch Adam step, also for the short batches. Equal
    # to float32 rounding (the sums are taken in another order).
    two_workers_against_one_process(
        tmp_path, ["--steps", "2", "--epochs", "2"], ["--steps", "4", "--epochs", "2"]
    )
    # Only the chief wrote checkpoints and logs.
    assert (tmp_path / "multi" / "checkpoints").is_dir()
    assert sorted(os.listdir(tmp_path / "multi")) == [
        "checkpoints",
        "config.json",
        "final.npz",
        "log.jsonl",
        "tensorboard",
    ]


def test_two_workers_invariant_adam_equal_two_replicas_of_one_process(tmp_path):
    # InvariantAdam's window end all-reduces every replica-local moment in
    # one batched call: across two workers (collective ops) the same as
    # across two replicas of one process, micro-batch for micro-batch.
    args = ["--steps", "2", "--epochs", "2", "--optimizer", "invariant"]
    two_workers_against_one_process(tmp_path, args, args + ["--replicas", "2"])


def test_killed_worker_stops_the_survivor(tmp_path):
    # Worker 1 is SIGKILLed mid-run. Worker 0 must leave its collective with
    # an error by itself (TF's coordination service notices the missing
    # heartbeats) within a bounded time, not hang; the launcher then reports
    # the first failure. The bound is a hang guard, not a timing claim.
    cluster = multiworker.LocalCluster(
        2,
        JOB + ["--workdir", str(tmp_path / "run"), "--epochs", "50", "--sleep", "0.2"],
        env=ENV,
        log_dir=str(tmp_path / "logs"),
        grace_seconds=120,
    )
    with cluster:
        deadline = time.monotonic() + 180
        while "window 3" not in cluster.log(1):
            assert all(p.poll() is None for p in cluster.processes), cluster.log(0) + cluster.log(1)
            assert time.monotonic() < deadline
            time.sleep(0.1)
        cluster.kill(1, signal.SIGKILL)
        killed_at = time.monotonic()
        survivor = cluster.processes[0]
        try:
            survivor.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(
                "the surviving worker still runs 60 s after its "
                "peer died:\n" + cluster.log(0)[-3000:]
            )
        assert time.monotonic() - killed_at < 60
        assert survivor.returncode != 0
        assert "WorkerLostError" in cluster.log(0), cluster.log(0)[-3000:]
        # The project's own error, with how to resume; no raw TF error.
        assert "To resume: the same command" in cluster.log(0)
        assert not cluster.log(0).rstrip().splitlines()[-1].startswith("tensorflow.python")
        with pytest.raises(
            multiworker.WorkerFailedError, match=r"Worker 1 failed with exit code -9"
        ):
            cluster.wait(timeout=10)


def _seconds_to_worker_lost(cluster, survivor, killed_at, limit=60):
    """Seconds from `killed_at` until the survivor's log shows the
    WorkerLostError (polled every 50 ms), or None after `limit` s."""
    while time.monotonic() - killed_at < limit:
        if "WorkerLostError: " in cluster.log(survivor):
            return time.monotonic() - killed_at
        if cluster.processes[survivor].poll() is not None:
            return (
                time.monotonic() - killed_at
                if "WorkerLostError: " in cluster.log(survivor)
                else None
            )
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("victim", [0, 1])
def test_worker_lost_early_stops_the_other_within_10_s(tmp_path, victim):
    # The bound: a worker SIGKILLed as soon as the cluster has
    # formed stops the other one with WorkerLostError and the resume hint
    # within 10 s, on either side (worker 0 hosts TF's coordination
    # service). The other one is then in 15 s of Python work with no
    # collective (as when tracing a big first step, which took 10.6-20 s to
    # end before the peer watch): only the watch can stop it in time. A
    # correctness bound with a wide margin (about 2 s measured on a loaded
    # 2-core machine), not a speed claim.
    cluster = multiworker.LocalCluster(
        2,
        JOB + ["--workdir", str(tmp_path / "run"), "--epochs", "3", "--busy", "15"],
        env=ENV,
        log_dir=str(tmp_path / "logs"),
        grace_seconds=120,
    )
    survivor = 1 - victim
    with cluster:
        deadline = time.monotonic() + 180
        while "cluster formed" not in cluster.log(victim):
            assert all(p.poll() is None for p in cluster.processes), cluster.log(0) + cluster.log(1)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cluster.kill(victim, signal.SIGKILL)
        seconds = _seconds_to_worker_lost(cluster, survivor, time.monotonic())
        log = cluster.log(survivor)
        assert seconds is not None, log[-3000:]
        print(f"worker {victim} killed: WorkerLostError on worker {survivor} after {seconds:.2f} s")
        assert seconds <= 10, (seconds, log[-3000:])
        assert cluster.processes[survivor].wait(timeout=60) != 0
        last = cluster.log(survivor).rstrip().splitlines()[-1]
        assert last.startswith("keras_accum.training.distribute.WorkerLostError: "), last
        assert "To resume: the same command" in last


def test_launcher_kills_the_rest_after_a_failure(tmp_path):
    # A worker that fails while the other one would run on: the launcher
    # kills the other after grace_seconds and raises.
    script = (
        "import os, sys, time, json\n"
        "i = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
        "sys.exit(3) if i == 1 else time.sleep(600)\n"
    )
    start = time.monotonic()
    with pytest.raises(multiworker.WorkerFailedError, match=r"Worker 1 failed with exit code 3"):
        multiworker.launch_local_workers(
            2, [sys.executable, "-c", script], log_dir=str(tmp_path), grace_seconds=1, timeout=120
        )
    assert time.monotonic() - start < 60


def test_launcher_arguments():
    with pytest.raises(ValueError, match="num_workers=0"):
        multiworker.LocalCluster(0, JOB)
    with pytest.raises(ValueError, match="argv="):
        multiworker.LocalCluster(2, "python job.py")
    ports = multiworker.free_ports(3)
    assert len(set(ports)) == 3
