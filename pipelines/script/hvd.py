"""Horovod's PyTorch API (`import horovod.torch as hvd`, the API of v0.28.1, Horovod's last
release) on torch.distributed, so that a Horovod script runs unchanged in a kfvision job: no
Horovod build, no MPI, no sshd. The user's processes import it as `horovod.torch` only when their
environment has no Horovod of its own (pipelines/script/bridges.py); kfvision's processes never do.

    hvd.init(); torch.manual_seed(hvd.rank())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

Horovod's semantics, as horovod/torch/optimizer.py, functions.py and mpi_ops.py at v0.28.1 have
them (read there; this is our own code): a hook on each parameter's gradient accumulator counts
the local backward passes, and only with more than one process; the local passes of
`backward_passes_per_step` are summed, not divided; Average scales by 1/gradient_predivide_factor
before the sum and by gradient_predivide_factor/size after it; a parameter with no gradient is
reduced as zeros in step(); fp16 compression casts floating gradients to half for the wire.

One difference, in how, not what: Horovod's core negotiates the order of the reductions by name,
and torch.distributed needs every rank to issue them in one order. So the gradients are reduced
in step() (or synchronize()), coalesced per dtype and device, in the parameters' name order;
compute and communication do not overlap as in Horovod or DDP. The process group is gloo for CPU
tensors and NCCL for CUDA tensors ("cpu:gloo,cuda:nccl" when a GPU is there).
"""

import itertools

import torch
import torch.distributed as dist
from kfvision.trainer.distributed import launcher_env
from kfvision.trainer.errors import KfvisionError

# horovod/common/basics.py reads these from the C library; any distinct values do
Average, Sum, Adasum, Min, Max, Product = range(6)
_TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
              Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
PROVIDED = ("init, shutdown, is_initialized, rank, size, local_rank, local_size, cross_rank, "
            "cross_size, DistributedOptimizer, broadcast_parameters, broadcast_optimizer_state, "
            "broadcast_object, allgather_object, allreduce[_][_async], allgather[_async], "
            "broadcast[_][_async], alltoall, join, barrier, poll, synchronize, Compression.none/"
            "fp16, Average, Sum, Min, Max, Product")


class HorovodNotProvidedError(KfvisionError, NotImplementedError):
    """A part of Horovod that kfvision's bridge does not provide (docs/scripts.md, "Horovod
    scripts")."""


def not_provided(what: str):
    raise HorovodNotProvidedError(
        f"{what} is not provided by kfvision's horovod.torch (a bridge onto torch.distributed); "
        f"it provides {PROVIDED}. Put `horovod` in requirements.txt to use Horovod's own, or port "
        "that part to torch.distributed (docs/scripts.md, \"Horovod scripts\").")


class HorovodInternalError(RuntimeError):
    """Horovod's name for a failed collective (scripts catch it)."""


class _State:
    made_group = False
    handles, next_handle = {}, itertools.count(1)


def init(*args, **kwargs) -> None:
    """Join the job's process group (torchrun's variables), or a group of one."""
    if dist.is_initialized():
        return
    rank, _, world, _ = launcher_env()
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if world > 1:
        dist.init_process_group(backend)
    else:  # a script started alone: a group of one, as Horovod runs it
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _State.made_group, _State.handles = True, {}


def shutdown(*args, **kwargs) -> None:
    if _State.made_group and dist.is_initialized():
        dist.destroy_process_group()
    _State.made_group = False


def is_initialized() -> bool:
    return dist.is_initialized()


def _check() -> None:
    if not dist.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def rank() -> int:
    _check()
    return dist.get_rank()


def size() -> int:
    _check()
    return dist.get_world_size()


def local_rank() -> int:
    _check()
    return launcher_env()[1]


def local_size() -> int:
    _check()
    return min(launcher_env()[3], size())


def cross_rank() -> int:
    return rank() // local_size()


def cross_size() -> int:
    return size() // local_size()


class ProcessSet:
    """Only the global process set is provided."""

    def __init__(self, ranks=None):
        if ranks is not None:
            not_provided("process sets (hvd.ProcessSet)")

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True


global_process_set = ProcessSet()


def add_process_set(*args, **kwargs):
    not_provided("process sets (hvd.add_process_set)")


remove_process_set = add_process_set


def global_only(process_set) -> None:
    if process_set is not global_process_set:
        not_provided("process sets")


