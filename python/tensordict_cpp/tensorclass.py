"""``@tensorclass``: dataclass-style classes backed by a :class:`tensordict_cpp.TensorDict`.

A tensorclass declares its fields with annotations, as a dataclass does; each instance keeps
its values in one TensorDict (``instance._tensordict``), so that indexing, ``clone``, ``to``
and every transfer of the TensorDict (send / recv, init_remote, the collectives, the pipe)
work on the whole instance at once, with the wire format of the reference ``tensordict``'s
``@tensorclass``: a reference peer sending or receiving a tensorclass with the same fields
exchanges data with ours.

>>> import torch
>>> from tensordict_cpp import tensorclass
>>> @tensorclass
... class MyData:
...     obs: torch.Tensor
...     reward: torch.Tensor
>>> data = MyData(obs=torch.zeros(3, 4), reward=torch.ones(3), batch_size=[3])
>>> data[1:].obs.shape
torch.Size([2, 4])

The class name travels with ``init_remote`` and ``broadcast`` as ``"<module>.<qualname>"``.
A receiver resolves it among the tensorclasses defined in its own process
(:func:`_resolve_tensorclass_type`), never by importing a module that a peer names unless the
caller passes ``allow_import=True``.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import re
import sys
import types
import typing
import weakref
from typing import Any, Callable

import torch

from tensordict_cpp import _collectives, _reference
from tensordict_cpp._td import TensorDict, _repr_compact, cat, stack

__all__ = ["tensorclass", "is_tensorclass"]

_NO_DEFAULT = object()
_MARK = "_is_tensordict_cpp_tensorclass"

# "<module>.<qualname>" -> class, for every class decorated in this process. Weak: a class
# defined in a function that is gone is not kept alive by being resolvable.
_REGISTRY: "weakref.WeakValueDictionary[str, type]" = weakref.WeakValueDictionary()

# A script's classes are "__main__.X" when it runs directly and "__mp_main__.X" in processes
# started by multiprocessing's spawn (which re-imports the main script under that name).
_MAIN_ALIASES = {"__main__": "__mp_main__", "__mp_main__": "__main__"}
_MAX_NAME_LEN = 4096  # as the C++ metadata reader bounds it
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# The kinds of fields, from their annotation (or from the value, for "any").
_TENSOR, _NESTED, _NON_TENSOR, _ANY = "tensor", "nested", "non-tensor", "any"
_NON_TENSOR_TYPES = (str, int, float, bool, list, dict)


# ---- field specifications -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Spec:
    """How one field is stored: its kind, its class when nested, and whether it may be None
    (absent from the TensorDict)."""

    kind: str
    target: type | None
    nullable: bool
    annotation: Any
    field: dataclasses.Field


def _classify(ann: Any) -> tuple[str, type | None, bool]:
    """(kind, nested class, admits None) of an annotation."""
    if ann is Any or ann is object:
        return _ANY, None, True
    if ann is None or ann is type(None):
        return _ANY, None, True
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _classify(typing.get_args(ann)[0])
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(ann)
        others = [a for a in args if a is not type(None)]
        nullable = len(others) < len(args)
        kinds = [_classify(a) for a in others]
        if len(kinds) == 1:
            kind, target, inner_nullable = kinds[0]
            return kind, target, nullable or inner_nullable
        # Union[str, int] stays non-tensor; a mix of kinds is decided by each value.
        if all(k[0] == _NON_TENSOR for k in kinds):
            return _NON_TENSOR, None, nullable
        return _ANY, None, True
    if origin is not None:  # list[int], dict[str, float]
        ann = origin
    if isinstance(ann, type):
        if issubclass(ann, torch.Tensor):
            return _TENSOR, None, False
        if is_tensorclass(ann) or issubclass(ann, TensorDict):
            return _NESTED, ann, False
        if issubclass(ann, _NON_TENSOR_TYPES):
            return _NON_TENSOR, None, False
    return _ANY, None, True


def _type_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations; one that cannot be resolved yet (a forward reference to a
    class defined later, or a local name) stays a string, which makes its field "any"."""
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception:  # noqa: BLE001 - resolved one by one below
        pass
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        module = sys.modules.get(klass.__module__)
        globalns = dict(vars(module)) if module else {}
        for name, ann in klass.__dict__.get("__annotations__", {}).items():
            if isinstance(ann, str):
                try:
                    ann = eval(ann, globalns, dict(vars(klass)))  # noqa: S307 - the class's own source
                except Exception:  # noqa: BLE001
                    pass
            hints[name] = ann
    return hints


def _specs(cls: type, retry: bool = False) -> dict[str, _Spec]:
    """The field specifications of a tensorclass, in declaration order.

    Cached on the class once every annotation resolves. Until then (a forward reference to a
    class defined after this one), the partial result is cached too, and ``retry`` (on each
    construction) tries again, so that the reference resolves once its class exists.
    """
    cached = cls.__dict__.get("_tc_specs")
    if cached is not None:
        return cached
    partial = cls.__dict__.get("_tc_specs_partial")
    if partial is not None and not retry:
        return partial
    hints = _type_hints(cls)
    specs = {}
    resolved = True
    for f in dataclasses.fields(cls):
        ann = hints.get(f.name, f.type)
        if isinstance(ann, str):
            resolved = False
        kind, target, nullable = _classify(ann)
        specs[f.name] = _Spec(kind, target, nullable or f.default is None, ann, f)
    type.__setattr__(cls, "_tc_specs" if resolved else "_tc_specs_partial", specs)
    return specs


