"""UnbatchedTensor: a leaf whose shape need not start with its TensorDict's batch size, as the
reference's ``tensordict.UnbatchedTensor`` (include/tensordict/tensor_dict.h,
``Value::unbatched``).

A layer below ``_td``: this module imports nothing of the package.
"""
from __future__ import annotations

from typing import Any

import torch


class UnbatchedTensor(torch.Tensor):
    """A tensor that a TensorDict holds whole, whatever its batch size, as the reference's
    ``tensordict.UnbatchedTensor``: its shape is not checked against the batch size, batch
    operations (indexing, reshape, stack, cat, ...) pass it through whole, and operations on
    the values (clone, to, apply, arithmetic) keep it unbatched. ``td["u"]`` returns it as an
    UnbatchedTensor sharing the leaf's storage.

    Transfers: per-leaf send/recv/isend/irecv and the reductions move it like any leaf (in the
    wire order of its key); the uncollated pipe lists it in the header's ``"unbatched"``;
    ``consolidate()`` refuses it (NotImplementedError naming the key), and so do init_remote,
    the collectives that consolidate, ``send(consolidated=True)`` and the consolidated pipe, as
    the reference does.

    Args:
        data (torch.Tensor or array-like): the values (shared, not copied, when a tensor).
    """

    # The reference's mark of a value a TensorDict passes through (its _pass_through); the
    # core recognises either class by it.
    _pass_through = True

    @staticmethod
    def __new__(cls, data: Any, batch_size: Any = None) -> "UnbatchedTensor":
        if not isinstance(data, torch.Tensor):
            data = torch.as_tensor(data)
        # Always over a new tensor of the same storage (detach() makes one; the autograd flag is
        # passed on): torch 2.14 refuses to make a subclass of a tensor that an object of another
        # subclass already wraps, such as the reference's UnbatchedTensor of a converted leaf.
        return torch.Tensor._make_subclass(cls, data.detach(), data.requires_grad)

    def __init__(self, data: Any, batch_size: Any = None) -> None:
        super().__init__()

    @classmethod
    def _wrap(cls, tensor: torch.Tensor) -> "UnbatchedTensor":
        return cls(tensor)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"UnbatchedTensor({torch.Tensor.__repr__(self.as_subclass(torch.Tensor))})"

    def __reduce_ex__(self, protocol: int) -> tuple:
        return UnbatchedTensor, (self.as_subclass(torch.Tensor),)


# Its pickle is the class and a plain tensor: safe for torch.load(weights_only=True).
torch.serialization.add_safe_globals([UnbatchedTensor])
