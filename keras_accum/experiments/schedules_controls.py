"""Controls for the character-LM batch-size warmup (issue #35).

The warmup result of docs/BATCH_SIZE_SCHEDULES.md compared an adaptive
schedule with weak baselines. This study runs, on the same character LM
(`keras_accum.experiments.charlm`) and the same example budget, named
*arms*, each a window schedule with InvariantAdam (`scaling_rule`, the
published result's `"fixed_beta_1"` by default):

* `{"steps": 4}`: constant kappa;
* `{"steps": [[512, 1024], [1, 2, 4]]}`: a `PiecewiseSteps` (boundaries in
  micro-steps, fixed in the config before any test loss is seen);
* `{"steps": "adaptive"}`: `AdaptiveSteps(1, max_kappa, micro_batch_size,
  powers_of_two=True, **adaptive)` with its default smoothing and settling,
  fed at every evaluation the B_simple of `probe_windows` seeded windows of
  8 training micro-batches (a `GradientNoiseScale`, EMA `probe_ema`) in the
  norm of `estimate` (`"b_simple"` or `"adam_preconditioned"`); both
  estimates of the same probe gradients are logged;
* `"decay": "cosine"`: the learning rate falls as a cosine to zero over the
  arm's micro-batches (a schedule InvariantAdam evaluates at micro-batches
  consumed); `"wsd"`: warmup-stable-decay, constant then linearly to zero
  over the last `wsd_decay` fraction of them (Hägele et al. 2024; no lr
  warmup, like the cosine arm); else constant;
* `"ramp"` (with a piecewise `steps`): `PiecewiseSteps(..., ramp=ramp)`, each
  switch reached through the integers between (micro-steps);
* `"lr_ramp"` (with a piecewise `steps` of one switch 1 -> k): the lr
  schedule times 1/k at the switch, back to 1 linearly over `lr_ramp`
  micro-steps: under `"fixed_beta_1"` the per-update lr goes from 1x to kx
  kappa = 1's over the ramp instead of at once (what a ramp of the scaled
  lr inside InvariantAdam would do, emulated through the lr schedule);
* `"lr_scale"` (with a piecewise `steps` of one switch 1 -> k): the lr
  schedule times `lr_scale` from the switch on (1/k keeps the per-update
  lr of kappa = 1 under every rule: the switch then changes the betas and
  not the step size);
* `"scaling_rule"`: the arm's own InvariantAdam rule, else the study's;
* `"beta_forms"` ([form of beta_1, form of beta_2], each `"linear"`,
  `"power"` or `"fixed"`, see `keras_accum.scaling.BETA_FORMS`): the
  window's betas scaled so instead of as the rule says (lr_k = kappa_k lr
  as under every rule; `ArmInvariantAdam`, a study-only variant);
* `"bias_correction": "updates"`: the bias correction from the update
  count at the window's betas, sqrt(1 - beta_2,k ** k) / (1 - beta_1,k ** k),
  instead of the products P_i of the betas used (what Adam given the
  scaled betas would compute; it jumps at a switch where P_i does not;
  `ArmInvariantAdam`);
* `"learning_rates"`, `"examples"`, `"seeds"`: the arm's own, else the
  study's.

`task` picks the model and data: `"charlm"` (the default) or
`"mnist1d_cnn"`, the MNIST-1D CNN (`models.cnn`, 5,210 parameters) on
MNIST-1D (`data.py`, offline; 4000 train / 1000 test examples).

Protocol: the last `validation_examples` examples (sequences) of the task's
train split are a validation split, never trained on; tuning reads `val_loss`,
reported numbers `test_loss`. Every run of a seed starts from the same
weights and reads the same seeded stream of micro-batches (a longer arm
reads a longer prefix of it). With `deterministic`, TensorFlow's op
determinism is on and its thread pools have `threads` threads: two runs of
one seed give the same curve (`repeat` reruns the first seed of the named
arms to measure it).

Rows: one per evaluation (every `eval_every` sequences) with `micro_batches`,
`gradient_evaluations` (micro-batches trained plus probe micro-batches),
`seconds` and `cpu_seconds` (wall and process CPU time of training and
probing, evaluations excluded; the wall time depends on the machine's load). Written
after every run: an interrupted study keeps its finished runs.
"""

