"""The library files one window of `apply` calls enters, per optimizer.

A measure of how far a reader follows one micro-batch: `sys.settrace`
records every function of `keras_accum/` that runs while four micro-batches
(one window of `steps=4`) go through `apply`, and the files they live in
are listed. The backend is `KERAS_BACKEND`'s (unset: Keras's default):

* JAX and PyTorch: `apply` called eagerly.
* TensorFlow: `apply` traced by `tf.function(autograph=False)`, so that the
  library's own Python runs (AutoGraph would run converted copies, kept in
  temporary files) and the window's `cond` branches are traced once.

    KERAS_BACKEND=torch python scripts/route_files.py
    KERAS_BACKEND=jax python scripts/route_files.py --functions
"""

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_accum as ka  # noqa: E402

OPTIMIZERS = {
    "InvariantAdam": lambda: ka.InvariantAdam(1e-3, steps=4),
    "UpdateAccumulationAdam": lambda: ka.UpdateAccumulationAdam(1e-3, steps=4),
    "GradientAccumulation": lambda: ka.GradientAccumulation(keras.optimizers.Adam(1e-3), steps=4),
}


def entered(make_optimizer, micro_batches=4):
    """{file relative to keras_accum/: sorted names of the functions run}
    while `micro_batches` calls of `apply` run (after a first, untraced one
    that builds the optimizer)."""
    root = os.path.dirname(ka.__file__) + os.sep
    variables = [keras.Variable(np.ones((3, 2), "float32")), keras.Variable(np.ones(2, "float32"))]
    grads = [keras.ops.ones((3, 2)), keras.ops.ones((2,))]
    optimizer = make_optimizer()
    optimizer.build(variables)
    step = lambda: optimizer.apply(grads, variables)  # noqa: E731
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        step = tf.function(step, autograph=False)
    found = {}

    def trace(frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith(root):
            found.setdefault(name[len(root) :], set()).add(frame.f_code.co_name)

    sys.settrace(trace)
    try:
        for _ in range(micro_batches):
            step()
    finally:
        sys.settrace(None)
    return {name: sorted(functions) for name, functions in sorted(found.items())}


def main():
    print(f"backend: {keras.backend.backend()}")
    for name, make in OPTIMIZERS.items():
        files = entered(make)
        print(f"{name}: {len(files)} files")
        for path, functions in files.items():
            tail = f": {', '.join(functions)}" if "--functions" in sys.argv else ""
            print(f"  {path}{tail}")


if __name__ == "__main__":
    main()
