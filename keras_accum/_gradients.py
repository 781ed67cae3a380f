"""The gradient of a model's compiled loss, on each backend: the one place
`keras_accum.diagnostics` differentiates (its probe micro-batches).

TensorFlow: `tf.GradientTape` (`tape_gradients`, traced into the probe's
`tf.function`). JAX: `jax.grad` of `model.compute_loss_and_updates` over
the variables' values, stateless, jitted once per model. PyTorch:
`torch.autograd.grad` of the loss of an eager forward pass. Each backend's
module is imported only when its function runs: under JAX or PyTorch no
TensorFlow is imported.

Every forward pass runs with `training=True` (dropout on, batch norm in
batch mode, as in `train_step`); the non-trainable and metric variables it
changes are as before when `micro_batch_gradients` is done.
"""

from keras import ops

from keras_accum import _backend, _compat


def tape_gradients(model, x, y, sample_weight):
    """TensorFlow: the gradients of the compiled loss of one micro-batch
    with respect to `model.trainable_variables` (None where unconnected)."""
    tf = _backend.tf
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
    return tape.gradient(loss, model.trainable_variables)


class MicroBatchGradients:
    """`gradients(batches)`: for each `(x, y, sample_weight)` of `batches`,
    the list of gradients of the compiled loss with respect to
    `model.trainable_variables` (zeros where unconnected), one micro-batch
    at a time; the model's state as before once exhausted. JAX and
    PyTorch (TensorFlow's probe traces `tape_gradients`)."""

    def __init__(self, model):
        self.model = model
        self._jitted = None

    def gradients(self, batches):
        if _backend.BACKEND == "jax":
            return self._jax(batches)
        if _backend.BACKEND == "torch":
            return self._torch(batches)
        raise RuntimeError(f"MicroBatchGradients runs under JAX or PyTorch, not {_backend.BACKEND}")

    def _jax(self, batches):
        import jax

        model = self.model
        if self._jitted is None:

            def loss(trainable, non_trainable, metrics, x, y, sample_weight):
                # `compute_loss_and_updates` without its loss scaling: the
                # compiled loss's own gradient, as TensorFlow's tape takes.
                kwargs = {"training": True} if _compat.call_has_training_arg(model) else {}
                y_pred, non_trainable, losses = model.stateless_call(
                    trainable, non_trainable, x, return_losses=True, **kwargs
                )
                # The forward pass's losses (regularizers) into the loss.
                with _compat.losses_override(model, losses):
                    value, (_, non_trainable, _) = model.stateless_compute_loss(
                        trainable,
                        non_trainable,
                        metrics,
                        x=x,
                        y=y,
                        y_pred=y_pred,
                        sample_weight=sample_weight,
                        training=True,
                    )
                return value, non_trainable

            self._jitted = jax.jit(jax.grad(loss, has_aux=True))
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        metrics = [v.value for v in model.metrics_variables]
        for x, y, sample_weight in batches:
            # The RNG seeds and statistics move from one micro-batch to the
            # next, and are never written back: stateless.
            grads, non_trainable = self._jitted(
                trainable, non_trainable, metrics, x, y, sample_weight
            )
            yield list(grads)

    def _torch(self, batches):
        import torch

        model = self.model
        weights = model.trainable_variables
        state = model.non_trainable_variables + model.metrics_variables
        saved = [ops.copy(v.value) for v in state]
        # Dropout without a seed draws from PyTorch's global generator: the
        # probe's draws must not move training's.
        rng = torch.random.fork_rng()  # the CPU's and CUDA's generators
        rng.__enter__()
        try:
            for x, y, sample_weight in batches:
                x, y, sample_weight = (
                    None if t is None else ops.convert_to_tensor(t) for t in (x, y, sample_weight)
                )
                with torch.enable_grad():
                    y_pred = model(x, training=True)
                    loss = model.compute_loss(
                        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                    )
                    grads = torch.autograd.grad(loss, [w.value for w in weights], allow_unused=True)
                yield [
                    ops.zeros_like(w.value) if g is None else g.detach()
                    for g, w in zip(grads, weights)
                ]
        finally:
            for v, value in zip(state, saved):
                v.assign(value)
            rng.__exit__(None, None, None)