import functools
import json
import math
import pathlib
import time

import keras
import numpy as np
import tensorflow as tf
from keras import ops

import keras_accum as ka
from keras_accum import _compat, equations, scaling, schedules
from keras_accum.experiments import charlm, data, optimizers, study_runner
from keras_accum.experiments import config as cfg
from keras_accum.experiments.invariance.report import write_csv
from keras_accum.experiments.study_runner import StudyRunner, micro_batch_indices
from keras_accum.training import atomic

F = cfg.Field
PROBE_KAPPA = 8  # micro-batches per probe window
ESTIMATES = tuple(ka.diagnostics.NOISE_ESTIMATES)
_RULES = ka.scaling.SCALING_RULES[:-1]

TASKS = ("charlm", "mnist1d_cnn")

FIELDS = [
    F("task", "str", "charlm", "Model and data", choices=TASKS),
    F("data_dir", "path", None, "TFDS data_dir"),
    F("micro_batch_size", "int", 16, "Sequences per micro-batch", minimum=1),
    cfg.fraction("beta_1", 0.9, "Adam beta_1 at kappa = 1"),
    cfg.fraction("beta_2", 0.999, "Adam beta_2 at kappa = 1"),
    F("epsilon", "float", 1e-7, "Adam epsilon", minimum=0.0, open_minimum=True),
    F(
        "scaling_rule",
        "str",
        "fixed_beta_1",
        "InvariantAdam rule",
        choices=ka.scaling.SCALING_RULES[:-1],
    ),
    F("seeds", "list", [0], "Seeds", item=F("", "int", 0, "", minimum=0)),
    F("learning_rates", "list", [3e-3], "Base lrs", minimum=1, item=cfg.POSITIVE),
    F("train_examples", "int", 49152, "Sequences per run", minimum=1),
    F("eval_every", "int", 1024, "Sequences between evaluations", minimum=1),
    F("train_eval_examples", "int", 256, "Train sequences for the train loss", minimum=1),
    F("validation_examples", "int", 512, "Train sequences held out for tuning", minimum=1),
    F("max_kappa", "int", 8, "Largest window (a power of two)", minimum=1),
    F("probe_windows", "int", 4, "Probe windows per estimate", minimum=1),
    cfg.fraction("probe_ema", 0.9, "EMA of the probes' B_simple"),
    F("arms", "dict", {"kappa=1": {"steps": 1}}, "name -> arm spec (module docstring)"),
    F(
        "repeat",
        "list",
        [],
        "Arms rerun once for the first seed (determinism)",
        minimum=0,
        item=F("", "str", "x", ""),
    ),
    cfg.fraction("wsd_decay", 0.2, "Fraction of a WSD arm's micro-batches spent decaying"),
    F("threads", "int", 1, "TensorFlow intra- and inter-op threads", minimum=1),
    F("deterministic", "bool", True, "TensorFlow op determinism"),
    F("verbose", "int", 1, "1: a line per run, 0: silent", choices=(0, 1)),
]
_ARM_KEYS = {
    "steps",
    "decay",
    "learning_rates",
    "examples",
    "estimate",
    "adaptive",
    "seeds",
    "ramp",
    "lr_ramp",
    "lr_scale",
    "scaling_rule",
    "beta_forms",
    "bias_correction",
}
BETA_FORMS = ("linear", "power", "fixed")
BIAS_CORRECTIONS = ("products", "updates")
DECAYS = ("constant", "cosine", "wsd")


