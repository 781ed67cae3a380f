"""What a benchmark run depends on: `BenchConfig` and the `SETTINGS`."""

import dataclasses
import sys
import time

from keras_accum import validation
from keras_accum.experiments import config as cfg
from keras_accum.experiments.bench.workloads import WORKLOADS


@dataclasses.dataclass(frozen=True)
class Setting:
    """How the train step is compiled and distributed.

    steps_per_execution: micro-batches per `model.train_function` call;
    None means a whole call, K = steps x windows micro-batches, in one
    `tf.while_loop` (Keras's `steps_per_execution = K`).
    """

    name: str
    jit_compile: bool
    replicas: int = 1
    steps_per_execution: int | None = None
    description: str = ""


SETTINGS = {
    s.name: s
    for s in (
        Setting("graph", False, description="tf.function, steps_per_execution = K"),
        Setting("xla", True, description="XLA, steps_per_execution = K"),
        Setting("graph_spe1", False, steps_per_execution=1, description="tf.function, spe 1"),
        Setting("xla_spe1", True, steps_per_execution=1, description="XLA, spe 1"),
        # Keras 3.15 fails under MirroredStrategy with steps_per_execution > 1
        # ("You must feed a value for placeholder tensor ... while/cond",
        # even with plain SGD): one micro-batch per execution there.
        Setting("mirrored", False, 2, 1, "MirroredStrategy, 2 logical CPUs, spe 1"),
    )
}


F = cfg.Field


def _check_contenders(c):
    from keras_accum.experiments.bench.contenders import CONTENDERS

    for i, name in enumerate(c["contenders"]):
        validation.check_choice(f"contenders[{i}]", name, tuple(CONTENDERS))


# One field per config key; the script's flags are derived from them.
FIELDS = [
    cfg.names("models", ("cnn", "mlp", "transformer", "lm"), "Models", tuple(WORKLOADS)),
    cfg.names(
        "contenders",
        (
            "adam",
            "keras_accumulation",
            "gradient_accumulation",
            "invariant_adam",
            "update_accumulation_adam",
            "big_batch",
            "gradients_only",
        ),
        "Contenders (see contenders.CONTENDERS)",
    ),
    cfg.names("settings", tuple(SETTINGS), "Settings (see SETTINGS)", tuple(SETTINGS)),
    F("steps", "int", 8, "N: micro-batches per window", minimum=1),
    F("micro_batch", "int", 32, "b: examples per micro-batch (global)", minimum=1),
    F(
        "limit_micro_batch",
        "int",
        256,
        "Also timed at this b in limit_settings (0: off)",
        minimum=0,
    ),
    cfg.names(
        "limit_settings", ("graph", "xla"), "Settings timed at limit_micro_batch", tuple(SETTINGS)
    ),
    F("windows", "int", 1, "Windows per train-function call: K = steps x windows", minimum=1),
    F("repeats", "int", 11, "Timed rounds per group", minimum=1),
    F("warmup", "int", 2, "Untimed calls after the warm-up fit", minimum=0),
    F("min_sample_seconds", "float", 0.2, "A timed sample repeats calls to last this", minimum=0.0),
    F(
        "rss",
        "bool",
        True,
        "Peak RSS and peak tensor memory (graph, XLA), one subprocess per measurement",
    ),
    F("timing", "bool", True, "Run the timed groups (off: only memory / copies)"),
    F("xla_copies", "bool", True, "Count XLA copies per (model, contender) from the HLO"),
    F("quick", "bool", False, "Tiny sizes: a smoke test, not a measurement"),
    F("seed", "int", 0, "Seed of the data and the weights", minimum=0),
]
SCHEMA = cfg.Schema("benchmark", FIELDS, [_check_contenders])
_DEFAULTS = {name: tuple(v) if isinstance(v, list) else v for name, v in SCHEMA.defaults().items()}


@dataclasses.dataclass
class BenchConfig:
    """Everything a run depends on; written beside its results.

    The fields, defaults and checks are `SCHEMA`'s: a bad value is a
    `ConfigError` (a ValueError) naming the key, at construction.
    """

    models: tuple = _DEFAULTS["models"]
    contenders: tuple = _DEFAULTS["contenders"]
    settings: tuple = _DEFAULTS["settings"]
    steps: int = _DEFAULTS["steps"]
    micro_batch: int = _DEFAULTS["micro_batch"]
    limit_micro_batch: int = _DEFAULTS["limit_micro_batch"]
    limit_settings: tuple = _DEFAULTS["limit_settings"]
    windows: int = _DEFAULTS["windows"]
    repeats: int = _DEFAULTS["repeats"]
    warmup: int = _DEFAULTS["warmup"]
    min_sample_seconds: float = _DEFAULTS["min_sample_seconds"]
    rss: bool = _DEFAULTS["rss"]
    timing: bool = _DEFAULTS["timing"]
    xla_copies: bool = _DEFAULTS["xla_copies"]
    quick: bool = _DEFAULTS["quick"]
    seed: int = _DEFAULTS["seed"]

    def __post_init__(self):
        resolved = SCHEMA.resolve(dataclasses.asdict(self))
        for name, value in resolved.items():
            setattr(self, name, tuple(value) if isinstance(value, list) else value)

    def resolved(self):
        """The config with `quick` applied: what actually runs."""
        if not self.quick:
            return self
        return dataclasses.replace(
            self,
            steps=min(self.steps, 2),
            micro_batch=min(self.micro_batch, 8),
            limit_micro_batch=min(self.limit_micro_batch, 16),
            windows=1,
            repeats=min(self.repeats, 2),
            warmup=1,
            min_sample_seconds=0.0,
        )

    def groups(self):
        """(setting, micro_batch) pairs to time, in order."""
        pairs = [(s, self.micro_batch) for s in self.settings]
        if self.limit_micro_batch and self.limit_micro_batch != self.micro_batch:
            pairs += [(s, self.limit_micro_batch) for s in self.limit_settings]
        return pairs

    @classmethod
    def from_dict(cls, fields):
        """From `dataclasses.asdict` output; keys it does not know are
        dropped (a results.json of an older version)."""
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known})


def run_device(setting):
    """Where a group in `setting` runs in this process: "gpu" when
    TensorFlow sees a GPU and the setting has one replica (TensorFlow then
    places the whole step on GPU:0), else "cpu" (MirroredStrategy is given
    logical CPUs, also on a machine with a GPU)."""
    import tensorflow as tf

    if SETTINGS[setting].replicas == 1 and tf.config.list_physical_devices("GPU"):
        return "gpu"
    return "cpu"


def device_of(row):
    """The device a row (or a memory or copy measurement) was taken on;
    results written before devices were recorded ran on the CPU."""
    return row.get("device") or "cpu"


def place(row):
    """The setting as the report shows it: "graph" on the CPU, "graph on
    GPU" for a group timed on a GPU (its rows are never pooled or compared
    with the CPU's)."""
    setting = row.get("setting", "-")
    return setting if device_of(row) == "cpu" else f"{setting} on {device_of(row).upper()}"


def log(message):
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
