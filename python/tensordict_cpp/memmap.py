"""Memory-mapped tensors and the TensorDict memmap methods (bound as TensorDict's methods).

A layer below ``_td``: the functions take the TensorDict as ``self`` (or its class) and use only
its ``_cpp`` (the ``_C.TensorDict``) and ``_wrap``, so this module imports nothing of the package
but ``_C``. The C++ core (include/tensordict/memmap.h) maps the files and writes the layout;
here are the reference's calling conventions and the :class:`MemoryMappedTensor` subclass.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from tensordict_cpp import _C

__all__ = ["MemoryMappedTensor"]


def _path(filename: Any) -> str | None:
    return None if filename is None else os.fspath(filename)


def _cpu(device: Any) -> None:
    if device is not None and torch.device(device).type != "cpu":
        raise RuntimeError("Only CPU tensors are supported.")


def _shape(args: tuple, kwargs: dict) -> list[int]:
    # The reference's _proc_args_const: ``2, 3``, ``(2, 3)`` or ``shape=(2, 3)``.
    if args:
        if len(args) == 1 and isinstance(args[0], torch.Tensor):
            raise NotImplementedError("nested (jagged) memory-mapped tensors are not supported")
        shape = torch.Size(args[0]) if len(args) == 1 and not isinstance(args[0], int) \
            else torch.Size(args)
    else:
        if "shape" not in kwargs or kwargs["shape"] is None:
            raise TypeError("Could not find the shape argument in the arguments.")
        if isinstance(kwargs["shape"], torch.Tensor):
            raise NotImplementedError("nested (jagged) memory-mapped tensors are not supported")
        shape = torch.Size(kwargs["shape"])
    return list(shape)


class MemoryMappedTensor(torch.Tensor):
    """A CPU tensor whose storage is a file on disk (or anonymous shared memory without a
    filename), as the reference's ``tensordict.MemoryMappedTensor``: in-place writes reach the
    file, which holds the raw bytes of the tensor (C-contiguous, nothing else).

    It is a ``torch.Tensor``: build one with the class methods (:meth:`from_tensor`,
    :meth:`from_filename`, :meth:`empty`, :meth:`zeros`, :meth:`ones`, :meth:`full`,
    :meth:`empty_like`, ...). The mapping is made by the C++ core, and the object is a
    ``torch.Tensor`` subclass over that tensor sharing its storage (no copy). Indexing that
    makes a view gives a MemoryMappedTensor of the same mapping; other operations give plain
    tensors, as in the reference.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __new__(cls, source: Any, *, dtype: torch.dtype | None = None, shape: Any = None,
                index: Any = None, device: Any = None,
                filename: Any = None) -> "MemoryMappedTensor":
        """The reference's constructor forms: a path ``source`` maps that file (``dtype`` and
        ``shape`` required), a tensor with ``filename`` is copied there, and a tensor that is
        memory-mapped already is wrapped (same storage). A tensor that is not memory-mapped,
        without ``filename``, raises a TypeError: the reference would wrap it without a mapping
        (a MemoryMappedTensor in name only); use :meth:`from_tensor` to copy it."""
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"{cls} device must be cpu!")
        if isinstance(source, (str, os.PathLike)):
            if filename is not None:
                raise TypeError("Duplicated filename argument.")
            if dtype is None or shape is None:
                raise TypeError("dtype and shape are required to map a file.")
            return cls.from_filename(source, dtype, shape, index)
        if not isinstance(source, torch.Tensor):
            raise TypeError(f"MemoryMappedTensor takes a tensor or a path, got {type(source)}")
        if dtype is not None:
            raise TypeError("Cannot pass new dtype if source is provided.")
        if filename is not None:
            out = cls.from_tensor(source, filename=filename, shape=shape)
        elif _C._is_memmap(source):
            out = cls._wrap(source)
        else:
            raise TypeError("MemoryMappedTensor(tensor) needs a memory-mapped tensor or a "
                            "filename; use MemoryMappedTensor.from_tensor(tensor) to copy it")
        return out if index is None else out[index]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # __new__ did the work (torch.Tensor.__init__ takes no arguments)

    @classmethod
    def _wrap(cls, tensor: torch.Tensor) -> "MemoryMappedTensor":
        # An alias of the same storage (a new TensorImpl): no copy.
        if isinstance(tensor, cls):
            return tensor
        return torch.Tensor._make_subclass(cls, tensor)

    @property
    def filename(self) -> str:
        """The absolute path of the file that holds the data; RuntimeError for anonymous
        memory."""
        name = _C._memmap_filename(self)
        if name is None:
            raise RuntimeError("The MemoryMappedTensor has no file associated.")
        return name

    def __getitem__(self, index: Any) -> Any:
        out = super().__getitem__(index)
        if isinstance(out, torch.Tensor) and _C._is_memmap(out):
            return MemoryMappedTensor._wrap(out)
        return out

    def __reduce_ex__(self, protocol: int) -> Any:
        # The reference pickles a file name; ours would copy the data as a plain tensor, which
        # would silently break the sharing. Refuse instead.
        raise NotImplementedError("tensordict_cpp.MemoryMappedTensor cannot be pickled; pickle "
                                  "the file name (t.filename) and map it with from_filename")

    # ---- factories -----------------------------------------------------------------------
    @classmethod
    def from_tensor(cls, input: torch.Tensor, *, filename: Any = None, existsok: bool = False,
                    copy_existing: bool = False, copy_data: bool = True,
                    shape: Any = None) -> "MemoryMappedTensor":
        """A MemoryMappedTensor holding a copy of ``input`` (in ``filename``, or anonymous
        shared memory). ``input`` is returned as it is when it already maps ``filename`` (or,
        without a filename, anonymous memory).

        Keyword Args:
            filename (str or PathLike, optional): the file to write. Defaults to ``None``.
            existsok (bool, optional): replace an existing file instead of raising a
                RuntimeError. Defaults to ``False``.
            copy_existing (bool, optional): copy an ``input`` mapped to another file instead of
                raising a RuntimeError. Defaults to ``False``.
            copy_data (bool, optional): ``False`` leaves the content unwritten (zeros).
                Defaults to ``True``.
            shape (torch.Size, optional): only ``None`` or ``input``'s shape.

        Raises:
            RuntimeError: for a file that exists, a missing or read-only directory, a symlink
                (naming the path), or an ``input`` that requires grad.
            TypeError: for a NumPy array, or a sparse or nested tensor.
        """
        if not isinstance(input, torch.Tensor):
            raise TypeError("Convert input to torch.Tensor before calling "
                            "MemoryMappedTensor.from_tensor.")
        if shape is not None and torch.Size(shape) != input.shape:
            raise NotImplementedError("from_tensor(shape=...) with another shape is not supported")
        if not copy_data:
            return cls.empty_like(input, filename=filename, existsok=existsok)
        return cls._wrap(_C._memmap_from_tensor(input, _path(filename), existsok, copy_existing))

    @classmethod
    def from_filename(cls, filename: Any, dtype: torch.dtype, shape: Any, index: Any = None,
                      mode: str | None = None) -> "MemoryMappedTensor":
        """Maps the existing file ``filename`` (raw data, no header) as ``dtype`` and ``shape``:
        shared when the file is writable, copy-on-write otherwise.

        Raises:
            RuntimeError: naming the path, when it is missing or smaller than the tensor.
            ValueError: for a ``mode`` other than ``None`` (``"r"``/``"r+"``: not supported).
        """
        if mode is not None:
            if mode not in ("r", "r+"):
                raise ValueError(f"mode must be 'r', 'r+' or None, got {mode!r}.")
            raise NotImplementedError("from_filename(mode=...) is not supported (None maps "
                                      "shared when writable, copy-on-write otherwise)")
        if isinstance(shape, torch.Tensor):
            raise NotImplementedError("nested (jagged) memory-mapped tensors are not supported")
        out = cls._wrap(_C._memmap_from_filename(os.fspath(filename), dtype,
                                                 list(torch.Size(shape))))
        return out if index is None else out[index]

    @classmethod
    def empty(cls, *args: Any, **kwargs: Any) -> "MemoryMappedTensor":
        """A new MemoryMappedTensor of the given shape (``2, 3``, ``(2, 3)`` or
        ``shape=(2, 3)``); a new file or anonymous memory reads as zeros.

        Keyword Args:
            dtype (torch.dtype, optional): defaults to ``torch.get_default_dtype()``.
            device: ``None`` or ``"cpu"``.
            filename (str or PathLike, optional): defaults to ``None`` (anonymous memory).
            existsok (bool, optional): replace an existing file. Defaults to ``False``.
        """
        shape = _shape(args, kwargs)
        _cpu(kwargs.get("device"))
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        return cls._wrap(_C._memmap_empty(shape, dtype, _path(kwargs.get("filename")),
                                          bool(kwargs.get("existsok", False))))

    @classmethod
    def zeros(cls, *args: Any, **kwargs: Any) -> "MemoryMappedTensor":
        """As :meth:`empty`, filled with zeros."""
        return cls.empty(*args, **kwargs)  # a new mapping reads as zeros

    @classmethod
    def ones(cls, *args: Any, **kwargs: Any) -> "MemoryMappedTensor":
        """As :meth:`empty`, filled with ones."""
        out = cls.empty(*args, **kwargs)
        out.fill_(1)
        return out

    @classmethod
    def full(cls, *args: Any, fill_value: Any, **kwargs: Any) -> "MemoryMappedTensor":
        """As :meth:`empty`, filled with ``fill_value`` (a keyword, as in the reference)."""
        out = cls.empty(*args, **kwargs)
        out.fill_(fill_value)
        return out

    @classmethod
    def empty_like(cls, input: torch.Tensor, *, filename: Any = None,
                   existsok: bool = False) -> "MemoryMappedTensor":
        """A new MemoryMappedTensor with the shape and dtype of ``input`` (not its values)."""
        return cls.empty(list(input.shape), dtype=input.dtype, filename=filename,
                         existsok=existsok)

    @classmethod
    def zeros_like(cls, input: torch.Tensor, *, filename: Any = None) -> "MemoryMappedTensor":
        """As :meth:`empty_like`, filled with zeros."""
        return cls.empty_like(input, filename=filename)

    @classmethod
    def ones_like(cls, input: torch.Tensor, *, filename: Any = None) -> "MemoryMappedTensor":
        """As :meth:`empty_like`, filled with ones."""
        out = cls.empty_like(input, filename=filename)
        out.fill_(1)
        return out

    @classmethod
    def full_like(cls, input: torch.Tensor, fill_value: Any, *,
                  filename: Any = None) -> "MemoryMappedTensor":
        """As :meth:`empty_like`, filled with ``fill_value``."""
        out = cls.empty_like(input, filename=filename)
        out.fill_(fill_value)
        return out