def _field_names(cls: type) -> list[str]:
    return list(_specs(cls))


def _did_you_mean(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _ann_name(ann: Any) -> str:
    return ann.__qualname__ if isinstance(ann, type) else str(ann)


# ---- entries -------------------------------------------------------------------------------
def _read_entry(td: TensorDict, key: Any) -> Any:
    """The entry at ``key``: a tensor, a TensorDict, or the data of a non-tensor entry (never
    a tensor or a TensorDict, so the type tells the kinds apart)."""
    return td[key]


# ---- the field descriptor -------------------------------------------------------------------
class _Field:
    """A field of a tensorclass: reads and writes the entry of the backing TensorDict."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            # On the class, the default, as dataclasses leave it.
            default = owner.__dataclass_fields__[self.name].default
            if default is dataclasses.MISSING:
                raise AttributeError(f"type object {owner.__name__!r} has no attribute "
                                     f"{self.name!r} (a field without a default)")
            return default
        return _get_field(obj, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        _set_field(obj, self.name, value)

    def __delete__(self, obj: Any) -> None:
        _set_field(obj, self.name, None)


def _get_field(obj: Any, name: str) -> Any:
    td = obj._tensordict
    if name not in td:  # a None field is a missing entry, as in the reference
        return None
    value = _read_entry(td, name)
    spec = _specs(type(obj))[name]
    if isinstance(value, TensorDict) and spec.target is not None and is_tensorclass(spec.target):
        return spec.target._wrap(value)
    return value


def _set_field(obj: Any, name: str, value: Any) -> None:
    cls = type(obj)
    spec = _specs(cls)[name]
    td = obj._tensordict
    where = f"{cls.__name__}.{name}"
    if value is None:
        if not spec.nullable:
            raise TypeError(
                f"{where} cannot be None: it is annotated {_ann_name(spec.annotation)}, "
                "without Optional[...] or a None default")
        if name in td:
            del td[name]
        return
    entry = _entry_for(where, spec, value)
    try:
        if entry is _NON_TENSOR:
            # Explicitly: td[name] = 3 would store a tensor, and a dict a nested TensorDict.
            td.set_non_tensor(name, value)
        else:
            td[name] = entry
    except (ValueError, TypeError) as err:
        raise type(err)(f"{where}: {err}") from err


def _entry_for(where: str, spec: _Spec, value: Any) -> Any:
    """What goes into the TensorDict for ``value`` (``_NON_TENSOR`` for non-tensor data);
    TypeError when the value does not fit the field's annotation."""
    got = type(value).__name__
    if spec.kind == _TENSOR:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where} expects a torch.Tensor, got {got}")
        return value
    if spec.kind == _NESTED:
        target = spec.target
        if is_tensorclass(target):
            if isinstance(value, target):
                return value._tensordict
            if isinstance(value, TensorDict):
                return target.from_tensordict(value)._tensordict  # checks its fields
            raise TypeError(f"{where} expects a {target.__name__} (or a TensorDict with its "
                            f"fields), got {got}")
        if isinstance(value, TensorDict):
            return value
        raise TypeError(f"{where} expects a tensordict_cpp.TensorDict, got {got}")
    if isinstance(value, (torch.Tensor, TensorDict)) or is_tensorclass(value):
        if spec.kind == _NON_TENSOR:
            raise TypeError(f"{where} is annotated {_ann_name(spec.annotation)} (non-tensor "
                            f"data), got {got}")
        return value._tensordict if is_tensorclass(value) else value
    return _NON_TENSOR


# ---- methods installed on every tensorclass -------------------------------------------------
def _unwrap(arg: Any) -> Any:
    """A tensorclass becomes its TensorDict, also inside a list or tuple (``scatter``'s
    ``tensordicts``, ``apply``'s others)."""
    if is_tensorclass(arg) and not isinstance(arg, type):
        return arg._tensordict
    if isinstance(arg, (list, tuple)) and any(is_tensorclass(a) for a in arg):
        return type(arg)(_unwrap(a) for a in arg)
    return arg


def _td_method(name: str, wrap: bool) -> Callable:
    """A method that runs ``TensorDict.<name>`` on the backing TensorDict; with ``wrap``, a
    TensorDict result (or a tuple of them) comes back as this tensorclass."""
    td_fn = getattr(TensorDict, name)

    def method(self, *args: Any, **kwargs: Any) -> Any:
        out = getattr(self._tensordict, name)(
            *[_unwrap(a) for a in args], **{k: _unwrap(v) for k, v in kwargs.items()})
        if wrap:
            return _wrap_like(self, out)
        return out

    functools.update_wrapper(method, td_fn)  # docs and signature (through __wrapped__)
    method.__qualname__ = f"tensorclass.{name}"
    return method


