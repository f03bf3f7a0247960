"""Everything about "which process am I": the one place that reads the launcher's environment.

Run one process with `python -m kfvision.trainer.train ...`, or several with
`torchrun --nproc-per-node 2 -m kfvision.trainer.train ...`. Under a Kubeflow PyTorchJob the
operator sets node-level `RANK`/`WORLD_SIZE` plus `PET_*` variables; the container must start us
through torchrun, which turns `PET_*` into per-process `RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
`LOCAL_WORLD_SIZE` (see ../shared/reference/README.md). Nothing else in kfvision reads these
variables.
"""

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from kfvision.trainer import cpus
from kfvision.trainer.errors import DeviceError, KfvisionError, check_choice
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _pick_device(requested: str, local_rank: int, local_world_size: int) -> torch.device:
    check_choice("device", requested, ("auto", "cpu", "cuda"))
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            "device = 'cuda' was requested but PyTorch sees no CUDA GPU on this machine; "
            "use --device cpu (or auto), or run on a GPU node."
        )
    gpus = torch.cuda.device_count()
    if local_world_size > gpus:
        raise DeviceError(
            f"{local_world_size} processes per node were started but this node has {gpus} GPU(s); "
            f"start at most {gpus} (torchrun --nproc-per-node / PyTorchJob nprocPerNode), "
            "or use --device cpu."
        )
    return torch.device("cuda", local_rank)


def launcher_env(environ=None) -> tuple:
    """(rank, local rank, world size, local world size) as the launcher set them (torchrun, the
    operator); (0, 0, 1, 1) for a process started alone."""
    env = os.environ if environ is None else environ
    world_size = int(env.get("WORLD_SIZE", "1"))
    return (int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0")), world_size,
            int(env.get("LOCAL_WORLD_SIZE", str(world_size))))


def init(device: str = "auto", timeout_s: float = 1800.0) -> DistContext:
    """Join the process group when started by torchrun (WORLD_SIZE > 1), else run alone.

    Args:
        device: "auto" (CUDA when available), "cpu" or "cuda".
        timeout_s: collective timeout; a lost peer fails the job after this long.
    Returns:
        the frozen DistContext of this process.
    Raises:
        DeviceError: CUDA requested but missing, or more local processes than GPUs.
    """
    rank, local_rank, world_size, local_world_size = launcher_env()
    dev = _pick_device(device, local_rank, local_world_size)
    if world_size > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        from datetime import timedelta

        dist.init_process_group(
            backend="nccl" if dev.type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
    return DistContext(rank, local_rank, world_size, local_world_size, dev)


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum a tensor over all processes (in place), a no-op when running alone."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(obj, ctx: DistContext) -> list:
    """Every process's obj, in rank order (a one-element list when running alone)."""
    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, ctx: DistContext):
    """Rank 0's obj on every process."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_buffers(module: torch.nn.Module, ctx: DistContext) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics) to every process.

    DDP syncs buffers at the start of each forward, so after the last training step every rank
    holds statistics of its own last batch; syncing once per epoch makes all ranks evaluate and
    save the same model.
    """
    if ctx.distributed:
        for buf in module.buffers():
            dist.broadcast(buf, src=0)


def wrap_model(model: torch.nn.Module, ctx: DistContext, example: torch.Tensor,
               autocast=contextlib.nullcontext) -> torch.nn.Module:
    """`model` in DistributedDataParallel, its gradient buckets already in their final layout (the
    model itself when running alone). A collective: every rank calls it.

    Why: DDP reduces a new wrapper's first backward in one bucket of all gradients, then rebuilds
    its buckets for good in the order the gradients became ready. gloo's ring all-reduce sums an
    element in an order set by where it falls in its bucket, so with 3 or more processes the two
    layouts round the same gradients differently. A resumed run's first step is its processes'
    first, an unbroken run's is not: a resumed run ended some ulps away from one that never
    stopped (tests/jobs/test_resume_exact.py shows it with 2 x 2 processes). So one throwaway
    backward of `example` (an input like a batch's, forward under `autocast()` as in training)
    has DDP rebuild before the first real step, in a run that starts and one that resumes
    alike. It changes nothing of the model: eval mode (BatchNorm
    statistics stay, dropout draws no random numbers), no optimizer step, gradients dropped.
    """
    if not ctx.distributed:
        return model
    ddp = DistributedDataParallel(model, device_ids=[ctx.device] if ctx.device.type == "cuda"
                                  else None)
    training = model.training
    model.eval()
    with autocast():
        out = ddp(example)
    out.float().sum().backward()
    model.zero_grad(set_to_none=True)
    model.train(training)
    return ddp


def on_main(ctx: DistContext, fn):
    """Run fn() on rank 0 alone: the one way rank-0-only work (saving, metrics files) is done.

    Every rank calls it: a KfvisionError that fn raises (a full disk, a read-only volume) is raised
    on every rank, so that no rank waits forever in a collective for one that has failed; any
    other exception is raised on rank 0 as it is, and as a RuntimeError naming it elsewhere.
    Returns fn's result on rank 0, None elsewhere.
    """
    result, error, original = None, None, None
    if ctx.is_main:
        try:
            result = fn()
        except KfvisionError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others hear of it
            original, error = e, RuntimeError(f"rank 0 failed: {type(e).__name__}: {e}")
    error = broadcast_object(error, ctx)
    if original is not None:
        raise original
    if error is not None:
        raise error
    return result


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def cpus_per_process(ctx: DistContext) -> int:
    """CPU cores this process may use (kfvision.trainer.cpus), shared by the local ranks."""
    return cpus.per_process(ctx.local_world_size)
