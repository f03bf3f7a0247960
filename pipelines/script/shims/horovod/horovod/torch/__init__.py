"""`import horovod.torch as hvd` in a kfvision job: Horovod v0.28.1's PyTorch API on
torch.distributed (kfvision.pipelines.script.hvd, hvdopt). What is not provided raises
HorovodNotProvidedError, which lists what is."""

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
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    not_provided,
    poll,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    synchronize,
)
from kfvision.pipelines.script.hvdopt import (  # noqa: F401
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)

_NOT_PROVIDED = {"elastic": "horovod.torch.elastic", "SyncBatchNorm": "hvd.SyncBatchNorm",
                 "grouped_allreduce": "grouped collectives", "grouped_allgather":
                 "grouped collectives", "reducescatter": "hvd.reducescatter",
                 "sparse_allreduce_async": "sparse allreduce"}


def __getattr__(name):
    if name in _NOT_PROVIDED or name.startswith(("grouped_", "reducescatter")):
        not_provided(_NOT_PROVIDED.get(name, f"hvd.{name}"))
    raise AttributeError(f"module 'horovod.torch' has no attribute {name!r}")