def _inplace_method(name: str) -> Callable:
    td_fn = getattr(TensorDict, name)

    def method(self, *args: Any, **kwargs: Any) -> Any:
        getattr(self._tensordict, name)(
            *[_unwrap(a) for a in args], **{k: _unwrap(v) for k, v in kwargs.items()})
        return self

    functools.update_wrapper(method, td_fn)
    method.__qualname__ = f"tensorclass.{name}"
    return method


def _wrap_like(self: Any, out: Any) -> Any:
    if isinstance(out, TensorDict):
        return type(self)._wrap(out)
    if isinstance(out, tuple) and out and all(isinstance(t, TensorDict) for t in out):
        return tuple(type(self)._wrap(t) for t in out)
    return out


# Run on the backing TensorDict, results returned as they are (the reference's
# _FALLBACK_METHOD_FROM_TD_NOWRAP): the per-leaf transfers and the reductions return tags or
# Work handles.
_NOWRAP = ("send", "isend", "irecv", "all_reduce", "reduce", "keys", "values", "items",
           "is_consolidated", "is_empty", "numel", "dim", "all", "any", "allclose")
# Run on the backing TensorDict, a TensorDict result rewrapped as this tensorclass (the
# reference's _FALLBACK_METHOD_FROM_TD).
_WRAP = ("clone", "to", "contiguous", "consolidate", "unbind", "reshape", "view", "expand",
         "unsqueeze", "squeeze", "split", "apply", "__eq__", "__ne__")
# In place on the backing TensorDict; they return the instance itself.
_INPLACE = ("zero_", "lock_", "unlock_", "update", "fill_")


def _rebuild_tensorclass(cls: type, tensordict: TensorDict) -> Any:
    return cls._wrap(tensordict)