def _check_arms(c):
    b, k = c["micro_batch_size"], c["max_kappa"]
    chunk, window = c["eval_every"] // b, k * b
    if k & (k - 1):
        raise cfg.ConfigError(f"`max_kappa` must be a power of two. Received: max_kappa={k}")
    if c["eval_every"] % window:
        raise cfg.ConfigError(
            f"`eval_every` must be a multiple of max_kappa x micro_batch_size ({window}). "
            f"Received: eval_every={c['eval_every']}"
        )
    for name, arm in c["arms"].items():
        where = f"arms[{name!r}]"
        if not isinstance(arm, dict) or set(arm) - _ARM_KEYS or "steps" not in arm:
            raise cfg.ConfigError(
                f"{where} must be a dict with `steps` and optionally "
                f"{sorted(_ARM_KEYS - {'steps'})}. Received: {arm!r}"
            )
        examples = arm.get("examples", c["train_examples"])
        if examples % c["eval_every"]:
            raise cfg.ConfigError(f"{where}: examples must be a multiple of eval_every")
        steps = arm["steps"]
        if isinstance(steps, int):
            ok = 1 <= steps <= k and not steps & (steps - 1)
        elif steps == "adaptive":
            ok = arm.get("estimate", "b_simple") in ESTIMATES
        else:
            try:
                bounds, values = steps
                ok = len(values) == len(bounds) + 1 and all(m % chunk == 0 for m in bounds)
                ok = ok and all(v <= k and not v & (v - 1) for v in values)
            except (TypeError, ValueError):
                ok = False
        if not ok:
            raise cfg.ConfigError(
                f"{where}: `steps` must be a power of two <= max_kappa, 'adaptive' (estimate in "
                f"{ESTIMATES}) or [boundaries (multiples of {chunk} micro-steps), values]. "
                f"Received: {arm!r}"
            )
        if arm.get("decay", "constant") not in DECAYS:
            raise cfg.ConfigError(f"{where}: `decay` must be one of {DECAYS}")
        if "ramp" in arm and (isinstance(steps, (int, str)) or not isinstance(arm["ramp"], int)):
            raise cfg.ConfigError(f"{where}: `ramp` is an int, with a piecewise `steps` only")
        if "lr_ramp" in arm and (
            isinstance(steps, (int, str)) or len(steps[0]) != 1 or steps[1][0] != 1
        ):
            raise cfg.ConfigError(f"{where}: `lr_ramp` needs a piecewise `steps` 1 -> k")
        if "lr_scale" in arm and (
            isinstance(steps, (int, str))
            or len(steps[0]) != 1
            or steps[1][0] != 1
            or isinstance(arm["lr_scale"], bool)
            or not isinstance(arm["lr_scale"], (int, float))
            or not arm["lr_scale"] > 0
            or "lr_ramp" in arm
        ):
            raise cfg.ConfigError(
                f"{where}: `lr_scale` is a number > 0, with a piecewise `steps` 1 -> k and "
                "no `lr_ramp`"
            )
        if arm.get("scaling_rule", c["scaling_rule"]) not in _RULES:
            raise cfg.ConfigError(f"{where}: `scaling_rule` must be one of {_RULES}")
        forms = arm.get("beta_forms", ["fixed", "fixed"])
        if (
            not isinstance(forms, (list, tuple))
            or len(forms) != 2
            or any(f not in BETA_FORMS for f in forms)
        ):
            raise cfg.ConfigError(
                f"{where}: `beta_forms` must be [form of beta_1, form of beta_2], each one of "
                f"{BETA_FORMS}. Received: {forms!r}"
            )
        if arm.get("bias_correction", "products") not in BIAS_CORRECTIONS:
            raise cfg.ConfigError(f"{where}: `bias_correction` must be one of {BIAS_CORRECTIONS}")
    unknown = set(c["repeat"]) - set(c["arms"])
    if unknown:
        raise cfg.ConfigError(f"`repeat` names arms that do not exist: {sorted(unknown)}")


SCHEMA = cfg.Schema("schedules controls", FIELDS, [_check_arms])
DEFAULTS = SCHEMA.defaults()


def resolve_config(config):
    return SCHEMA.resolve(config)


def configure_determinism(threads, deterministic=True):
    """Op determinism and `threads`-thread pools (the pools only take
    effect before TensorFlow's runtime starts: a process that has already
    run an op keeps its own, said in the return value)."""
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:
        return False
    return True


@keras.saving.register_keras_serializable(package="keras_accum_experiments")
class CosineToZero(keras.optimizers.schedules.LearningRateSchedule):
    """peak x (1 + cos(pi min(t, total) / total)) / 2: from `peak` (a
    variable, so one trace serves every learning rate) to 0 at `total`."""

    def __init__(self, peak, total):
        self.peak, self.total = peak, int(total)

    def __call__(self, step):
        t = tf.minimum(tf.cast(step, tf.float32), float(self.total))
        return self.peak * 0.5 * (1.0 + tf.cos(math.pi * t / self.total))

    def get_config(self):
        return {"peak": float(self.peak.numpy()), "total": self.total}


