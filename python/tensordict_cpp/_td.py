"""The Python face of the C++ TensorDict: the reference tensordict's calling conventions over
``tensordict_cpp._C.TensorDict``, which does the work.

Imports go one way through the package (tests/python/test_imports.py checks it): errors, _C,
then _p2p and _collectives (transfers over ``self._cpp``) and _reference (the reference's
objects), then this module, which binds them as TensorDict's methods, then tensorclass, pipe
and the package's ``__init__``.
"""
from __future__ import annotations

import errno
import functools
import numbers
import os
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch

from tensordict_cpp import _C, _collectives, _p2p, _reference, errors
from tensordict_cpp import memmap as _memmap
from tensordict_cpp._non_tensor import (MetaData, NonTensorData, NonTensorStack, from_cpp as
                                        _non_tensor_from_cpp, is_non_tensor as _is_non_tensor,
                                        to_cpp as _non_tensor_to_cpp)
from tensordict_cpp._non_tensor import as_index as _as_index
from tensordict_cpp._non_tensor import linked_values as _linked_values

_NO_DEFAULT = object()
_CTD = _C.TensorDict


def _is_key(index: Any) -> bool:
    if isinstance(index, str):
        return True
    return isinstance(index, tuple) and len(index) > 0 and all(_is_key(i) for i in index)


def _batch_size(batch_size: Any) -> list[int]:
    if batch_size is None:
        return []
    if isinstance(batch_size, numbers.Integral):
        return [int(batch_size)]
    return [int(s) for s in batch_size]


def _shape_args(shape: tuple) -> list[int]:
    # reshape(2, 3) and reshape((2, 3)) / reshape(torch.Size([2, 3])) alike.
    if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
        return [int(s) for s in shape[0]]
    return [int(s) for s in shape]


def _device(device: Any) -> torch.device | None:
    return None if device is None else torch.device(device)


_PRINT_OPTIONS = {"compact": True}


class set_printoptions:
    """Sets how a TensorDict prints, as the reference's ``tensordict.set_printoptions`` (its
    ``compact`` option): as a context manager or decorator for a block, the previous option
    coming back at its end, or for the rest of the program with ``set_printoptions(...).set()``.

    Keyword Args:
        compact (bool, optional): ``True`` (the default) prints each entry as its dtype and
            feature dims (``f32[3]``) on one line where it fits in 80 columns;
            ``False`` prints the detailed form, a ``Tensor(shape=..., device=..., dtype=...,
            is_shared=...)`` per entry.
    """

    def __init__(self, *, compact: bool | None = None) -> None:
        self._options = {} if compact is None else {"compact": bool(compact)}
        self._previous: dict = {}

    def set(self) -> None:
        _PRINT_OPTIONS.update(self._options)

    def __enter__(self) -> "set_printoptions":
        self._previous = dict(_PRINT_OPTIONS)
        self.set()
        return self

    def __exit__(self, *exc: Any) -> None:
        _PRINT_OPTIONS.update(self._previous)

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with set_printoptions(**self._options):
                return fn(*args, **kwargs)
        return wrapped


def _repr_compact() -> bool:
    return _PRINT_OPTIONS["compact"]