class _Methods:
    """The methods every tensorclass gets (unless it defines its own)."""

    def __reduce__(self) -> tuple:
        # The class (pickled by its import path, as any class) and its TensorDict. Not
        # allowlisted for torch.load(weights_only=True): the class is the user's, as in the
        # reference.
        return _rebuild_tensorclass, (type(self), self._tensordict)

    def __init__(self, *args: Any, batch_size: Any = None, device: Any = None,
                 **kwargs: Any) -> None:
        cls = type(self)
        specs = _specs(cls, retry=True)
        init_names = [n for n, s in specs.items() if s.field.init]
        if len(args) > len(init_names):
            raise TypeError(f"{cls.__name__}() takes {len(init_names)} positional field "
                            f"values ({', '.join(init_names)}) but {len(args)} were given")
        values = dict(zip(init_names, args))
        for key, value in kwargs.items():
            if key not in init_names:
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {key!r}: "
                                f"{cls.__name__} has no field of that name (fields: "
                                f"{init_names}).{_did_you_mean(key, init_names)}")
            if key in values:
                raise TypeError(f"{cls.__name__}() got multiple values for field {key!r}")
            values[key] = value
        missing = [n for n in init_names if n not in values
                   and specs[n].field.default is dataclasses.MISSING
                   and specs[n].field.default_factory is dataclasses.MISSING]
        if missing:
            raise TypeError(f"{cls.__name__}() missing required field(s): "
                            f"{', '.join(repr(m) for m in missing)}")
        object.__setattr__(self, "_tensordict",
                           TensorDict({}, batch_size=batch_size, device=device))
        # Declaration order, whatever the order of the arguments: it is the insertion order of
        # the TensorDict, hence the consolidated layout, which must match a reference peer's.
        for name, spec in specs.items():
            if name in values:
                value = values[name]
            elif spec.field.default_factory is not dataclasses.MISSING:
                value = spec.field.default_factory()
            elif spec.field.default is not dataclasses.MISSING:
                value = spec.field.default
            else:
                continue  # field(init=False) without a default: left to __post_init__
            _set_field(self, name, value)
        post_init = getattr(self, "__post_init__", None)
        if post_init is not None:
            post_init()

    @classmethod
    def from_tensordict(cls, tensordict: TensorDict) -> Any:
        """Wraps ``tensordict`` as an instance of this class, without copying: the instance and
        the TensorDict share their entries.

        Every key must be a field of the class; every field must be present, unless it may be
        ``None`` (annotated ``Optional[...]`` or with a ``None`` default), which a missing key
        means. Tensor fields must hold tensors, nested tensorclass fields TensorDicts with
        that class's fields (checked recursively), non-tensor fields non-tensor entries.
        ``__post_init__`` is not run (the reference runs it): the entries are taken as they
        are, which keeps a received consolidated TensorDict intact.

        Args:
            tensordict (TensorDict): a ``tensordict_cpp.TensorDict``, or a reference
                ``tensordict.TensorDict``, converted without copies (its leaves are shared).

        Raises:
            TypeError: if ``tensordict`` is neither, or an entry has the wrong kind for its
                field.
            ValueError: for a key that is not a field, or a missing field that cannot be None;
                the message names it.
        """
        if _reference.is_reference(tensordict):
            tensordict = TensorDict.from_tensordict(tensordict)
        _check_tensordict(cls, tensordict)
        return cls._wrap(tensordict)

    @classmethod
    def _wrap(cls, tensordict: TensorDict) -> Any:
        # No checks: for TensorDicts derived from an instance's own (indexing, clone, ...).
        obj = cls.__new__(cls)
        object.__setattr__(obj, "_tensordict", tensordict)
        return obj

    def to_tensordict(self, *, retain_none: bool | None = None) -> TensorDict:
        """A TensorDict with a copy of the fields (tensors cloned; nested tensorclasses become
        nested TensorDicts; ``None`` fields are left out), as :meth:`TensorDict.to_tensordict`."""
        return self._tensordict.to_tensordict()

    # ---- shape and device ---------------------------------------------------------------------
    @property
    def batch_size(self) -> torch.Size:
        """The batch dimensions shared by every field (settable, as the TensorDict's)."""
        return self._tensordict.batch_size

    @batch_size.setter
    def batch_size(self, value: Any) -> None:
        self._tensordict.batch_size = value

    @property
    def shape(self) -> torch.Size:
        """Same as :attr:`batch_size`."""
        return self._tensordict.batch_size

    @property
    def batch_dims(self) -> int:
        return self._tensordict.batch_dims

    ndim = batch_dims

    @property
    def device(self) -> torch.device | None:
        """The device of the backing TensorDict, or ``None``."""
        return self._tensordict.device

    @property
    def is_locked(self) -> bool:
        return self._tensordict.is_locked

    @property
    def sorted_keys(self) -> list[str]:
        """The keys sorted by code point: the order of per-leaf transfers."""
        return self._tensordict.sorted_keys

    def __len__(self) -> int:
        return len(self._tensordict)

    # ---- entries ------------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        cls = type(self)
        if name in _specs(cls):
            _set_field(self, name, value)
            return
        if name.startswith("_") or any(name in k.__dict__ for k in cls.__mro__):
            object.__setattr__(self, name, value)  # a private or class-defined attribute
            return
        fields = _field_names(cls)
        raise AttributeError(f"Cannot set the attribute {name!r}: {cls.__name__} has no such "
                             f"field. Its fields are {fields}.{_did_you_mean(name, fields)}")

    def get(self, key: Any, default: Any = _NO_DEFAULT) -> Any:
        """The field ``key`` (a nested key reaches into nested fields); ``default`` when it is
        missing, if given (KeyError otherwise)."""
        if isinstance(key, str) and key in _specs(type(self)):
            value = _get_field(self, key)
            if value is None and default is not _NO_DEFAULT:
                return default
            return value
        if key not in self._tensordict:
            if default is not _NO_DEFAULT:
                return default
            raise KeyError(f"{key!r} is not a field of {type(self).__name__}")
        return _read_entry(self._tensordict, key)

    def set(self, key: Any, value: Any) -> Any:
        """Sets the field ``key`` (as attribute assignment does) and returns the instance; a
        nested key writes into a nested field's TensorDict."""
        if isinstance(key, str):
            if key not in _specs(type(self)):
                fields = _field_names(type(self))
                raise KeyError(f"{key!r} is not a field of {type(self).__name__} (fields: "
                               f"{fields}).{_did_you_mean(key, fields)}")
            _set_field(self, key, value)
        else:
            self._tensordict.set(key, _unwrap(value))
        return self

    def __getitem__(self, index: Any) -> Any:
        """``obj["field"]`` reads a field; any other index (int, slice, mask, ...) indexes the
        batch dimensions and returns an instance of the same class."""
        if isinstance(index, str) or (isinstance(index, tuple) and index
                                      and all(isinstance(i, str) for i in index)):
            return self.get(index)
        return type(self)._wrap(self._tensordict[index])

    def __setitem__(self, index: Any, value: Any) -> None:
        """``obj["field"] = v`` sets a field; ``obj[index] = other`` writes ``other`` (an
        instance of the class, a TensorDict, a tensor or a number) into the batch at
        ``index``, in place."""
        if isinstance(index, str):
            self.set(index, value)
        else:
            self._tensordict[index] = _unwrap(value)

    def __iter__(self):
        """Iterates over the first batch dimension, one instance per row."""
        for td in self._tensordict:
            yield type(self)._wrap(td)

    def __bool__(self) -> bool:
        return bool(self._tensordict)  # raises, as the TensorDict's (and the reference's)

    __hash__ = None  # type: ignore[assignment]

    # ---- printing -----------------------------------------------------------------------------
    def __repr__(self) -> str:
        """The reference's repr: by default its compact form (``Cls(batch_size=[3],
        fields={x: f32[2], label: str, unset: None})``, the unset fields last), and under
        ``set_printoptions(compact=False)`` its detailed form: the present fields sorted, then
        the ``None`` fields in declaration order, then ``batch_size``, ``device`` and
        ``is_shared``."""
        td = self._tensordict
        present = set(td.keys())
        specs = _specs(type(self))
        if _repr_compact():
            hidden = [k for k in present if k in specs and not specs[k].field.repr]
            unset = [(name, "None") for name, spec in specs.items()
                     if name not in present and spec.field.repr]
            nested = [(k, spec.target.__name__) for k, spec in specs.items()
                      if k in present and spec.target is not None and is_tensorclass(spec.target)]
            return td._cpp.repr(True, type(self).__name__, hidden, unset, nested)
        bs, dev = td.batch_size, td.device
        shown = [key for key in td.keys() if key not in specs or specs[key].field.repr]
        fields = sorted(f"{key}={_entry_repr(self, key)}" for key in shown)
        fields += [f"{name}=None" for name, spec in specs.items()
                   if name not in present and spec.field.repr]
        fields += [f"batch_size={bs}", f"device={dev}",
                   f"is_shared={dev is not None and dev.type == 'cuda'}"]
        body = ",\n".join(_indent(f) for f in fields)
        return f"{type(self).__name__}(\n{body})"

    # ---- torch functions ----------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """``torch.stack`` / ``torch.cat`` of instances of one class give an instance of it;
        ``torch.unbind`` a tuple of them."""
        kwargs = kwargs or {}
        if func in (torch.stack, torch.cat):
            items = args[0] if args else kwargs.pop("tensors")
            owner = type(items[0])
            out = (stack if func is torch.stack else cat)(
                [_unwrap(i) for i in items], *args[1:], **kwargs)
            return owner._wrap(out)
        if func is torch.unbind:
            return args[0].unbind(*args[1:], **kwargs)
        return NotImplemented

    # ---- transfers needing the class name -----------------------------------------------------
    def init_remote(self, dst: int | None = None, group: Any = None, device: Any = None,
                    use_broadcast: bool = False) -> None:
        """:meth:`tensordict_cpp.TensorDict.init_remote` of the backing TensorDict, with the
        class name (``"<module>.<qualname>"``) in the metadata, as the reference's tensorclass
        sends it: the receiver's ``from_remote_init`` returns an instance of the tensorclass
        of that name in its process (ours or the reference's).

        Args and Raises: as :meth:`tensordict_cpp.TensorDict.init_remote`.
        """
        self._tensordict.init_remote(dst=dst, group=group, device=device,
                                     use_broadcast=use_broadcast,
                                     _tensorclass_type=_type_name(type(self)))

    @classmethod
    def from_remote_init(cls, src: int, group: Any = None, device: Any = None,
                         use_broadcast: bool = False, **kwargs: Any) -> Any:
        """Receives what ``init_remote`` sends (:meth:`tensordict_cpp.TensorDict.from_remote_init`).

        When the sender was a tensorclass, the result is the tensorclass of the name it sent,
        found among this process's tensorclasses (as the reference, which returns the class
        the sender names); when it sent a plain TensorDict, the result is an instance of
        ``cls`` (the reference returns the TensorDict), checked by :meth:`from_tensordict`.

        Args, Keyword Args (``max_total_bytes``, ``allow_import``) and Raises: as
        :meth:`tensordict_cpp.TensorDict.from_remote_init`; also ValueError when a plain
        TensorDict's keys are not the fields of ``cls``.
        """
        out = TensorDict.from_remote_init(src, group=group, device=device,
                                          use_broadcast=use_broadcast, **kwargs)
        if isinstance(out, TensorDict):
            return cls.from_tensordict(out)
        return out

    def broadcast(self, src: int, *, group: Any = None, device: Any = None,
                  **kwargs: Any) -> Any:
        """:meth:`tensordict_cpp.TensorDict.broadcast` of the backing TensorDict, with the
        class name in the metadata on the source, as the reference's tensorclass sends it.

        Every rank gets an instance of this class (the placeholder's class on the receivers,
        as in the reference), checked by :meth:`from_tensordict` where it was received.

        Args, Keyword Args and Raises: as :meth:`tensordict_cpp.TensorDict.broadcast`.
        """
        out = self._tensordict.broadcast(src, group=group, device=device,
                                         _tensorclass_type=_type_name(type(self)), **kwargs)
        if isinstance(out, type(self)):
            return out
        if is_tensorclass(out):
            out = out._tensordict  # the source named another class: check it as this one
        return type(self).from_tensordict(out)

    # Unlike the reference's tensorclass, which returns plain TensorDicts here, the results
    # are checked instances of this class (as in the C++ tensorclass): every rank or peer of a
    # tensorclass transfer holds the same class.
    def all_gather(self, **kwargs: Any) -> list:
        """Every rank's instance, on every rank, in rank order
        (:meth:`tensordict_cpp.TensorDict.all_gather`); each is checked as this class
        (ValueError / TypeError naming the field of a rank whose fields differ)."""
        return [type(self).from_tensordict(t) for t in self._tensordict.all_gather(**kwargs)]

    def scatter(self, src: int, tensordicts: Any = None, **kwargs: Any) -> Any:
        """This rank's instance of those the source passes in ``tensordicts``
        (:meth:`tensordict_cpp.TensorDict.scatter`), checked as this class."""
        return type(self).from_tensordict(
            self._tensordict.scatter(src, _unwrap(tensordicts), **kwargs))

    def recv(self, src: Any = None, **kwargs: Any) -> Any:
        """:meth:`tensordict_cpp.TensorDict.recv` on the backing TensorDict. From a process
        group it receives in place and returns the tag; from a pipe it RETURNS what arrived,
        as an instance of this class."""
        out = self._tensordict.recv(src, **kwargs)
        return type(self).from_tensordict(out) if isinstance(out, TensorDict) else out

    # ---- the pipe (coroutines, so that inspect sees them as such) -----------------------------
    async def asend(self, dst: Any) -> None:
        """Sends the backing TensorDict through a :class:`~tensordict_cpp.TensorDictPipe`
        (:meth:`tensordict_cpp.TensorDict.asend`)."""
        await self._tensordict.asend(dst)

    async def arecv(self, src: Any, *, device: Any = None) -> Any:
        """Receives from a :class:`~tensordict_cpp.TensorDictPipe` and RETURNS what arrived
        (:meth:`tensordict_cpp.TensorDict.arecv`), as an instance of this class."""
        return type(self).from_tensordict(await self._tensordict.arecv(src, device=device))


# Their signatures are the TensorDict's (inspect.signature follows __wrapped__).
for _name in ("all_gather", "scatter", "recv"):
    getattr(_Methods, _name).__wrapped__ = getattr(TensorDict, _name)
del _name


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.split("\n"))


def _entry_repr(obj: Any, key: str) -> str:
    value = _read_entry(obj._tensordict, key)
    if isinstance(value, torch.Tensor):
        return (f"Tensor(shape={value.shape}, device={value.device}, dtype={value.dtype}, "
                f"is_shared={value.is_shared()})")
    if isinstance(value, TensorDict):
        spec = _specs(type(obj)).get(key)
        if spec is not None and spec.target is not None and is_tensorclass(spec.target):
            return repr(spec.target._wrap(value))
        return repr(value)
    return repr(obj._tensordict.get(key))  # the NonTensorData wrapper: the reference's repr


def is_tensor_collection(datatype: Any) -> bool:
    """True for a TensorDict, a tensorclass (instance or class) of ours, and the reference's
    tensor collections, as the reference's ``is_tensor_collection``."""
    if isinstance(datatype, type):
        return issubclass(datatype, TensorDict) or is_tensorclass(datatype) or (
            _reference.is_reference_class(datatype))
    return isinstance(datatype, TensorDict) or is_tensorclass(datatype) or \
        _reference.is_reference(datatype)