# ---- TensorDict methods (bound in _td) ---------------------------------------------------
def _wrap_leaves(cpp: Any) -> Any:
    """Makes every memory-mapped leaf of ``cpp`` a MemoryMappedTensor (an alias of the same
    storage, set back in place), so that ``td[key]`` returns one: torch keeps the Python object
    of a TensorImpl, and its class, for as long as the C++ tensor lives."""
    locked = cpp.is_locked()
    if locked:
        cpp.unlock_()
    for key in cpp.keys(True, True):
        value = cpp.get(key)
        if isinstance(value, torch.Tensor) and not isinstance(value, MemoryMappedTensor) \
                and _C._is_memmap(value):
            cpp.set(key, MemoryMappedTensor._wrap(value))
    if locked:
        cpp.lock_()
    return cpp


def _check_common(num_threads: int, return_early: bool, share_non_tensor: bool,
                  robust_key: Any) -> None:
    if return_early:
        raise NotImplementedError("return_early=True is not supported (the files are written "
                                  "before the call returns)")
    if share_non_tensor:
        raise NotImplementedError("share_non_tensor=True is not supported")
    if robust_key not in (None, True, False):
        raise TypeError(f"robust_key must be a bool or None, got {type(robust_key).__name__}")


def _dtensor_keys(cpp: Any) -> list:
    """The keys of ``cpp``'s DTensor leaves, level by level (a lazy stack is not read: memmap
    refuses it by name)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return []

    def walk(level: Any, prefix: tuple) -> list:
        if level.is_lazy_stack():
            return []
        out = []
        for key, value in level.items(False, False):
            if isinstance(value, _C.TensorDict):
                out += walk(value, prefix + (key,))
            elif isinstance(value, DTensor):
                out.append(prefix + (key,))
        return out

    return walk(cpp, ())


def _put_full_tensors(cpp: Any, keys: list) -> None:
    """Replaces the DTensor leaves at ``keys`` by their full tensors, as the reference's memmap
    writes them (``full_tensor()`` is a collective: every rank of the mesh calls memmap)."""
    if not keys:
        return
    locked = cpp.is_locked()
    cpp.unlock_()
    for key in keys:
        cpp.set(key, cpp.get(key).full_tensor())
    if locked:
        cpp.lock_()


def memmap(self: Any, prefix: Any = None, copy_existing: bool = False, *, num_threads: int = 0,
           return_early: bool = False, share_non_tensor: bool = False, existsok: bool = True,
           robust_key: Any = True) -> Any:
    """Writes every leaf to ``<prefix>/<key>.memmap`` (a subdirectory per nested TensorDict,
    a ``meta.json`` per level, the reference's layout) and returns a new, locked TensorDict of
    :class:`MemoryMappedTensor` leaves on the CPU. ``prefix=None`` maps anonymous shared memory
    and writes nothing, as the reference does. The TensorDict is not changed.

    ``num_threads`` is accepted; the files are written by the calling thread. ``robust_key``:
    keys that the reference would percent-encode are refused (ValueError) with either value.

    Raises:
        ValueError: a key that is not a safe file name (``/``, ``..``, ``%``, a space, ...) or
            that names a meta.json field (``shape``, ``device``, ...), naming its path; nothing
            is written.
        RuntimeError: a file-system failure (read-only or missing directory, a path under a
            file, an existing file with ``existsok=False``), naming the path.
    """
    _check_common(num_threads, return_early, share_non_tensor, robust_key)
    source, keys = self._cpp, _dtensor_keys(self._cpp)
    if keys:
        source = source.copy()  # new levels, the same leaves: this TensorDict is not changed
        _put_full_tensors(source, keys)
    out = _C._memmap_td(source, _path(prefix), bool(copy_existing), bool(existsok))
    return type(self)._wrap(_wrap_leaves(out))


def memmap_(self: Any, prefix: Any = None, copy_existing: bool = False, *, num_threads: int = 0,
            return_early: bool = False, share_non_tensor: bool = False, existsok: bool = True,
            robust_key: Any = True) -> Any:
    """:meth:`memmap` in place: writes the same files, then replaces every leaf (at every
    level) by its :class:`MemoryMappedTensor`, locks the TensorDict and returns it. If writing
    fails, the TensorDict is left as it was. Its ``device`` is unchanged (the reference sets
    it to the CPU)."""
    _check_common(num_threads, return_early, share_non_tensor, robust_key)
    _put_full_tensors(self._cpp, _dtensor_keys(self._cpp))
    _C._memmap_td_(self._cpp, _path(prefix), bool(copy_existing), bool(existsok))
    _wrap_leaves(self._cpp)
    return self


def memmap_like(self: Any, prefix: Any = None, copy_existing: bool = False, *,
                existsok: bool = True, num_threads: int = 0, return_early: bool = False,
                share_non_tensor: bool = False, robust_key: Any = True) -> Any:
    """As :meth:`memmap`, without the values: every file (or anonymous mapping) is new and
    filled with zeros. An existing file is replaced (the reference maps it and keeps its
    content)."""
    _check_common(num_threads, return_early, share_non_tensor, robust_key)
    out = _C._memmap_like(self._cpp, _path(prefix), bool(existsok))
    return type(self)._wrap(_wrap_leaves(out))


def load_memmap(cls: Any, prefix: Any, device: Any = None, non_blocking: bool = False, *,
                out: Any = None, robust_key: Any = True, mode: str | None = None,
                allow_pickle: bool | None = None) -> Any:
    """Loads a directory that :meth:`memmap` wrote, here or with the reference: a TensorDict
    (not locked) of :class:`MemoryMappedTensor` leaves (shared mappings of the files when they
    are writable, copy-on-write otherwise), nested TensorDicts and non-tensor entries.

    ``device``: ``None`` or the CPU keeps the mappings; another device copies the leaves there.
    Pickled non-tensor data is never loaded (whatever ``allow_pickle`` says): only JSON data.

    Raises:
        ValueError: bad meta.json content (unknown dtype or type, bad shape, unsafe key, a
            nested tensor, a format version above 1), naming the file and key.
        RuntimeError: a missing directory, meta.json or leaf file, a file too small for its
            leaf, a symbolic link below ``prefix`` (never followed) or a file that is not a
            regular file (a FIFO or device, never opened for reading), naming the path.
        ValueError: also a meta.json beyond the load's memory budget (docs/reliability.md).
    """
    if out is not None:
        raise NotImplementedError("load_memmap(out=...) is not supported")
    if mode is not None:
        if mode not in ("r", "r+"):
            raise ValueError(f"mode must be 'r', 'r+' or None, got {mode!r}.")
        raise NotImplementedError("load_memmap(mode=...) is not supported")
    if robust_key not in (None, True, False):
        raise TypeError(f"robust_key must be a bool or None, got {type(robust_key).__name__}")
    if allow_pickle is not None and not isinstance(allow_pickle, bool):
        raise TypeError("allow_pickle must be a bool or None.")
    result = cls._wrap(_wrap_leaves(_C._load_memmap(os.fspath(prefix))))
    if device is not None and torch.device(device).type != "cpu":
        result = result.to(device)
    return result


def is_memmap(self: Any) -> bool:
    """True when the TensorDict is locked and every leaf is memory-mapped (what :meth:`memmap`,
    :meth:`memmap_` and :meth:`memmap_like` return); unlocking it ends that, as in the
    reference. A locked TensorDict built from memory-mapped tensors also counts (the reference
    keeps a flag and says False)."""
    return _C._is_memmap_td(self._cpp)