class TensorDict:
    """A dictionary of tensors that share leading batch dimensions, backed by the C++ core.

    Entries are tensors (leaves), nested TensorDicts or non-tensor entries (JSON-like data, see
    :class:`NonTensorData`), kept in insertion order; every entry's shape (a non-tensor
    entry's batch size) starts with ``batch_size``. Keys are strings; a tuple of strings
    reaches into nested levels, in the constructor's mapping as in ``td[key]``, :meth:`get`
    and :meth:`set`. Indexing with anything else (ints, slices, masks, index tensors) indexes
    the batch dimensions of every leaf at once. A TensorDict behaves like the reference
    ``tensordict.TensorDict`` for the methods it has, exchanges data with it through
    :meth:`send` / :meth:`recv` and their asynchronous forms, and converts from and to its
    objects without copies (:meth:`from_tensordict`, :meth:`to_reference`).

    Args:
        source (dict or TensorDict, optional): the initial entries. Nested dicts become nested
            TensorDicts with the same batch size and device, and so do the missing levels of a
            tuple key (``{("a", "b"): x}`` makes ``a`` holding ``b``). Exclusive with
            ``**kwargs``.
        batch_size (sequence of int, torch.Size or int, optional): the leading dimensions that
            every entry shares. Defaults to ``None``: no batch dimensions.
        device (torch.device, str or int, optional): if given, every leaf is moved there and
            the TensorDict reports it. Defaults to ``None``: leaves stay where they are.
        **kwargs: the entries as keyword arguments, instead of ``source``.

    Raises:
        ValueError: if both ``source`` and keyword entries are given.
        BatchSizeError: (a RuntimeError, as the reference raises, and a ValueError) if an
            entry does not start with ``batch_size``.
        InvalidKeyError: (a KeyError, as the reference raises, and a TypeError) if a key is
            neither a str nor a non-empty tuple of str.
        TypeError: if a value is neither a
            tensor, a number, a dict, a TensorDict, nor JSON-like non-tensor data (str, None,
            a list that is not numeric, a :class:`NonTensorData`).

    Examples:
        >>> td = TensorDict(a=torch.ones(4), b=torch.ones(4, 3), batch_size=[4])
        >>> td["b"].shape
        torch.Size([4, 3])
        >>> td[1:3].batch_size
        torch.Size([2])
    """

    __slots__ = ("_cpp", "__weakref__")
    _params_class: type  # tensordict_cpp.nn.TensorDictParams, which sets it (nn imports this)

    def __init__(self, source: Any = None, batch_size: Any = None, device: Any = None,
                 **kwargs: Any) -> None:
        if source is not None and kwargs:
            raise ValueError(
                "Either a dictionary or a sequence of kwargs must be provided, not both.")
        source = kwargs if kwargs else source
        if _reference.is_reference(source):
            converted = _reference.from_reference(source)  # the leaves shared, not copied
            if batch_size is None and device is None:
                self._cpp = converted
                if converted.is_lazy_stack():  # same slots: the object becomes what it holds
                    self.__class__ = LazyStackedTensorDict
                return
            source = TensorDict._wrap(converted)
        if isinstance(source, TensorDict):
            source = dict(source.items())
        if source is not None and not isinstance(source, Mapping):
            raise TypeError(f"source must be a mapping or a TensorDict, got {type(source)}")
        bs = _batch_size(batch_size)
        dev = _device(device)
        _check_keys(source or {})
        entries = [(k, _to_value(v, bs, dev, k)) for k, v in (source or {}).items()]
        self._cpp = _level(entries, bs, dev)

    @classmethod
    def from_tensordict(cls, td: Any) -> "TensorDict":
        """``td`` as a tensordict_cpp.TensorDict: itself when it is one, else a TensorDict sharing
        the leaves of a reference ``tensordict.TensorDict`` (or of a reference tensorclass's
        TensorDict), with its batch size, device, nested levels, non-tensor entries and lock;
        a reference ``LazyStackedTensorDict`` becomes ours, over its converted members.
        Nothing is copied: values written into the result (a ``recv``) land in ``td``'s
        tensors.

        Raises:
            TypeError: for anything else, naming its class.
        """
        if isinstance(td, TensorDict):
            return td
        if _reference.is_reference(td):
            return cls._wrap(_reference.from_reference(td))
        raise TypeError(f"expected a TensorDict or a reference tensordict object, got "
                        f"{type(td).__module__}.{type(td).__qualname__}")

    def to_reference(self) -> Any:
        """A reference ``tensordict.TensorDict`` sharing this TensorDict's leaves (no copy),
        with its batch size, device, nested levels, non-tensor entries and lock (a reference
        ``LazyStackedTensorDict`` for a lazy stack, at any level): the inverse of
        :meth:`from_tensordict`. Values written into either land in both.

        Raises:
            ImportError: when the reference package ``tensordict`` is not installed.
        """
        return _reference.to_reference(self._cpp)

    def to_tensordict(self, *, retain_none: bool | None = None) -> "TensorDict":
        """A copy as a plain TensorDict, as the reference's ``to_tensordict()``: every tensor
        cloned (autograd history kept, as ``clone()``), every nested level a new TensorDict, a
        lazy stack (at any level) stacked into dense leaves, unlocked, with the batch size and
        device; non-tensor entries, whose values are immutable, are shared. Nothing written into
        the copy reaches this TensorDict, nor the other way round. (:meth:`to_reference` gives
        the reference's TensorDict over the same leaves.)

        Keyword Args:
            retain_none (bool, optional): accepted for the reference's signature; a TensorDict
                of ours holds no ``None`` fields.

        Raises:
            RuntimeError: for a lazy stack whose members' leaves differ in shape, as the
                reference (read them from ``tensordicts`` instead).
        """
        return TensorDict._wrap(_dense_copy(self._cpp))

    # ---- pickling ----------------------------------------------------------------------------
    def __reduce__(self) -> tuple:
        """Pickles (pickle, torch.save, multiprocessing queues, DataLoader workers) as the
        reference pickles its own: a consolidated TensorDict as its storage and metadata (one
        shared storage through a multiprocessing queue), a lazy stack as its members, another as
        its entries (each leaf pickled by torch: shared memory in a queue). Loading is the
        caller's trust decision, as with ``torch.load``; ``torch.load(weights_only=True)`` takes
        the globals these pickles name (allowlisted below), not a tensorclass's."""
        cpp = self._cpp
        if cpp.is_consolidated():
            return _rebuild_consolidated, (cpp.consolidated_storage(),
                                           cpp.consolidated_metadata_json())
        if cpp.is_lazy_stack():
            return _rebuild_lazy_stack, (self.tensordicts, self.stack_dim, self.stack_dim_name,
                                         self.is_locked)
        device = None if self.device is None else str(self.device)
        with _C.json_scope():  # entries sharing a value give one Python object: pickled once
            items = list(self.items())
        return _rebuild_tensordict, (items, list(self.batch_size), device, self.is_locked)

    # ---- modules -----------------------------------------------------------------------------
    @classmethod
    def from_module(cls, module: torch.nn.Module, as_module: bool = False, lock: bool = False,
                    use_state_dict: bool = False, filter_empty: bool = True) -> "TensorDict":
        """A TensorDict holding the parameters and buffers of ``module`` themselves (not
        copies), a nested TensorDict per submodule, with batch size ``[]``, as the reference.

        Args:
            module (torch.nn.Module): the module to read.
            as_module (bool, optional): return a :class:`~tensordict_cpp.nn.TensorDictParams`
                whose parameters are the module's own Parameter objects (nothing converted), as
                the reference. Defaults to ``False``.
            lock (bool, optional): lock the result. Defaults to ``False``.
            use_state_dict (bool, optional): read ``module.state_dict(keep_vars=True)`` (its
                hooks run), unflattened at the dots. Defaults to ``False``.
            filter_empty (bool, optional): leave out submodules without parameters or buffers
                (``nn.ReLU``). Defaults to ``True``.
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"from_module: expected a torch.nn.Module, got {type(module)}")
        if use_state_dict:
            out = cls({})
            for name, value in module.state_dict(keep_vars=True).items():
                out[tuple(name.split("."))] = value
        else:
            out = cls._wrap(_module_entries(module, filter_empty) or _CTD([], [], None))
        if as_module:
            return TensorDict._params_class(out, no_convert=True, lock=lock)
        if lock:
            out.lock_()
        return out

    def to_module(self, module: torch.nn.Module, *, inplace: bool | None = None,
                  return_swap: bool = True, swap_dest: Any = None, use_state_dict: bool = False,
                  non_blocking: bool = False, preserve_module_state: bool = True,
                  memo: Any = None) -> "TensorDict | None":
        """Writes this TensorDict's leaves into the parameters and buffers of ``module``
        (nested keys are submodules), as the reference; returns the values the module held
        before (a TensorDict, or ``swap_dest`` updated with them) when ``return_swap``.

        Keyword Args:
            inplace (bool, optional): copy into the existing tensors, which keep their identity;
                otherwise the leaves replace them. Defaults to ``None`` (``False``).
            return_swap (bool, optional): return the previous values. Defaults to ``True``.
            swap_dest (TensorDict, optional): where to write the previous values.
            use_state_dict (bool, optional): load through ``module.load_state_dict`` (its hooks
                run). Defaults to ``False``.
            non_blocking (bool, optional): asynchronous copies with ``inplace``.
            preserve_module_state (bool, optional): a leaf replacing a parameter becomes a
                parameter with the old ``requires_grad``, one replacing a buffer a buffer.
                Defaults to ``True``.

        Raises:
            KeyError: a key that is not a parameter, buffer or submodule of ``module``.
            RuntimeError: ``memo`` (no longer accepted, as in the reference), or ``inplace``
                with ``use_state_dict``.
        """
        if memo is not None:
            raise RuntimeError("memo cannot be passed to the public to_module anymore.")
        if use_state_dict:
            if inplace is not None:
                raise RuntimeError("inplace argument cannot be passed when use_state_dict=True.")
            old = TensorDict.from_module(module, use_state_dict=True).clone() if return_swap else None
            flat = {".".join((k,) if isinstance(k, str) else k): v
                    for k, v in self.items(include_nested=True, leaves_only=True)}
            module.load_state_dict(flat, strict=True)
            return _swap_result(old, swap_dest) if return_swap else None
        old = _write_module(self, module, bool(inplace), non_blocking, preserve_module_state,
                            return_swap)
        return _swap_result(TensorDict._wrap(old), swap_dest) if return_swap else None

    @classmethod
    def _wrap(cls, cpp: _CTD) -> "TensorDict":
        if cpp.is_lazy_stack():
            cls = LazyStackedTensorDict if cls is TensorDict else cls
        elif cls is LazyStackedTensorDict:
            cls = TensorDict
        out = cls.__new__(cls)
        out._cpp = cpp
        return out

    # ---- shape and device --------------------------------------------------------------------
    @property
    def batch_size(self) -> torch.Size:
        """The batch dimensions shared by every entry, as a ``torch.Size``.

        Assigning a new batch size checks that every entry starts with it
        (:class:`~tensordict_cpp.errors.BatchSizeError`, a RuntimeError and a ValueError,
        otherwise).
        """
        return torch.Size(self._cpp.batch_size)

    @batch_size.setter
    def batch_size(self, value: Any) -> None:
        self._cpp.set_batch_size(_batch_size(value))

    @property
    def shape(self) -> torch.Size:
        """Same as :attr:`batch_size`."""
        return self.batch_size

    @property
    def batch_dims(self) -> int:
        """The number of batch dimensions."""
        return self._cpp.batch_dims

    ndim = batch_dims

    def dim(self) -> int:
        """The number of batch dimensions."""
        return self._cpp.batch_dims

    def numel(self) -> int:
        """The product of the batch dimensions (1 without batch dimensions)."""
        return self._cpp.numel()

    @property
    def device(self) -> torch.device | None:
        """The device of the TensorDict, or ``None`` when it was built without one."""
        return self._cpp.device

    def __len__(self) -> int:
        """The size of the first batch dimension, or 0 without batch dimensions."""
        bs = self._cpp.batch_size
        return bs[0] if bs else 0

    # ---- entries -----------------------------------------------------------------------------
    def __getitem__(self, index: Any) -> Any:
        """``td[key]`` returns an entry; ``td[index]`` indexes the batch dimensions.

        A str or a tuple of str is a key (KeyError if absent). Anything else (int, slice,
        ``None``, ``...``, boolean mask, index tensor or list, or a tuple of these) indexes
        every leaf's batch dimensions and returns a new TensorDict; ints and slices give views.
        IndexError or ValueError when the index does not fit the batch size.
        """
        # A str key naming a tensor never gets here: _C._install_getitem (below the class)
        # serves it in C++ and calls this method for the rest.
        if _is_key(index):
            value = self._cpp.get(index)
        else:
            return TensorDict._wrap(self._cpp.index(_as_index(index)))
        # As the reference: a non-tensor entry reads as its data, a stack's as a LinkedList of
        # its values that writes item assignments back.
        if isinstance(value, _C.NonTensorData):
            return self._non_tensor_content(value, index)
        return _from_value(value)

    def _non_tensor_content(self, value: _C.NonTensorData, key: Any) -> Any:
        if not value.is_stack:
            return value.data
        # An entry in a lazy stack is assembled from its members: not linked (nor is the
        # reference's).
        level, lazy = self._cpp, self._cpp.is_lazy_stack()
        for part in (key[:-1] if isinstance(key, tuple) else ()):
            level = level.get(part)
            lazy = lazy or level.is_lazy_stack()
        return _linked_values(value, None if lazy else self._cpp, key)

    def __setitem__(self, index: Any, value: Any) -> None:
        """``td[key] = value`` sets an entry; ``td[index] = value`` writes into the batch.

        With a key, ``value`` is a tensor, a number, a dict or a TensorDict whose shape starts
        with the batch size (BatchSizeError, a RuntimeError and a ValueError, otherwise);
        missing nested levels are created; a locked TensorDict raises RuntimeError. As in the
        reference, numbers and lists of numbers
        become tensors, a dict becomes a nested TensorDict, a ``str`` or ``None`` becomes a
        non-tensor entry (see :meth:`set_non_tensor`) and a list that is not numeric a
        :class:`NonTensorStack` of its values (nested lists of equal lengths nesting); a
        :class:`NonTensorData`, :class:`MetaData` or :class:`NonTensorStack` is set as it is.
        With a batch index, every leaf is written in place at
        that index, from the matching leaf of a TensorDict ``value`` or from a tensor or number
        broadcast to every leaf.
        """
        if _is_key(index):
            value = _to_value(value, self._cpp.batch_size, self._cpp.device, index)
            if isinstance(value, _RawNonTensor):
                self._cpp.set_non_tensor(index, value.data)
            else:
                self._cpp.set(index, value)
            return
        index = _as_index(index)
        if self._cpp.has_lazy_stack():
            # A lazy stack's leaves read as stacked copies, so the write goes through views of
            # its members' leaves: those of the indexed TensorDict, for basic indices.
            if not any(isinstance(i, (torch.Tensor, list)) for i in index):
                target = self._cpp.index(index)
                if isinstance(value, TensorDict):
                    target.update(value._cpp, False, True)
                else:
                    value = torch.as_tensor(value)
                    for key in target.keys(True, True):
                        target.set_(key, value)
                return
            # Advanced indices copy: each leaf is read stacked, written, and written back.
            for key in self._cpp.keys(True, True):
                leaf = self._cpp.get(key)
                leaf[index] = value[key] if isinstance(value, TensorDict) else value
                self._cpp.set_(key, leaf)
            return
        for key, leaf in self._cpp.items(True, True):
            if isinstance(value, TensorDict):
                leaf[index] = value[key]
            else:
                leaf[index] = value

    def _get_sub_tensordict(self, index: Any) -> "_SubTensorDict":
        """The rows that ``index`` selects, as a view whose writes and receives land in this
        TensorDict (the reference's ``_get_sub_tensordict``): see :class:`_SubTensorDict`."""
        return _SubTensorDict(self, index)

    def __delitem__(self, key: Any) -> None:
        """Removes the entry at ``key`` (KeyError if absent, RuntimeError if locked)."""
        self._cpp.erase(key)

    def __contains__(self, key: Any) -> bool:
        """True when ``key`` (a str or a tuple of str) is an entry, at any nesting level."""
        return self._cpp.contains(key)

    def get(self, key: Any, default: Any = _NO_DEFAULT) -> Any:
        """The entry at ``key``; ``default`` when it is missing, if given (KeyError otherwise).
        A non-tensor entry comes as a :class:`NonTensorData` (``td[key]`` gives its data), as
        in the reference."""
        if default is not _NO_DEFAULT and not self._cpp.contains(key):
            return default
        return _from_value(self._cpp.get(key))

    def set(self, key: Any, value: Any, inplace: bool = False) -> "TensorDict":
        """Sets the entry at ``key`` and returns the TensorDict.

        With ``inplace=True`` and an existing leaf, ``value`` is copied into that leaf instead
        of replacing it (shapes must match). See :meth:`__setitem__` for the accepted values.
        """
        if inplace and self._cpp.contains(key) and isinstance(value, torch.Tensor):
            self._cpp.set_(key, value)
        else:
            self[key] = value
        return self

    def set_(self, key: Any, value: torch.Tensor) -> "TensorDict":
        """Copies ``value`` into the existing leaf at ``key`` (works on locked TensorDicts);
        KeyError if there is no such leaf."""
        self._cpp.set_(key, value)
        return self

    def set_non_tensor(self, key: Any, value: Any) -> "TensorDict":
        """Sets ``value`` as a non-tensor entry at ``key``, with the batch size and device of
        its level (missing levels are created), and returns the TensorDict.

        ``value`` is JSON-like: ``str``, ``int`` (int64), ``float``, ``bool``, ``None``, or
        lists and dicts (with ``str`` keys) of them; numbers and dicts are stored as they are,
        not converted to tensors or nested TensorDicts.

        Raises:
            TypeError: if ``value`` is not JSON-like (a tuple, a set, an object, a dict with a
                key that is not a ``str``), naming the key and the position inside the value.
            ValueError: for an int outside int64 or a value nested more than 512 levels deep.
            RuntimeError: if the TensorDict is locked.
        """
        self._cpp.set_non_tensor(key, value)
        return self

    def get_non_tensor(self, key: Any, default: Any = _NO_DEFAULT) -> Any:
        """The data of the non-tensor entry at ``key``. As in the reference, an entry that is
        not a non-tensor is returned as it is, and a missing key returns ``default`` if given
        (KeyError otherwise)."""
        if default is not _NO_DEFAULT and not self._cpp.contains(key):
            return default
        value = self._cpp.get(key)
        if isinstance(value, _C.NonTensorData):
            return self._non_tensor_content(value, key)
        return _from_value(value)

    def is_non_tensor(self, key: Any) -> bool:
        """True when the entry at ``key`` is a non-tensor entry (KeyError if absent)."""
        return isinstance(self._cpp.get(key), _C.NonTensorData)

    def pop(self, key: Any, default: Any = _NO_DEFAULT) -> Any:
        """Removes the entry at ``key`` and returns it; ``default`` when it is missing, if
        given (KeyError otherwise)."""
        if default is not _NO_DEFAULT and not self._cpp.contains(key):
            return default
        return _from_value(self._cpp.pop(key))

    def keys(self, include_nested: bool = False, leaves_only: bool = False,
             is_leaf: Callable | None = None) -> list:
        """The keys, in insertion order.

        Args:
            include_nested (bool, optional): also list the entries of nested TensorDicts, as
                tuple keys such as ``("a", "b")``. Defaults to ``False``.
            leaves_only (bool, optional): keep only tensors: leave out nested TensorDicts and,
                as the reference does, non-tensor entries. Defaults to ``False``.
            is_leaf (callable, optional): called with an entry's type: what ``leaves_only``
                keeps (a nested TensorDict for which it returns True is listed too, after its
                entries). Defaults to tensors being the leaves.
        """
        if is_leaf is None:
            return self._cpp.keys(include_nested, leaves_only)
        return self._cpp.keys(include_nested, leaves_only,
                              lambda value: bool(is_leaf(type(_from_value(value)))))

    def values(self, include_nested: bool = False, leaves_only: bool = False) -> list:
        """The entries, in the order of :meth:`keys` with the same arguments."""
        return [_from_value(v) for v in self._cpp.values(include_nested, leaves_only)]

    def items(self, include_nested: bool = False, leaves_only: bool = False) -> list:
        """``(key, entry)`` pairs, in the order of :meth:`keys` with the same arguments."""
        return [(k, _from_value(v)) for k, v in self._cpp.items(include_nested, leaves_only)]

    @property
    def sorted_keys(self) -> list[str]:
        """The keys of this level sorted by code point: the order in which per-leaf
        :meth:`send` visits them."""
        return self._cpp.sorted_keys()

    def is_empty(self) -> bool:
        """True when no level holds a tensor or a non-tensor entry."""
        return self._cpp.is_empty()

    def __iter__(self):
        """Iterates over the first batch dimension, like :meth:`unbind` (nothing without batch
        dimensions)."""
        if self._cpp.batch_dims:
            yield from self.unbind(0)

    def __bool__(self) -> bool:
        raise RuntimeError(
            "Converting a tensordict to boolean value is not permitted. Use len(td.keys()) to "
            "test for keys, td.is_empty() to test for leaves, or (a == b).all() / .any() to "
            "reduce a comparison.")

    # ---- locking -----------------------------------------------------------------------------
    @property
    def is_locked(self) -> bool:
        """True when entries can be neither added nor removed (values can still be written)."""
        return self._cpp.is_locked()

    def lock_(self) -> "TensorDict":
        """Locks this TensorDict and every nested level; returns it."""
        self._cpp.lock_()
        return self

    def unlock_(self) -> "TensorDict":
        """Unlocks this TensorDict and every nested level; returns it."""
        self._cpp.unlock_()
        return self

    # ---- batch operations --------------------------------------------------------------------
    def unbind(self, dim: int = 0) -> tuple["TensorDict", ...]:
        """Splits the TensorDict along batch dimension ``dim`` into a tuple of views."""
        return tuple(TensorDict._wrap(t) for t in self._cpp.unbind(dim))

    def reshape(self, *shape: Any) -> "TensorDict":
        """A TensorDict with the batch dimensions reshaped to ``shape`` (leaf dims kept)."""
        return TensorDict._wrap(self._cpp.reshape(_shape_args(shape)))

    def view(self, *shape: Any) -> "TensorDict":
        """As :meth:`reshape`, but only as views (RuntimeError when a leaf cannot be viewed)."""
        return TensorDict._wrap(self._cpp.view(_shape_args(shape)))

    def expand(self, *shape: Any) -> "TensorDict":
        """A TensorDict whose leaves are expanded to the batch size ``shape``, as views."""
        return TensorDict._wrap(self._cpp.expand(_shape_args(shape)))

    def unsqueeze(self, dim: int) -> "TensorDict":
        """Inserts a batch dimension of size 1 at ``dim``."""
        return TensorDict._wrap(self._cpp.unsqueeze(dim))

    def squeeze(self, dim: int | None = None) -> "TensorDict":
        """Removes the batch dimensions of size 1, or only ``dim`` if given and of size 1."""
        return TensorDict._wrap(self._cpp.squeeze(dim))

    def split(self, split_size: int | Sequence[int], dim: int = 0) -> tuple["TensorDict", ...]:
        """Splits along batch dimension ``dim`` into chunks of ``split_size`` (an int), or of
        the given sizes (a sequence of int), as ``torch.split`` does."""
        sizes = split_size if isinstance(split_size, numbers.Integral) else list(split_size)
        return tuple(TensorDict._wrap(t) for t in self._cpp.split(sizes, dim))

    # ---- tensor-like operations --------------------------------------------------------------
    def clone(self, recurse: bool = True, **kwargs: Any) -> "TensorDict":
        """An independent copy: every leaf is cloned, every level rebuilt. With
        ``recurse=False``, only the structure is new and the leaves are shared (:meth:`copy`)."""
        return TensorDict._wrap(self._cpp.clone() if recurse else self._cpp.copy())

    def to(self, *args: Any, **kwargs: Any) -> "TensorDict":
        """A TensorDict with every leaf moved to a device or cast to a dtype.

        Takes one positional argument, a ``torch.dtype`` or a device (``torch.device``, str or
        int), or the keyword ``device=`` or ``dtype=``. Moving to a device sets the
        TensorDict's device.
        """
        if len(args) + len(kwargs) != 1 or (kwargs and next(iter(kwargs)) not in ("device", "dtype")):
            raise TypeError("to() takes one device or dtype, positionally or as device= / dtype=")
        dest = args[0] if args else next(iter(kwargs.values()))
        if isinstance(dest, torch.dtype):
            return TensorDict._wrap(self._cpp.to_dtype(dest))
        return TensorDict._wrap(self._cpp.to_device(torch.device(dest)))

    def contiguous(self) -> "TensorDict":
        """A TensorDict whose leaves are contiguous (copies only where needed)."""
        return TensorDict._wrap(self._cpp.contiguous())

    def apply(self, fn: Callable, *others: "TensorDict", batch_size: Any = None,
              names: Any = None, **kwargs: Any) -> "TensorDict":
        """A new TensorDict with ``fn`` applied to every leaf; nested levels are kept.

        Non-tensor entries are kept as they are, as in the reference.

        Args:
            fn (callable): called as ``fn(leaf)``, or ``fn(leaf, other_leaf)`` with one other
                TensorDict; returns a tensor, or ``None`` to leave the leaf out.
            *others (TensorDict): at most one TensorDict holding every key of this one.
            batch_size (sequence of int, optional): the result's batch size, for an ``fn``
                that changes the batch dims (every level gets it). Defaults to this one's.
            names: the reference's dim names; only ``None`` is supported.
        """
        if names is not None:
            raise NotImplementedError("apply: names= (dim names) is not supported")
        if batch_size is not None:
            batch_size = _batch_size(batch_size)
        if not others:
            return TensorDict._wrap(self._cpp.apply(fn, batch_size))
        if len(others) > 1:
            raise NotImplementedError("apply() takes at most one other TensorDict")
        return TensorDict._wrap(self._cpp.apply2(fn, _to_cpp_td(others[0], self), batch_size))

    def update(self, input_dict_or_td: Any, clone: bool = False,
               inplace: bool = False) -> "TensorDict":
        """Sets every entry of ``input_dict_or_td`` (a TensorDict or a dict) here, merging
        nested levels key by key, and returns this TensorDict.

        Args:
            input_dict_or_td (TensorDict or dict): the entries to set.
            clone (bool, optional): store clones of the given tensors. Defaults to ``False``.
            inplace (bool, optional): copy into the existing leaves (same shapes and dtypes)
                instead of replacing them. Defaults to ``False``.
        """
        self._cpp.update(_to_cpp_td(input_dict_or_td, self), clone, inplace)
        return self

    def zero_(self) -> "TensorDict":
        """Sets every leaf to zero in place; returns this TensorDict."""
        self._cpp.zero_()
        return self

    def fill_(self, key: Any, value: numbers.Number | bool) -> "TensorDict":
        """Fills the leaf at ``key`` (or every leaf of the nested TensorDict there) with
        ``value`` in place; returns this TensorDict."""
        self._cpp.fill_(key, value)
        return self

    def __eq__(self, other: Any) -> "TensorDict":  # type: ignore[override]
        """Elementwise ``==``: a TensorDict of boolean tensors with this structure. ``other``
        is a TensorDict (or dict) with the same keys, a number, or a tensor that broadcasts
        against every leaf."""
        return self._compare(other, _CTD.eq, _CTD.eq_scalar, torch.eq)

    def __ne__(self, other: Any) -> "TensorDict":  # type: ignore[override]
        """Elementwise ``!=``; see :meth:`__eq__`."""
        return self._compare(other, _CTD.ne, _CTD.ne_scalar, torch.ne)

    __hash__ = None  # type: ignore[assignment]

    def _compare(self, other, with_td, with_scalar, with_tensor):
        if isinstance(other, (TensorDict, Mapping)):
            return TensorDict._wrap(with_td(self._cpp, _to_cpp_td(other, self)))
        if isinstance(other, (numbers.Number, bool)):
            other = other.item() if hasattr(other, "item") else other  # numpy scalars
            return TensorDict._wrap(with_scalar(self._cpp, other))
        if isinstance(other, torch.Tensor):
            return TensorDict._wrap(self._cpp.apply(lambda t: with_tensor(t, other)))
        return NotImplemented

    def all(self) -> bool:
        """True when every element of every leaf is true (True for no leaves)."""
        return self._cpp.all()

    def any(self) -> bool:
        """True when some element of some leaf is true."""
        return self._cpp.any()

    def allclose(self, other: "TensorDict", rtol: float = 1e-5, atol: float = 1e-8,
                 equal_nan: bool = False) -> bool:
        """True when every leaf is close to the leaf of ``other`` at the same key, as
        ``torch.allclose`` decides."""
        return self._cpp.allclose(_to_cpp_td(other, self), rtol, atol, equal_nan)

    # ---- consolidation -----------------------------------------------------------------------
    def consolidate(self, filename: Any = None, *, num_threads: int = 0, device: Any = None,
                    share_memory: bool = False, pin_memory: bool = False,
                    metadata: bool = False) -> "TensorDict":
        """Copies every leaf into one flat storage and returns a TensorDict of views of it.

        The storage has the reference tensordict's byte layout, so a consolidated TensorDict can
        be sent or received as a single message (``send(consolidated=True)``) to or from a
        reference peer. The result is locked. Returns this TensorDict when it is consolidated
        already.

        Args:
            filename (str or path, optional): write the storage into this file, memory-mapped,
                followed by the metadata (JSON) and its length: the reference's file layout,
                which :meth:`from_consolidated` here or in the reference reads back. The
                result's leaves are views of the shared mapping, so writes to them reach the
                file. An existing file is replaced. Exclusive with a ``device`` other than the
                CPU. Defaults to ``None``: in memory.

        Keyword Args:
            num_threads (int, optional): copy CPU leaves with that many threads (0 or 1: the
                calling thread). Defaults to ``0``.
            device (torch.device, str or int, optional): the storage's device. Defaults to the
                TensorDict's device, else the CPU.
            share_memory (bool, optional): put a CPU storage in shared memory. Defaults to
                ``False``.
            pin_memory (bool, optional): page-locked CPU storage (needs an accelerator).
                Defaults to ``False``.
            metadata (bool, optional): accepted for compatibility; the metadata is always
                built. Defaults to ``False``.

        Raises:
            ValueError: for a dtype the layout cannot name, or bad options.
            TypeError: for a sparse or nested-tensor leaf.
        """
        return TensorDict._wrap(self._cpp.consolidate(
            _device(device), pin_memory, share_memory, num_threads,
            None if filename is None else os.fspath(filename)))

    @classmethod
    def from_consolidated(cls, filename: Any) -> "TensorDict":
        """The TensorDict a ``consolidate(filename=...)`` wrote (ours or the reference's), its
        leaves views of a private (copy-on-write) mapping of the file, as the reference maps
        it: writes to them do not reach the file.

        The file is untrusted: its trailer, metadata and every leaf's range are checked
        against its size before anything is viewed. A truncated or forged file is a
        RuntimeError naming the file, a missing one FileNotFoundError, as in the reference. (A
        file truncated while it is mapped makes reads of its leaves fault:
        docs/reliability.md.)
        """
        filename = os.fspath(filename)
        if not os.path.exists(filename):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), filename)
        return cls._wrap(_C.from_consolidated(filename))

    def is_consolidated(self) -> bool:
        """True when the TensorDict is a view of one consolidated storage (see
        :meth:`consolidate`). Setting or deleting an entry, at any level, ends that; changing a
        leaf tensor in place through its own handle (``Tensor.set_``, ``resize_``,
        ``unsqueeze_``, ...) is not seen, as in the reference."""
        return self._cpp.is_consolidated()

    # ---- the reference's everyday methods (docs/api-coverage.md) -------------------------
    def select(self, *keys: Any, inplace: bool = False, strict: bool = True,
               as_tensordict: bool = False) -> "TensorDict":
        """A TensorDict of ``keys`` only, sharing the leaves (with ``inplace``, this one loses
        the others). KeyError for a missing key unless ``strict=False``."""
        return self._same_or_new(self._cpp.select(list(keys), inplace, strict), inplace)

    def exclude(self, *keys: Any, inplace: bool = False) -> "TensorDict":
        """A TensorDict without ``keys`` (missing ones are ignored), sharing the leaves."""
        return self._same_or_new(self._cpp.exclude(list(keys), inplace), inplace)

    def flatten_keys(self, separator: str = ".", inplace: bool = False,
                     is_leaf: Any = None) -> "TensorDict":
        """Nested levels flattened into keys joined by ``separator`` (``("a", "b")`` ->
        ``"a.b"``)."""
        return self._replace(self._cpp.flatten_keys(separator), inplace)

    def unflatten_keys(self, separator: str = ".", inplace: bool = False) -> "TensorDict":
        """Keys holding ``separator`` become nested levels (the inverse of flatten_keys)."""
        return self._replace(self._cpp.unflatten_keys(separator), inplace)

    def rename_key_(self, old_key: Any, new_key: Any, safe: bool = False) -> "TensorDict":
        """Moves the entry at ``old_key`` to ``new_key`` (KeyError if absent; with ``safe``,
        KeyError if ``new_key`` exists)."""
        self._cpp.rename_key_(old_key, new_key, safe)
        return self

    def setdefault(self, key: Any, default: Any, inplace: bool = False) -> Any:
        """The entry at ``key``, setting ``default`` there first when it is absent."""
        if key not in self:
            self.set(key, default)
        return self.get(key)

    def del_(self, key: Any) -> "TensorDict":
        """Removes the entry at ``key`` and returns the TensorDict."""
        self._cpp.erase(key)
        return self

    def update_(self, input_dict_or_td: Any = None, clone: bool = False, *,
                non_blocking: bool = False, keys_to_update: Any = None,
                **kwargs: Any) -> "TensorDict":
        """Copies the leaves of ``input_dict_or_td`` into the existing leaves at their keys
        (KeyError naming a key this TensorDict lacks)."""
        source = input_dict_or_td if input_dict_or_td is not None else kwargs
        self._cpp.update_(_to_cpp_td(source, self), keys_to_update)
        return self

    def set_at_(self, key: Any, value: Any, index: Any, *,
                non_blocking: bool = False) -> "TensorDict":
        """Writes ``value`` into the leaf at ``key``, at ``index`` of its batch dims."""
        self._cpp.set_at_(key, torch.as_tensor(value), _as_index(index))
        return self

    def get_at(self, key: Any, index: Any, default: Any = _NO_DEFAULT) -> Any:
        """The leaf at ``key`` indexed by ``index``; ``default`` when the key is missing."""
        if default is not _NO_DEFAULT and key not in self:
            return default
        return self._cpp.get_at(key, _as_index(index))

    def filter_non_tensor_data(self) -> "TensorDict":
        """This TensorDict without its non-tensor entries, at every level."""
        return TensorDict._wrap(self._cpp.filter_non_tensor_data())

    def empty(self, recurse: bool = False, *, batch_size: Any = None, device: Any = _NO_DEFAULT,
              names: Any = _NO_DEFAULT) -> "TensorDict":
        """A TensorDict with this batch size and device and no leaves; with ``recurse``, the
        same nested levels, empty."""
        out = TensorDict._wrap(self._cpp.empty(recurse))
        if batch_size is not None:
            out.batch_size = batch_size
        if device is not _NO_DEFAULT and device is not None:
            out = out.to(device)
        return out

    def copy(self) -> "TensorDict":
        """A new structure sharing the leaves (``clone(recurse=False)``)."""
        return TensorDict._wrap(self._cpp.copy())

    def copy_(self, tensordict: "TensorDict", non_blocking: bool = False) -> "TensorDict":
        """Copies every leaf of ``tensordict`` into this TensorDict's leaves (same keys)."""
        self._cpp.copy_(_to_cpp_td(tensordict, self))
        return self

    def to_dict(self, *, retain_none: bool = True, convert_tensors: bool = False,
                tolist_first: bool = False) -> dict:
        """A nested dict of the entries: tensors as they are (or their ``tolist()`` with
        ``convert_tensors``), nested TensorDicts as dicts, non-tensor entries as their data."""
        out = {}
        for key, value in self._cpp.items(False, False):
            if isinstance(value, _CTD):
                out[key] = TensorDict._wrap(value).to_dict(convert_tensors=convert_tensors)
            elif isinstance(value, _C.NonTensorData):
                out[key] = _non_tensor_data(value)
            else:
                out[key] = value.tolist() if convert_tensors else value
        return out

    @classmethod
    def from_dict(cls, input_dict: Any, *, auto_batch_size: bool | None = None,
                  batch_size: Any = None, device: Any = None, batch_dims: int | None = None,
                  names: Any = None) -> "TensorDict":
        """A TensorDict from a (nested) dict. With ``auto_batch_size``, the batch size is the
        longest leading shape every leaf shares (at most ``batch_dims`` dims)."""
        td = cls(input_dict, batch_size=batch_size, device=device)
        if auto_batch_size and batch_size is None:
            shapes = [v.shape for v in td.values(True, True)]
            common = []
            for dims in zip(*shapes) if shapes else ():
                if len(set(dims)) != 1 or (batch_dims is not None and len(common) == batch_dims):
                    break
                common.append(dims[0])
            _set_batch_sizes(td, common)
        return td

    def tolist(self, *, convert_nodes: bool = True, convert_tensors: bool = False,
               tolist_first: bool = False, as_linked_list: bool = False) -> list:
        """The batch as nested lists (one level per batch dim) of dicts (``to_dict()`` of each
        element)."""
        if self.batch_dims == 0:
            return self.to_dict(convert_tensors=convert_tensors)
        return [td.tolist(convert_tensors=convert_tensors) for td in self.unbind(0)]

    def chunk(self, chunks: int, dim: int = 0) -> tuple["TensorDict", ...]:
        """``chunks`` pieces along batch dim ``dim``, as torch.chunk."""
        return tuple(TensorDict._wrap(t) for t in self._cpp.chunk(chunks, dim))

    def flatten(self, start_dim: int | None = None, end_dim: int | None = None, *,
                inplace: bool = False) -> "TensorDict":
        """Batch dims ``start_dim`` to ``end_dim`` merged into one."""
        out = self._cpp.flatten(0 if start_dim is None else start_dim,
                                -1 if end_dim is None else end_dim)
        return self._replace(out, inplace)

    def unflatten(self, dim: int, unflattened_size: Sequence[int], *,
                  inplace: bool = False) -> "TensorDict":
        """Batch dim ``dim`` split into ``unflattened_size``."""
        return self._replace(self._cpp.unflatten(dim, list(unflattened_size)), inplace)

    def permute(self, *dims: Any, **kwargs: Any) -> "TensorDict":
        """The batch dims permuted (feature dims stay in place)."""
        dims = kwargs.get("dims", dims)
        return TensorDict._wrap(self._cpp.permute(_shape_args(tuple(dims))))

    def transpose(self, dim0: int, dim1: int) -> "TensorDict":
        """Batch dims ``dim0`` and ``dim1`` swapped."""
        return TensorDict._wrap(self._cpp.transpose(dim0, dim1))

    def apply_(self, fn: Callable, *others: Any, **kwargs: Any) -> "TensorDict":
        """``fn`` applied to every leaf in place (its result copied into the leaf)."""
        if others:
            for key, leaf in self._cpp.items(True, True):
                self._cpp.set_(key, fn(leaf, *(o[key] for o in others)))
            return self
        self._cpp.apply_(fn)
        return self

    def named_apply(self, fn: Callable, *others: Any, nested_keys: bool = False,
                    **kwargs: Any) -> "TensorDict":
        """:meth:`apply` with the leaf's key first: ``fn(key, leaf)``."""
        if others:
            raise NotImplementedError("named_apply: other TensorDicts are not supported")
        return TensorDict._wrap(self._cpp.named_apply(fn, nested_keys))

    def masked_fill(self, mask: torch.Tensor, value: Any) -> "TensorDict":
        """Every leaf with ``value`` where ``mask`` (over the batch dims) is true."""
        return TensorDict._wrap(self._cpp.masked_fill(mask, value))

    def masked_fill_(self, mask: torch.Tensor, value: Any) -> "TensorDict":
        """:meth:`masked_fill` in place."""
        self._cpp.masked_fill_(mask, value)
        return self

    def where(self, condition: torch.Tensor, other: Any, *, out: Any = None,
              pad: Any = None, update_batch_size: bool = False) -> "TensorDict":
        """``torch.where(condition, leaf, other's leaf)`` for every leaf (``other`` a
        TensorDict or a number)."""
        if out is not None or pad is not None:
            raise NotImplementedError("where: out= and pad= are not supported")
        other = other._cpp if isinstance(other, TensorDict) else other
        return TensorDict._wrap(self._cpp.where(condition, other))

    def detach(self) -> "TensorDict":
        """Every leaf detached from autograd."""
        return TensorDict._wrap(self._cpp.detach())

    @property
    def data(self) -> "TensorDict":
        """Every leaf's ``.data`` (detached, sharing its storage), as the reference's ``data``."""
        return self.detach()

    def detach_(self) -> "TensorDict":
        """Every leaf detached in place."""
        self._cpp.detach_()
        return self

    def abs(self) -> "TensorDict":
        """Every leaf's absolute value."""
        return TensorDict._wrap(self._cpp.abs())

    def isfinite(self) -> "TensorDict":
        """Every leaf's ``torch.isfinite`` (bool leaves)."""
        return TensorDict._wrap(self._cpp.isfinite())

    def _reduce_call(self, op: str, dim: Any, keepdim: Any, dtype: Any = None,
                     correction: int = 1, reduce: bool | None = None) -> Any:
        dim = None if dim is _NO_DEFAULT else dim
        keepdim = False if keepdim is _NO_DEFAULT else bool(keepdim)
        out = self._cpp.reduction(op, dim, keepdim, dtype, correction, bool(reduce))
        if isinstance(out, tuple):
            return torch.return_types.max((TensorDict._wrap(out[0]), TensorDict._wrap(out[1]))) \
                if op == "max" else torch.return_types.min((TensorDict._wrap(out[0]),
                                                            TensorDict._wrap(out[1])))
        return TensorDict._wrap(out) if isinstance(out, _CTD) else out

    def sum(self, dim: Any = _NO_DEFAULT, keepdim: Any = _NO_DEFAULT, *, dtype: Any = None,
            reduce: bool | None = None) -> Any:
        """Every leaf summed over all its elements, batch dims ``dim`` or (``"feature"``) its
        feature dims; with ``reduce=True``, one tensor over every leaf."""
        return self._reduce_call("sum", dim, keepdim, dtype, reduce=reduce)

    def mean(self, dim: Any = _NO_DEFAULT, keepdim: Any = _NO_DEFAULT, *, dtype: Any = None,
             reduce: bool | None = None) -> Any:
        """As :meth:`sum`, the mean."""
        return self._reduce_call("mean", dim, keepdim, dtype, reduce=reduce)

    def std(self, dim: Any = _NO_DEFAULT, keepdim: Any = _NO_DEFAULT, *, correction: int = 1,
            reduce: bool | None = None) -> Any:
        """As :meth:`sum`, the standard deviation (``correction`` as in torch.std)."""
        return self._reduce_call("std", dim, keepdim, correction=correction, reduce=reduce)

    def max(self, dim: Any = _NO_DEFAULT, keepdim: bool = False, *, reduce: bool | None = None,
            return_indices: bool = True) -> Any:
        """Every leaf's maximum; with a batch ``dim``, ``torch.return_types.max`` of value and
        index TensorDicts (values only without ``return_indices``)."""
        out = self._reduce_call("max", dim, keepdim, reduce=reduce)
        return out if return_indices or not isinstance(out, tuple) else out.values

    def min(self, dim: Any = _NO_DEFAULT, keepdim: bool = False, *, reduce: bool | None = None,
            return_indices: bool = True) -> Any:
        """As :meth:`max`, the minimum."""
        out = self._reduce_call("min", dim, keepdim, reduce=reduce)
        return out if return_indices or not isinstance(out, tuple) else out.values

    def add_(self, other: Any, *, alpha: float | None = None) -> "TensorDict":
        """``leaf += alpha * other`` for every leaf (``other`` a TensorDict, tensor or number)."""
        self._cpp.add_(other._cpp if isinstance(other, TensorDict) else other, alpha)
        return self

    def mul_(self, other: Any) -> "TensorDict":
        """``leaf *= other`` for every leaf."""
        self._cpp.mul_(other._cpp if isinstance(other, TensorDict) else other)
        return self

    def lerp_(self, end: "TensorDict", weight: Any) -> "TensorDict":
        """``leaf.lerp_(end's leaf, weight)`` for every leaf (weight a number or TensorDict)."""
        self._cpp.lerp_(_to_cpp_td(end, self),
                        weight._cpp if isinstance(weight, TensorDict) else weight)
        return self

    def _arith(self, op: str, other: Any) -> "TensorDict":
        return TensorDict._wrap(self._cpp.arith(op, other._cpp if isinstance(other, TensorDict)
                                                else other))

    def __add__(self, other: Any) -> "TensorDict":
        return self._arith("+", other)

    def __sub__(self, other: Any) -> "TensorDict":
        return self._arith("-", other)

    def __mul__(self, other: Any) -> "TensorDict":
        return self._arith("*", other)

    def __truediv__(self, other: Any) -> "TensorDict":
        return self._arith("/", other)

    __radd__, __rmul__ = __add__, __mul__

    def __rsub__(self, other: Any) -> "TensorDict":
        return self._arith("-", other) * -1

    def float(self, *, cast_filter: Any = None) -> "TensorDict":
        """Every leaf cast to ``torch.float32`` (``cast_filter`` is accepted and ignored)."""
        return self.to(torch.float32)

    def double(self, *, cast_filter: Any = None) -> "TensorDict":
        """Every leaf cast to ``torch.float64`` (``cast_filter`` is accepted and ignored)."""
        return self.to(torch.float64)

    def half(self, *, cast_filter: Any = None) -> "TensorDict":
        """Every leaf cast to ``torch.float16`` (``cast_filter`` is accepted and ignored)."""
        return self.to(torch.float16)

    def bfloat16(self, *, cast_filter: Any = None) -> "TensorDict":
        """Every leaf cast to ``torch.bfloat16`` (``cast_filter`` is accepted and ignored)."""
        return self.to(torch.bfloat16)

    def int(self, *, cast_filter: Any = None) -> "TensorDict":
        """Every leaf cast to ``torch.int32`` (``cast_filter`` is accepted and ignored)."""
        return self.to(torch.int32)

    def long(self, *, cast_filter: Any = None) -> "TensorDict":
        """Every leaf cast to ``torch.int64`` (``cast_filter`` is accepted and ignored)."""
        return self.to(torch.int64)

    def bool(self, *, cast_filter: Any = None) -> "TensorDict":
        """Every leaf cast to ``torch.bool`` (``cast_filter`` is accepted and ignored)."""
        return self.to(torch.bool)

    def cpu(self, **kwargs: Any) -> "TensorDict":
        """Every leaf on the CPU (``to("cpu")``)."""
        return self.to("cpu")

    def cuda(self, device: Any = None, **kwargs: Any) -> "TensorDict":
        """Every leaf on a CUDA device (``device`` an index or a device; the current one by
        default)."""
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device)
                       if isinstance(device, int) else device)

    def pin_memory(self, num_threads: int | None = None, inplace: bool = False) -> "TensorDict":
        """Every leaf in page-locked memory (RuntimeError without an accelerator)."""
        return self._replace(self._cpp.pin_memory(), inplace)

    def share_memory_(self) -> "TensorDict":
        """Every CPU leaf moved into shared memory, then the TensorDict locked, as the
        reference."""
        self._cpp.share_memory_()
        return self

    def is_shared(self) -> bool:
        """True when every leaf is in shared or CUDA memory."""
        return self._cpp.is_shared()

    def numpy(self) -> Any:
        """The leaves as numpy arrays, in a nested dict (an array for one leaf at the root)."""
        return {k: (TensorDict._wrap(v).numpy() if isinstance(v, _CTD) else
                    _non_tensor_data(v) if isinstance(v, _C.NonTensorData) else v.numpy())
                for k, v in self._cpp.items(False, False)}

    def _same_or_new(self, cpp: _CTD, inplace: bool) -> "TensorDict":
        return self if inplace else TensorDict._wrap(cpp)

    def _replace(self, cpp: _CTD, inplace: bool) -> "TensorDict":
        """``cpp`` as the result, or with ``inplace`` as this TensorDict's new contents."""
        if not inplace:
            return TensorDict._wrap(cpp)
        for key in self._cpp.keys(False, False):
            self._cpp.erase(key)
        self._cpp.set_batch_size(cpp.batch_size)
        for key, value in cpp.items(False, False):
            self._cpp.set(key, value)
        return self

    # ---- printing ----------------------------------------------------------------------------
    def __repr__(self) -> str:
        """The reference's repr (its default, compact form): ``TensorDict(batch_size=[4],
        fields={next: {reward: f32[1]}, obs: f32[3]})``, sorted by key and wrapped at 80
        columns; :class:`set_printoptions` chooses the detailed form."""
        return self._cpp.repr(_repr_compact())

    # ---- torch functions ---------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Lets ``torch.stack``, ``torch.cat`` and ``torch.unbind`` take TensorDicts."""
        kwargs = kwargs or {}
        if func is torch.stack:
            return stack(*args, **kwargs)
        if func is torch.cat:
            return cat(*args, **kwargs)
        if func is torch.unbind:
            return args[0].unbind(*args[1:], **kwargs)
        return NotImplemented

    # ---- point-to-point transfers ------------------------------------------------------------
    send, recv, isend, irecv = _p2p.send, _p2p.recv, _p2p.isend, _p2p.irecv
    asend, arecv = _p2p.asend, _p2p.arecv

    # ---- init_remote and collectives ---------------------------------------------------------
    init_remote, from_remote_init = _collectives.init_remote, _collectives.from_remote_init
    broadcast, all_gather = _collectives.broadcast, _collectives.all_gather
    scatter, all_reduce, reduce = _collectives.scatter, _collectives.all_reduce, _collectives.reduce
    gather_and_stack = _collectives.gather_and_stack

    # ---- memory-mapped storage (tensordict_cpp/memmap.py) ----------------------------------
    memmap, memmap_, memmap_like = _memmap.memmap, _memmap.memmap_, _memmap.memmap_like
    is_memmap, load_memmap = _memmap.is_memmap, classmethod(_memmap.load_memmap)


