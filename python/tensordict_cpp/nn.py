"""TensorDictParams: an ``nn.Module`` that holds a TensorDict whose leaves are its registered
parameters and buffers, as the reference's ``tensordict.nn.TensorDictParams`` (where a policy's
weights live for weight synchronisation).

It is a TensorDict (every method works on the wrapped one, and the transfers write into the
leaves in place) and an ``nn.Module`` (``named_parameters()`` gives the leaves under flat
"a.b" names, so an optimizer, ``state_dict`` or a parent module sees them). The leaves *are*
the Parameter objects: a ``recv`` into a TensorDictParams, or into ``from_module(m,
as_module=True)``, writes into ``m``'s own parameters, and an optimizer holding them sees the new
values. Unlike the reference's, such a receive bumps the parameters' autograd versions, so a
backward built before it raises instead of using the new values (docs/distributed.md), and
``torch.load(weights_only=True)`` reads a saved TensorDictParams back (``_rebuild_params`` is
allowlisted; the reference's needs ``weights_only=False``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tensordict_cpp._td import TensorDict

__all__ = ["TensorDictParams"]

_PARAM_DTYPES = (torch.float16, torch.float32, torch.float64)
_LOCKED = ("Cannot modify locked TensorDict. For in-place modification, consider using the "
           "`set_()` method and make sure the key is present.")


def _is_buffer(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Buffer) or getattr(t, "_is_buffer", False)


def _convert(value: Any, no_convert: bool) -> Any:
    """A leaf as the reference registers it: without no_convert, float16/32/64 tensors become
    Parameters and the others buffers; with it, only Parameters stay parameters."""
    if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter) or _is_buffer(value):
        return value
    if not no_convert and value.dtype in _PARAM_DTYPES:
        return nn.Parameter(value)
    if value.requires_grad:  # a buffer that keeps its autograd history (the reference's legacy)
        return value
    return nn.Buffer(value)


class TensorDictParams(TensorDict, nn.Module):
    """A TensorDict whose leaves are the registered parameters and buffers of this module.

    Args:
        parameters (TensorDict, dict or reference tensordict, optional): the entries. Their
            leaves are registered as they are (a float16/32/64 tensor becomes an
            ``nn.Parameter`` sharing its storage, another tensor a buffer), so nothing is
            copied. A TensorDictParams is shared with its registrations. Exclusive with
            ``**kwargs``.

    Keyword Args:
        no_convert (bool, optional): register the leaves without making Parameters: only
            ``nn.Parameter`` leaves are parameters, the others buffers. Defaults to ``False``.
        lock (bool, optional): lock the wrapped TensorDict (writes through this module still
            work, as in the reference). Defaults to ``False``.
        **kwargs: the entries as keyword arguments, instead of ``parameters``.

    Examples:
        >>> params = TensorDictParams(TensorDict(w=torch.zeros(3), step=torch.zeros((), dtype=torch.long)))
        >>> [name for name, _ in params.named_parameters()], [n for n, _ in params.named_buffers()]
        (['w'], ['step'])
    """

    __hash__ = nn.Module.__hash__  # modules go in sets (named_modules); TensorDict has __eq__

    def __init__(self, parameters: Any = None, *, no_convert: Any = False, lock: bool = False,
                 **kwargs: Any) -> None:
        nn.Module.__init__(self)
        if parameters is None:
            parameters = kwargs
        elif kwargs:
            raise TypeError(f"parameters cannot be passed along with extra keyword arguments, but "
                            f"got {kwargs.keys()} extra args.")
        registered = None
        if isinstance(parameters, TensorDictParams):
            registered = dict(parameters._parameters), dict(parameters._buffers)
            td = parameters.copy().lock_()
            no_convert = "skip"
        elif isinstance(parameters, Mapping):
            td = TensorDict(parameters)
        else:
            td = TensorDict.from_tensordict(parameters)
        if td._cpp.is_lazy_stack():
            raise TypeError("TensorDictParams: a lazy stack cannot be registered (its members' "
                            "leaves are not one tensor each); stack it densely first")
        self._cpp = td._cpp
        self.no_convert = no_convert
        if no_convert != "skip":
            self._convert_leaves()
        self._lock_content = lock
        if lock:
            td.lock_()
        self._is_locked = False
        self._reset_params(*(registered or (None, None)))

    # ---- registration ------------------------------------------------------------------------
    @property
    def _param_td(self) -> TensorDict:
        """The wrapped TensorDict (the same entries; its own object)."""
        return TensorDict._wrap(self._cpp)

    def _convert_leaves(self) -> None:
        td = self._param_td
        relock = td.is_locked
        td.unlock_()
        try:
            for key, value in td.items(True, True):
                converted = _convert(value, bool(self.no_convert))
                if converted is not value:
                    td.set(key, converted)
        finally:
            if relock:
                td.lock_()

    def _reset_params(self, params: dict | None = None, buffers: dict | None = None) -> None:
        self._parameters.clear()
        self._buffers.clear()
        if params is not None:
            self._parameters.update(params)
            self._buffers.update(buffers)
            return
        for key, value in self._param_td.items(True, True):
            if not isinstance(value, torch.Tensor):
                continue  # non-tensor entries are not registered
            name = ".".join(key) if isinstance(key, tuple) else key
            (self._parameters if isinstance(value, nn.Parameter) else self._buffers)[name] = value

    def _write(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A write through the module: converted, allowed on a locked wrapped TensorDict (not on
        a locked TensorDictParams), then registered again."""
        if self._is_locked:
            raise RuntimeError(_LOCKED)
        td = self._param_td
        relock = td.is_locked
        td.unlock_()
        try:
            out = getattr(TensorDict, method)(self, *args, **kwargs)
            if method != "__delitem__":
                self._convert_leaves()
        finally:
            if relock:
                td.lock_()
            self._reset_params()
        return out  # TensorDict's own method ran on self: set / update / del_ return self

    # ---- writes ------------------------------------------------------------------------------
    def set(self, key: Any, value: Any, inplace: bool = False, **kwargs: Any) -> TensorDictParams:
        if value is self:
            raise ValueError(f"Cannot set a TensorDictParams into itself under key {key!r}.")
        return self._write("set", key, value, inplace, **kwargs)

    def __setitem__(self, index: Any, value: Any) -> None:
        if value is self:
            raise ValueError(f"Cannot set a TensorDictParams into itself under key {index!r}.")
        self._write("__setitem__", index, value)

    def update(self, input_dict_or_td: Any, clone: bool = False, *args: Any,
               **kwargs: Any) -> TensorDictParams:
        return self._write("update", input_dict_or_td, clone, *args, **kwargs)

    def __delitem__(self, key: Any) -> None:
        self._write("__delitem__", key)

    def del_(self, key: Any) -> TensorDictParams:
        return self._write("del_", key)

    def pop(self, key: Any, *default: Any) -> Any:
        return self._write("pop", key, *default)

    # ---- the lock: this module's own, beside the wrapped TensorDict's -------------------------
    @property
    def is_locked(self) -> bool:
        return self._is_locked

    def lock_(self) -> TensorDictParams:
        self._is_locked = True
        TensorDict.lock_(self)
        return self

    def unlock_(self) -> TensorDictParams:
        self._is_locked = False
        if not self._lock_content:
            TensorDict.unlock_(self)
        return self

    # ---- what the reference returns as a TensorDictParams ------------------------------------
    def clone(self, recurse: bool = True, **kwargs: Any) -> TensorDictParams:
        """A TensorDictParams of copies (new Parameters of the same requires_grad; buffers stay
        buffers)."""
        td = TensorDict.clone(self._param_td, recurse, **kwargs)
        if recurse:
            for key, value in self._param_td.items(True, True):
                if isinstance(value, nn.Parameter):
                    td.set(key, nn.Parameter(td.get(key), requires_grad=value.requires_grad))
                elif isinstance(value, torch.Tensor):
                    td.set(key, nn.Buffer(td.get(key)))
        return TensorDictParams(td, no_convert=True, lock=self._lock_content)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        # The wrapped TensorDict's order, as the reference's state_dict (nn.Module's would put
        # every parameter before every buffer).
        for key, value in self._param_td.items(True, True):
            if isinstance(value, torch.Tensor):
                name = ".".join(key) if isinstance(key, tuple) else key
                destination[prefix + name] = value if keep_vars else value.detach()

    def __repr__(self) -> str:
        return f"TensorDictParams(params={TensorDict.__repr__(self._param_td)})"

    def __reduce__(self) -> tuple:
        # A module, not TensorDict's pickle: the wrapped TensorDict (Parameters pickle as
        # Parameters, buffers keep their mark) and the options.
        return _rebuild_params, (TensorDict._wrap(self._cpp), self.no_convert, self._lock_content,
                                 self._is_locked)


