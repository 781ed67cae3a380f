"""The oldest Keras this package supports, checked at import (see
docs/guides/testing.md). Keras 3.8 is the first whose `Loss` divides each
replica's loss by the replica count, the convention the optimizers follow.
No imports here: `packaging` need not be installed.
"""

KERAS_FLOOR = "3.8.0"


def release(version):
    """(major, minor, patch) of a version string: "3.10.0rc1" -> (3, 10, 0);
    a missing or non-numeric part counts as 0."""
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
