"""tensordict_cpp.tensorclass: local behaviour (fields, defaults, indexing, repr against the
reference's, misuse), the class-name registry, every transfer between our processes, and
interop with the reference's @tensorclass (per-leaf and consolidated transfers, init_remote /
broadcast carrying "_tensorclass_type" both ways). Multi-process tests run through
tensordict_cpp.distributed.run (spawn, a FileStore per run, Gloo on 127.0.0.1)."""
import asyncio
import dataclasses
import functools
import inspect
import os
import sys
import textwrap
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

import tensordict
from reference_peer import REFERENCES, on_reference
from tensordict_cpp import set_printoptions as tdc_set_printoptions
from tensordict_cpp import TensorDict, TensorDictPipe, is_tensorclass, tensorclass
from tensordict_cpp.distributed import run
from tensordict_cpp.tensorclass import _resolve_tensorclass_type

TC_MODULE = sys.modules["tensordict_cpp.tensorclass"]  # `tensordict_cpp.tensorclass` is the decorator
RUN = dict(timeout=150, group_timeout=20)



@tensorclass
class Pose:
    q: torch.Tensor


@tensorclass
class Sample:
    obs: torch.Tensor
    reward: torch.Tensor
    pose: Pose
    mask: Optional[torch.Tensor] = None


@tensorclass
class Labelled:
    obs: torch.Tensor
    label: str
    meta: dict = None
    step: int = 0


@tensorclass
class Forward:
    child: "ForwardChild"  # defined below: resolved on first use
    x: torch.Tensor


@tensorclass
class ForwardChild:
    y: torch.Tensor


def sample(fill, batch=3, mask=False):
    out = Sample(obs=torch.full((batch, 4), float(fill)),
                 reward=torch.full((batch,), float(fill), dtype=torch.float64),
                 pose=Pose(q=torch.full((batch, 2), fill, dtype=torch.int64), batch_size=[batch]),
                 batch_size=[batch])
    if mask:
        out.mask = torch.full((batch,), bool(fill))
    return out


def placeholder():
    """A Sample without batch dimensions: a broadcast receiver's handle, not used."""
    return sample(0, batch=1)[0]


def check(x, fill, batch=3):
    assert type(x) is Sample, type(x)
    assert type(x.pose) is Pose
    assert x.batch_size == torch.Size([batch])
    assert x.obs.dtype == torch.float32 and (x.obs == fill).all(), x.obs
    assert x.reward.dtype == torch.float64 and (x.reward == fill).all(), x.reward
    assert x.pose.q.dtype == torch.int64 and (x.pose.q == fill).all(), x.pose.q


# ---- local behaviour -------------------------------------------------------------------------
def test_fields_defaults_and_attributes():
    s = sample(1)
    assert is_tensorclass(s) and is_tensorclass(Sample) and not is_tensorclass(TensorDict)
    assert s.batch_size == s.shape == torch.Size([3]) and s.device is None and len(s) == 3
    assert s.mask is None and "mask" not in s.keys()  # None: no entry, as in the reference
    assert s.keys() == ["obs", "reward", "pose"]     # declaration order
    assert isinstance(s._tensordict, TensorDict) and s._tensordict["obs"] is s.obs
    s.mask = torch.ones(3, dtype=torch.bool)
    assert s.keys() == ["obs", "reward", "pose", "mask"] and s.get("mask").all()
    s.mask = None
    assert "mask" not in s.keys()
    s.obs = torch.zeros(3, 4)
    assert (s["obs"] == 0).all() and (s._tensordict["obs"] == 0).all()
    s["reward"] = torch.full((3,), 7.0, dtype=torch.float64)
    assert (s.reward == 7).all()
    assert s.get(("pose", "q")).shape == (3, 2) and s["pose", "q"].dtype == torch.int64
    # Positional, in declaration order; device.
    p = Sample(torch.ones(2, 4), torch.ones(2), Pose(torch.ones(2, 2), batch_size=[2]),
               batch_size=[2], device="cpu")
    assert p.device == torch.device("cpu") and p.pose.q.shape == (2, 2)
    assert [f.name for f in dataclasses.fields(Sample)] == ["obs", "reward", "pose", "mask"]
    assert list(inspect.signature(Sample).parameters) == [
        "obs", "reward", "pose", "mask", "batch_size", "device"]
    s.batch_size = [3]
    assert s.batch_size == torch.Size([3])


def test_defaults_factories_post_init_and_inheritance():
    @tensorclass
    class WithDefaults:
        x: torch.Tensor
        y: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(2))
        z: Optional[torch.Tensor] = None

        def __post_init__(self):
            self.x = self.x * 2

    w = WithDefaults(torch.ones(2), batch_size=[2])
    assert (w.x == 2).all() and (w.y == 0).all() and w.z is None
    assert WithDefaults.z is None  # the default, on the class, as dataclasses leave it

    @tensorclass
    class Child(WithDefaults):
        extra: Optional[torch.Tensor] = None

    c = Child(torch.ones(2), extra=torch.ones(2), batch_size=[2])
    assert type(c[0]) is Child and (c.x == 2).all() and c.keys() == ["x", "y", "extra"]


