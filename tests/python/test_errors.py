"""C++ errors reach Python as the table of docs/errors.md says, with texts and no C++
backtrace; the p2p argument checks raise the reference's exact ValueError texts."""
import builtins
import datetime
import os

import pytest
import tensordict
import torch
import torch.distributed as dist

import tensordict_cpp
from tensordict_cpp import TensorDict, _C, errors

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the one-rank groups below bind to loopback


@pytest.mark.parametrize("kind, expected", [
    ("KeyError", KeyError),
    ("ValueError", ValueError),
    ("TypeError", TypeError),
    ("IndexError", IndexError),
    ("NotImplementedError", NotImplementedError),
    ("DistBackendError", dist.DistBackendError),
    ("DistNetworkError", dist.DistNetworkError),
    ("DistStoreError", dist.DistStoreError),
    ("DistError", dist.DistError),
    ("RuntimeError", RuntimeError),
    ("InternalAssert", RuntimeError),
])
def test_each_cpp_error_type_maps_to_its_python_class(kind, expected):
    with pytest.raises(expected) as info:
        _C._raise_for_test(kind, "the message")
    assert type(info.value) is expected
    assert "the message" in str(info.value)
    assert "Exception raised from" not in str(info.value)  # no C++ backtrace


# Each typed error of errors.h: its Python class, and the built-in classes (the types raised
# before the typed errors existed) that it must still be an instance of.
TYPED = [
    ("TimeoutError", errors.TimeoutError,
     (dist.DistBackendError, dist.DistError, RuntimeError, builtins.TimeoutError, OSError)),
    ("PeerLostError", errors.PeerLostError, (dist.DistBackendError, dist.DistError, RuntimeError)),
    ("PipeClosedError", errors.PipeClosedError, (RuntimeError,)),
    ("PeerClosedError", errors.PeerClosedError, (RuntimeError,)),
    ("SchemaMismatchError", errors.SchemaMismatchError, (RuntimeError,)),
    ("MalformedPeerDataError", errors.MalformedPeerDataError, (ValueError, RuntimeError)),
    ("NoPublisherError", errors.NoPublisherError, (RuntimeError,)),
    ("BatchSizeError", errors.BatchSizeError, (RuntimeError, ValueError)),
]


@pytest.mark.parametrize("kind, cls, bases", TYPED, ids=[t[0] for t in TYPED])
def test_each_typed_cpp_error_maps_to_its_errors_class(kind, cls, bases):
    with pytest.raises(cls) as info:
        _C._raise_for_test(kind, "the message")
    assert type(info.value) is cls
    assert cls.__name__ == kind and cls.__module__ == "tensordict_cpp.errors"
    assert str(info.value) == "the message"  # the whole text, no C++ backtrace
    for base in bases:
        assert isinstance(info.value, base), base
        assert issubclass(cls, base)
    assert len(cls.__doc__.strip().splitlines()) == 1  # a one-line docstring


@pytest.mark.parametrize("kind, cls, bases", TYPED, ids=[t[0] for t in TYPED])
def test_typed_errors_are_caught_as_before(kind, cls, bases):
    # The except clauses a caller wrote before the typed errors existed still catch them.
    caught = None
    try:
        _C._raise_for_test(kind, "m")
    except ValueError as e:
        caught = ("ValueError", e)
    except builtins.TimeoutError as e:
        caught = ("TimeoutError", e)
    except RuntimeError as e:
        caught = ("RuntimeError", e)
    assert caught is not None and type(caught[1]) is cls
    if issubclass(cls, ValueError):
        assert caught[0] == "ValueError"
    elif issubclass(cls, builtins.TimeoutError):
        assert caught[0] == "TimeoutError"
        with pytest.raises(RuntimeError):  # also still a RuntimeError (DistBackendError)
            _C._raise_for_test(kind, "m")
    else:
        assert caught[0] == "RuntimeError"
    if issubclass(cls, dist.DistBackendError):
        with pytest.raises(dist.DistBackendError):
            _C._raise_for_test(kind, "m")


def test_the_typed_error_classes_are_the_errors_module():
    assert tensordict_cpp.errors is errors
    # InvalidKeyError is Python's alone (no C++ type): a key the binding cannot read.
    assert set(errors.__all__) == {t[0] for t in TYPED} | {"InvalidKeyError"}
    assert issubclass(errors.InvalidKeyError, KeyError) and issubclass(errors.InvalidKeyError, TypeError)
    assert dist.DistBackendError is torch._C._DistBackendError  # the class torch raises


def test_unknown_raise_for_test_kind_is_a_value_error():
    with pytest.raises(ValueError, match="unknown kind"):
        _C._raise_for_test("NoSuchError", "m")


def td():
    return TensorDict(a=torch.ones(4), n={"x": torch.ones(4, 2)}, batch_size=[4])


def test_missing_key_is_a_key_error():
    with pytest.raises(KeyError, match="missing"):
        td()["missing"]
    with pytest.raises(KeyError):
        td()["n", "missing"]
    with pytest.raises(KeyError):
        td().pop("missing")