# help() names the class, not the module the methods are written in.
for _name in ("send", "recv", "isend", "irecv", "asend", "arecv", "init_remote",
              "from_remote_init", "broadcast", "all_gather", "scatter", "all_reduce", "reduce",
              "gather_and_stack", "memmap", "memmap_", "memmap_like", "is_memmap",
              "load_memmap"):
    _fn = TensorDict.__dict__[_name]
    getattr(_fn, "__func__", _fn).__qualname__ = f"TensorDict.{_name}"
del _name, _fn


_C._install_getitem(TensorDict)


class LazyStackedTensorDict(TensorDict):
    """TensorDicts stacked along a new batch dimension ``stack_dim`` without copying them, as
    the reference's ``tensordict.LazyStackedTensorDict``: the members keep their own leaves,
    which may differ in shape (a heterogeneous stack), and every method reads or writes them.

    Keys are those every member has (``exclusive_keys`` lists the others). Reading a leaf
    stacks the members' tensors (a copy; RuntimeError naming the key and the shapes when they
    differ); a nested level reads as the lazy stack of the members' levels. Writing (``set``,
    ``td[key] = v``, ``update``, ``fill_``, ``zero_``, ``td[index] = v``) writes into the
    members. ``td[i]`` at the stack dim is member ``i``; a slice or an index tensor there
    gives a lazy stack of the chosen members; ``unbind(stack_dim)`` gives the members.
    ``contiguous()`` is the dense TensorDict. Every transfer takes it with the reference's
    wire: per-leaf transfers walk the members in order, ``consolidate()`` writes the
    reference's lazy-stack node, and ``init_remote``/``from_remote_init``, the collectives
    and the pipe deliver a lazy stack.

    Args:
        *tensordicts (TensorDict): the members (reference TensorDicts are converted without
            copies), all with the same batch size; a single list of them is accepted too.

    Keyword Args:
        stack_dim (int, optional): where the new dimension goes; negative counts from the end.
            Defaults to ``0``.
        stack_dim_name (str, optional): a name for that dimension, kept in the metadata.

    Raises:
        ValueError: no members, or members with different batch sizes.
        RuntimeError: ``stack_dim`` out of range, as the reference's message.
    """

    __slots__ = ()

    def __init__(self, *tensordicts: Any, stack_dim: int = 0,
                 stack_dim_name: str | None = None) -> None:
        if len(tensordicts) == 1 and isinstance(tensordicts[0], (list, tuple)):
            tensordicts = tuple(tensordicts[0])
        members = [TensorDict.from_tensordict(td)._cpp for td in tensordicts]
        self._cpp = _C.lazy_stack(members, stack_dim, stack_dim_name)

    @classmethod
    def lazy_stack(cls, items: Sequence[Any], dim: int = 0, *,
                   stack_dim_name: str | None = None) -> "LazyStackedTensorDict":
        """``LazyStackedTensorDict(*items, stack_dim=dim)``, as the reference's classmethod."""
        return cls(*items, stack_dim=dim, stack_dim_name=stack_dim_name)

    @classmethod
    def maybe_dense_stack(cls, items: Sequence[Any], dim: int = 0, out: Any = None,
                          strict: bool = False) -> TensorDict:
        """A dense stack of ``items`` when they have the same keys and leaf shapes (level by
        level: a nested level that differs becomes a lazy stack inside the dense result), a
        :class:`LazyStackedTensorDict` otherwise, as the reference's ``maybe_dense_stack``.

        Keyword Args:
            out (TensorDict, optional): write the stack into ``out`` (same keys and batch size;
                with ``strict``, no key of ``out`` may be missing from the items) and return it.
        """
        return maybe_dense_stack(items, dim, out=out, strict=strict)

    @property
    def tensordicts(self) -> list[TensorDict]:
        """The members, in stack order: the same TensorDicts (shared), each a new Python
        object."""
        return [TensorDict._wrap(t) for t in self._cpp.tensordicts()]

    @property
    def stack_dim(self) -> int:
        """The batch dimension the members are stacked along."""
        return self._cpp.stack_dim

    @property
    def stack_dim_name(self) -> str | None:
        """The name given to the stack dimension, if any."""
        return self._cpp.stack_dim_name

    def exclusive_keys(self) -> list[list]:
        """For each member, its keys (nested ones as tuples) that some other member lacks."""
        common = set(self.keys(True))
        return [[k for k in TensorDict._wrap(t).keys(True) if k not in common]
                for t in self._cpp.tensordicts()]