@keras.saving.register_keras_serializable(package="keras_accum_experiments")
class WarmupStableDecay(keras.optimizers.schedules.LearningRateSchedule):
    """`peak` (a variable) until `total` x (1 - `decay`), then linearly to 0
    at `total` (the "stable" and "decay" phases of WSD; no lr warmup)."""

    def __init__(self, peak, total, decay=0.2):
        self.peak, self.total, self.decay = peak, int(total), float(decay)

    def __call__(self, step):
        t = tf.minimum(tf.cast(step, tf.float32), float(self.total))
        length = self.decay * self.total
        # factor = min(1, (total - t) / (decay x total))
        return self.peak * tf.minimum(1.0, (self.total - t) / length)

    def get_config(self):
        return {"peak": float(self.peak.numpy()), "total": self.total, "decay": self.decay}


@keras.saving.register_keras_serializable(package="keras_accum_experiments")
class SwitchLrRamp(keras.optimizers.schedules.LearningRateSchedule):
    """`inner`(t) x f(t): f = 1 before `at`, 1/`ratio` at `at`, back to 1
    linearly over `ramp` micro-batches (the per-update lr of a switch
    1 -> ratio under "fixed_beta_1" ramped from 1x to ratio x)."""

    def __init__(self, inner, at, ramp, ratio):
        self.inner, self.at, self.ramp, self.ratio = inner, int(at), int(ramp), float(ratio)

    def __call__(self, step):
        t = tf.cast(step, tf.float32)
        done = tf.clip_by_value((t - self.at) / self.ramp, 0.0, 1.0)
        # f = 1/ratio + (1 - 1/ratio) x done after the switch
        f = tf.where(t < self.at, 1.0, 1.0 / self.ratio + (1.0 - 1.0 / self.ratio) * done)
        return self.inner(step) * f

    def get_config(self):
        return {"at": self.at, "ramp": self.ramp, "ratio": self.ratio}


@keras.saving.register_keras_serializable(package="keras_accum_experiments")
class SwitchLrScale(keras.optimizers.schedules.LearningRateSchedule):
    """`inner`(t) before `at`, `inner`(t) x `factor` from `at` on (with
    `factor` = 1/k the per-update lr of a switch 1 -> k stays kappa = 1's)."""

    def __init__(self, inner, at, factor):
        self.inner, self.at, self.factor = inner, int(at), float(factor)

    def __call__(self, step):
        t = tf.cast(step, tf.float32)
        return self.inner(step) * tf.where(t < self.at, 1.0, self.factor)

    def get_config(self):
        return {"at": self.at, "factor": self.factor}


class ArmInvariantAdam(ka.InvariantAdam):
    """InvariantAdam with two study-only departures, each to change one
    thing at a switch (issue #42, the causes of the spike):

    * `beta_forms` (form of beta_1, form of beta_2): a window's betas
      scaled by these forms of `keras_accum.scaling.BETA_FORMS` instead of
      the rule's (lr_k = kappa_k lr stays as under every rule); e.g.
      ("fixed", "fixed") keeps beta_2 per update at its kappa = 1 value,
      where "fixed_beta_1" takes it to beta_2 ** kappa.
    * `bias_correction="updates"`: alpha_k = lr_k sqrt(1 - beta_2,k ** k) /
      (1 - beta_1,k ** k) with k the update count and beta_i,k this
      window's betas, as Adam given the scaled betas would compute, instead
      of the library's products P_i of the betas each window used (which
      make the correction at a switch that of kappa = 1 at the same
      examples under "fixed_beta_1" and "power"). The products are still
      kept.
    """

    def __init__(self, *args, beta_forms=None, bias_correction="products", **kwargs):
        super().__init__(*args, **kwargs)
        forms = scaling.BETA_FORMS[self.scaling_rule] if beta_forms is None else beta_forms
        self.beta_forms = tuple(forms)
        top = schedules.steps_range(self.steps)[1]
        for (name, beta), form in zip((("beta_1", self.beta_1), ("beta_2", self.beta_2)), forms):
            if form == "linear":
                scaling.check_linear_beta(top, name, beta, argument="beta_forms")
        self.bias_correction = bias_correction

    def _window_factors(self, replicas):
        steps = self.window_steps
        if not isinstance(steps, int):
            steps = ops.cast(steps, "float32")
        kappa = steps * replicas
        form_1, form_2 = self.beta_forms
        return (
            steps,
            equations.one_minus_beta(self.beta_1, kappa, form_1),
            equations.one_minus_beta(self.beta_2, kappa, form_2),
        )

    def _scaled_rate(self, replicas, keep=True):
        learning_rate, correction = super()._scaled_rate(replicas, keep)
        if self.bias_correction == "products":
            return learning_rate, correction
        _, rate_1, rate_2 = self._window_factors(replicas)
        k = ops.cast(_compat.update_counter(self), "float32") + 1.0
        beta_1 = 1.0 - ops.convert_to_tensor(rate_1, "float32")
        beta_2 = 1.0 - ops.convert_to_tensor(rate_2, "float32")
        # sqrt(1 - beta_2,k ** k) / (1 - beta_1,k ** k)
        correction = ops.sqrt(1.0 - ops.power(beta_2, k)) / (1.0 - ops.power(beta_1, k))
        return learning_rate, correction


