"""Batch-size schedules study: changing kappa during a run (docs/BATCH_SIZE_SCHEDULES.md).

Two experiments on MNIST-1D (or, with `dataset="char_corpus"`, on the
character-level transformer LM of `keras_accum.experiments.charlm`; `model`
is then ignored), every run of a seed from the same weights and the same
stream of micro-batches (only their grouping into updates changes):

* **switch**: kappa = 1 for the first `switch_examples`, then 8. Per base
  learning rate (tuned at kappa = 1) and method, three runs: constant
  kappa = 1, constant kappa = 8, and the switch.

  | method      | optimizer                                                  |
  |-------------|------------------------------------------------------------|
  | `invariant` | `InvariantAdam(lr, steps=..., scaling_rule="invariant")`   |
  | `power`     | `InvariantAdam(lr, steps=..., scaling_rule="power")`       |
  | `sqrt`      | `GradientAccumulation(Adam(...), steps=...)`, square-root rule |

  The `sqrt` switch re-applies the rule at the switch (lr x sqrt 8,
  1 - beta x 8, eps / sqrt 8) to the same Adam, its moments kept.

  At kappa = 1 `power` is `invariant`: that run is shared. The spread at a
  point is max - min over the runs compared; `ratio` = mean spread of
  {kappa=1, kappa=8, switch} / mean spread of {kappa=1, kappa=8} over the
  points after the switch (<= 2: the switch stays on the constant curves),
  `offset` = mean |switch - kappa=1| there.
* **adaptive**: `InvariantAdam(scaling_rule="power")` under
  `AdaptiveSteps(1, max_steps, micro_batch_size)`, fed every
  `probe_every` examples a B_simple estimate (a `GradientNoiseScale` over
  `probe_windows` probe windows of 8 training micro-batches, drawn with a
  seeded generator), against constant kappa = 1 and kappa = max_steps:
  final losses at equal examples and number of updates.

Speed: one compiled loop per optimizer configuration, reused over seeds and
learning rates by restoring the optimizer's initial variable values.
"""

import functools
import json
import pathlib
import time

import keras
import numpy as np
import tensorflow as tf

import keras_accum as ka
from keras_accum import diagnostics
from keras_accum.experiments import charlm, data
from keras_accum.experiments.invariance.report import METRICS, write_csv
from keras_accum.experiments.invariance.trainer import (
    Trainer,
    load_arrays,
    micro_batch_indices,
)
from keras_accum.training import atomic

DEFAULTS = {
    "dataset": "mnist1d",
    "data_dir": None,
    "model": "mlp",
    "micro_batch_size": 32,
    "beta_1": 0.9,
    "beta_2": 0.999,
    "epsilon": 1e-7,
    "seeds": [0, 1, 2],
    "train_examples": 32768,
    "eval_every": 1024,  # a multiple of the largest window in examples
    "train_eval_examples": 1000,
    # switch experiment
    "switch_kappa": 8,
    "switch_examples": 16384,
    "switch_methods": ["invariant", "power", "sqrt"],
    "switch_learning_rates": [1e-4, 1e-3, 1e-2],
    # adaptive experiment
    "adaptive_learning_rates": [1e-3],
    "adaptive_max_steps": 16,
    "probe_every": 1024,  # examples
    "probe_windows": 4,
    "probe_ema": 0.9,
    "verbose": 1,
}


def resolve_config(config):
    """DEFAULTS updated with `config`; refuses unknown keys and bad values."""
    unknown = sorted(set(config) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"Unknown config key(s) {unknown}. Valid keys: {sorted(DEFAULTS)}")
    c = {**DEFAULTS, **config}
    window = max(c["switch_kappa"], c["adaptive_max_steps"]) * c["micro_batch_size"]
    for key in ("eval_every", "switch_examples", "train_examples", "probe_every"):
        if not isinstance(c[key], int) or c[key] < window or c[key] % window:
            raise ValueError(
                f"`{key}` must be a positive multiple of the largest window "
                f"({window} examples). Received: {key}={c[key]!r}"
            )
    if not set(c["switch_methods"]) <= {"invariant", "power", "sqrt"}:
        raise ValueError(f"Unknown `switch_methods`. Received: {c['switch_methods']!r}")
    return c