class _SubTensorDict:
    """The rows of a TensorDict that an index selects, as a view whose writes land in that
    TensorDict (its parent): the reference's ``_SubTensorDict``, reached as it reaches it,
    ``td._get_sub_tensordict(index)``.

    Reads come from the parent at the index; :meth:`set_`, ``sub[key] = value``,
    :meth:`update_` and the receives (:meth:`recv`, :meth:`irecv`, and their consolidated
    forms) write into the parent's rows. With basic indices (ints, slices, ``None``, ``...``)
    a receive goes straight into the parent's storage; with index tensors or masks it lands in
    a copy of the rows that is written back (the reference loses it in ``irecv``). A
    consolidated receive goes into a consolidated copy of the rows, laid out as the sender's
    TensorDict of the same structure, then into the parent (the reference refuses it).
    """

    __slots__ = ("_parent", "_rows")

    def __init__(self, source: TensorDict, idx: Any) -> None:
        if not isinstance(source, TensorDict):
            raise TypeError(f"Expected source to be a TensorDict, got {type(source)}")
        self._parent = source
        self._rows = _C.SubTensorDict(source._cpp, _as_index(idx))

    @property
    def batch_size(self) -> torch.Size:
        return torch.Size(self._rows.batch_size)

    shape = batch_size

    @property
    def device(self) -> torch.device | None:
        return self._parent.device

    @property
    def is_locked(self) -> bool:
        return self._parent.is_locked

    def get_parent_tensordict(self) -> TensorDict:
        return self._parent

    def _view(self) -> TensorDict:
        return TensorDict._wrap(self._rows.view())

    def keys(self, *args: Any, **kwargs: Any) -> list:
        return self._view().keys(*args, **kwargs)

    def items(self, *args: Any, **kwargs: Any) -> list:
        return self._view().items(*args, **kwargs)

    def values(self, *args: Any, **kwargs: Any) -> list:
        return self._view().values(*args, **kwargs)

    def __contains__(self, key: Any) -> bool:
        return key in self._parent

    def get(self, key: Any, *default: Any) -> Any:
        return self._view().get(key, *default)

    def __getitem__(self, index: Any) -> Any:
        return self._view()[index]

    def set_(self, key: Any, value: Any) -> "_SubTensorDict":
        """Writes ``value`` into the parent's leaf ``key`` at the rows; a TensorDict (or dict)
        value writes each of its leaves under ``key``."""
        if isinstance(value, (TensorDict, Mapping)) or _reference.is_reference(value):
            prefix = key if isinstance(key, tuple) else (key,)
            value = value if isinstance(value, TensorDict) else TensorDict(value, self.batch_size)
            for sub, leaf in value.items(True, True):
                self.set_(prefix + (sub if isinstance(sub, tuple) else (sub,)), leaf)
            return self
        self._rows.set_(key, torch.as_tensor(value))
        return self

    def set(self, key: Any, value: Any, inplace: bool = False) -> "_SubTensorDict":
        """Writes into the parent's rows: an existing leaf in place; a new one as a leaf of
        zeros elsewhere (a new non-tensor entry holds the value for every row), as the
        reference's sub-tensordict does."""
        value = _to_value(value, list(self.batch_size), self.device, key)
        if isinstance(value, _RawNonTensor):
            value = _C.NonTensorData(value.data, [], None, key)
        self._rows.set(key, value)
        return self

    __setitem__ = set

    def update_(self, input_dict_or_td: Any, clone: bool = False,
                **kwargs: Any) -> "_SubTensorDict":
        for key, value in (input_dict_or_td.items(True, True)
                           if isinstance(input_dict_or_td, TensorDict)
                           else input_dict_or_td.items()):
            self.set_(key, value)
        return self

    def update(self, input_dict_or_td: Any, **kwargs: Any) -> "_SubTensorDict":
        items = (input_dict_or_td.items(True, True) if isinstance(input_dict_or_td, TensorDict)
                 else input_dict_or_td.items())
        for key, value in items:
            self.set(key, value)
        return self

    def to_tensordict(self) -> TensorDict:
        """An independent copy of the rows."""
        return TensorDict._wrap(self._rows.to_tensordict())

    def clone(self, recurse: bool = True) -> TensorDict:
        return self.to_tensordict()

    def is_consolidated(self) -> bool:
        return False  # the rows have no storage of their own, as in the reference

    def lock_(self) -> "_SubTensorDict":
        raise RuntimeError("Cannot lock a _SubTensorDict. Lock the parent tensordict instead.")

    def unlock_(self) -> "_SubTensorDict":
        raise RuntimeError("Cannot unlock a _SubTensorDict. Unlock the parent tensordict instead.")

    recv = _p2p.recv  # into the parent's rows (see the class)
    irecv = _p2p.irecv  # return_premature: basic indices only (others are written back)

    def send(self, dst: Any = None, **kwargs: Any) -> None:
        return self._view().send(dst, **kwargs)

    def isend(self, dst: Any = None, **kwargs: Any) -> Any:
        return self._view().isend(dst, **kwargs)

    def __repr__(self) -> str:
        return self._view()._cpp.repr(_repr_compact(), "_SubTensorDict",
                                      nested_names=[("*", "_SubTensorDict")])