def _check_tensordict(cls: type, td: Any, where: str = "") -> None:
    """from_tensordict's checks, recursively through nested tensorclass fields."""
    name = f"{cls.__name__}.from_tensordict"
    if not isinstance(td, TensorDict):
        hint = (" (a tensordict_cpp tensorclass: pass its _tensordict)" if is_tensorclass(td)
                else "")
        raise TypeError(f"{name}: expected a tensordict_cpp.TensorDict{where}, got "
                        f"{type(td).__module__}.{type(td).__qualname__}{hint}")
    specs = _specs(cls, retry=True)
    keys = td.keys()
    for key in keys:
        if key not in specs:
            raise ValueError(f"{name}: key {key!r}{where} is not a field of {cls.__name__} "
                             f"(fields: {list(specs)}).{_did_you_mean(key, list(specs))}")
    for field, spec in specs.items():
        if field not in keys:
            if not spec.nullable:
                raise ValueError(f"{name}: field {field!r}{where} is missing (it is annotated "
                                 f"{_ann_name(spec.annotation)} and cannot be None)")
            continue
        value = _read_entry(td, field)
        kind = ("tensor" if isinstance(value, torch.Tensor) else
                "TensorDict" if isinstance(value, TensorDict) else "non-tensor data")
        if spec.kind == _TENSOR and kind != "tensor" \
                or spec.kind == _NESTED and kind != "TensorDict" \
                or spec.kind == _NON_TENSOR and kind != "non-tensor data":
            raise TypeError(f"{name}: field {field!r}{where} is annotated "
                            f"{_ann_name(spec.annotation)} but holds {kind}")
        if spec.kind == _NESTED and is_tensorclass(spec.target):
            _check_tensordict(spec.target, value, f" (in {field!r}{where})")


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# Every attribute the decorator installs; a field may not take one of these names.
_RESERVED = frozenset(
    {n for n in vars(_Methods) if not n.startswith("__")} | set(_NOWRAP) | set(_WRAP)
    | set(_INPLACE) | {"_tensordict"})


