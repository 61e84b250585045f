"""The non-tensor entries of a TensorDict, as the reference's ``NonTensorData``, ``MetaData``
and ``NonTensorStack``, over the core's ``_C.NonTensorData`` (include/tensordict/non_tensor.h).

A layer below ``_td``: this module imports nothing of the package but ``_C``.
"""
from __future__ import annotations

import numbers
from typing import Any

import torch
import torch.utils._pytree as _pytree

from tensordict_cpp import _C


def _batch_size(batch_size: Any) -> list[int]:
    if batch_size is None:
        return []
    if isinstance(batch_size, numbers.Integral):
        return [int(batch_size)]
    return [int(s) for s in batch_size]


def _device(device: Any) -> torch.device | None:
    return None if device is None else torch.device(device)


def index_item(item: Any) -> Any:
    """One element of a batch index as the core takes it: ints, slices, None, Ellipsis, bools
    and tensors; other sequences become index tensors, as torch would read them."""
    if item is None or item is Ellipsis or isinstance(item, (bool, int, slice, torch.Tensor)):
        return item
    if isinstance(item, numbers.Integral):
        return int(item)
    if isinstance(item, (list, range)) or hasattr(item, "__array__"):
        return torch.as_tensor(item)
    raise TypeError(f"unsupported index element of type {type(item)}")


def as_index(index: Any) -> tuple:
    return tuple(index_item(i) for i in (index if isinstance(index, tuple) else (index,)))


def _elementwise(values_a: Any, values_b: Any, batch: list[int]) -> torch.Tensor:
    """A bool tensor of shape ``batch``: the element-wise equality of two nested value lists."""
    flat_a, flat_b = [values_a], [values_b]
    for _ in batch:
        flat_a = [x for v in flat_a for x in v]
        flat_b = [x for v in flat_b for x in v]
    return torch.tensor([a == b for a, b in zip(flat_a, flat_b)], dtype=torch.bool).reshape(batch)


class NonTensorData:
    """A non-tensor entry of a TensorDict: JSON-like data with the batch size and device of
    the level that holds it, as the reference's ``tensordict.NonTensorData``.

    The data is ``str``, ``int`` (int64), ``float``, ``bool``, ``None``, or lists and dicts
    (with ``str`` keys) of them. ``td["key"]`` and :meth:`TensorDict.get_non_tensor` return
    the data; :meth:`TensorDict.get`, ``items()`` and ``values()`` return this wrapper.
    Per-leaf transfers and reductions skip non-tensor entries (the receiver keeps its own);
    consolidate() records them, so init_remote, the collectives and the pipe deliver them.
    Stacking TensorDicts stacks their non-tensor entries into a :class:`NonTensorStack`, as the
    reference does, even when the data are equal.

    Args:
        data: the JSON-like value (a NonTensorData is unwrapped: its data is used).
        batch_size (sequence of int, optional): its batch size; empty (the default) takes the
            batch size of the level it is set in.
        device (optional): its device; a level with a device gives it its own.
    """

    __slots__ = ("data", "batch_size", "device")
    _metadata = False  # MetaData says True

    def __reduce__(self) -> tuple:
        # Its class and plain arguments: what torch.load(weights_only=True) can rebuild.
        cls = MetaData if isinstance(self, MetaData) else NonTensorData
        return cls, (self.data, list(self.batch_size),
                     None if self.device is None else str(self.device))

    def __init__(self, data: Any, batch_size: Any = None, device: Any = None) -> None:
        if isinstance(data, NonTensorData):
            data = data.data
        self.data = data
        self.batch_size = torch.Size(_batch_size(batch_size))
        self.device = _device(device)

    @property
    def shape(self) -> torch.Size:
        return self.batch_size

    def __repr__(self) -> str:
        # The reference's NonTensorData.__repr__.
        data_str = str(self.data)
        if len(data_str) > 200:
            data_str = data_str[:20] + "  ...  " + data_str[-20:]
        return (f"{type(self).__name__}(data={data_str}, batch_size={self.batch_size}, "
                f"device={self.device})")

    def __eq__(self, other: Any) -> torch.Tensor:  # type: ignore[override]
        """As the reference: a bool tensor of the batch size, all True when the data (of
        ``other`` if it is a NonTensorData, else ``other`` itself) equals this data; against
        a :class:`NonTensorStack`, element by element."""
        if isinstance(other, NonTensorStack):
            return other == self
        other_data = other.data if isinstance(other, NonTensorData) else other
        return torch.full(self.batch_size, self.data == other_data, dtype=torch.bool,
                          device=self.device)

    def __ne__(self, other: Any) -> torch.Tensor:  # type: ignore[override]
        return ~(self == other)

    __hash__ = None  # type: ignore[assignment]

    def tolist(self) -> Any:
        """The data, repeated along the batch dims (the reference's tolist())."""
        out = self.data
        for size in reversed(self.batch_size):
            out = [out for _ in range(size)]
        return out

    def _to_cpp(self, key: Any = "data") -> _C.NonTensorData:
        return _C.NonTensorData(self.data, list(self.batch_size), self.device, key,
                                self._metadata)