def test_init_false_forward_references_and_any_fields():
    @tensorclass
    class Derived:
        x: torch.Tensor
        twice: torch.Tensor = dataclasses.field(init=False)
        anything: Any = None

        def __post_init__(self):
            self.twice = self.x * 2

    d = Derived(torch.ones(2), batch_size=[2])
    assert (d.twice == 2).all() and "twice" not in inspect.signature(Derived).parameters
    # Any: the value decides the kind.
    d.anything = torch.zeros(2)
    assert isinstance(d.anything, torch.Tensor)
    d.anything = TensorDict(z=torch.zeros(2), batch_size=[2])
    assert isinstance(d.anything, TensorDict)
    d.anything = sample(1, batch=2)  # a tensorclass in an Any field reads back as a TensorDict
    assert type(d.anything) is TensorDict and (d.anything["obs"] == 1).all()
    d.anything = "text"
    assert d.anything == "text" and d._tensordict.is_non_tensor("anything")
    d.anything = None
    assert "anything" not in d.keys()

    f = Forward(child=ForwardChild(y=torch.ones(2), batch_size=[2]), x=torch.ones(2),
                batch_size=[2])
    assert type(f.child) is ForwardChild and type(f[0].child) is ForwardChild
    with pytest.raises(TypeError, match="Forward.child expects a ForwardChild"):
        f.child = torch.ones(2)


def test_in_place_methods_return_the_instance():
    s = sample(1)
    assert s.fill_("obs", 3.0) is s and (s.obs == 3).all()
    assert s.update(sample(4)) is s and (s.reward == 4).all() and type(s.pose) is Pose
    assert s.lock_() is s and s.is_locked and s.unlock_() is s and not s.is_locked
    assert s.apply(lambda t: t + 1).obs[0, 0] == 5 and type(s.apply(lambda t: t)) is Sample


def test_batch_indexing_iteration_clone_to_eq():
    s = sample(1, mask=True)
    row = s[1]
    assert type(row) is Sample and row.batch_size == torch.Size([]) and row.obs.shape == (4,)
    assert type(row.pose) is Pose and row.pose.q.shape == (2,)
    assert type(s[1:]) is Sample and s[1:].batch_size == torch.Size([2])
    assert s[torch.tensor([True, False, True])].batch_size == torch.Size([2])
    s[0] = sample(5, mask=True)[0]
    assert (s.obs[0] == 5).all() and (s.obs[1] == 1).all() and (s.pose.q[0] == 5).all()
    assert [type(r) for r in s] == [Sample] * 3
    assert len(s.unbind(0)) == 3 and type(s.unbind(0)[2]) is Sample

    c = s.clone()
    assert type(c) is Sample and type(c.pose) is Pose
    c.obs.zero_()
    assert (s.obs[1] == 1).all()  # independent
    d = s.to(torch.float64)
    assert type(d) is Sample and d.obs.dtype == torch.float64 and d.pose.q.dtype == torch.float64
    assert type(s.to("cpu")) is Sample and s.to("cpu").device == torch.device("cpu")

    eq = s == s.clone()
    assert type(eq) is Sample and eq.obs.dtype == torch.bool and eq.all()
    assert not (s != s.clone()).any()
    assert not (s == sample(9, mask=True)).obs.any()
    with pytest.raises(RuntimeError, match="boolean value"):
        bool(s)
    assert Sample.__hash__ is None

    st = torch.stack([sample(1), sample(2)])
    assert type(st) is Sample and st.batch_size == torch.Size([2, 3]) and (st.obs[1] == 2).all()
    assert type(torch.cat([sample(1), sample(2)])) is Sample
    assert s.zero_() is s and (s.obs == 0).all()


