"""Zero-copy exchange with the reference ``tensordict``'s objects.

The reference stays an optional import: it is looked up in ``sys.modules`` only, so an object
of it can exist only where the user imported it, and nothing here imports it unless a caller
asks for a reference object (``to_reference``). Leaves are shared, never copied: a value
received into a converted TensorDict lands in the user's tensors.

A layer below ``_td``: this module imports nothing of the package but ``_C``.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from tensordict_cpp import _C


def _module() -> Any:
    return sys.modules.get("tensordict")


def is_reference(obj: Any) -> bool:
    """Whether ``obj`` is one of the reference's tensor collections (a TensorDictBase or a
    tensorclass instance)."""
    ref = _module()
    if ref is None:
        return False
    return isinstance(obj, ref.TensorDictBase) or (
        not isinstance(obj, type) and ref.is_tensorclass(obj))


def is_reference_class(cls: type) -> bool:
    """Whether ``cls`` is one of the reference's tensor collection classes."""
    ref = _module()
    return ref is not None and (issubclass(cls, ref.TensorDictBase) or ref.is_tensorclass(cls))


def from_reference(obj: Any) -> _C.TensorDict:
    """The ``_C.TensorDict`` holding the leaves of the reference object ``obj``, shared, with its
    batch size, device, nested levels, non-tensor entries and lock. TypeError naming the class
    for a collection we do not convert."""
    ref = _module()
    if not isinstance(obj, ref.TensorDictBase):
        obj = obj._tensordict  # a tensorclass: its TensorDict, as ours do it
    elif isinstance(obj, ref.nn.TensorDictParams):
        obj = obj._param_td  # its leaves are the module's Parameters and buffers themselves
    return _convert(obj, ref)


def _convert(obj: Any, ref: Any) -> _C.TensorDict:
    if type(obj) is ref.LazyStackedTensorDict:
        out = _C.lazy_stack([from_reference(td) for td in obj.tensordicts], obj.stack_dim,
                            obj._td_dim_name)
        if obj.is_locked:
            out.lock_()
        return out
    if type(obj) is not ref.TensorDict:
        raise TypeError(f"cannot convert the reference's {type(obj).__module__}."
                        f"{type(obj).__qualname__} to a tensordict_cpp.TensorDict: only "
                        f"tensordict.TensorDict, LazyStackedTensorDict and tensorclasses over "
                        f"them are supported")
    entries = []
    for key, value in obj.items():
        # Exact types first: the ABC checks below cost about a microsecond each.
        if isinstance(value, torch.Tensor):
            pass
        elif type(value) is ref.TensorDict or type(value) is ref.LazyStackedTensorDict:
            value = _convert(value, ref)
        elif ref.is_non_tensor(value):
            value = _non_tensor(value, ref, key)
        elif isinstance(value, ref.TensorDictBase) or ref.is_tensorclass(value):
            value = from_reference(value)  # a nested tensorclass, or a class refused there
        entries.append((key, value))
    out = _C.TensorDict(entries, list(obj.batch_size), obj.device)
    if obj.is_locked:
        out.lock_()
    return out


def _non_tensor(value: Any, ref: Any, key: Any) -> _C.NonTensorData:
    """The core's entry for the reference's NonTensorData, MetaData or NonTensorStack."""
    if isinstance(value, ref.NonTensorStack):
        members = [_non_tensor(m, ref, key) for m in value.tensordicts]
        if not members:
            return _C.NonTensorData.from_list([], value.device, key)
        return _C.NonTensorData.stack(members, value.stack_dim, value._td_dim_name)
    return _C.NonTensorData(value.data, list(value.batch_size), value.device, key,
                            isinstance(value, ref.MetaData))


def _reference_non_tensor(cpp: _C.NonTensorData, ref: Any) -> Any:
    """The reference's object for the core's entry."""
    if cpp.is_stack:
        members = [_reference_non_tensor(m, ref) for m in cpp.members]
        return ref.NonTensorStack(*members, stack_dim=cpp.stack_dim,
                                  stack_dim_name=cpp.stack_dim_name)
    cls = ref.MetaData if cpp.is_metadata else ref.NonTensorData
    return cls(data=cpp.data, batch_size=cpp.batch_size, device=cpp.device)


def to_reference(cpp: _C.TensorDict) -> Any:
    """A reference ``tensordict.TensorDict`` sharing the leaves of ``cpp``. ImportError naming
    the package when it is not installed."""
    try:
        import tensordict as ref
    except ImportError as e:
        raise ImportError("to_reference() needs the reference package `tensordict` "
                          "(pip install tensordict)") from e
    if cpp.is_lazy_stack():
        out = ref.LazyStackedTensorDict(*(to_reference(t) for t in cpp.tensordicts()),
                                        stack_dim=cpp.stack_dim,
                                        stack_dim_name=cpp.stack_dim_name)
        if cpp.is_locked():
            out.lock_()
        return out
    source = {}
    for key, value in cpp.items(False, False):
        if getattr(type(value), "_pass_through", False) and isinstance(value, torch.Tensor):
            value = ref.UnbatchedTensor(value.as_subclass(torch.Tensor))
        elif isinstance(value, _C.TensorDict):
            value = to_reference(value)
        elif isinstance(value, _C.NonTensorData):
            value = _reference_non_tensor(value, ref)
        source[key] = value
    out = ref.TensorDict(source, batch_size=cpp.batch_size, device=cpp.device)
    if cpp.is_locked():
        out.lock_()
    return out