@keras.saving.register_keras_serializable(package="keras_accum_experiments")
class Constant(keras.optimizers.schedules.LearningRateSchedule):
    """`peak` (a variable) at every step."""

    def __init__(self, peak):
        self.peak = peak

    def __call__(self, step):
        return self.peak * tf.ones_like(tf.cast(step, tf.float32))

    def get_config(self):
        return {"peak": float(self.peak.numpy())}


def arm_steps(arm, c):
    """The `steps` argument of the arm's optimizer."""
    steps = arm["steps"]
    if isinstance(steps, int):
        return steps
    if steps == "adaptive":
        kwargs = {"powers_of_two": True, **arm.get("adaptive", {})}
        return ka.AdaptiveSteps(
            1,
            c["max_kappa"],
            c["micro_batch_size"],
            noise_estimate=arm.get("estimate", "b_simple"),
            **kwargs,
        )
    if "ramp" in arm:
        return ka.PiecewiseSteps(*steps, ramp=arm["ramp"])
    return ka.PiecewiseSteps(*steps)


def _task(task, data_dir):
    """(load(split) -> (x, y) numpy, input shape, classes, build, model name)."""
    if task == "mnist1d_cnn":
        shape = data.dataset_info("mnist1d", data_dir).input_shape
        load = functools.partial(study_runner.load_arrays, "mnist1d", data_dir=data_dir)
        return load, shape, 10, None, "cnn"
    load = functools.partial(charlm.load_arrays, data_dir=data_dir)
    return load, (charlm.SEQ_LEN,), charlm.VOCAB_SIZE, charlm.build_lm, None