def lazy_stack(input: Sequence[Any], dim: int = 0, *, out: Any = None,
               stack_dim_name: str | None = None) -> LazyStackedTensorDict:
    """Stacks TensorDicts lazily along a new batch dimension ``dim``: a
    :class:`LazyStackedTensorDict` sharing them, as the reference's ``tensordict.lazy_stack``.
    ``out`` is not supported (ValueError when given)."""
    if out is not None:
        raise ValueError("lazy_stack: out= is not supported; the result shares its inputs")
    return LazyStackedTensorDict(*input, stack_dim=dim, stack_dim_name=stack_dim_name)


def maybe_dense_stack(input: Sequence[Any], dim: int = 0, *, out: Any = None,
                      strict: bool = False) -> TensorDict:
    """:meth:`LazyStackedTensorDict.maybe_dense_stack`, as the reference's
    ``tensordict.maybe_dense_stack``."""
    if not input:
        raise RuntimeError("list_of_tensordicts cannot be empty")
    result = TensorDict._wrap(_C.maybe_dense_stack(
        [TensorDict.from_tensordict(td)._cpp for td in input], dim))
    if out is None:
        return result
    if list(out.batch_size) != list(result.batch_size):
        raise RuntimeError(f"maybe_dense_stack: out has batch_size {out.batch_size}, the stack "
                           f"{result.batch_size}")
    if strict:
        missing = set(out.keys(True, True)) - set(result.keys(True, True))
        if missing:
            raise RuntimeError(f"The output tensordict has keys that are missing in the "
                               f"tensordict that has to be written: {missing}.")
    out.update_(result)
    return out


