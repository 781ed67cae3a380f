"""Is a `fit` arm slower by its optimizer or by the weights it trained?

`scripts/backend_bench.py` times whole `fit` epochs, so an arm's time
includes the model's forward and backward pass at the weights that arm's
optimizer reached. This trains the bench's CNN (same initial weights, same
data) with InvariantAdam, UpdateAccumulationAdam and plain Adam for as many
epochs as the bench runs (a warm-up and 9 rounds), then times one
micro-batch's forward and backward pass, no optimizer, for each model; then
swaps the InvariantAdam and UpdateAccumulationAdam models' weights and
times them again. A cost that follows the weights is the model's, not the
optimizer's.

    KERAS_BACKEND=torch taskset -c 0 python scripts/weights_swap.py
"""

import os
import pathlib
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import backend_bench  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

ARMS = ("invariant", "update_adam", "plain_adam")
EPOCHS = 10  # the bench's warm-up fit and its 9 rounds


def forward_backward_ms(model, x, y, repeats=60):
    """Median ms of one micro-batch's forward pass, loss and gradient
    (PyTorch's `backward`)."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for variable in variables:
            variable.value.grad = None
        loss(y, model(x, training=True)).backward()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main():
    if keras.backend.backend() != "torch":
        sys.exit(f"weights_swap.py times PyTorch's backward pass; got {keras.backend.backend()}")
    backend_bench.FLAGS(sys.argv[:1])
    sizes, micro = backend_bench._settings("cnn")
    batch = sizes["batch"]
    x, y = backend_bench.make_data("cnn", sizes, micro * batch, 0)
    keras.utils.set_random_seed(0)
    weights = backend_bench.build_model("cnn", sizes).get_weights()
    models = {a: backend_bench.compiled_model("cnn", sizes, a, 4, weights) for a in ARMS}
    for _ in range(EPOCHS):
        for arm in ARMS:
            backend_bench.run_fit(models[arm], x, y, batch)
    x_1, y_1 = x[:batch], y[:batch]
    print(f"backend: {keras.backend.backend()}; CNN after {EPOCHS} epochs of fit per arm")
    for arm in ARMS:
        print(
            f"forward+backward, {arm}'s model: {forward_backward_ms(models[arm], x_1, y_1):.2f} ms"
        )
    ia, uaa = models["invariant"], models["update_adam"]
    ia_weights, uaa_weights = ia.get_weights(), uaa.get_weights()
    ia.set_weights(uaa_weights)
    uaa.set_weights(ia_weights)
    print(
        f"forward+backward, invariant's model at update_adam's weights: "
        f"{forward_backward_ms(ia, x_1, y_1):.2f} ms"
    )
    print(
        f"forward+backward, update_adam's model at invariant's weights: "
        f"{forward_backward_ms(uaa, x_1, y_1):.2f} ms"
    )


if __name__ == "__main__":
    main()