def test_batch_size_mismatch_is_a_batch_size_error_runtime_and_value_error():
    # RuntimeError as the reference raises it (test_parity.py runs the same calls on it),
    # ValueError as ours raised it before.
    for call in (lambda: td().__setitem__("bad", torch.ones(3)),
                 lambda: TensorDict(a=torch.ones(3), batch_size=[4]),
                 lambda: setattr(td(), "batch_size", [5]),
                 lambda: td().set("n", TensorDict(x=torch.ones(2), batch_size=[2])),
                 lambda: td()._get_sub_tensordict(slice(0, 2)).set("new", torch.ones(3))):
        with pytest.raises(errors.BatchSizeError) as info:
            call()
        assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    with pytest.raises(errors.BatchSizeError, match="'bad'"):
        td()["bad"] = torch.ones(3)


def test_wrong_kind_of_value_is_a_type_error():
    with pytest.raises(TypeError, match="str or a tuple of str"):
        td().get(("n", 1))  # converted by the C++ layer
    with pytest.raises(TypeError):
        td()._cpp.set("x", object())
    with pytest.raises(TypeError):
        td()[1.5]


def test_out_of_range_index_is_an_index_error():
    with pytest.raises(IndexError):
        td()[4]


def test_writing_a_locked_tensordict_is_a_runtime_error():
    locked = td().lock_()
    with pytest.raises(RuntimeError, match="locked"):
        locked["z"] = torch.ones(4)


def test_consolidated_recv_into_a_plain_tensordict_is_a_value_error():
    # Checked before any message is posted, so one process suffices.
    with pytest.raises(ValueError, match="consolidated"):
        td().recv(group=_standalone_group(), group_src=0, consolidated=True)


def _standalone_group():
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the exception itself is what we compare
        return type(e), str(e)
    return None


@pytest.mark.parametrize("method, kwargs", [
    ("send", {}),
    ("send", {"group_dst": 0}),
    ("send", {"dst": 0, "group_dst": 0, "group": "G"}),
    ("recv", {}),
    ("recv", {"group_src": 0}),
    ("recv", {"src": 0, "group_src": 0, "group": "G"}),
    ("isend", {}),
    ("isend", {"group_dst": 0}),
    ("isend", {"dst": 0, "group_dst": 0, "group": "G"}),
    ("irecv", {}),
    ("irecv", {"group_src": 0}),
    ("irecv", {"src": 0, "group_src": 0, "group": "G"}),
])
def test_peer_value_errors_equal_the_reference(method, kwargs):
    group = _standalone_group()
    kwargs = {k: (group if v == "G" else v) for k, v in kwargs.items()}
    ref = tensordict.TensorDict(a=torch.ones(4), batch_size=[4])
    ours = TensorDict(a=torch.ones(4), batch_size=[4])
    expected = _error(lambda: getattr(ref, method)(**kwargs))
    assert expected is not None and expected[0] is ValueError
    assert _error(lambda: getattr(ours, method)(**kwargs)) == expected


def test_global_rank_without_default_group_fails_as_torch_does():
    assert not dist.is_initialized()
    ours = TensorDict(a=torch.ones(4), batch_size=[4])
    ref = tensordict.TensorDict(a=torch.ones(4), batch_size=[4])
    expected = _error(lambda: ref.send(dst=1))
    assert _error(lambda: ours.send(dst=1)) == expected


def test_a_group_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="ProcessGroup"):
        TensorDict(a=torch.ones(1), batch_size=[1]).send(group=object(), group_dst=0)


def test_package_exports():
    assert tensordict_cpp.TensorDict is TensorDict
    assert callable(tensordict_cpp.stack) and callable(tensordict_cpp.cat)


def test_a_tensordict_inside_itself_is_refused_as_the_reference():
    for lib in (tensordict, tensordict_cpp):
        td = lib.TensorDict(a=torch.zeros(2), batch_size=[2])
        with pytest.raises(ValueError, match=r"Cannot set a tensordict inside itself \(key 'me'\)"):
            td["me"] = td
        with pytest.raises(ValueError, match=r"inside itself \(key \('x', 'y'\)\)"):
            td["x", "y"] = td
    # Through a chain, which the reference lets through and then loops on: refused here.
    a, b = TensorDict(), TensorDict()
    a["b"] = b
    with pytest.raises(ValueError, match="contain themselves"):
        b["a"] = a
    assert repr(a) == "TensorDict(batch_size=[], fields={b: {}})"


@pytest.mark.parametrize("keys", [["a.b", "a"], ["a", "a.b"]])
def test_unflatten_keys_that_would_overwrite_raise_as_the_reference(keys):
    for lib in (tensordict, tensordict_cpp):
        td = lib.TensorDict({k: torch.full((1,), float(i)) for i, k in enumerate(keys)})
        with pytest.raises(KeyError, match=r"override an existing for unflattened key \('a', 'b'\)"):
            td.unflatten_keys(".")


def test_a_batch_size_beyond_int64_is_refused():
    with pytest.raises(ValueError, match="more elements than int64 can count"):
        TensorDict(batch_size=[2 ** 40, 2 ** 40])
