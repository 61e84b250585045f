"""The transfer bindings of tensordict_cpp._C name their arguments: help() shows the real
signature, and a misspelt keyword is a TypeError (not a silently ignored option)."""
import datetime
import re

import pytest
import torch
import torch.distributed as dist

from tensordict_cpp import TensorDict, _C

P2P = ["td", "group", "init_tag", "pseudo_rand", "consolidated", "checked", "timeout"]

SIGNATURES = {
    "send": P2P + ["dst", "group_dst"],
    "isend": P2P + ["dst", "group_dst"],
    "isend_early": P2P + ["dst", "group_dst"],
    "recv": P2P + ["src", "group_src", "late"],
    "irecv": P2P + ["src", "group_src", "late"],
    "irecv_premature": P2P + ["src", "group_src", "late"],
    "init_remote": ["td", "group_dst", "group", "device", "use_broadcast", "_tensorclass_type",
                    "timeout"],
    "from_remote_init": ["group_src", "group", "device", "use_broadcast", "max_total_bytes",
                         "timeout", "late"],
    "broadcast": ["td", "group_src", "group", "device", "max_total_bytes", "_tensorclass_type",
                  "timeout"],
    "all_gather": ["td", "group", "max_total_bytes", "timeout"],
    "scatter": ["group_src", "tensordicts", "group", "device", "max_total_bytes", "timeout"],
    "all_reduce": ["td", "op", "async_op", "group", "timeout", "bucket_bytes", "check_buckets"],
    "reduce": ["td", "group_dst", "op", "async_op", "return_premature", "group", "timeout",
               "bucket_bytes", "check_buckets"],
}


def _signature(fn) -> str:
    return fn.__doc__.strip().splitlines()[0]


def _defaults(sig: str) -> dict:
    """{name: default text or None} of a rendered pybind11 signature (the type hints' spelling
    varies with the pybind11 version; the names and defaults do not)."""
    params = sig[sig.index("(") + 1:sig.rindex(") ->")]
    out = {}
    for part in re.split(r", (?![^\[]*\])", params):  # not inside typing's brackets
        if part in ("*", "/"):
            continue
        name, _, rest = part.partition(": ")
        out[name] = rest.rpartition(" = ")[2] if " = " in rest else None
    return out


def test_send_shows_its_signature():
    sig = _signature(_C.send)
    assert sig.startswith("send(td: ") and ", *, group: " in sig
    assert _defaults(sig) == {"td": None, "dst": "None", "group": "None", "group_dst": "None",
                              "init_tag": "0", "pseudo_rand": "False", "consolidated": "False",
                              "checked": "False", "timeout": "None"}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_every_transfer_binding_names_its_arguments(name):
    if not _C.has_distributed:
        pytest.skip("built without the c10d layer")
    sig = _signature(getattr(_C, name))
    assert sig.startswith(f"{name}(")
    assert sorted(_defaults(sig)) == sorted(SIGNATURES[name]), sig


def test_pipe_bindings_name_their_arguments():
    if not hasattr(_C, "Pipe"):
        pytest.skip("built without the UCX pipe")
    # max_storage_bytes: None, half of the machine's memory resolved by the pipe (a default that
    # depends on the machine has no place in a signature).
    options = {"consolidated": "True", "timeout": "30.0", "max_metadata_bytes": str(64 << 20),
               "max_storage_bytes": "None", "linger": "0.0", "max_unreceived": "16",
               "spin": "0.0001", "max_unread_bytes": str(64 << 20)}
    for fn, first in [(_C.Pipe.listen, ["port", "host"]), (_C.Pipe.connect, ["host", "port"]),
                      (_C.PipeServer.__init__, ["self", "port", "host"])]:
        sig = _signature(fn)
        assert ", *, consolidated: " in sig, sig
        found = _defaults(sig)
        assert list(found)[:len(first)] == first, sig
        assert {k: found[k] for k in options} == options, sig
    assert list(_defaults(_signature(_C.Pipe.recv))) == ["self", "td", "device"]


def _group():
    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))


def test_a_misspelt_keyword_is_a_type_error():
    td = TensorDict(a=torch.ones(2), batch_size=[2])
    with pytest.raises(TypeError, match="incompatible function arguments"):
        _C.send(td._cpp, None, group=_group(), group_dst=0, init_tagg=3)
    with pytest.raises(TypeError):
        _C.recv(td._cpp, None, group=_group(), group_dst=0)  # recv's is group_src
    with pytest.raises(TypeError):
        _C.all_reduce(td._cpp, dist.ReduceOp(dist.ReduceOp.SUM), asyncop=True)


def test_options_are_keyword_only():
    # Positional options were how the Python layer used to call _C; now a stray positional
    # argument cannot land in the wrong option.
    td = TensorDict(a=torch.ones(2), batch_size=[2])
    with pytest.raises(TypeError):
        _C.send(td._cpp, None, _group(), 0)