class MetaData(NonTensorData):
    """A non-tensor entry that holds one value for the whole batch, as the reference's
    ``tensordict.MetaData``: it behaves as :class:`NonTensorData`, except that stacking
    TensorDicts whose MetaData hold equal data gives one MetaData (with the stacked batch
    size) instead of a :class:`NonTensorStack`, and indexing keeps it whole.

    The reference compares the values by identity (``is``); ours holds JSON-like values, which
    have no identity once stored, and compares them by equality. Between two processes of ours
    a MetaData stays one through init_remote, the collectives and the consolidated pipe; a
    reference peer receives a NonTensorData, as it does from its own MetaData
    (docs/non_tensor.md).

    ``MetaData[cls]`` is a subclass whose constructor raises TypeError when the data is not an
    instance of ``cls``.
    """

    __slots__ = ()
    _metadata = True
    _expected_type: Any = None
    _typed: dict = {}

    def __init__(self, data: Any, batch_size: Any = None, device: Any = None) -> None:
        super().__init__(data, batch_size, device)
        expected = type(self)._expected_type
        if expected is not None and not isinstance(self.data, expected):
            raise TypeError(f"Expected data of type {getattr(expected, '__name__', expected)}, "
                            f"got {type(self.data).__name__}")

    def __class_getitem__(cls, item: Any) -> type:
        if cls is not MetaData:
            raise TypeError(f"Cannot specify type for {cls.__name__}")
        if item not in MetaData._typed:
            name = f"MetaData[{getattr(item, '__name__', str(item))}]"
            MetaData._typed[item] = type(name, (MetaData,), {"__slots__": (),
                                                             "_expected_type": item})
        return MetaData._typed[item]