# -- optimizers ---------------------------------------------------------------


def make_optimizer(method, steps, c):
    """The optimizer of `method` with `steps` (int or schedule), lr 1e-3
    (set per run); `sqrt` is built with the kappa = steps hyperparameters
    when `steps` is an int, the kappa = 1 ones for a schedule."""
    b1, b2, eps = c["beta_1"], c["beta_2"], c["epsilon"]
    if method in ("invariant", "power"):
        return ka.InvariantAdam(1e-3, b1, b2, eps, steps=steps, scaling_rule=method)
    kappa = steps if isinstance(steps, int) else 1
    h = ka.scale_hyperparameters(kappa, "sqrt", 1e-3, b1, b2, eps)
    return ka.GradientAccumulation(keras.optimizers.Adam(**h), steps=steps)


def _sqrt_learning_rate(lr, kappa):
    return ka.scale_hyperparameters(kappa, "sqrt", lr)["learning_rate"]


class ScheduleTrainer(Trainer):
    """The invariance study's trainer, with runs made of segments: each a
    number of micro-batches, a compiled loop and a learning rate. `build`
    (optional) replaces the model builder (the character LM)."""

    def __init__(self, *args, build=None, **kwargs):
        super().__init__(*args, **kwargs)
        if build is not None:
            self._build = build
            self.model = build()
        self._loops = {}

    def loops(self, key, make, phases=()):
        """(optimizer, one compiled loop per phase, pending changes, initial
        variable values). `phases[i]` changes the optimizer before the loop
        of phase i + 1 is first traced: Python hyperparameters are baked
        into a trace, so each phase keeps its own."""
        if key not in self._loops:
            optimizer = make()
            variables = self.model.trainable_variables
            optimizer.build(variables)
            fns = [
                tf.function(
                    functools.partial(_train_chunk, self._gradient_fn, optimizer, variables)
                )
                for _ in range(len(phases) + 1)
            ]
            pending = dict(enumerate(phases, start=1))
            initial = [v.numpy() for v in optimizer.variables]
            self._loops[key] = (optimizer, fns, pending, initial)
        return self._loops[key]

    def run_segments(self, key, make, segments, weights, xs, ys, chunk, phases=(), probe=None):
        """Trains from `weights`; `segments` = [(micro_batches, phase, lr)].
        Evaluates every `chunk` micro-batches; `probe(optimizer)` runs after
        each chunk. Returns points: examples, updates, window size, metrics."""
        optimizer, loops, pending, initial = self.loops(key, make, phases)
        for variable, value in zip(optimizer.variables, initial):
            variable.assign(value)
        for variable, value in zip(self.model.weights, weights):
            variable.assign(value)
        b = int(xs.shape[1])
        points = [{"examples": 0, "updates": 0, "kappa": _kappa(optimizer), **self.evaluate()}]
        start = 0
        for length, phase, lr in segments:
            optimizer.learning_rate = lr
            for lo in range(start, start + length, chunk):
                if phase in pending:  # before its loop's first (only) trace
                    pending.pop(phase)(optimizer)
                loops[phase](xs[lo : lo + chunk], ys[lo : lo + chunk])
                if probe is not None:
                    probe(optimizer)
                updates = int(optimizer.iterations.numpy())
                points.append(
                    {
                        "examples": (lo + chunk) * b,
                        "updates": updates,
                        "kappa": _kappa(optimizer),
                        **self.evaluate(),
                    }
                )
            start += length
        return points


def _kappa(optimizer):
    """The window size in force (before the first window: the first one's)."""
    if isinstance(optimizer.steps, int):
        return optimizer.steps
    if int(optimizer.micro_step.numpy()) == 0:
        return int(optimizer.steps(0).numpy())
    return int(optimizer.window_steps.numpy())