_CLASS_BOOKKEEPING = frozenset({"__module__", "__qualname__", "__doc__", "__dict__",
                                "__weakref__", "__annotations__", "__firstlineno__",
                                "__static_attributes__"})


def _install(cls: type) -> None:
    own = cls.__dict__
    for name, member in vars(_Methods).items():
        if name in _CLASS_BOOKKEEPING:
            continue
        # The class's own definitions win; __init__ and __repr__ are always made for it
        # (dataclass-style) unless the class itself defines them.
        if name in own or (not name.startswith("__") and _defined_above(cls, name)):
            continue
        type.__setattr__(cls, name, member)
    made = [(n, lambda n: _td_method(n, False)) for n in _NOWRAP]
    made += [(n, lambda n: _td_method(n, True)) for n in _WRAP]
    made += [(n, _inplace_method) for n in _INPLACE]
    for name, make in made:
        if name in own or (not name.startswith("__") and _defined_above(cls, name)):
            continue
        type.__setattr__(cls, name, make(name))


def _defined_above(cls: type, name: str) -> bool:
    """Defined by a base that is not a tensorclass (a user mixin)."""
    return any(name in k.__dict__ for k in cls.__mro__[1:]
               if k is not object and not k.__dict__.get(_MARK))


def _signature(cls: type) -> inspect.Signature:
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for name, spec in _specs(cls).items():
        if not spec.field.init:
            continue
        default = spec.field.default
        if spec.field.default_factory is not dataclasses.MISSING:
            default = spec.field.default_factory  # shown as the factory
        params.append(inspect.Parameter(
            name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=inspect.Parameter.empty if default is dataclasses.MISSING else default,
            annotation=spec.annotation))
    params += [inspect.Parameter("batch_size", inspect.Parameter.KEYWORD_ONLY, default=None),
               inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default=None)]
    return inspect.Signature(params)