# The rebuilds convert their non-tensor values in one _C.json_scope(): what a pickle shares
# (one str in many entries, one list referenced many times) is converted once and shared, as
# the unpickled Python objects are, instead of copied per reference.
def _rebuild_tensordict(entries: list, batch_size: list, device: str | None,
                        locked: bool) -> TensorDict:
    with _C.json_scope():
        td = TensorDict(dict(entries), batch_size, device)
    return td.lock_() if locked else td


def _rebuild_lazy_stack(members: list, stack_dim: int, stack_dim_name: str | None,
                        locked: bool) -> TensorDict:
    with _C.json_scope():
        td = LazyStackedTensorDict(*members, stack_dim=stack_dim, stack_dim_name=stack_dim_name)
    return td.lock_() if locked else td


def _rebuild_consolidated(storage: torch.Tensor, metadata_json: str) -> TensorDict:
    return TensorDict._wrap(_C.rebuild_consolidated(metadata_json, storage))


def _transfer_function(name: str) -> Callable:
    """``tensordict_cpp.<name>(td, ...)``: ``td.<name>(...)``, where ``td`` may also be a
    reference tensordict object (through TensorDict.from_tensordict: its leaves are shared, so
    what is received lands in them)."""
    method = getattr(TensorDict, name)

    @functools.wraps(method)
    def call(td: Any, *args: Any, **kwargs: Any) -> Any:
        if _reference.is_reference(td):
            td = TensorDict.from_tensordict(td)
        elif not hasattr(td, name):  # ours and our tensorclasses have the method
            raise TypeError(f"{name}: expected a TensorDict, a tensorclass or a reference "
                            f"tensordict object, got {type(td).__module__}."
                            f"{type(td).__qualname__}")
        return getattr(td, name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = name
    call.__doc__ = (f"``tensordict_cpp.{name}(td, ...)`` is ``td.{name}(...)``; ``td`` may also "
                    f"be a reference ``tensordict`` TensorDict or tensorclass, whose leaves are "
                    f"shared (received values land in them).\n\n{method.__doc__ or ''}")
    return call


send, recv, isend, irecv = (_transfer_function(n) for n in ("send", "recv", "isend", "irecv"))
init_remote, consolidate = _transfer_function("init_remote"), _transfer_function("consolidate")
broadcast, all_gather = _transfer_function("broadcast"), _transfer_function("all_gather")
scatter, all_reduce, reduce = (_transfer_function(n) for n in ("scatter", "all_reduce", "reduce"))
gather_and_stack = _transfer_function("gather_and_stack")


def stack(list_of_tds: Sequence[TensorDict], dim: int = 0) -> TensorDict:
    """Stacks TensorDicts with the same keys and batch size along a new batch dimension
    ``dim`` (also reached through ``torch.stack``)."""
    return TensorDict._wrap(_C.stack([_cpp_of(td) for td in list_of_tds], dim))


def cat(list_of_tds: Sequence[TensorDict], dim: int = 0) -> TensorDict:
    """Concatenates TensorDicts with the same keys along batch dimension ``dim`` (also
    reached through ``torch.cat``)."""
    return TensorDict._wrap(_C.cat([_cpp_of(td) for td in list_of_tds], dim))


def _set_batch_sizes(td: TensorDict, batch_size: list[int]) -> None:
    """The batch size of ``td`` and of its nested levels, whose sizes start with it."""
    for value in td._cpp.values(False, False):
        if isinstance(value, _CTD):
            _set_batch_sizes(TensorDict._wrap(value), batch_size)
    td._cpp.set_batch_size(batch_size)


def _module_entries(module: torch.nn.Module, filter_empty: bool) -> _CTD | None:
    """The parameters, buffers and (recursively) submodules of ``module``; None when it has
    none and ``filter_empty``."""
    entries = [(k, v) for k, v in module._parameters.items() if v is not None]
    entries += [(k, v) for k, v in module._buffers.items() if v is not None]
    for name, child in module._modules.items():
        if child is None:
            continue
        nested = _module_entries(child, filter_empty)
        if nested is not None:
            entries.append((name, nested))
    if not entries and filter_empty:
        return None
    return _CTD(entries, [], None)


def _write_module(td: TensorDict, module: torch.nn.Module, inplace: bool, non_blocking: bool,
                  preserve: bool, swap: bool) -> _CTD:
    """Writes td into module (see TensorDict.to_module); the previous values, as a _C
    TensorDict."""
    old = []
    for key, value in td._cpp.items(False, False):
        if isinstance(value, _CTD):
            child = module._modules.get(key)
            if child is None:
                raise KeyError(f"to_module: {key!r} is not a submodule of "
                               f"{type(module).__name__}")
            old.append((key, _write_module(TensorDict._wrap(value), child, inplace, non_blocking,
                                           preserve, swap)))
            continue
        if isinstance(value, _C.NonTensorData):
            raise TypeError(f"to_module: key {key!r} is a non-tensor entry, not a tensor")
        if key in module._parameters:
            current, table = module._parameters[key], module._parameters
        elif key in module._buffers:
            current, table = module._buffers[key], module._buffers
        elif hasattr(module, key) and isinstance(getattr(module, key), torch.Tensor):
            current, table = getattr(module, key), None
        else:
            raise KeyError(f"to_module: {key!r} is not a parameter or buffer of "
                           f"{type(module).__name__}")
        if current is not None and swap:
            old.append((key, current.clone() if inplace else current))
        if inplace:
            with torch.no_grad():
                current.copy_(value, non_blocking=non_blocking)
        elif table is module._parameters and preserve and not isinstance(value, torch.nn.Parameter):
            requires_grad = current.requires_grad if current is not None else True
            table[key] = torch.nn.Parameter(value, requires_grad=requires_grad and value.is_floating_point())
        elif table is not None:
            table[key] = value
        else:
            setattr(module, key, value)
    return _CTD(old, [], None)


def _swap_result(old: TensorDict, swap_dest: Any) -> Any:
    if swap_dest is None:
        return old
    swap_dest.update(old)
    return swap_dest


def _cpp_of(td: Any) -> _CTD:
    if not isinstance(td, TensorDict):
        raise TypeError(f"expected a TensorDict, got {type(td)}")
    return td._cpp


def _to_cpp_td(other: Any, like: TensorDict) -> _CTD:
    if isinstance(other, TensorDict):
        return other._cpp
    if isinstance(other, Mapping):
        return TensorDict(dict(other), batch_size=like.batch_size, device=like.device)._cpp
    raise TypeError(f"expected a TensorDict or a dict, got {type(other)}")


class _RawNonTensor:
    """A value that __setitem__ stores as a non-tensor entry of its level."""

    __slots__ = ("data",)

    def __init__(self, data: Any) -> None:
        self.data = data


def _check_keys(source: Mapping) -> None:
    for k in source:
        if not _is_key(k):
            raise errors.InvalidKeyError(
                f"TensorDict: key {k!r} ({type(k).__name__}) is not a str or a non-empty "
                f"tuple of str; a tuple such as ('a', 'b') makes nested levels")


def _level(entries: list, batch_size: list[int], device: torch.device | None) -> _CTD:
    """The core TensorDict of one level's converted entries."""
    entries = [(k, _C.NonTensorData(v.data, [], None, k) if isinstance(v, _RawNonTensor) else v)
               for k, v in entries]
    return _CTD(entries, batch_size, device)


# Dicts nested deeper than this (or a dict that holds itself) are refused, as non-tensor data
# nested deeper than 512 levels is (python/csrc/tensor_dict.cpp).
_MAX_DICT_DEPTH = 512


def _nested_level(root: Mapping, batch_size: list[int], device: torch.device | None,
                  key: Any) -> _CTD:
    """The nested TensorDict of a dict value and the dicts inside it, built bottom-up with a
    stack of its own: Python's recursion limit (about 240 levels of TensorDict.__init__) is not
    what bounds the depth, _MAX_DICT_DEPTH is, with a ValueError."""
    # Each frame: a dict, its remaining items, its converted entries so far.
    _check_keys(root)
    stack = [(iter(root.items()), [])]
    while True:
        items, done = stack[-1]
        for k, v in items:
            if isinstance(v, Mapping) and not isinstance(v, TensorDict) and \
                    not _reference.is_reference(v):
                if len(stack) >= _MAX_DICT_DEPTH:
                    raise ValueError(
                        f"TensorDict: the dict of key {key!r} is nested deeper than "
                        f"{_MAX_DICT_DEPTH} levels (a dict that holds itself never ends)")
                _check_keys(v)
                done.append((k, None))  # the level below, once built
                stack.append((iter(v.items()), []))
                break
            done.append((k, _to_value(v, batch_size, device, k)))
        else:
            stack.pop()
            cpp = _level(done, batch_size, device)
            if not stack:
                return cpp
            parent = stack[-1][1]
            parent[-1] = (parent[-1][0], cpp)


def _to_value(value: Any, batch_size: list[int], device: torch.device | None,
              key: Any = None) -> Any:
    # The reference's __setitem__ conversions (base.py _convert_to_tensor): numbers and numeric
    # lists become tensors, dicts nested TensorDicts, anything else a non-tensor entry.
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, TensorDict):
        return value._cpp
    if _is_non_tensor(value):
        return _non_tensor_to_cpp(value, key if key is not None else "data")
    if isinstance(value, Mapping) and not _reference.is_reference(value):
        return _nested_level(value, batch_size, device, key)
    if isinstance(value, Mapping):
        return TensorDict(value, batch_size=batch_size, device=device)._cpp
    if isinstance(value, (numbers.Number, bool)) or hasattr(value, "__array__"):
        return torch.as_tensor(value)
    if isinstance(value, list):
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            pass  # not numeric (strings, None, ragged): a NonTensorStack, as the reference
        return _C.NonTensorData.from_list(value, device, key if key is not None else "data")
    if value is None or isinstance(value, str):
        return _RawNonTensor(value)
    where = f"key {key!r}: " if key is not None else ""
    raise TypeError(f"{where}a TensorDict holds tensors, numbers, TensorDicts and JSON-like "
                    f"non-tensor data (str, None, lists; set_non_tensor() for any JSON-like "
                    f"value), got {type(value)}")