def test_from_tensordict_to_tensordict():
    s = sample(2)
    td = s.to_tensordict()
    assert type(td) is TensorDict and td["pose", "q"].shape == (3, 2)
    td["obs"].zero_()
    assert (s.obs == 2).all()  # a copy
    back = Sample.from_tensordict(td)
    assert type(back) is Sample and type(back.pose) is Pose and back._tensordict is td  # no copy
    assert back.mask is None
    # Errors name the key at fault.
    with pytest.raises(ValueError, match="key 'zzz' is not a field of Sample"):
        Sample.from_tensordict(TensorDict(obs=torch.zeros(3, 4), zzz=torch.ones(3),
                                          batch_size=[3]))
    with pytest.raises(ValueError, match="field 'reward' is missing"):
        Sample.from_tensordict(TensorDict(obs=torch.zeros(3, 4), batch_size=[3]))
    bad = s.to_tensordict()
    del bad["pose", "q"]
    bad["pose", "r"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"key 'r' \(in 'pose'\) is not a field of Pose"):
        Sample.from_tensordict(bad)
    bad = s.to_tensordict()
    bad["reward"] = TensorDict(x=torch.zeros(3), batch_size=[3])
    with pytest.raises(TypeError, match="field 'reward' is annotated Tensor but holds TensorDict"):
        Sample.from_tensordict(bad)
    with pytest.raises(TypeError, match="expected a tensordict_cpp.TensorDict"):
        Sample.from_tensordict({"obs": torch.zeros(3, 4)})
    # A reference TensorDict is taken without a copy: writes land in its tensors.
    ref_td = sample(3).to_tensordict().to_reference()
    from_ref = Sample.from_tensordict(ref_td)
    assert type(from_ref) is Sample and type(from_ref.pose) is Pose
    from_ref.obs.fill_(9)
    assert (ref_td["obs"] == 9).all()
    with pytest.raises(ValueError, match="field 'reward' is missing"):
        Sample.from_tensordict(tensordict.TensorDict(obs=torch.zeros(3, 4), batch_size=[3]))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(foo=1), TypeError, "unexpected keyword argument 'foo'"),
    (dict(obx=1), TypeError, "Did you mean 'obs'"),
    (dict(drop="reward"), TypeError, "missing required field.*'reward'"),
    (dict(obs="not a tensor"), TypeError, "Sample.obs expects a torch.Tensor, got str"),
    (dict(obs=None), TypeError, "Sample.obs cannot be None"),
    (dict(pose=torch.zeros(3, 2)), TypeError, "Sample.pose expects a Pose"),
    (dict(obs=torch.zeros(2, 4)), ValueError, "Sample.obs: batch size mismatch"),
])
def test_constructor_misuse_names_the_field(kwargs, error, match):
    args = dict(obs=torch.zeros(3, 4), reward=torch.zeros(3),
                pose=Pose(q=torch.zeros(3, 2), batch_size=[3]))
    args.pop(kwargs.pop("drop", None), None)
    with pytest.raises(error, match=match):
        Sample(**{**args, **kwargs}, batch_size=[3])


def test_attribute_misuse():
    s = sample(1)
    with pytest.raises(AttributeError, match="Cannot set the attribute 'foo': Sample has no such field"):
        s.foo = 1
    with pytest.raises(TypeError, match="Sample.reward expects a torch.Tensor, got float"):
        s.reward = 1.0
    with pytest.raises(TypeError, match="Sample.pose cannot be None"):
        s.pose = None
    with pytest.raises(KeyError, match="'nope' is not a field of Sample"):
        s.set("nope", torch.zeros(3))
    with pytest.raises(TypeError, match="too many|takes 4 positional"):
        Sample(1, 2, 3, 4, 5)
    with pytest.raises(TypeError, match="multiple values for field 'obs'"):
        Sample(torch.zeros(3, 4), obs=torch.zeros(3, 4))
    with pytest.raises(AttributeError, match="'batch_size' can't be used with @tensorclass"):
        @tensorclass
        class Bad:
            batch_size: torch.Tensor
    with pytest.raises(AttributeError, match="'send' can't be used"):
        @tensorclass
        class Bad2:
            send: torch.Tensor
    # A nested field accepts a TensorDict with the nested class's fields (checked).
    s.pose = TensorDict(q=torch.ones(3, 2), batch_size=[3])
    assert type(s.pose) is Pose
    with pytest.raises(ValueError, match="key 'w' is not a field of Pose"):
        s.pose = TensorDict(w=torch.ones(3, 2), batch_size=[3])


def test_repr_matches_the_reference():
    @tensordict.tensorclass
    class RefPose:
        q: torch.Tensor

    @tensordict.tensorclass
    class RefSample:
        obs: torch.Tensor
        reward: torch.Tensor
        pose: RefPose
        mask: Optional[torch.Tensor] = None
        extra: tensordict.TensorDict = None

    @tensorclass
    class OurSample:
        obs: torch.Tensor
        reward: torch.Tensor
        pose: Pose
        mask: Optional[torch.Tensor] = None
        extra: TensorDict = None

    def build(cls, pose_cls, td_cls, **kw):
        return cls(obs=torch.zeros(3, 4), reward=torch.ones(3, dtype=torch.float64),
                   pose=pose_cls(q=torch.zeros(3, 2, dtype=torch.int64), batch_size=[3]),
                   batch_size=[3], **kw)

    cases = [dict(), dict(extra=True, device="cpu")]
    for kw in cases:
        ref_kw = dict(kw)
        if ref_kw.pop("extra", False):
            ref_kw["extra"] = tensordict.TensorDict(x=torch.ones(3, 1), batch_size=[3])
        our_kw = dict(kw)
        if our_kw.pop("extra", False):
            our_kw["extra"] = TensorDict(x=torch.ones(3, 1), batch_size=[3])
        ref = build(RefSample, RefPose, tensordict.TensorDict, **ref_kw)
        ours = build(OurSample, Pose, TensorDict, **our_kw)
        with tensordict.set_printoptions(compact=False), tdc_set_printoptions(compact=False):
            want = repr(ref).replace("RefSample(", "OurSample(").replace("RefPose(", "Pose(")
            assert repr(ours) == want
            assert repr(ours[0]) == repr(ref[0]).replace("RefSample(", "OurSample(").replace(
                "RefPose(", "Pose(")