# ---- the decorator --------------------------------------------------------------------------
def tensorclass(cls: type | None = None) -> Any:
    """Makes ``cls`` a tensorclass: a dataclass-style class whose fields live in a
    :class:`~tensordict_cpp.TensorDict`, with that TensorDict's methods and transfers.

    Fields are declared with annotations, optionally with defaults or
    ``dataclasses.field(default_factory=...)``; the constructor takes them positionally (in
    declaration order) or by name, plus the keywords ``batch_size`` and ``device`` of the
    backing TensorDict (``obj._tensordict``). How a field is stored follows its annotation:

    * ``torch.Tensor``: a tensor leaf; the value must be a tensor starting with the batch size.
    * another tensorclass, or ``TensorDict``: a nested TensorDict; a tensorclass field reads
      back as an instance of its class.
    * ``str``, ``int``, ``float``, ``bool``, ``list``, ``dict`` (and their generic forms): a
      non-tensor entry of the TensorDict (``set_non_tensor``): JSON-like data (``str``,
      ``int``, ``float``, ``bool``, ``None``, and lists and dicts with ``str`` keys of them).
    * anything else (``Any``, an unresolved forward reference, a union of kinds): decided by
      the value (tensor, TensorDict / tensorclass, else non-tensor data).

    ``None`` means absent: a field set to ``None`` has no entry, as in the reference. A field
    may be ``None`` only if it is annotated ``Optional[...]`` or ``Any``, or has a ``None``
    default. Entries are inserted in declaration order, which fixes the consolidated layout
    (the same as a reference tensorclass with the same fields).

    Instances support ``obj.field`` get and set, ``obj[index]`` (batch indexing, the same
    class), ``clone``, ``to``, ``==`` (an instance of booleans), ``keys``,
    :meth:`from_tensordict`, ``to_tensordict``, and every transfer of the TensorDict:
    ``send``, ``recv``, ``isend``, ``irecv``, ``asend``, ``arecv``, ``consolidate``,
    ``init_remote``, ``from_remote_init``, ``broadcast``, ``all_gather``, ``scatter``,
    ``all_reduce``, ``reduce``. ``consolidate``, ``broadcast`` and ``from_remote_init``
    return instances, as in the reference; so do ``all_gather``, ``scatter`` and a pipe's
    ``recv`` / ``arecv`` (the reference's return TensorDicts there).

    The class is registered under ``"<module>.<qualname>"``, the name that ``init_remote`` and
    ``broadcast`` send, so that a receiving process that defines (or imports) it gets
    instances of it.

    Args:
        cls (type): the class to decorate (``@tensorclass`` or ``@tensorclass()``).

    Raises:
        AttributeError: if a field takes the name of a tensorclass attribute (``batch_size``,
            ``device``, ``to``, ``send``, ...).
        TypeError / ValueError: as ``dataclasses.dataclass`` (a mutable default, ...).

    Examples:
        >>> @tensorclass
        ... class MyData:
        ...     obs: torch.Tensor
        ...     reward: torch.Tensor
        ...     label: str = "train"
        >>> data = MyData(obs=torch.zeros(3, 4), reward=torch.ones(3), batch_size=[3])
        >>> data[0].obs.shape
        torch.Size([4])
    """
    if cls is None:
        return tensorclass
    if not isinstance(cls, type):
        raise TypeError(f"@tensorclass decorates a class, got {type(cls).__name__}")
    for name in cls.__dict__.get("__annotations__", {}):
        if name in _RESERVED:
            raise AttributeError(
                f"Attribute name {name!r} can't be used with @tensorclass, as tensorclasses "
                f"have a member of that name.")
    cls = dataclasses.dataclass(cls, init=False, repr=False, eq=False)
    type.__setattr__(cls, _MARK, True)
    for cached in ("_tc_specs", "_tc_specs_partial"):  # decorated twice: recompute
        if cached in cls.__dict__:
            type.__delattr__(cls, cached)
    for f in dataclasses.fields(cls):
        type.__setattr__(cls, f.name, _Field(f.name))
    _install(cls)
    if "__init__" not in cls.__dict__ or cls.__dict__["__init__"] is _Methods.__init__:
        # A function of its own, so that its signature shows this class's fields.
        def __init__(self, *args: Any, batch_size: Any = None, device: Any = None,
                     **kwargs: Any) -> None:
            _Methods.__init__(self, *args, batch_size=batch_size, device=device, **kwargs)

        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        __init__.__doc__ = f"Builds a {cls.__name__} from its fields, ``batch_size`` and ``device``."
        __init__.__signature__ = _signature(cls)
        type.__setattr__(cls, "__init__", __init__)
    _REGISTRY[_type_name(cls)] = cls
    return cls


