"""tensordict_cpp: a C++ TensorDict on libtorch, with the Python surface of the reference
``tensordict`` for the methods it has, and point-to-point transfers that interoperate with it.

>>> import torch
>>> from tensordict_cpp import TensorDict
>>> td = TensorDict(a=torch.ones(4), b=torch.ones(4, 3), batch_size=[4])
"""
# torch first: _C links against its libraries and uses its pybind11 type registrations
# (Tensor, and ProcessGroup / Work from torch.distributed).
import torch
import torch.distributed  # noqa: F401

# The pipe links the UCX of PyPI's libucx-cu12 wheel (the one ucxx runs on): load it before _C,
# so that one copy of UCX serves both in a process (two copies cannot coexist).
try:
    import libucx

    libucx.load_library()
except ImportError:  # a build without the pipe, or against a system UCX
    pass

# errors first: _C looks its classes up while it is imported (errors imports nothing else).
from tensordict_cpp import errors
from tensordict_cpp import _C
from tensordict_cpp.memmap import MemoryMappedTensor
from tensordict_cpp.observability import (log_level, reset_transfer_stats, set_log_level,
                                          transfer_stats)
from tensordict_cpp._non_tensor import LinkedList, MetaData, NonTensorStack
from tensordict_cpp._unbatched import UnbatchedTensor
from tensordict_cpp._td import (LazyStackedTensorDict, NonTensorData, TensorDict, all_gather,
                                all_reduce, broadcast, cat, consolidate, gather_and_stack,
                                init_remote, irecv, isend, lazy_stack, maybe_dense_stack, recv,
                                reduce, scatter, send, set_printoptions, stack)
from tensordict_cpp.pipe import TensorDictPipe, TensorDictServer
from tensordict_cpp import nn
from tensordict_cpp.nn import TensorDictParams
# As in the reference, the name `tensorclass` is the decorator; the module stays reachable as
# `from tensordict_cpp.tensorclass import ...` (through sys.modules).
from tensordict_cpp.tensorclass import is_tensor_collection, is_tensorclass, tensorclass
if _C.has_distributed or hasattr(_C, "PipePublisher"):
    from tensordict_cpp.publication import Publisher, Subscriber

__all__ = ["TensorDict", "LazyStackedTensorDict", "NonTensorData", "MetaData", "NonTensorStack",
           "LinkedList",
           "UnbatchedTensor", "TensorDictParams", "MemoryMappedTensor", "stack",
           "maybe_dense_stack", "from_consolidated",
           "cat", "lazy_stack", "TensorDictPipe", "TensorDictServer", "tensorclass",
           "is_tensorclass", "send", "recv", "isend", "irecv", "init_remote", "consolidate",
           "broadcast", "all_gather", "scatter", "all_reduce", "reduce", "gather_and_stack",
           "is_tensor_collection", "set_log_level", "log_level", "transfer_stats",
           "reset_transfer_stats", "set_printoptions", "Publisher", "Subscriber"]
from_consolidated = TensorDict.from_consolidated
__version__ = "0.1.0"