def test_non_tensor_fields():
    x = Labelled(obs=torch.zeros(3, 2), label="train", meta={"a": [1, 2]}, batch_size=[3])
    assert x.label == "train" and x.meta == {"a": [1, 2]} and x.step == 0
    assert x.keys() == ["obs", "label", "meta", "step"]
    assert x._tensordict.get_non_tensor("label") == "train"
    assert x._tensordict.is_non_tensor("step")  # an int field is data, not a tensor
    x.label = "eval"
    x.step = 5
    assert x.label == "eval" and x.step == 5
    x.meta = None
    assert x.meta is None and "meta" not in x.keys()
    assert x[1].label == "eval" and type(x[1]) is Labelled  # indexing keeps non-tensor data
    c = x.clone()
    assert c.label == "eval" and c.step == 5
    back = Labelled.from_tensordict(x.to_tensordict())
    assert back.label == "eval" and back.step == 5
    with tdc_set_printoptions(compact=False):
        assert "label=NonTensorData(data=eval, batch_size=torch.Size([3]), device=None)" in repr(x)
    assert "label: str" in repr(x)
    with pytest.raises(TypeError, match="Labelled.label is annotated str .*got Tensor"):
        x.label = torch.zeros(3)
    with pytest.raises(TypeError, match="Labelled.meta: .*"):
        x.meta = {"a": {1, 2}}  # a set is not JSON-like: the TensorDict's error, with the field
    td = x.to_tensordict()
    td["label"] = torch.zeros(3)  # a tensor where non-tensor data belongs
    with pytest.raises(TypeError, match="field 'label' is annotated str but holds tensor"):
        Labelled.from_tensordict(td)


def test_transfer_methods_forward_with_our_signatures():
    for name in ("send", "recv", "isend", "irecv", "all_gather", "scatter", "all_reduce",
                 "reduce", "consolidate"):
        ours = inspect.signature(getattr(Sample, name))
        want = inspect.signature(getattr(TensorDict, name))
        assert ours == want, name
    # The reference's tensorclass signatures; receivers' extra keywords go through **kwargs.
    assert list(inspect.signature(Sample.init_remote).parameters) == [
        "self", "dst", "group", "device", "use_broadcast"]
    assert list(inspect.signature(Sample.from_remote_init).parameters) == [
        "src", "group", "device", "use_broadcast", "kwargs"]
    assert list(inspect.signature(Sample.broadcast).parameters) == [
        "self", "src", "group", "device", "kwargs"]
    assert inspect.iscoroutinefunction(Sample.asend) and inspect.iscoroutinefunction(Sample.arecv)


