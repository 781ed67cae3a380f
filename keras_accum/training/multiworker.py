"""Run a MultiWorkerMirroredStrategy job as N local processes on 127.0.0.1.

    python -m keras_accum.training.multiworker --num_workers 2 -- \\
        python my_train.py --workdir /tmp/run

starts the command N times with TF_CONFIG on free local ports (worker 0 is
the chief) and waits; a failed worker's peers are killed `grace_seconds`
later and `WorkerFailedError` names it. See docs/guides/custom_loop.md.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


class WorkerFailedError(RuntimeError):
    """A worker exited with an error (or the job timed out)."""


def free_ports(count, host="127.0.0.1"):
    """`count` distinct ports free a moment ago (another program may take one)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(addresses, index):
    """TF_CONFIG of worker `index` in a cluster of `addresses`."""
    return json.dumps(
        {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}}
    )


class LocalCluster:
    """N processes of `argv` with their TF_CONFIG; on exit, kills any still running.

    Args:
        num_workers: number of processes (>= 1).
        argv: the command, e.g. `[sys.executable, "train.py", "--flag"]`.
        env: extra environment variables for every worker.
        worker_env: {index: variables} for single workers.
        log_dir: folder of `worker_<i>.log` (stdout and stderr); default: new.
        grace_seconds: how long the others may run on after a worker failed.
    """

    def __init__(
        self, num_workers, argv, *, env=None, worker_env=None, log_dir=None, grace_seconds=30.0
    ):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(
                f"`num_workers` must be an integer >= 1. Received: num_workers={num_workers!r}"
            )
        if not argv or isinstance(argv, str):
            raise ValueError(f"`argv` must be a non-empty list of strings. Received: argv={argv!r}")
        self.num_workers, self.argv = num_workers, list(argv)
        self.env, self.worker_env = dict(env or {}), dict(worker_env or {})
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="keras_accum_workers")
        self.grace_seconds = grace_seconds
        self.processes = []

    def log_path(self, index):
        return os.path.join(self.log_dir, f"worker_{index}.log")

    def log(self, index):
        with open(self.log_path(index), errors="replace") as f:
            return f.read()

    def start(self):
        os.makedirs(self.log_dir, exist_ok=True)
        addresses = [f"127.0.0.1:{p}" for p in free_ports(self.num_workers)]
        for index in range(self.num_workers):
            env = dict(os.environ, **self.env, **self.worker_env.get(index, {}))
            env.update(PYTHONUNBUFFERED="1", TF_CONFIG=tf_config(addresses, index))
            with open(self.log_path(index), "w") as log:
                self.processes.append(
                    subprocess.Popen(self.argv, env=env, stdout=log, stderr=subprocess.STDOUT)
                )
        return self

    def kill(self, index, sig=signal.SIGKILL):
        if self.processes[index].poll() is None:
            self.processes[index].send_signal(sig)

    def wait(self, timeout=None):
        """Returns the exit codes; `WorkerFailedError` if one fails (the rest
        are killed after `grace_seconds`) or after `timeout` s (all killed)."""
        start, failed_at, first_failure = time.monotonic(), None, None
        while any(p.poll() is None for p in self.processes):
            now = time.monotonic()
            for index, p in enumerate(self.processes):
                if first_failure is None and p.poll() not in (None, 0):
                    first_failure, failed_at = index, now
            if failed_at is not None and now - failed_at > self.grace_seconds:
                self._kill_all()
            if timeout is not None and now - start > timeout:
                self._kill_all()
                raise WorkerFailedError(
                    f"The {self.num_workers} workers did not finish within "
                    f"{timeout} s and were killed; logs in {self.log_dir}."
                )
            time.sleep(0.1)
        codes = [p.returncode for p in self.processes]
        if first_failure is None and any(codes):
            # All exited before we looked: blame a signal before an error.
            first_failure = min(
                (i for i, c in enumerate(codes) if c), key=lambda i: (codes[i] >= 0, i)
            )
        if first_failure is not None:
            tail = self.log(first_failure)[-2000:]
            raise WorkerFailedError(
                f"Worker {first_failure} failed with exit code "
                f"{codes[first_failure]} (all exit codes: {codes}); logs in "
                f"{self.log_dir}. Its log ends with:\n{tail}"
            )
        return codes

    def _kill_all(self):
        for index in range(self.num_workers):
            self.kill(index)
        for p in self.processes:
            p.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self._kill_all()


def launch_local_workers(
    num_workers, argv, *, env=None, log_dir=None, timeout=None, grace_seconds=30.0
):
    """Runs `argv` as `num_workers` local workers; returns the exit codes
    (all 0) or raises `WorkerFailedError`. Arguments as `LocalCluster`'s."""
    with LocalCluster(
        num_workers, argv, env=env, log_dir=log_dir, grace_seconds=grace_seconds
    ) as cluster:
        return cluster.wait(timeout)


def main(args=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument("--log_dir", default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--grace_seconds", type=float, default=30.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    flags = parser.parse_args(args)
    command = flags.command
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        launch_local_workers(
            flags.num_workers,
            command,
            log_dir=flags.log_dir,
            timeout=flags.timeout,
            grace_seconds=flags.grace_seconds,
        )
    except WorkerFailedError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
