"""`layers.BatchNormalization` on JAX and PyTorch: the layer counts its
windows (`base.bounds`) and moves its statistics in the forward pass that
ends one, each write a select. See docs/BATCH_NORM.md.
"""

import contextlib
import math

from keras import ops

from keras_accum import _backend, _compat, per_device
from keras_accum.schedules import PiecewiseSteps, StepsSchedule


class BatchNormalizationForm:
    """The JAX and PyTorch form of `keras_accum.layers.BatchNormalization`."""

    def _local_scope(self):
        return contextlib.nullcontext()  # one device's worth of state

    def _calling_model(self):
        return _compat.training_model()

    def _follow(self, optimizer):
        # PyTorch's eager forward pass reads a schedule's state as the
        # optimizer's step will; JAX's compiled one would keep the value it
        # was traced with.
        if (
            _backend.BACKEND == "jax"
            and isinstance(optimizer.steps, StepsSchedule)
            and not isinstance(optimizer.steps, PiecewiseSteps)
        ):
            raise ValueError(
                "`keras_accum.layers.BatchNormalization` counts its windows itself "
                "under jax, so it follows an integer `steps` or a `PiecewiseSteps`, "
                "not a schedule that sizes windows from the optimizer's state "
                "(TensorFlow and PyTorch run that). "
                f"Received: steps={optimizer.steps!r}"
            )

    def _fold_micro_batch(self, inputs, mask, mean, variance, optimizer):
        """The micro-batch into the sums; at the window's end the statistics
        moved and the sums restarted (selects)."""
        channels = self.window_sum.shape[0]
        items = math.prod(inputs.shape) // channels
        terms = self._window_terms(inputs, mask, mean, variance, items)
        # Under `PerDeviceGradients` (JAX): summed over the devices.
        terms = per_device.summed_over_devices(terms)
        # S1 += n_i (mu_i - c); S2 += n_i (s_i^2 + (mu_i - c)^2); N += n_i
        sums = [self.window_sum, self.window_square_sum, self.window_count]
        total_sum, total_square_sum, total_count = [
            ops.convert_to_tensor(total) + term for total, term in zip(sums, terms)
        ]
        size, done = self._count(optimizer)
        steps = optimizer.steps
        # At the window's end: mu - c = S1 / N; s^2 = S2 / N - (mu - c)^2.
        seen = total_count > 0
        safe = ops.where(seen, total_count, ops.ones_like(total_count))
        shifted = ops.where(seen, total_sum / safe, ops.zeros_like(total_sum))
        variance = ops.where(seen, total_square_sum / safe, ops.zeros_like(total_sum))
        variance = ops.maximum(variance - ops.square(shifted), 0.0)
        mean = ops.cast(self.moving_mean, shifted.dtype) + shifted
        # A window this layer saw nothing of leaves its statistics alone.
        write = ops.logical_and(seen, done)
        momenta = self._momenta(steps if isinstance(steps, int) else size)
        self._move_statistics(mean, variance, write, momenta)
        for variable, total in [
            (self.window_sum, total_sum),
            (self.window_square_sum, total_square_sum),
            (self.window_count, total_count),
        ]:
            variable.assign(ops.where(done, ops.zeros_like(total), total))