class NonTensorStack:
    """A stack of non-tensor entries, one value per element of the batch, as the reference's
    ``tensordict.NonTensorStack``.

    You get one by stacking TensorDicts that hold non-tensor entries (``torch.stack`` /
    :func:`~tensordict_cpp.stack`, or a lazy stack's read of the key), by assigning a list that
    is not numeric to a key (``td["text"] = ["a", "b", "c"]``), or with
    ``NonTensorStack("a", "b")`` / :meth:`from_list`. ``td["text"]`` returns its values as a
    :class:`LinkedList` (a nested list that writes item assignments back), ``td.get("text")``
    the stack itself; indexing a TensorDict indexes its
    stacks, so ``td[1]["text"]`` is the second value. Per-leaf transfers skip it, as the
    reference does; consolidate(), init_remote, the collectives and the pipe (both modes) carry
    it in the reference's format, so either side may be the reference.

    Args:
        *members: the members: :class:`NonTensorData`, :class:`MetaData` or stacks, or any
            JSON-like value (wrapped in a NonTensorData with batch size ``[]``). They share
            one batch size.

    Keyword Args:
        stack_dim (int, optional): the dim of the stack's batch size that indexes the members.
            Defaults to ``0``.
        stack_dim_name (str, optional): its name (kept in the metadata only).

    Raises:
        ValueError: when the members' batch sizes differ.
    """

    __slots__ = ("_cpp",)

    def __init__(self, *members: Any, stack_dim: int = 0,
                 stack_dim_name: str | None = None) -> None:
        parts = [to_cpp(m if is_non_tensor(m) else NonTensorData(m), str(i))
                 for i, m in enumerate(members)]
        self._cpp = _C.NonTensorData.stack(parts, stack_dim, stack_dim_name)

    def __reduce__(self) -> tuple:
        with _C.json_scope():  # members sharing a value give one Python object: pickled once
            members = list(self.tensordicts)
        return _rebuild_stack, (members, self.stack_dim, self.stack_dim_name)

    @classmethod
    def from_list(cls, values: list, device: Any = None) -> "NonTensorStack":
        """A stack of ``values``, nested lists of equal lengths becoming nested stacks, as the
        reference's ``NonTensorStack.from_list``."""
        return cls._wrap(_C.NonTensorData.from_list(values, _device(device), "values"))

    @classmethod
    def _wrap(cls, cpp: _C.NonTensorData) -> "NonTensorStack":
        out = cls.__new__(cls)
        out._cpp = cpp
        return out

    @property
    def batch_size(self) -> torch.Size:
        return torch.Size(self._cpp.batch_size)

    shape = batch_size

    @property
    def device(self) -> torch.device | None:
        return self._cpp.device

    @property
    def stack_dim(self) -> int:
        return self._cpp.stack_dim

    @property
    def stack_dim_name(self) -> str | None:
        return self._cpp.stack_dim_name

    @property
    def tensordicts(self) -> list:
        """The members, in stack order."""
        return [from_cpp(m) for m in self._cpp.members]

    @property
    def data(self) -> Any:
        """The value every element holds; AttributeError when they differ (use tolist())."""
        if self._cpp.members:
            values = self._cpp.tolist()
            for _ in range(len(self.batch_size) - 1):
                values = [x for v in values for x in v]
            if values and all(v == values[0] for v in values):
                return values[0]
        raise AttributeError("Cannot get the non-unique data of a NonTensorStack. Use .tolist() "
                             "instead.")

    def tolist(self) -> list:
        """The values, nested as the batch dims (row-major, whatever the stack dim)."""
        return self._cpp.tolist()

    def to_dict(self) -> list:
        return self.tolist()

    def is_empty(self) -> bool:
        return False  # a stack holds values, as the reference says

    def __len__(self) -> int:
        return self.batch_size[0]

    def __iter__(self):
        return iter(self.unbind(0))

    def __getitem__(self, index: Any) -> Any:
        """Indexes the batch dims: one element is a :class:`NonTensorData`, several a stack."""
        td = _C.TensorDict([("x", self._cpp)], list(self.batch_size), None)
        return from_cpp(td.index(as_index(index)).get("x"))

    def unbind(self, dim: int = 0) -> tuple:
        """The slices along ``dim``: the members along the stack dim."""
        return tuple(from_cpp(m) for m in self._cpp.unbind(dim))

    def clone(self, recurse: bool = True) -> "NonTensorStack":
        return NonTensorStack._wrap(self._cpp)  # the values are immutable: sharing is a copy

    def to(self, device: Any, *args: Any, **kwargs: Any) -> "NonTensorStack":
        return NonTensorStack._wrap(self._cpp.with_device(_device(device)))

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        """Element by element against another stack or a NonTensorData of the same batch size
        (a bool tensor); ``False`` against anything else, as the reference."""
        if isinstance(other, (NonTensorStack, NonTensorData)):
            if list(other.batch_size) != list(self.batch_size):
                raise RuntimeError(f"Could not compare tensordicts with shapes {self.batch_size} "
                                   f"and {other.batch_size}")
            return _elementwise(self.tolist(), other.tolist(), list(self.batch_size))
        return False

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        eq = self == other
        return ~eq if isinstance(eq, torch.Tensor) else not eq

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return self._cpp.repr()


