"""Tensor-parallel runs: launched by ``torchrun``, nothing to turn on.

Under ``torchrun --nproc-per-node N`` (``WORLD_SIZE`` > 1 in the environment) a model
loaded from disk is split with transformers' own tensor-parallel plan
(``DistributedConfig(tp_size=N)``): each rank holds the projections of its share of the
attention heads, and therefore the KV cache of its own KV heads only. The LM head
gathers its output, so every rank sees the same full logits; with the same seed every
rank then makes the same draft, accept and sample decisions, and the ranks never
diverge. Rank 0 alone writes text, progress and files.

The process group is NCCL on GPUs and gloo on CPU, started here when the model is
loaded (or by the caller beforehand) and shut down at exit.
"""

from __future__ import annotations

import atexit
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenswift.errors import ModelLoadError

logger = logging.getLogger(__name__)


def _group_running() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Processes in this run: ``WORLD_SIZE`` as torchrun sets it (1 when not launched by it)."""
    if _group_running():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    if _group_running():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_primary() -> bool:
    """True on the one process that writes output (rank 0, or the only process)."""
    return rank() == 0


def launched() -> bool:
    """True under torchrun with more than one process."""
    return world_size() > 1


SHUTDOWN_WAIT = timedelta(seconds=60)


def _shutdown() -> None:
    """Meet the other ranks, then close the group: no rank tears its sockets down while
    another is still finishing (a peer's gloo connection closed under it aborts the
    process). A rank that never arrives (it failed) is waited for ``SHUTDOWN_WAIT`` at most."""
    if not _group_running():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=SHUTDOWN_WAIT)
        else:
            dist.barrier()
    except Exception as err:  # a rank failed; closing is all that is left to do
        logger.warning("rank %d: not every rank reached the end of the run (%s)", rank(), err)
    dist.destroy_process_group()


def init(device: torch.device) -> None:
    """Start the process group (NCCL on CUDA, gloo otherwise) if torchrun launched us
    and nobody has started it yet."""
    if not launched() or _group_running():
        return
    check_device_type(device)
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend)
    atexit.register(_shutdown)
    logger.info("rank %d of %d: process group started (%s)", rank(), world_size(), backend)


def check_device_type(device: torch.device) -> None:
    """transformers splits a model over this machine's accelerator (CPU when it has
    none); refuse a spec that asks for another device type."""
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    expected = "cpu" if accelerator is None else accelerator.type
    if device.type != expected:
        raise ModelLoadError(
            f"under torchrun the model is split over this machine's {expected} devices, one per process; "
            f"set the model's device to {expected!r} (the spec asks for {str(device)!r})"
        )


def check_divisible(config, size: int) -> None:
    """Refuse a model whose attention or KV head count does not divide by ``size``."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % size or kv_heads % size:
        raise ModelLoadError(
            f"tensor parallelism over {size} processes needs head counts divisible by {size}; "
            f"this model has {heads} attention heads and {kv_heads} KV heads"
        )


def tensor_parallel_size(model: torch.nn.Module) -> int:
    """How many ranks the model's heads are split over (1 when it is not split)."""
    return int(getattr(model, "tp_size", None) or 1)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly) sharded parameter (a collective on DTensors)."""
    gather = getattr(tensor, "full_tensor", None)
    return gather() if gather is not None else tensor


def broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank (unchanged without a process group)."""
    if not _group_running():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def min_over_ranks(value: int) -> int:
    """The smallest ``value`` of all ranks, so that every rank takes the same decision."""
    if not _group_running():
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())
