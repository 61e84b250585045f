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

from tensordict_cpp import _C
from tensordict_cpp._td import TensorDict, cat, stack
from tensordict_cpp.pipe import TensorDictPipe, TensorDictServer

__all__ = ["TensorDict", "stack", "cat", "TensorDictPipe", "TensorDictServer"]
__version__ = "0.1.0"