def is_tensorclass(obj: Any) -> bool:
    """True for a ``tensordict_cpp`` tensorclass or an instance of one.

    The reference's tensorclasses are not ours: this is False for them.
    """
    klass = obj if isinstance(obj, type) else type(obj)
    return bool(getattr(klass, _MARK, False))


# ---- resolving a class name sent by a peer --------------------------------------------------
def _resolve_tensorclass_type(type_str: str, allow_import: bool = False) -> type:
    """The tensorclass named ``type_str`` (``"<module>.<qualname>"``, as ``init_remote`` and
    ``broadcast`` send it) among the ``tensordict_cpp`` tensorclasses of this process.

    The name comes from a peer, so it is first looked up among the classes decorated in this
    process (``"__main__"`` and ``"__mp_main__"`` standing for each other, since spawn renames a
    script's main module), which imports nothing. Only with ``allow_import=True`` is a module
    imported (the longest importable prefix of the name), and the class must then be one of
    ours.

    Args:
        type_str (str): the class's ``"<module>.<qualname>"``.
        allow_import (bool, optional): import the module the name gives when the class is not
            known here. Defaults to ``False``: the reference always imports, which runs the
            module's code on a peer's word.

    Raises:
        ValueError: for a name that is not known here (without ``allow_import``), that cannot
            be imported, or that names something other than a ``tensordict_cpp``
            tensorclass.
    """
    if not isinstance(type_str, str) or not type_str or len(type_str) > _MAX_NAME_LEN:
        raise ValueError(f"invalid tensorclass name {type_str!r}: expected a non-empty "
                         f"'<module>.<qualname>' string of at most {_MAX_NAME_LEN} characters")
    found = _lookup(type_str)
    if found is not None:
        return found
    if not allow_import:
        raise ValueError(
            f"{type_str!r} is not a tensordict_cpp tensorclass known in this process; define "
            "or import it first, or pass allow_import=True to import its module (only for "
            "peers you trust: importing runs the module's code)")
    parts = type_str.split(".")
    if len(parts) < 2 or not all(_IDENTIFIER.fullmatch(p) for p in parts):
        raise ValueError(f"cannot import tensorclass {type_str!r}: not a dotted path of "
                         "identifiers '<module>.<qualname>' (a class defined in a function "
                         "cannot be imported)")
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and (module_name == err.name
                                         or module_name.startswith(err.name + ".")):
                continue  # no such module: try a shorter prefix
            raise ValueError(f"importing {module_name!r} for tensorclass {type_str!r} "
                             f"failed: {err}") from err
        except Exception as err:  # noqa: BLE001 - the module's own failure, named
            raise ValueError(f"importing {module_name!r} for tensorclass {type_str!r} "
                             f"failed: {type(err).__name__}: {err}") from err
        found = _lookup(type_str)  # importing it decorated (registered) the class
        if found is not None:
            return found
        obj: Any = module
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                raise ValueError(f"module {module_name!r} has no {'.'.join(parts[i:])!r} "
                                 f"(tensorclass {type_str!r})")
        if isinstance(obj, type) and is_tensorclass(obj):
            return obj
        raise ValueError(f"{type_str!r} names {obj!r}, which is not a tensordict_cpp "
                         "tensorclass")
    raise ValueError(f"cannot import tensorclass {type_str!r}: no module of that name")


def _lookup(type_str: str) -> type | None:
    found = _REGISTRY.get(type_str)
    if found is None:
        module, _, rest = type_str.partition(".")
        alias = _MAIN_ALIASES.get(module)
        if alias is not None and rest:
            found = _REGISTRY.get(f"{alias}.{rest}")
    return found


# from_remote_init and broadcast (in _collectives, a layer below) resolve a sender's
# tensorclass name through this module's registry.
_collectives._set_tensorclass_resolver(_resolve_tensorclass_type)