def _op(op, average):
    """Horovod's rule (handle_average_backwards_compatibility): op, else average, else
    Average."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    op = op if op is not None else (Sum if average is False else Average)
    if op == Adasum:
        not_provided("Adasum")
    return op


def _handle(works, finish) -> int:
    h = next(_State.next_handle)
    _State.handles[h] = (works, finish)
    return h


def poll(handle) -> bool:
    works, _ = _State.handles[handle]
    return all(w is None or w.is_completed() for w in works)


def synchronize(handle):
    """Wait for an _async operation; its result."""
    if handle not in _State.handles:
        return None
    works, finish = _State.handles.pop(handle)
    try:
        for w in works:
            if w is not None:
                w.wait()
    except RuntimeError as e:
        raise HorovodInternalError(e) from e
    return finish()


def _scale(tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:  # Horovod's core scales integers as doubles and casts back
        tensor.copy_((tensor.double() * factor).to(tensor.dtype))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> int:
    """In place: each rank's tensor times prescale_factor, reduced by `op`, times
    postscale_factor (divided by the size for Average)."""
    op, _ = _op(op, average), global_only(process_set)
    _scale(tensor, prescale_factor)
    work = dist.all_reduce(tensor, op=_TORCH_OPS[op], async_op=True)
    post = postscale_factor / size() if op == Average else postscale_factor

    def finish():
        _scale(tensor, post)
        return tensor
    return _handle([work], finish)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> int:
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor,
                            postscale_factor, process_set)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale):
        ctx.args = (op, prescale, postscale)
        return synchronize(allreduce_async(tensor, None, None, op, prescale, postscale))

    @staticmethod
    def backward(ctx, grad):
        return _Allreduce.apply(grad, *ctx.args), None, None, None


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """A new tensor: `tensor` reduced across the ranks (differentiable, as Horovod's)."""
    compression = compression or Compression.none
    global_only(process_set)
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, _op(op, average), prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def _gather(tensor):
    """Every rank's tensor concatenated on dim 0 (first dims may differ); each rank's length."""
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size())]
    dist.all_gather(lengths, torch.tensor([tensor.shape[0] if tensor.dim() else 1]))
    lengths = [int(n) for n in lengths]
    flat = tensor.reshape(-1, *tensor.shape[1:]) if tensor.dim() else tensor.reshape(1)
    pad = torch.zeros((max(lengths), *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
    pad[:flat.shape[0]] = flat
    parts = [torch.empty_like(pad) for _ in lengths]
    dist.all_gather(parts, pad)
    return torch.cat([p[:n] for p, n in zip(parts, lengths, strict=True)]), lengths


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        out, lengths = _gather(tensor.detach())
        ctx.start, ctx.n = sum(lengths[:rank()]), lengths[rank()]
        return out

    @staticmethod
    def backward(ctx, grad):  # Horovod: the gradients averaged, this rank's slice
        return allreduce(grad, op=Average).narrow(0, ctx.start, ctx.n)


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's `tensor` concatenated on the first dimension (which may differ)."""
    global_only(process_set)
    return _Allgather.apply(tensor)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    out = allgather(tensor, name, process_set)
    return _handle([], lambda: out)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    global_only(process_set)
    with torch.no_grad():
        work = dist.broadcast(tensor.data, root_rank, async_op=True)
    return _handle([work], lambda: tensor)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Slices of dim 0 to each rank (`splits` rows each, else equal parts); what came back (and
    the received splits when `splits` was given)."""
    global_only(process_set)
    n = size()
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(f"alltoall without splits: the first dimension ({tensor.shape[0]}) "
                             f"must divide by the number of processes ({n}).")
        sent = [tensor.shape[0] // n] * n
    else:
        sent = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    got = torch.zeros(n, dtype=torch.int64)
    dist.all_to_all_single(got, torch.tensor(sent, dtype=torch.int64))
    got = [int(g) for g in got]
    out = tensor.new_empty((sum(got), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), got, sent)
    return out if splits is None else (out, torch.tensor(got, dtype=torch.int32))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    out = alltoall(tensor, splits, name, process_set)
    return _handle([], lambda: out)


def barrier(process_set=global_process_set) -> None:
    global_only(process_set)
    dist.barrier()


def join(device=-1) -> int:
    """Every rank waits here; the rank that came last. Unlike Horovod's, a rank that joined does
    not stand in (with zeros) for the reductions the others still do: every rank must reach
    join() after the same number of reductions."""
    import time

    times = allgather_object(time.monotonic_ns())  # not comparable across hosts: rank only
    return max(range(len(times)), key=lambda r: (times[r], r)) if len(times) > 1 else 0


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    global_only(process_set)
    box = [obj if rank() == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank)
    return box[0]


def allgather_object(obj, name=None):
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out


class NoneCompressor:
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    @staticmethod
    def compress(tensor):
        """Floating tensors as half for the wire; the dtype to come back to."""
        return (tensor.type(torch.float16) if tensor.dtype.is_floating_point else tensor,
                tensor.dtype)

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.type(ctx) if ctx.is_floating_point else tensor


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
