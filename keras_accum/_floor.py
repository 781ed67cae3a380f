"""The oldest Keras this package supports, checked when it is imported.

Measured, not guessed: `.ci/floor` runs the optimizer, schedule, fit and
saving tests with exactly `keras==KERAS_FLOOR` and the TensorFlow floor of
setup.cfg. With Keras 3.5-3.7 (TensorFlow 2.16.2) 5 of them fail, all
`model.fit` under a `MirroredStrategy` against one device; Keras 3.8 is the
release whose `Loss` divides each replica's loss by the number of replicas,
the convention the optimizers and `weigh_micro_batches` follow. No imports
here: `packaging` need not be installed.
"""

KERAS_FLOOR = "3.8.0"


def release(version):
    """The leading (major, minor, patch) numbers of a version string:
    "3.16.0.dev2026" -> (3, 16, 0), "3.10.0rc1" -> (3, 10, 0); a missing
    or non-numeric part counts as 0."""
    numbers = []
    for part in str(version).split(".")[:3]:
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        numbers.append(int(digits) if digits else 0)
    return tuple(numbers + [0] * (3 - len(numbers)))


def check_keras(version, floor=KERAS_FLOOR):
    """ImportError (one line) when Keras `version` is older than `floor`."""
    if release(version) < release(floor):
        raise ImportError(
            f"keras_accum needs Keras >= {floor}, but Keras {version} is installed"
            f" (pip install 'keras>={floor}')"
        )
