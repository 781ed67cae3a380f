"""Several PyTorch processes (`torch.distributed`, e.g. gloo on CPUs or NCCL
on GPUs): each trains `model.fit` on its own share of every global batch,
without DDP, and the optimizer communicates, once per window where it can.

Keras's PyTorch trainer computes each process's gradient of its own
micro-batch and hands it to the optimizer, reducing nothing (DDP would
all-reduce every gradient on every backward pass). Under an initialized
process group of more than one process the portable driver
(`keras_accum.drivers.portable`) then:

* `GradientAccumulation`: each process sums its micro-batches' weighted
  gradients into S_r and their weights into W_r; at the window's end S, W
  (and the count of non-finite micro-batches) are all-reduced in ONE call,
  before the window is checked, so every process steps its inner optimizer
  with the same S / W (the global big batch's mean gradient, weighed by
  item counts under `weigh_micro_batches`) or drops the same window.
* `InvariantAdam`: each process's gradient is a micro-batch of the window
  (kappa = steps x processes, as each replica's under `tf.distribute`):
  each folds its share g_r / processes into its own part of m and v; at the
  window's end the parts are all-reduced in one call, the step taken from
  the totals, and each process keeps total / processes (their sum is the
  moment).
* `UpdateAccumulationAdam` needs the reduced gradient on every micro-batch
  by definition: it all-reduces the micro-batch's gradients (their mean
  over processes) on every call, what DDP does.

Every process must build the same model from the same weights (a seeded
initializer, or the weights broadcast from process 0 before `fit`) and run
the same number of micro-batches.
"""

from keras_accum import _backend

__all__ = ["count", "sum_in_place", "mean_of"]


def count():
    """Processes of the initialized `torch.distributed` group (1 without
    one, or under another backend)."""
    if _backend.BACKEND != "torch":
        return 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def sum_in_place(variables):
    """Each variable's value summed over the processes, written back: ONE
    all-reduce of them flattened together (in float64 if any is, else
    float32: the counts among them are small integers, exact there)."""
    import torch
    import torch.distributed as dist

    values = [v.value for v in variables]
    wide = torch.float64 if any(x.dtype == torch.float64 for x in values) else torch.float32
    flat = torch.cat([x.detach().reshape(-1).to(wide) for x in values])
    dist.all_reduce(flat)
    offset = 0
    for variable, x in zip(variables, values):
        size = x.numel()
        variable.assign(flat[offset : offset + size].reshape(x.shape).to(x.dtype))
        offset += size


def mean_of(tensors):
    """The tensors averaged over the processes (one all-reduce of them
    flattened together): a micro-batch's gradient of all processes."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset : offset + t.numel()].reshape(t.shape).to(t.dtype))
        offset += t.numel()
    return out
