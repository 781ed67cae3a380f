"""The gradient of a model's compiled loss on each backend, for the noise
probes (`keras_accum.diagnostics`): a tape, a jitted stateless `jax.grad`,
or `torch.autograd.grad`. Forward passes run with `training=True`; the
model's non-trainable and metric state is left as it was.
"""

from keras import ops

from keras_accum import _backend, _compat


def tape_gradients(model, x, y, sample_weight):
    """TensorFlow: one micro-batch's gradients (None where unconnected)."""
    tf = _backend.tf
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
    return tape.gradient(loss, model.trainable_variables)


class MicroBatchGradients:
    """JAX and PyTorch: `gradients(batches)` yields each `(x, y,
    sample_weight)`'s gradients (zeros where unconnected)."""

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
            # Seeds and statistics carry over, never written back.
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
        # Unseeded dropout draws from the global generator: keep training's.
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