# ---- the registry ----------------------------------------------------------------------------
def write_module(directory, name, body):
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture
def scratch_modules(tmp_path, monkeypatch):
    """A directory on sys.path; the modules imported from it are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("tc_"):
            del sys.modules[name]


def test_registry_resolves_known_classes_without_importing(monkeypatch):
    def no_import(name, *args, **kwargs):
        raise AssertionError(f"imported {name}")

    monkeypatch.setattr(TC_MODULE.importlib, "import_module", no_import)
    assert _resolve_tensorclass_type(f"{__name__}.Sample", False) is Sample
    assert _resolve_tensorclass_type(f"{__name__}.Pose", True) is Pose  # known: no import

    def local():
        @tensorclass
        class Local:
            x: torch.Tensor
        return Local

    cls = local()
    assert _resolve_tensorclass_type(f"{__name__}.{cls.__qualname__}", False) is cls
    assert "<locals>" in cls.__qualname__


def test_registry_main_and_mp_main_stand_for_each_other():
    cls = tensorclass(type("MainOnly", (), {"__module__": "__main__", "__qualname__": "MainOnly",
                                             "__annotations__": {"x": torch.Tensor}}))
    assert _resolve_tensorclass_type("__main__.MainOnly", False) is cls
    assert _resolve_tensorclass_type("__mp_main__.MainOnly", False) is cls


def test_registry_unknown_name_is_an_error_and_imports_nothing(scratch_modules):
    marker = scratch_modules / "imported"
    write_module(scratch_modules, "tc_sidefx", f"""
        open({str(marker)!r}, "w").close()
        import torch
        from tensordict_cpp import tensorclass

        @tensorclass
        class Evil:
            x: torch.Tensor
        """)
    with pytest.raises(ValueError, match=r"'tc_sidefx.Evil' is not a tensordict_cpp tensorclass "
                                         r"known in this process; define or import it first, "
                                         r"or pass allow_import=True"):
        _resolve_tensorclass_type("tc_sidefx.Evil", False)
    assert not marker.exists() and "tc_sidefx" not in sys.modules
    # With allow_import=True the module is imported and registers the class.
    cls = _resolve_tensorclass_type("tc_sidefx.Evil", True)
    assert marker.exists() and cls.__name__ == "Evil" and is_tensorclass(cls)
    assert _resolve_tensorclass_type("tc_sidefx.Evil", False) is cls  # now known


def test_registry_allow_import_checks_what_it_finds(scratch_modules):
    write_module(scratch_modules, "tc_plain", """
        import torch
        import tensordict

        class NotOne:
            pass

        @tensordict.tensorclass
        class RefOnly:
            x: torch.Tensor

        class Outer:
            class Inner:
                pass
        """)
    with pytest.raises(ValueError, match="names .*NotOne.*which is not a tensordict_cpp tensorclass"):
        _resolve_tensorclass_type("tc_plain.NotOne", True)
    with pytest.raises(ValueError, match="RefOnly.*not a tensordict_cpp tensorclass"):
        _resolve_tensorclass_type("tc_plain.RefOnly", True)  # the reference's, not ours
    with pytest.raises(ValueError, match="not a tensordict_cpp tensorclass"):
        _resolve_tensorclass_type("tc_plain.Outer.Inner", True)  # a nested qualname is walked
    with pytest.raises(ValueError, match="module 'tc_plain' has no 'Missing'"):
        _resolve_tensorclass_type("tc_plain.Missing", True)
    with pytest.raises(ValueError, match="no module of that name"):
        _resolve_tensorclass_type("tc_nowhere_at_all.X", True)
    with pytest.raises(ValueError, match="cannot be imported"):
        _resolve_tensorclass_type("tc_plain.f.<locals>.X", True)
    write_module(scratch_modules, "tc_broken", "raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="importing 'tc_broken' .*failed: RuntimeError: boom"):
        _resolve_tensorclass_type("tc_broken.X", True)


@pytest.mark.parametrize("bad", ["", 3, None, "x" * 5000])
def test_registry_rejects_malformed_names(bad):
    with pytest.raises(ValueError, match="invalid tensorclass name"):
        _resolve_tensorclass_type(bad, True)


# ---- the pipe (one process, UCX on loopback) -------------------------------------------------
def test_pipe_asend_arecv_and_send_recv(monkeypatch):
    from tensordict_cpp import _C

    if not hasattr(_C, "Pipe"):
        pytest.skip("built without the UCX pipe")
    for key, value in (("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo"),
                       ("UCX_WARN_UNUSED_ENV_VARS", "n")):
        monkeypatch.setenv(key, value)

    async def main():
        server = await TensorDictPipe.listen(0, "127.0.0.1", timeout=10.0)
        async with await TensorDictPipe.connect("127.0.0.1", server.port, timeout=10.0) as client:
            async with server:
                await sample(3).asend(client)
                got = await placeholder().arecv(server)
                assert type(got) is Sample  # the reference's tensorclass returns a TensorDict
                check(got, 3)
                sample(4).send(client)
                got = placeholder().recv(server)
                assert type(got) is Sample
                check(got, 4)

    asyncio.run(asyncio.wait_for(main(), 30))


# ---- our processes -----------------------------------------------------------------------------
def ours_transfers(rank, world_size):
    torch.set_num_threads(1)
    # Per-leaf, with init_tag and pseudo-random tags; recv returns the last tag (3 leaves + mask).
    for kw in ({}, {"init_tag": 5}, {"init_tag": 3, "pseudo_rand": True}):
        if rank == 0:
            assert sample(1, mask=True).send(dst=1, **kw) is None
        else:
            x = sample(0, mask=True)
            last = x.recv(src=0, **kw)
            check(x, 1)
            assert x.mask.all()
            if not kw.get("pseudo_rand"):
                assert last == kw.get("init_tag", 0) + 3

    # isend(return_early) / irecv(return_premature), then the blocking forms.
    if rank == 0:
        works = sample(2).isend(dst=1, init_tag=100, return_early=True)
        assert len(works) == 3
        for w in works:
            w.wait()
        assert sample(3).isend(dst=1, init_tag=7) == 7 + 2
    else:
        x = sample(0)
        works = x.irecv(src=0, init_tag=100, return_premature=True)
        assert len(works) == 3
        for w in works:
            w.wait()
        check(x, 2)
        assert x.irecv(src=0, init_tag=7) is None
        check(x, 3)

    # Consolidated: one message into a consolidated instance of the same layout.
    if rank == 0:
        sample(4).send(dst=1, consolidated=True)
        c = sample(5).consolidate()
        assert type(c) is Sample and c.is_consolidated()
        c.send(dst=1, consolidated=True)
    else:
        target = sample(0).consolidate()
        assert type(target) is Sample and type(target.pose) is Pose
        assert target.recv(src=0, consolidated=True) is None
        check(target, 4)
        target.recv(src=0, consolidated=True)
        check(target, 5)

    # init_remote, then the steady state into the received instance.
    if rank == 0:
        src = sample(6).consolidate()
        src.init_remote(dst=1)
        src.obs.fill_(7)
        src.reward.fill_(7)
        src.pose.q.fill_(7)
        src.send(dst=1, consolidated=True)
    else:
        got = Sample.from_remote_init(src=0)
        assert got.is_consolidated()
        check(got, 6)
        ptr = got._tensordict._cpp.consolidated_storage().data_ptr()
        got.recv(src=0, consolidated=True)
        check(got, 7)
        assert got._tensordict._cpp.consolidated_storage().data_ptr() == ptr
    if rank == 1:
        sample(8).init_remote(use_broadcast=True)
    else:
        check(Sample.from_remote_init(src=1, use_broadcast=True), 8)

    # broadcast: the receivers hold a placeholder; every rank gets a Sample back.
    for root in (0, 1):
        out = (sample(10 + root) if rank == root else placeholder()).broadcast(src=root)
        assert out.is_consolidated()
        check(out, 10 + root)

    # all_gather and scatter return instances (the reference's tensorclass: TensorDicts).
    outs = sample(20 + rank).all_gather()
    assert len(outs) == 2 and all(type(o) is Sample for o in outs)
    for r, out in enumerate(outs):
        check(out, 20 + r)
    tds = [sample(30), sample(31)] if rank == 1 else None
    out = placeholder().scatter(src=1, tensordicts=tds)
    assert type(out) is Sample
    check(out, 30 + rank)

    # all_reduce and reduce, in place.
    x = sample(rank + 2)
    x.all_reduce()
    check(x, 5)
    x = sample(rank + 2)
    for work in x.all_reduce(op=dist.ReduceOp.PRODUCT, async_op=True):
        work.wait()
    check(x, 6)
    x = sample(rank + 2)
    x.reduce(1)
    if rank == 1:
        check(x, 5)
    dist.barrier()


def test_transfers_between_our_processes():
    run(ours_transfers, world_size=2, **RUN)


def ours_class_name_on_the_wire(rank, world_size):
    torch.set_num_threads(1)
    # TensorDict.from_remote_init / broadcast on a plain handle give back the class named on
    # the wire, found in this process's registry.
    if rank == 0:
        sample(1).init_remote(dst=1)
        sample(2).broadcast(src=0)
    else:
        got = TensorDict.from_remote_init(src=0)
        check(got, 1)
        check(TensorDict({}, []).broadcast(src=0), 2)
    dist.barrier()


def test_class_name_on_the_wire_between_our_processes():
    run(ours_class_name_on_the_wire, world_size=2, **RUN)


def ours_non_tensor(rank, world_size):
    torch.set_num_threads(1)
    mine = Labelled(obs=torch.full((3, 2), float(rank)), label=f"rank{rank}", step=rank,
                    batch_size=[3])
    # Per-leaf: non-tensor data never travels (the receiver keeps its own), as in the reference.
    if rank == 0:
        mine.send(dst=1)
    else:
        mine.recv(src=0)
        assert (mine.obs == 0).all() and mine.label == "rank1" and mine.step == 1
    # init_remote and broadcast carry it in the metadata.
    if rank == 0:
        mine.init_remote(dst=1)
    else:
        got = Labelled.from_remote_init(src=0)
        assert type(got) is Labelled and got.label == "rank0" and got.step == 0
    mine = Labelled(obs=torch.full((3, 2), 5.0 + rank), label=f"rank{rank}", meta={"r": [rank]},
                    batch_size=[3])
    out = mine.broadcast(src=1)
    assert type(out) is Labelled and (out.obs == 6).all()
    assert out.label == "rank1" and out.meta == {"r": [1]} and out.step == 0
    dist.barrier()


def test_non_tensor_fields_between_our_processes():
    run(ours_non_tensor, world_size=2, **RUN)


# ---- interop with the reference's @tensorclass -------------------------------------------------
def main_class(decorator, name="MyDistData", fields=None):
    """``__main__.<name>`` with ``fields`` (default: tensors a, b), made by ``decorator`` (ours
    or the reference's) and reachable as an attribute of this process's ``__main__`` (where the
    reference's receiver imports it from)."""
    fields = fields or {"a": torch.Tensor, "b": torch.Tensor}
    cls = type(name, (), {"__module__": "__main__", "__qualname__": name,
                          "__annotations__": fields})
    cls = decorator(cls)
    setattr(sys.modules["__main__"], name, cls)
    return cls


def dist_data(cls, a, b, batch=3):
    return cls(a=torch.full((batch,), float(a)), b=torch.full((batch, 2), float(b)),
               batch_size=[batch])


def check_dist_data(x, cls, a, b):
    assert type(x) is cls, type(x)
    assert (x.a == a).all() and (x.b == b).all(), (x.a, x.b)


REF = 0  # rank 0 runs the reference, rank 1 ours


def interop_transfers(rank, world_size):
    torch.set_num_threads(1)
    peer = 1 - rank
    if rank == REF:
        from tensordict import tensorclass as decorator
    else:
        decorator = tensorclass
    MyDistData = main_class(decorator)

    # Per-leaf, both directions, with and without pseudo-random tags.
    for sender in (0, 1):
        for kw in ({}, {"init_tag": 4, "pseudo_rand": True}):
            if rank == sender:
                dist_data(MyDistData, 1 + sender, 2 + sender).send(dst=peer, **kw)
            else:
                x = dist_data(MyDistData, 0, 0)
                x.recv(src=peer, **kw)
                check_dist_data(x, MyDistData, 1 + sender, 2 + sender)
    # isend -> irecv, both directions.
    for sender in (0, 1):
        if rank == sender:
            dist_data(MyDistData, 3, 4).isend(dst=peer, init_tag=20)
        else:
            x = dist_data(MyDistData, 0, 0)
            x.irecv(src=peer, init_tag=20)
            check_dist_data(x, MyDistData, 3, 4)
    # Consolidated, both directions: both consolidate in declaration (insertion) order.
    for sender in (0, 1):
        if rank == sender:
            dist_data(MyDistData, 42, 99).send(dst=peer, consolidated=True)
        else:
            x = dist_data(MyDistData, 0, 0).consolidate()
            assert type(x) is MyDistData and x.is_consolidated()
            x.recv(src=peer, consolidated=True)
            check_dist_data(x, MyDistData, 42, 99)

    # The collectives on tensorclasses of both libraries.
    outs = dist_data(MyDistData, rank, rank + 10).all_gather()
    for r, out in enumerate(outs):
        assert (out["a"] == r).all() and (out["b"] == r + 10).all()
    tds = [dist_data(MyDistData, r, r) for r in range(2)] if rank == 1 else None
    out = dist_data(MyDistData, 0, 0).scatter(src=1, tensordicts=tds)
    assert (out["a"] == rank).all() and (out["b"] == rank).all()
    x = dist_data(MyDistData, 1, 1)
    x.all_reduce()
    check_dist_data(x, MyDistData, 2, 2)
    x = dist_data(MyDistData, rank + 2, rank + 2)
    x.reduce(0)
    if rank == 0:
        check_dist_data(x, MyDistData, 5, 5)
    dist.barrier()


@pytest.mark.parametrize("reference", REFERENCES)
def test_interop_transfers_with_the_reference(reference):
    run(on_reference(reference, interop_transfers), world_size=2, **RUN)


def interop_nested_tensorclass(rank, world_size):
    torch.set_num_threads(1)
    # The reference's metadata names a nested tensorclass node's class itself (STACK_GLOBAL of
    # __main__.NestLeaf): our reader keeps it as an inert name and rebuilds a nested TensorDict.
    if rank == REF:
        from tensordict import TensorDict as TD
        from tensordict import tensorclass as decorator
    else:
        TD = TensorDict
        decorator = tensorclass
    Leaf = main_class(decorator, "NestLeaf", {"q": torch.Tensor})
    Holder = main_class(decorator, "NestHolder", {"x": torch.Tensor, "leaf": Leaf})

    def holder(fill):
        return Holder(x=torch.full((3,), float(fill)),
                      leaf=Leaf(q=torch.full((3, 2), fill, dtype=torch.int64), batch_size=[3]),
                      batch_size=[3])

    def check_plain(got, fill):
        assert type(got) is TensorDict and got.batch_size == torch.Size([3])
        inner = got["inner"]
        assert type(inner) is TensorDict, type(inner)
        assert inner["q"].dtype == torch.int64 and (inner["q"] == fill).all()
        assert (got["y"] == fill).all()

    def check_holder(got, fill):
        assert type(got) is Holder, type(got)
        assert type(got.leaf) is Leaf, type(got.leaf)
        assert (got.x == fill).all() and (got.leaf.q == fill).all()

    if rank == REF:
        def plain(fill):
            return TD(inner=Leaf(q=torch.full((3, 2), fill, dtype=torch.int64), batch_size=[3]),
                      y=torch.full((3,), float(fill)), batch_size=[3])

        plain(1).init_remote(dst=1)        # a plain TensorDict holding a tensorclass
        holder(2).init_remote(dst=1)       # a tensorclass with a nested tensorclass field
        holder(3).init_remote(dst=1)
        plain(4).broadcast(src=0)
        holder(5).broadcast(src=0)
    else:
        check_plain(TensorDict.from_remote_init(src=0), 1)
        check_holder(TensorDict.from_remote_init(src=0), 2)  # "_tensorclass_type" names ours
        check_holder(Holder.from_remote_init(src=0), 3)
        check_plain(TensorDict({}, []).broadcast(src=0), 4)
        check_holder(holder(0)[0].broadcast(src=0), 5)
    dist.barrier()


def test_interop_nested_tensorclass_from_the_reference():
    run(interop_nested_tensorclass, world_size=2, **RUN)


def interop_class_name(modules_dir, rank, world_size):
    torch.set_num_threads(1)
    peer = 1 - rank
    # Each rank gets its own tc_peer / tc_sidefx modules: the reference's classes on rank 0,
    # ours on rank 1 (where tc_sidefx must never be imported).
    sys.path.insert(0, os.path.join(modules_dir, "ref" if rank == REF else "ours"))
    if rank == REF:
        from tensordict import TensorDict as TD
        from tensordict import tensorclass as decorator
    else:
        TD = TensorDict
        decorator = tensorclass
    MyDistData = main_class(decorator)

    # init_remote, both directions: the receiver's TensorDict.from_remote_init returns ITS
    # MyDistData (the reference's TestTensorclassInitRemote), then the steady state (its
    # TestTensorclassSendConsolidated).
    for sender in (0, 1):
        if rank == sender:
            x = dist_data(MyDistData, 1, 2)
            x.init_remote(dst=peer)
            x.a.fill_(42)
            x.b.fill_(99)
            x.send(dst=peer, consolidated=True)
        else:
            got = TD.from_remote_init(src=peer)
            check_dist_data(got, MyDistData, 1, 2)
            assert got.is_consolidated()
            got.recv(src=peer, consolidated=True)
            check_dist_data(got, MyDistData, 42, 99)
    # Our class method gives the same.
    if rank == REF:
        dist_data(MyDistData, 5, 6).init_remote(dst=1)
    else:
        check_dist_data(MyDistData.from_remote_init(src=0), MyDistData, 5, 6)
    # init_remote(use_broadcast=True) and broadcast, both directions (the reference's
    # TestInitRemoteBroadcast / TestTensorclassBroadcast).
    for root in (0, 1):
        if rank == root:
            dist_data(MyDistData, 7, 8).init_remote(use_broadcast=True)
        else:
            check_dist_data(TD.from_remote_init(src=root, use_broadcast=True), MyDistData, 7, 8)
        mine = dist_data(MyDistData, 9, 10) if rank == root else dist_data(MyDistData, 0, 0, 1)[0]
        check_dist_data(mine.broadcast(src=root), MyDistData, 9, 10)

    # Non-tensor fields travel in the metadata, both ways (the reference's TestInitRemoteNonTensor).
    Tagged = main_class(decorator, "Tagged", {"obs": torch.Tensor, "label": str, "step": int})
    for sender in (0, 1):
        if rank == sender:
            Tagged(obs=torch.full((3,), float(sender)), label=f"from {sender}", step=sender,
                   batch_size=[3]).init_remote(dst=peer)
        else:
            got = TD.from_remote_init(src=peer)
            assert type(got) is Tagged and (got.obs == sender).all()
            assert got.label == f"from {sender}" and got.step == sender

    # A class this process does not know: ValueError, and its module is never imported.
    if rank == REF:
        from tc_sidefx import Evil

        Evil(x=torch.ones(3), batch_size=[3]).init_remote(dst=1)
        Evil(x=torch.ones(3), batch_size=[3]).broadcast(src=0)
    else:
        with pytest.raises(ValueError, match="'tc_sidefx.Evil' is not a tensordict_cpp "
                                             "tensorclass known in this process"):
            TensorDict.from_remote_init(src=0)
        with pytest.raises(ValueError, match="'tc_sidefx.Evil' is not a tensordict_cpp"):
            TensorDict({}, []).broadcast(src=0)
        assert "tc_sidefx" not in sys.modules
        assert not os.path.exists(os.path.join(modules_dir, "imported"))
    # allow_import=True: the receiver imports its own module of that name.
    if rank == REF:
        from tc_peer import PeerData

        PeerData(x=torch.full((3,), 3.0), batch_size=[3]).init_remote(dst=1)
    else:
        assert "tc_peer" not in sys.modules
        got = TensorDict.from_remote_init(src=0, allow_import=True)
        assert type(got).__module__ == "tc_peer" and is_tensorclass(got)
        assert (got.x == 3).all()
    dist.barrier()


def write_peer_modules(root):
    for side, (imp, deco) in {"ref": ("import tensordict", "tensordict.tensorclass"),
                              "ours": ("import tensordict_cpp", "tensordict_cpp.tensorclass")}.items():
        directory = root / side
        directory.mkdir()
        write_module(directory, "tc_peer", f"""
            import torch
            {imp}

            @{deco}
            class PeerData:
                x: torch.Tensor
            """)
        prelude = "" if side == "ref" else f"open({str(root / 'imported')!r}, 'w').close()\n"
        write_module(directory, "tc_sidefx", prelude + textwrap.dedent(f"""
            import torch
            {imp}

            @{deco}
            class Evil:
                x: torch.Tensor
            """))


def test_interop_class_name_on_the_wire(tmp_path):
    write_peer_modules(tmp_path)
    run(functools.partial(interop_class_name, str(tmp_path)), world_size=2, **RUN)
