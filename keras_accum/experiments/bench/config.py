"""What a benchmark run depends on: `BenchConfig` and the `SETTINGS`."""

import dataclasses
import sys
import time

from keras_accum.validation import check_choice, check_float, check_int


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


@dataclasses.dataclass
class BenchConfig:
    """Everything a run depends on; written beside its results."""

    models: tuple = ("cnn", "mlp", "transformer")
    contenders: tuple = (
        "adam",
        "keras_accumulation",
        "gradient_accumulation",
        "invariant_adam",
        "update_accumulation_adam",
        "big_batch",
        "gradients_only",
    )
    settings: tuple = ("graph", "xla", "graph_spe1", "xla_spe1", "mirrored")
    steps: int = 8  # N: micro-batches per window.
    micro_batch: int = 32  # b: examples per micro-batch (global).
    # The distance to the limit is also measured at this micro-batch, in
    # `limit_settings` (0: not measured).
    limit_micro_batch: int = 256
    limit_settings: tuple = ("graph", "xla")
    windows: int = 1  # windows per train_function call: K = steps * windows.
    repeats: int = 11  # timed rounds per group.
    warmup: int = 2  # untimed calls after the warm-up fit.
    min_sample_seconds: float = 0.2  # a sample repeats calls to last this.
    rss: bool = True  # peak RSS per (model, contender) in subprocesses.
    timing: bool = True  # the timed groups (off: only memory / copies).
    xla_copies: bool = True  # count XLA copies per (model, contender).
    quick: bool = False  # tiny sizes: a smoke test, not a measurement.
    seed: int = 0

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

    def validate(self, workloads, contenders):
        """ValueError naming the first unknown name or bad number."""
        for field, known in (
            ("models", workloads),
            ("contenders", contenders),
            ("settings", SETTINGS),
            ("limit_settings", SETTINGS),
        ):
            for name in getattr(self, field):
                check_choice(field, name, known)
        for field in ("steps", "micro_batch", "windows", "repeats"):
            check_int(field, getattr(self, field))
        check_int("limit_micro_batch", self.limit_micro_batch, minimum=0)
        check_int("warmup", self.warmup, minimum=0)
        check_float("min_sample_seconds", self.min_sample_seconds, minimum=0.0)
        return self

    @classmethod
    def from_dict(cls, fields):
        """From `dataclasses.asdict` output (JSON lists back to tuples)."""
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items() if k in known}
        )


def log(message):
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