TensorDict._params_class = TensorDictParams  # for TensorDict.from_module(as_module=True)


def _rebuild_params(td: TensorDict, no_convert: Any, lock: bool, locked: bool) -> TensorDictParams:
    """What a TensorDictParams pickles as (``__reduce__``): rebuilt from its TensorDict (whose
    leaves come back as the Parameters and buffers they were) and its three flags. It builds
    only from those, imports and calls nothing else, so ``torch.load(weights_only=True)`` may
    take it (allowlisted below); a forged pickle that passes other objects is refused here."""
    if type(td) is not TensorDict:
        raise TypeError(f"_rebuild_params: expected a TensorDict of the parameters, got "
                        f"{type(td).__name__}")
    if not (isinstance(no_convert, bool) or no_convert == "skip"):
        got = repr(no_convert) if isinstance(no_convert, str) else type(no_convert).__name__
        raise ValueError(f"_rebuild_params: no_convert must be a bool or 'skip', got {got}")
    for name, flag in (("lock", lock), ("locked", locked)):
        if not isinstance(flag, bool):
            raise TypeError(f"_rebuild_params: {name} must be a bool, got {type(flag).__name__}")
    params = TensorDictParams(td, no_convert=True, lock=lock)  # registered as pickled
    params.no_convert = no_convert
    return params.lock_() if locked else params


# torch.load(weights_only=True) rebuilds only allowlisted globals; the TensorDict and its
# Parameters are rebuilt by globals already allowed (_td.py's, torch's own).
torch.serialization.add_safe_globals([_rebuild_params])