def _from_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, _CTD):
        return TensorDict._wrap(value)
    if isinstance(value, _C.NonTensorData):
        return _non_tensor_from_cpp(value)
    return value


def _dense_copy(cpp: _CTD) -> _CTD:
    """to_tensordict(): the leaves cloned, lazy stacks at any level stacked, unlocked."""
    if not cpp.has_lazy_stack():
        return cpp.clone()  # a new structure with cloned leaves, unlocked
    if cpp.is_lazy_stack():
        cpp = cpp.contiguous()  # the members' leaves stacked into new tensors
    entries = []
    for key, value in cpp.items(False, False):
        if isinstance(value, _CTD):
            value = _dense_copy(value)
        elif isinstance(value, torch.Tensor):
            value = value.clone()
        entries.append((key, value))
    return _CTD(entries, cpp.batch_size, cpp.device)


def _non_tensor_data(value: _C.NonTensorData) -> Any:
    """What ``td[key]`` gives for a non-tensor entry: its data, or a stack's values."""
    return value.tolist() if value.is_stack else value.data


# torch.load(weights_only=True) rebuilds only allowlisted globals: these build TensorDicts from
# tensors, lists and strings, import nothing and read no file (the consolidated metadata is
# validated against its storage).
torch.serialization.add_safe_globals([_rebuild_tensordict, _rebuild_lazy_stack,
                                      _rebuild_consolidated, NonTensorData, MetaData])
