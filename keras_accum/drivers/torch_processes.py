"""The all-reduces of several PyTorch processes (`torch.distributed`, no
DDP): once per window where the optimizer can. See docs/guides/fit.md,
"PyTorch: several processes".
"""

from keras_accum import _backend

__all__ = ["count", "sum_in_place", "mean_of"]


def count():
    """Processes of the `torch.distributed` group (1 without one)."""
    if _backend.BACKEND != "torch":
        return 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def sum_in_place(variables):
    """Each variable summed over the processes in one flat all-reduce
    (float64 if any is, else float32: exact for the small counts)."""
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
    """The tensors averaged over the processes (one flat all-reduce)."""
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
