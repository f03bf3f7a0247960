"""`import horovod.torch as hvd` in a kfvision job: Horovod v0.28.1's PyTorch API on
torch.distributed (kfvision.pipelines.script.hvd, hvdopt). What is not provided raises
HorovodNotProvidedError, which lists what is."""

import warnings as _warnings

import torch as _torch
from kfvision.pipelines.script.hvd import (  # noqa: F401
    PROVIDED,
    Adasum,
    Average,
    Compression,
    HorovodInternalError,
    HorovodNotProvidedError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    cross_rank,
    cross_size,
    global_process_set,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    not_provided,
    poll,
    rank,
    remove_process_set,
    shutdown,
    size,
    synchronize,
)
from kfvision.pipelines.script.hvdopt import (  # noqa: F401
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)


def mpi_threads_supported() -> bool:
    return False


mpi_enabled = mpi_built = ddl_built = ccl_built = rocm_built = mpi_threads_supported


def gloo_enabled() -> bool:
    return True


gloo_built = gloo_enabled


def nccl_built() -> bool:
    return _torch.cuda.is_available()


cuda_built = nccl_built


def start_timeline(*args, **kwargs) -> None:
    _warnings.warn("kfvision's horovod.torch keeps no timeline", stacklevel=2)


stop_timeline = start_timeline



_NOT_PROVIDED = {"elastic": "horovod.torch.elastic", "SyncBatchNorm": "hvd.SyncBatchNorm",
                 "grouped_allreduce": "grouped collectives", "grouped_allgather":
                 "grouped collectives", "reducescatter": "hvd.reducescatter",
                 "sparse_allreduce_async": "sparse allreduce"}


def __getattr__(name):
    if name in _NOT_PROVIDED or name.startswith(("grouped_", "reducescatter")):
        not_provided(_NOT_PROVIDED.get(name, f"hvd.{name}"))
    raise AttributeError(f"module 'horovod.torch' has no attribute {name!r}")