def _train_chunk(gradient_fn, optimizer, variables, xs, ys):
    for i in tf.range(tf.shape(xs)[0]):
        optimizer.apply(gradient_fn(xs[i], ys[i]), variables)


# -- the study ----------------------------------------------------------------


class Study:
    def __init__(self, config):
        self.config = c = resolve_config(config)
        self.started, self.cpu_started = time.time(), time.process_time()
        if c["dataset"] == charlm.CharCorpus.name:
            self.x_train, self.y_train = charlm.load_arrays("train", c["data_dir"])
            test = charlm.load_arrays("test", c["data_dir"])
            shape, classes, build = (charlm.SEQ_LEN,), charlm.VOCAB_SIZE, charlm.build_lm
        else:
            info = data.dataset_info(c["dataset"], c["data_dir"])
            self.x_train, self.y_train = load_arrays(c["dataset"], "train", c["data_dir"])
            test = load_arrays(c["dataset"], "test", c["data_dir"])
            shape, classes, build = info.input_shape, info.num_classes, None
        n = c["train_eval_examples"]
        self.trainer = ScheduleTrainer(
            c["model"],
            shape,
            classes,
            {"train": (self.x_train[:n], self.y_train[:n]), "test": test},
            c["beta_1"],
            c["beta_2"],
            c["epsilon"],
            build=build,
        )
        self.rows, self.decisions = [], []

    def _log(self, message):
        if self.config["verbose"]:
            elapsed = (time.time() - self.started) / 60
            print(f"[{elapsed:5.1f} min] {message}", flush=True)

    def run(self):
        c = self.config
        b = c["micro_batch_size"]
        for seed in c["seeds"]:
            weights = self.trainer.initial_weights(seed)
            idx = micro_batch_indices(len(self.x_train), b, c["train_examples"] // b, seed)
            stream = (tf.constant(self.x_train[idx]), tf.constant(self.y_train[idx]))
            for lr in c["switch_learning_rates"]:
                self._switch_runs(seed, lr, weights, stream)
            for lr in c["adaptive_learning_rates"]:
                self._adaptive_runs(seed, lr, weights, stream)

    def _record(self, experiment, method, run, lr, seed, points):
        for p in points:
            self.rows.append(
                {
                    "experiment": experiment,
                    "method": method,
                    "run": run,
                    "learning_rate": lr,
                    "seed": seed,
                    **p,
                }
            )
        end = points[-1]
        self._log(
            f"seed {seed} lr {lr:g} {experiment} {method} {run}: train loss "
            f"{end['train_loss']:.4f} test loss {end['test_loss']:.4f} "
            f"updates {end['updates']}"
        )

    def _switch_runs(self, seed, lr, weights, stream):
        c = self.config
        b, kappa = c["micro_batch_size"], c["switch_kappa"]
        total, switch = c["train_examples"] // b, c["switch_examples"] // b
        chunk = c["eval_every"] // b
        for method in c["switch_methods"]:
            sqrt = method == "sqrt"
            for run, steps in (
                ("kappa=1", 1),
                (f"kappa={kappa}", kappa),
                ("switch", ka.PiecewiseSteps([switch], [1, kappa])),
            ):
                if method == "power" and steps == 1:
                    continue  # identical to invariant at kappa = 1
                phases, segments = (), [(total, 0, lr)]
                if sqrt and steps == kappa:
                    segments = [(total, 0, _sqrt_learning_rate(lr, kappa))]
                if run == "switch":
                    segments = [(switch, 0, lr), (total - switch, 1, lr)]
                    if sqrt:
                        phases = (functools.partial(_apply_sqrt_rule, kappa=kappa),)
                        segments[1] = (total - switch, 1, _sqrt_learning_rate(lr, kappa))
                    else:  # the schedule alone switches; one loop
                        segments = [(total, 0, lr)]
                key = ("switch", method, run)
                make = functools.partial(make_optimizer, method, steps, c)
                points = self.trainer.run_segments(
                    key, make, segments, weights, *stream, chunk, phases
                )
                self._record("switch", method, run, lr, seed, points)
                if method == "invariant" and steps == 1 and "power" in c["switch_methods"]:
                    self._record("switch", "power", run, lr, seed, points)

    def _adaptive_runs(self, seed, lr, weights, stream):
        c = self.config
        b, top = c["micro_batch_size"], c["adaptive_max_steps"]
        total, chunk = c["train_examples"] // b, c["probe_every"] // b
        for run, steps in (
            ("kappa=1", 1),
            (f"kappa={top}", top),
            ("adaptive", ka.AdaptiveSteps(1, top, b)),
        ):
            probe = None
            if run == "adaptive":
                # A schedule object is per optimizer: rebuild for each run.
                self.trainer._loops.pop(("adaptive", run), None)
                probe = self._prober(seed)
            make = functools.partial(make_optimizer, "power", steps, c)
            points = self.trainer.run_segments(
                ("adaptive", run), make, [(total, 0, lr)], weights, *stream, chunk, probe=probe
            )
            self._record("adaptive", "power", run, lr, seed, points)
            if run == "adaptive":
                opt = self.trainer._loops[("adaptive", run)][0]
                for micro_step, b_simple, kappa in opt.steps.decisions:
                    self.decisions.append(
                        {
                            "seed": seed,
                            "learning_rate": lr,
                            "micro_step": micro_step,
                            "b_simple": b_simple,
                            "steps": kappa,
                        }
                    )

    def _prober(self, seed):
        """Every call: B_simple from `probe_windows` windows of 8 seeded
        training micro-batches at the current weights, smoothed over calls;
        fed to the optimizer's AdaptiveSteps."""
        c, trainer = self.config, self.trainer
        b, kappa = c["micro_batch_size"], 8
        tracker = diagnostics.GradientNoiseScale(c["probe_ema"])
        rng = np.random.default_rng([seed, 3])

        @tf.function(autograph=False)
        def window(xw, yw):
            micro = [trainer._gradient_fn(xw[j], yw[j]) for j in range(kappa)]
            tracker.update_from_micro_grads(micro, b)

        def probe(optimizer):
            for _ in range(c["probe_windows"]):
                idx = rng.choice(len(self.x_train), kappa * b, replace=False).reshape(kappa, b)
                window(tf.constant(self.x_train[idx]), tf.constant(self.y_train[idx]))
            optimizer.steps.observe(tracker.b_simple)

        return probe

    def write(self, workdir):
        from keras_accum.experiments import schedules_report

        workdir = pathlib.Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        atomic.atomic_write_text(workdir / "config.json", json.dumps(self.config, indent=2) + "\n")
        write_csv(workdir / "runs.csv", self.rows)
        if self.decisions:  # none without adaptive runs
            write_csv(workdir / "decisions.csv", self.decisions)
        seconds = time.time() - self.started
        cpu = time.process_time() - self.cpu_started
        schedules_report.write_report(self.rows, self.decisions, self.config, workdir)
        summary = {
            "rows": len(self.rows),
            "seconds": round(seconds, 1),
            "cpu_seconds": round(cpu, 1),
        }
        # Last: a folder without summary.json is an unfinished study.
        atomic.atomic_write_text(workdir / "summary.json", json.dumps(summary, indent=2) + "\n")


def _apply_sqrt_rule(optimizer, kappa):
    """The square-root rule re-applied to the inner Adam at the switch."""
    inner = optimizer.inner_optimizer
    h = ka.scale_hyperparameters(kappa, "sqrt", 1.0, inner.beta_1, inner.beta_2, inner.epsilon)
    inner.beta_1, inner.beta_2, inner.epsilon = h["beta_1"], h["beta_2"], h["epsilon"]


def run_study(config, workdir):
    study = Study(config)
    study.run()
    study.write(workdir)
    return study


__all__ = ["DEFAULTS", "METRICS", "Study", "resolve_config", "run_study"]