class ControlsStudy:
    def __init__(self, config):
        self.config = c = resolve_config(config)
        self.threads_set = configure_determinism(c["threads"], c["deterministic"])
        self.started = time.time()
        load, shape, classes, build, model = _task(c["task"], c["data_dir"])
        x, y = load("train")
        n_val = c["validation_examples"]
        self.x_train, self.y_train = x[:-n_val], y[:-n_val]
        n = c["train_eval_examples"]
        eval_data = {
            "train": (self.x_train[:n], self.y_train[:n]),
            "validation": (x[-n_val:], y[-n_val:]),
            "test": load("test"),
        }
        self.trainer = StudyRunner(model, shape, classes, eval_data, build=build)
        self.rows, self.decisions, self.timings = [], [], []
        self._peaks = {}

    def _log(self, message):
        if self.config["verbose"]:
            print(f"[{(time.time() - self.started) / 60:5.1f} min] {message}", flush=True)

    def runs(self):
        """(arm, seed, lr, rerun) in the order run: arm by arm (the config's
        order: an interrupted study has its first arms complete), each arm
        of `repeat` followed by a rerun of its first run."""
        c = self.config
        out = []
        for name, arm in c["arms"].items():
            rates = arm.get("learning_rates", c["learning_rates"])
            seeds = arm.get("seeds", c["seeds"])
            out += [(name, seed, lr, 0) for lr in rates for seed in seeds]
            if name in c["repeat"]:
                out.append((name, seeds[0], rates[0], 1))
        return out

    def run(self, workdir=None):
        for name, seed, lr, rerun in self.runs():
            self.run_one(name, seed, lr, rerun)
            if workdir is not None:
                self.write(workdir, final=False)

    def _stream(self, seed, micro_batches):
        b = self.config["micro_batch_size"]
        idx = micro_batch_indices(len(self.x_train), b, micro_batches, seed)
        return tf.constant(self.x_train[idx]), tf.constant(self.y_train[idx])

    def _make(self, name, arm, total):
        c = self.config
        lr = 1e-3
        decay = arm.get("decay", "constant")
        if decay != "constant" or "lr_ramp" in arm or "lr_scale" in arm:
            peak = tf.Variable(1e-3, trainable=False, dtype="float32", name="peak_lr")
            self._peaks[name] = peak
            if decay == "cosine":
                lr = CosineToZero(peak, total)
            elif decay == "wsd":
                lr = WarmupStableDecay(peak, total, c["wsd_decay"])
            else:
                lr = Constant(peak)
            if "lr_ramp" in arm:
                [at], [_, ratio] = arm["steps"]
                lr = SwitchLrRamp(lr, at, arm["lr_ramp"], ratio)
            if "lr_scale" in arm:
                lr = SwitchLrScale(lr, arm["steps"][0][0], arm["lr_scale"])
        hyper = {"learning_rate": lr, "beta_1": c["beta_1"], "beta_2": c["beta_2"]}
        hyper["epsilon"] = c["epsilon"]
        steps = arm_steps(arm, c)
        rule = arm.get("scaling_rule", c["scaling_rule"])
        if "beta_forms" in arm or "bias_correction" in arm:
            return ArmInvariantAdam(
                **hyper,
                steps=steps,
                scaling_rule=rule,
                beta_forms=arm.get("beta_forms"),
                bias_correction=arm.get("bias_correction", "products"),
            )
        return optimizers.build("invariant_adam", steps, hyper, scaling_rule=rule)

    def run_one(self, name, seed, lr, rerun=0):
        c = self.config
        arm, b = c["arms"][name], c["micro_batch_size"]
        total = arm.get("examples", c["train_examples"]) // b
        chunk = c["eval_every"] // b
        adaptive = arm["steps"] == "adaptive"
        keras.utils.set_random_seed(seed)
        weights = self.trainer.initial_weights(seed)
        xs, ys = self._stream(seed, total)
        make = functools.partial(self._make, name, arm, total)
        optimizer, loops, _, initial = self.trainer.loops((name,), make)
        for variable, value in zip(optimizer.variables, initial):
            variable.assign(value)
        for variable, value in zip(self.trainer.model.weights, weights):
            variable.assign(value)
        if name in self._peaks:
            self._peaks[name].assign(lr)
        else:
            optimizer.learning_rate = lr
        probe = self._prober(name, optimizer, seed, lr, rerun) if adaptive else None
        if adaptive:
            optimizer.steps.decisions.clear()
        seconds, cpu, gradients = 0.0, 0.0, 0
        points = [self._point(optimizer, 0, 0, 0.0, 0.0)]
        for lo in range(0, total, chunk):
            started, cpu_started = time.perf_counter(), time.process_time()
            loops[0](xs[lo : lo + chunk], ys[lo : lo + chunk])
            gradients += chunk
            if probe is not None:
                gradients += probe(optimizer)
            float(optimizer.iterations.numpy())  # the work is done: stop the clock
            seconds += time.perf_counter() - started
            cpu += time.process_time() - cpu_started
            points.append(self._point(optimizer, (lo + chunk) * b, gradients, seconds, cpu))
        for p in points:
            self.rows.append({"arm": name, "seed": seed, "learning_rate": lr, "rerun": rerun, **p})
        self.timings.append(
            {
                "arm": name,
                "seed": seed,
                "learning_rate": lr,
                "rerun": rerun,
                "seconds": round(seconds, 3),
                "cpu_seconds": round(cpu, 3),
            }
        )
        end = points[-1]
        self._log(
            f"{name} seed {seed} lr {lr:g}{' (rerun)' * rerun}: val {end['val_loss']:.4f} "
            f"test {end['test_loss']:.4f} updates {end['updates']} "
            f"gradients {end['gradient_evaluations']} {seconds:.1f} s"
        )
        return points

    def _point(self, optimizer, examples, gradients, seconds, cpu):
        from keras_accum.experiments.study_runner import window_size

        metrics = self.trainer.evaluate()
        return {
            "examples": examples,
            "micro_batches": examples // self.config["micro_batch_size"],
            "updates": int(optimizer.iterations.numpy()),
            "kappa": window_size(optimizer),
            "gradient_evaluations": gradients,
            "seconds": round(seconds, 4),
            "cpu_seconds": round(cpu, 4),
            **metrics,
        }

    def _prober(self, name, optimizer, seed, lr, rerun):
        """probe(optimizer): `probe_windows` windows of 8 seeded micro-batches
        at the current weights into two trackers (both norms, the same
        gradients); the arm's estimate goes to `observe`. Returns the
        gradient evaluations spent."""
        c = self.config
        b, windows = c["micro_batch_size"], c["probe_windows"]
        key = ("probe", name)
        if key not in self.trainer._probes:
            trackers = {
                e: ka.diagnostics.GradientNoiseScale(
                    c["probe_ema"], squared_norm=ka.diagnostics.noise_estimate_norm(e, optimizer)
                )
                for e in ESTIMATES
            }

            @tf.function(autograph=False)
            def window(xw, yw):
                micro = [self.trainer.gradient(xw[j], yw[j]) for j in range(PROBE_KAPPA)]
                for tracker in trackers.values():
                    tracker.update_from_micro_grads(micro, b)

            self.trainer._probes[key] = (trackers, window)
        trackers, window = self.trainer._probes[key]
        for tracker in trackers.values():
            for variable in tracker.variables:
                variable.assign(tf.zeros_like(variable))
        rng = np.random.default_rng([seed, 3])
        used = c["arms"][name].get("estimate", "b_simple")

        def probe(optimizer):
            for _ in range(windows):
                idx = rng.choice(len(self.x_train), PROBE_KAPPA * b, replace=False)
                idx = idx.reshape(PROBE_KAPPA, b)
                window(tf.constant(self.x_train[idx]), tf.constant(self.y_train[idx]))
            values = {e: float(t.b_simple) for e, t in trackers.items()}
            optimizer.steps.observe(values[used])
            d = optimizer.steps.decisions[-1]
            self.decisions.append(
                {
                    "arm": name,
                    "seed": seed,
                    "learning_rate": lr,
                    "rerun": rerun,
                    "micro_step": d.micro_step,
                    "estimate": used,
                    **{f"b_{e}": values[e] for e in ESTIMATES},
                    "smoothed": d.smoothed,
                    "observations": d.observations,
                    "steps": d.steps,
                    "reason": d.reason,
                }
            )
            return windows * PROBE_KAPPA

        return probe

    def write(self, workdir, final=True):
        from keras_accum.experiments import controls_report

        workdir = pathlib.Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        atomic.atomic_write_text(workdir / "config.json", json.dumps(self.config, indent=2) + "\n")
        write_csv(workdir / "runs.csv", self.rows)
        if self.decisions:
            write_csv(workdir / "decisions.csv", self.decisions)
        write_csv(workdir / "timings.csv", self.timings)
        if not final:
            return
        controls_report.write_report(workdir)
        summary = {
            "rows": len(self.rows),
            "runs": len(self.timings),
            "seconds": round(time.time() - self.started, 1),
            "threads_set": self.threads_set,
        }
        atomic.atomic_write_text(workdir / "summary.json", json.dumps(summary, indent=2) + "\n")


def run_study(config, workdir):
    study = ControlsStudy(config)
    study.run(workdir)
    study.write(workdir)
    return study


__all__ = [
    "DEFAULTS",
    "TASKS",
    "ArmInvariantAdam",
    "ControlsStudy",
    "CosineToZero",
    "SwitchLrScale",
    "WarmupStableDecay",
    "resolve_config",
    "run_study",
]