class LinkedList(list):
    """The values of a :class:`NonTensorStack` entry as ``td[key]`` returns them: a ``list``
    (nested once per batch dim) whose item assignments write back into the TensorDict, as the
    reference's ``tensordict.utils.LinkedList``.

    ``values[i] = v`` (or a slice of the same length) replaces element ``i`` of the stack at
    ``key`` of the TensorDict it was read from, keeping that element's kind (a MetaData stays
    one); a list element of a stack with two or more batch dims is itself a LinkedList bound to
    its row. If the write fails (a value of the wrong batch size, data that is not JSON-like, a
    locked TensorDict), the list is left as it was and the error is raised. The methods that
    change the length (``append``, ``extend``, ``insert``, ``pop``, ``remove``, ``clear``,
    ``del``, ``+=``, ``*=``) change the list only and unlink it, as the reference's do.
    :meth:`tolist` returns plain nested lists. A LinkedList compares equal to a list with the
    same items, and pickles (or copies) as an unlinked one. ``LinkedList(iterable)`` is unlinked.

    The reference writes into the stack object itself; ours writes a new stack into the entry
    (the values are immutable), so the entry the list writes to is the one at ``key`` when it
    writes. A lazy stack's entry reads as an unlinked list: it is assembled from the members,
    and the reference's writes do not reach them either.
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._link = None  # (the _C.TensorDict the entry is in, its key, the row's index path)

    @classmethod
    def _linked(cls, values: list, td: Any, key: Any, path: tuple = (),
                depth: int = 1) -> "LinkedList":
        out = cls(values if depth <= 1 else
                  [cls._linked(v, td, key, path + (i,), depth - 1) for i, v in enumerate(values)])
        out._link = None if td is None else (td, key, path)
        return out

    def __setitem__(self, index: Any, value: Any) -> None:
        link = self._link
        if link is None:
            super().__setitem__(index, value)
            return
        is_slice = isinstance(index, slice)
        old = list(self) if is_slice else list.__getitem__(self, index)
        super().__setitem__(index, value)
        try:
            td, key, path = link
            entry = td.get(key)
            if not isinstance(entry, _C.NonTensorData) or not entry.is_stack:
                raise RuntimeError(f"the entry {key!r} this list was read from is no longer a "
                                   f"NonTensorStack")
            td.set(key, _replace_element(entry, path, index, value, key))
        except Exception:
            super().__setitem__(slice(None) if is_slice else index, old)
            raise

    def tolist(self) -> list:
        """A plain ``list`` copy of the items (nested LinkedLists as nested lists), not linked."""
        return [item.tolist() if isinstance(item, LinkedList) else item for item in self]

    def _unlink(self) -> None:
        self._link = None

    def append(self, object: Any) -> None:  # noqa: A002 - list's names
        self._unlink()
        super().append(object)

    def extend(self, iterable: Any) -> None:
        self._unlink()
        super().extend(iterable)

    def insert(self, index: Any, object: Any) -> None:  # noqa: A002
        self._unlink()
        super().insert(index, object)

    def pop(self, index: Any = -1) -> Any:
        self._unlink()
        return super().pop(index)

    def remove(self, value: Any) -> None:
        self._unlink()
        super().remove(value)

    def clear(self) -> None:
        self._unlink()
        super().clear()

    def __delitem__(self, index: Any) -> None:
        self._unlink()
        super().__delitem__(index)

    def __iadd__(self, other: Any) -> "LinkedList":
        self._unlink()
        return super().__iadd__(other)

    def __imul__(self, other: Any) -> "LinkedList":
        self._unlink()
        return super().__imul__(other)

    def __repr__(self) -> str:
        return f"LinkedList({super().__repr__()})"

    def __eq__(self, other: Any) -> bool:
        return list(self) == other

    def __ne__(self, other: Any) -> bool:
        return list(self) != other

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        return type(self), (list(self),)  # unlinked: a TensorDict handle does not pickle

    def __copy__(self) -> "LinkedList":
        return type(self)(self)


# A list to torch's pytree functions (torch.compile, vmap), as the reference registers its own.
_pytree.register_pytree_node(
    LinkedList, _pytree._list_flatten, _pytree._list_unflatten,
    serialized_type_name="tensordict_cpp.LinkedList",
    flatten_with_keys_fn=_pytree._list_flatten_with_keys)


def linked_values(entry: _C.NonTensorData, td: Any, key: Any) -> "LinkedList":
    """``td[key]`` for the stack ``entry`` at ``key`` of the _C.TensorDict ``td``: its values
    as a LinkedList writing back there (unlinked when ``td`` is None)."""
    return LinkedList._linked(entry.tolist(), td, key, (), len(entry.batch_size))


def _replace_element(entry: _C.NonTensorData, path: tuple, index: Any, value: Any,
                     key: Any) -> _C.NonTensorData:
    """``entry`` (a stack) with the element(s) at ``index`` of its row ``path`` (indices along
    its leading batch dims) replaced by ``value``; each keeps its batch size and kind."""
    parts = list(entry.unbind(0))  # the members when the stack dim is 0
    if path:
        parts[path[0]] = _replace_element(parts[path[0]], path[1:], index, value, key)
    elif isinstance(index, slice):
        positions = range(*index.indices(len(parts)))
        values = list(value)
        if len(values) != len(positions):
            raise RuntimeError(f"key {key!r}: {len(values)} values for {len(positions)} elements "
                               f"of the NonTensorStack: an assignment cannot change its length")
        for i, v in zip(positions, values):
            parts[i] = _element_like(parts[i], v, key)
    else:
        parts[index] = _element_like(parts[index], value, key)
    # A stack along another dim comes back stacked along dim 0: the same values.
    name = entry.stack_dim_name if entry.stack_dim == 0 else None
    return _C.NonTensorData.stack(parts, 0, name)


def _element_like(old: _C.NonTensorData, value: Any, key: Any) -> _C.NonTensorData:
    """``value`` as an element in the place of ``old``: its batch size, device and kind. A list
    is a stack of its items, as in ``td[key] = [...]``: it must have ``old``'s batch size."""
    if is_non_tensor(value):
        new = to_cpp(value, key)
    elif isinstance(value, list):
        new = _C.NonTensorData.from_list(value, old.device, key)
    else:
        return _C.NonTensorData(value, list(old.batch_size), old.device, key, old.is_metadata)
    if list(new.batch_size) != list(old.batch_size):
        raise RuntimeError(f"key {key!r}: the new element has batch size "
                           f"{list(new.batch_size)}, the one it replaces {list(old.batch_size)}")
    return new


def _rebuild_stack(members: list, stack_dim: int, stack_dim_name: str | None) -> NonTensorStack:
    # One conversion scope: members sharing one unpickled object share one value (_td.py).
    with _C.json_scope():
        return NonTensorStack(*members, stack_dim=stack_dim, stack_dim_name=stack_dim_name)


torch.serialization.add_safe_globals([_rebuild_stack])


def is_non_tensor(value: Any) -> bool:
    """Whether ``value`` is one of the non-tensor entry classes above."""
    return isinstance(value, (NonTensorData, NonTensorStack))


def to_cpp(value: Any, key: Any = "data") -> _C.NonTensorData:
    """The core's entry for a NonTensorData, MetaData or NonTensorStack (``key`` names it in
    errors about its data)."""
    if isinstance(value, NonTensorStack):
        return value._cpp
    return value._to_cpp(key)


def from_cpp(cpp: _C.NonTensorData) -> Any:
    """The Python face of the core's entry."""
    if cpp.is_stack:
        return NonTensorStack._wrap(cpp)
    cls = MetaData if cpp.is_metadata else NonTensorData
    return cls(cpp.data, cpp.batch_size, cpp.device)
