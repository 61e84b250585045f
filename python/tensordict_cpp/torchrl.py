"""torchrl integration: a ``WeightSyncScheme`` over :class:`~tensordict_cpp.Publisher` /
:class:`~tensordict_cpp.Subscriber`, for torchrl's multi-process collectors.

>>> from torchrl.collectors import MultiSyncCollector
>>> from tensordict_cpp.torchrl import TensorDictCppWeightSyncScheme
>>> collector = MultiSyncCollector([make_env] * 4, policy, frames_per_batch=200, total_frames=-1,
...                                weight_sync_schemes={"policy": TensorDictCppWeightSyncScheme()})
>>> for batch in collector:
...     train(policy, batch)
...     collector.update_policy_weights_()  # one publish; returns once every worker applied it

How it works (torchrl 0.14's scheme hooks):

* trainer, ``init_on_sender`` (before the workers start): a ``torch.distributed.TCPStore``
  master on ``host`` (a free port), for ``num_workers + 1`` ranks. Only its host and port
  travel to the workers (the scheme is pickled into each one's arguments).
* trainer, ``connect``: a standalone ``ProcessGroupGloo`` on that store (rank 0), built while
  checking that the workers are alive, then a ``Publisher`` and the initial weights (version 1).
* worker ``i``, ``connect`` (inside the worker's collector construction, its policy on the
  meta device): a store client, the group (rank ``i + 1``), a ``Subscriber``, a first pull into
  a new TensorDict written into the policy out of place (``to_module``: the meta Parameters
  become real ones; in place for a policy already real), then a daemon thread that pulls in
  place into ``TensorDict.from_module(policy, as_module=True)``, whose leaves *are* the
  policy's Parameters: a pull updates the live module, with one whole version.
  After each version it tells the worker's collector, as torchrl's own schemes do: a leaf
  torchrl ``Collector`` whose policy *is* the module just updated gets ``increment_version()``
  (its ``policy_version``, when ``track_policy_version`` is on), which is all its
  ``update_policy_weights_`` would add to a copy of the policy onto itself (that copy cost
  ~21 ms per update for a 600-leaf policy); any other context gets
  ``update_policy_weights_``. Then it acknowledges the version on the store.
* trainer, ``send`` (``collector.update_policy_weights_()``): one ``publish`` of the weights
  (the trainer's policy, read with ``TensorDict.from_module`` at that moment: ours, where
  torchrl's extraction would return just that), whatever the number of workers; with
  ``sync=True`` it returns once every worker acknowledged a version at least as new
  (``timeout``), with ``sync=False`` at once. It reads the acknowledgements in one store round
  trip, every 50 us at first, then every 1 ms at most.

Versions: ``scheme.version`` is the last version published (trainer) or applied (worker);
:meth:`TensorDictCppWeightSyncScheme.worker_versions` gives each worker's on the trainer.

Zero-copy workers: where the build's ``Subscriber.pull`` takes ``zero_copy=True`` (shared-memory
publication, docs/publication.md) and the worker shares the trainer's host, the worker thread
pulls with it (see the scheme's ``zero_copy`` argument for when): no bytes are copied, the
policy's Parameters (the same objects) become views of the slot where the trainer's publish
wrote the version, and the worker pins that slot until its next pull, so the trainer never
rewrites it under the worker (a publish takes another slot, or waits up to ``timeout`` naming
the pinning workers). What such a worker sees:

* its weights are read-only: the mapping is, so a write into them (an optimiser step, a
  ``copy_`` or ``load_state_dict`` into the policy, a forward that updates a buffer in place)
  faults that worker (SIGSEGV) and changes nothing that the trainer or the other workers read;
  build the scheme with ``zero_copy=False`` for such a worker;
* a pull moves them from one whole version to the next (a forward running meanwhile in
  another thread may read some leaves of each, as with a copy: see Thread safety), and no
  leaf ever changes between pulls;
* a trainer that dies leaves the views readable (the last version); the thread's next pull
  reports it (``poll_interval``) and the thread stops;
* a structure change (other keys or shapes) first gives the Parameters memory of their own
  again, then goes on by copy; the pin lasts until the next pull or the worker's exit.

Without it (today's builds, or another host), each pull copies the version into the Parameters.

Thread safety: the worker thread writes (or, zero-copy, re-points) the policy's parameters
while the worker may be running it. With ``MultiSyncCollector`` and ``sync=True`` the update
lands while the workers wait for the next batch request, so no rollout sees it partly; with
``MultiAsyncCollector`` (or ``sync=False``) a rollout step may run while the leaves are being
copied, as with torchrl's own multiprocess scheme, whose receiver thread updates the policy in
place the same way.

Shutdown: torchrl's ``collector.shutdown()`` leaves the schemes alone; call
``scheme.shutdown()`` after it to close the Publisher now (else at exit or garbage collection).
The workers stop their thread at exit.

Importing this module imports torchrl; ``import tensordict_cpp`` never does.
"""
from __future__ import annotations

import atexit
import datetime
import inspect
import logging
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme

from tensordict_cpp import errors
from tensordict_cpp._td import TensorDict
from tensordict_cpp.publication import Publisher, Subscriber

try:  # how torchrl 0.14's prepare_weights finds the model in its context
    from torchrl.weight_update.utils import _resolve_model
except ImportError:  # pragma: no cover - another torchrl: its prepare_weights only
    _resolve_model = None

try:  # torchrl >= 0.14 registers backends by name (WeightSyncScheme.from_backend)
    from torchrl.weight_update.weight_sync_schemes import register_weight_sync_backend
except ImportError:  # pragma: no cover - older torchrl
    register_weight_sync_backend = None

__all__ = ["TensorDictCppWeightSyncScheme"]

logger = logging.getLogger(__name__)

_EXTRA_STATE = "__extra_state__"  # torchrl's key for a module's get_extra_state()
# Per-process state that never travels to a worker (the scheme is pickled into its arguments).
_RUNTIME = ("_store", "_group", "_publisher", "_subscriber", "_params", "_params_owner",
            "_buffer", "_direct", "_lock", "_atexit_hook", "_cascade_failed", "_failed",
            "_acked_once", "_cascade_route", "_zero_copy")


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def _leaf_schema(td: Any) -> list:
    return sorted((k if isinstance(k, tuple) else (k,), tuple(v.shape), v.dtype)
                  for k, v in td.items(include_nested=True, leaves_only=True))


def _split_extra(td: TensorDict) -> tuple[TensorDict, dict | None]:
    """``td`` without torchrl's ``__extra_state__`` entry, and that entry as a flat dict."""
    if _EXTRA_STATE not in td.keys():
        return td, None
    extra = td.get(_EXTRA_STATE)
    flat = {".".join(k) if isinstance(k, tuple) else k: v.clone()
            for k, v in extra.items(include_nested=True, leaves_only=True)}
    return td.exclude(_EXTRA_STATE), flat


def _publishable(weights: Any) -> Any:
    """What :meth:`Publisher.publish` takes, from what ``prepare_weights`` returns."""
    if isinstance(weights, torch.nn.Module):
        return TensorDict.from_module(weights)
    if isinstance(weights, dict):  # the "state_dict" strategy: dotted keys
        out = TensorDict({}, batch_size=[])
        for name, value in weights.items():
            out[tuple(name.split("."))] = value
        return out
    return weights  # ours, a TensorDictParams, a tensorclass or the reference's TensorDict


def _pull_takes_zero_copy(sub: Subscriber) -> bool:
    """Whether this build's ``Subscriber.pull`` has the ``zero_copy`` keyword (shared-memory
    publication, docs/publication.md); the older ones pull by copy only."""
    try:
        return "zero_copy" in inspect.signature(sub.pull).parameters
    except (TypeError, ValueError):
        return False


def _updates_only_itself(context: Any, model: Any) -> bool:
    """Whether ``context`` is a leaf torchrl ``Collector`` (a multi-process collector's worker)
    whose ``update_policy_weights_(model_id=, policy_or_weights=)`` would copy the weights onto
    ``model`` itself, then ``increment_version()``: torchrl 0.14's ``_maybe_fallback_update``
    into ``_policy_w_state_dict`` (torchrl/collectors/_single.py), with no scheme or updater of
    its own that the call would drive."""
    return (isinstance(model, torch.nn.Module)
            and getattr(context, "_policy_w_state_dict", None) is model
            and not getattr(context, "_weight_sync_schemes", None)
            and getattr(context, "_weight_updater", None) is None
            and callable(getattr(context, "increment_version", None))
            and callable(getattr(type(context), "_maybe_fallback_update", None)))


class TensorDictCppWeightSyncScheme(WeightSyncScheme):
    """Synchronises one model from the trainer to a multi-process collector's workers through a
    :class:`~tensordict_cpp.Publisher` (see the module's documentation for the steps).

    Args:
        strategy (str, optional): torchrl's extraction strategy on the trainer, ``"tensordict"``
            or ``"state_dict"``. Defaults to ``"tensordict"``.

    Keyword Args:
        sync (bool, optional): ``send`` (``update_policy_weights_``) returns once every worker
            (or those of ``worker_ids``) applied the version. ``False``: it returns once the
            version is published; the workers take it as soon as their thread gets to it.
            Defaults to ``True``.
        timeout (float, optional): seconds ``send`` waits for the acknowledgements (and for a
            free slot). Defaults to 60.
        connect_timeout (float, optional): seconds the rendezvous and the first version may
            take (the workers start, import torchrl and build their environments meanwhile).
            Defaults to 120.
        poll_interval (float, optional): how long one pull of the worker thread waits before it
            looks at its stop flag; no bound on the latency of an update. Defaults to 0.5.
        max_slots (int, optional): the Publisher's slots. Defaults to 2.
        host (str, optional): the store's address; the workers are on this machine. Defaults to
            ``"127.0.0.1"``.
        background (bool, optional): start the worker thread. ``False``: the worker applies a
            version only in :meth:`receive`, which torchrl's worker loop never calls. Defaults to
            ``True``.
        num_workers (int, optional): the number of receivers when ``init_on_sender`` has no
            collector (``context``) to read it from. Defaults to ``None``.
        zero_copy (bool, optional): whether a worker's pulls make its policy's Parameters
            read-only views of the version where the trainer wrote it (see the module's
            documentation), where its Subscriber can (``pull(..., zero_copy=True)``, a worker
            on the trainer's host). ``None``: for a policy without buffers only (a forward may
            write its buffers, e.g. BatchNorm's running statistics). ``True``: also with
            buffers (none is ever written). ``False``: always by copy (a worker that writes
            its policy's weights). Defaults to ``None``.
    """

    def __init__(self, strategy: str = "tensordict", *, sync: bool = True,
                 timeout: float = 60.0, connect_timeout: float = 120.0,
                 poll_interval: float = 0.5, max_slots: int = 2, host: str = "127.0.0.1",
                 background: bool = True, num_workers: int | None = None,
                 zero_copy: bool | None = None) -> None:
        super().__init__(strategy=strategy)
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be positive, got {poll_interval}")
        self.sync = bool(sync)
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.poll_interval = float(poll_interval)
        self.max_slots = int(max_slots)
        self.host = host
        self.background = bool(background)
        self.num_workers = num_workers
        self.zero_copy = zero_copy
        self._port: int | None = None
        self._init_runtime()

    def _init_runtime(self) -> None:
        for name in _RUNTIME:
            setattr(self, name, None)
        self._lock = threading.RLock()
        self._direct = False
        self._cascade_failed = False
        self._acked_once = set()
        self._zero_copy = False

    # ---- pickling: only the configuration and the store's address travel -------------------

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        for name in _RUNTIME:
            state.pop(name, None)
        state["_weights"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._init_runtime()

    def create_transport(self, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} publishes through one Publisher and "
                                  f"uses no per-worker transport")

    # ---- the group ----------------------------------------------------------------------------

    @property
    def _world_size(self) -> int:
        return int(self.num_workers) + 1

    def _group_options(self) -> Any:
        timeout = _timedelta(max(self.timeout, self.connect_timeout))
        gloo = dist.ProcessGroupGloo
        try:
            options = gloo._Options()
            options._devices = [gloo.create_device(hostname=self.host)]
            options._timeout = timeout
            return options
        except (AttributeError, RuntimeError, TypeError):  # another torch: its default device
            return timeout

    def _new_group(self, rank: int) -> Any:
        return dist.ProcessGroupGloo(dist.PrefixStore("tensordict_cpp/group", self._store), rank,
                                     self._world_size, self._group_options())

    def _new_group_watching_workers(self) -> Any:
        """The trainer's group: it forms once every worker joined (in its ``connect``); a worker
        that dies first is named at once instead of after ``connect_timeout``."""
        built: dict = {}

        def build() -> None:
            try:
                built["group"] = self._new_group(0)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                built["error"] = e

        thread = threading.Thread(target=build, daemon=True, name="TensorDictCppRendezvous")
        thread.start()
        procs = getattr(self.context, "procs", None) or []
        while thread.is_alive():
            thread.join(0.05)
            for i, proc in enumerate(procs):
                if thread.is_alive() and proc.exitcode is not None:
                    self._failed = (f"worker {i} exited (code {proc.exitcode}) before joining "
                                    f"the weight-sync group")
                    if getattr(self.context, "pipes", None) is not None:
                        # A torchrl collector: it reads the worker's own error (and traceback)
                        # from its pipe next, a better report than this one.
                        logger.warning("%s: %s", type(self).__name__, self._failed)
                        return None
                    raise RuntimeError(f"{type(self).__name__}: {self._failed}")
        if "error" in built:
            raise built["error"]
        return built["group"]

    # ---- trainer ------------------------------------------------------------------------------

    def _init_on_sender_impl(self, *, model_id: str = "policy", context: Any = None,
                             ctx: Any = None, model: Any = None, weights: Any = None,
                             num_workers: int | None = None, **kwargs: Any) -> None:
        self.model_id = model_id
        if context is not None:
            self.context = context
        if model is not None:
            self.model = model
        if weights is not None:
            self.weights = weights
        if num_workers is not None:
            self.num_workers = num_workers
        elif context is not None and getattr(context, "num_workers", None) is not None:
            self.num_workers = context.num_workers
        if self.num_workers is None or int(self.num_workers) < 1:
            raise ValueError(f"{type(self).__name__}.init_on_sender: the number of workers is "
                             f"unknown: pass a collector as context, or num_workers")
        self._store = dist.TCPStore(self.host, 0, self._world_size, is_master=True,
                                    wait_for_workers=False,
                                    timeout=_timedelta(self.connect_timeout))
        self._port = self._store.port
        self._register_atexit()

    def _setup_connection_and_weights_on_sender_impl(self, *, worker_idx: int | None = None,
                                                     weights: Any = None) -> None:
        self._group = self._new_group_watching_workers()
        if self._group is None:
            return  # a worker died: the collector reports it (send() refuses)
        self._publisher = Publisher(group=self._group, max_slots=self.max_slots)
        # Version 1: each worker's connect is waiting for it (no acknowledgement awaited: the
        # workers go on initialising).
        self._publish(weights if weights is not None else getattr(self, "_weights", None))

    def _model_to_read(self, weights: Any) -> torch.nn.Module | None:
        """The module whose weights torchrl's ``prepare_weights`` would return as
        ``TensorDict.from_module(module)`` alone (the "tensordict" strategy, no extra state of
        the module's own), else None."""
        if _resolve_model is None or getattr(self._strategy, "extract_as", None) != "tensordict":
            return None
        if isinstance(weights, torch.nn.Module):
            model = weights
        elif weights is None and self.context is not None:
            try:  # as prepare_weights resolves it
                model = _resolve_model(self.context, self._model_id)
            except (AttributeError, KeyError):
                return None
        else:
            return None
        if not isinstance(model, torch.nn.Module) or \
                type(model).get_extra_state is not torch.nn.Module.get_extra_state:
            return None
        return model

    def _publish(self, weights: Any) -> int:
        model = self._model_to_read(weights)
        if model is not None:
            # The same leaves read with ours: no reference TensorDict built and then converted
            # (600 leaves: ~1.2 ms of each update).
            return self._publisher.publish(TensorDict.from_module(model), timeout=self.timeout)
        prepared = self.prepare_weights(weights=weights, model_id=self._model_id,
                                        strategy=self._strategy, context=self.context)
        if prepared is None:
            model = self.model
            if model is None:
                raise RuntimeError(f"{type(self).__name__}: no weights given and no model "
                                   f"{self._model_id!r} to read them from")
            prepared = self._strategy.extract_weights(model)
        return self._publisher.publish(_publishable(prepared), timeout=self.timeout)

    def send(self, weights: Any = None, worker_ids: int | list[int] | None = None) -> None:
        """Publishes ``weights`` (default: the model's, read now) once for every worker; with
        ``sync``, waits until each worker of ``worker_ids`` (default: all) applied it.

        Every worker receives every version: ``worker_ids`` selects only whose acknowledgement
        is awaited (one publication cannot hold per-worker weights)."""
        if not self.initialized_on_sender:
            raise RuntimeError("Must be initialized on sender before sending weights")
        if not self.synchronized_on_sender:
            raise RuntimeError("Must be synchronized on sender before sending weights")
        self._require_sender("send")
        version = self._publish(weights)
        if self.sync:
            self.wait_for_workers(version, worker_ids=worker_ids, timeout=self.timeout)

    def _applied(self, workers: Any) -> dict[int, int | None]:
        """The version each of ``workers`` acknowledged last (None: none yet): one store round
        trip for those that have acknowledged once (a ``get`` of a missing key would wait for
        it), one more per worker that had not yet."""
        workers = sorted(workers)
        known = self._acked_once
        for i in workers:
            if i not in known and self._store.check([f"applied/{i}"]):
                known.add(i)
        have = [i for i in workers if i in known]
        values = self._store.multi_get([f"applied/{i}" for i in have]) if have else []
        got = dict.fromkeys(workers)
        got.update((i, int(v)) for i, v in zip(have, values))
        return got

    def worker_versions(self) -> dict[int, int | None]:
        """Trainer: the version each worker applied last (None: none yet)."""
        self._require_sender("worker_versions")
        return self._applied(range(int(self.num_workers)))

    def stats(self) -> list[dict]:
        """Trainer: :meth:`Publisher.stats`, each entry with its ``worker`` index added (its
        ``version`` is the last the worker *received*; :meth:`worker_versions` what it
        applied)."""
        self._require_sender("stats")
        return [dict(s, worker=s["rank"] - 1) for s in self._publisher.stats()]

    def wait_for_workers(self, version: int | None = None, *,
                         worker_ids: int | list[int] | None = None,
                         timeout: float | None = None) -> None:
        """Trainer: waits until the workers (or those of ``worker_ids``) applied ``version``
        (default: the last published) or a newer one.

        Raises:
            TimeoutError: (:class:`tensordict_cpp.errors.TimeoutError`) after ``timeout``
                seconds (default: the scheme's), naming the workers and their versions.
            PeerLostError: when a waited-for worker's connection broke.
            RuntimeError: when a waited-for worker process exited.
        """
        self._require_sender("wait_for_workers")
        version = self._publisher.version if version is None else int(version)
        if worker_ids is None:
            pending = set(range(int(self.num_workers)))
        else:
            pending = {worker_ids} if isinstance(worker_ids, int) else set(worker_ids)
        timeout = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        procs = getattr(self.context, "procs", None) or []
        # A worker acknowledges within ~1 ms of the publish when it is idle (a pull and its
        # copy): poll often at first, then at most every 1 ms (one store round trip, ~10-80 us,
        # for every pending worker), so that the wait adds little to the acknowledgement.
        pause = 0.00005
        while True:
            got = self._applied(pending)
            pending = {i for i in pending if (got[i] or 0) < version}
            if not pending:
                return
            for s in self._publisher.stats():
                if s["lost"] and s["rank"] - 1 in pending:
                    raise errors.PeerLostError(f"{type(self).__name__}: worker {s['rank'] - 1} "
                                               f"was lost before applying version {version}: "
                                               f"{s['error']}")
            for i in pending:
                if i < len(procs) and procs[i].exitcode is not None:
                    raise RuntimeError(f"{type(self).__name__}: worker {i} exited (code "
                                       f"{procs[i].exitcode}) before applying version {version}")
            if time.monotonic() > deadline:
                got = {i: got[i] for i in sorted(pending)}
                raise errors.TimeoutError(f"{type(self).__name__}: workers {sorted(pending)} did "
                                          f"not apply version {version} within {timeout} s "
                                          f"(their versions: {got})")
            time.sleep(pause)
            pause = min(pause * 2, 0.001)

    def _require_sender(self, call: str) -> None:
        if self._publisher is None:
            why = f" ({self._failed})" if self._failed else ""
            raise RuntimeError(f"{type(self).__name__}.{call}: only on the trainer, after "
                               f"connect(){why}")

    # ---- worker -------------------------------------------------------------------------------

    def _init_on_receiver_impl(self, *, model_id: str, context: Any = None, model: Any = None,
                               worker_idx: int | None = None, **kwargs: Any) -> None:
        self.model_id = model_id
        if context is not None:
            self.context = context
        if model is not None:
            self.model = model
        if worker_idx is not None:
            self._worker_idx = worker_idx

    def _setup_connection_and_weights_on_receiver_impl(self, *,
                                                       worker_idx: int | None = None) -> None:
        if worker_idx is None:
            worker_idx = self._worker_idx
        if worker_idx is None:
            raise ValueError(f"{type(self).__name__}.connect: the worker index is unknown")
        if self._port is None:
            raise RuntimeError(f"{type(self).__name__}.connect: this scheme was not initialised "
                               f"on the trainer (no store address)")
        self._worker_idx = worker_idx
        self._store = dist.TCPStore(self.host, self._port, self._world_size, is_master=False,
                                    timeout=_timedelta(self.connect_timeout))
        self._group = self._new_group(worker_idx + 1)
        self._subscriber = Subscriber(src=0, group=self._group)
        first = self._subscriber.pull(timeout=self.connect_timeout)
        if first is None:
            raise errors.TimeoutError(f"{type(self).__name__}: worker {worker_idx} got no "
                                      f"weights within {self.connect_timeout} s")
        with self._lock:
            self._apply_first(first)
            self._zero_copy = self._choose_zero_copy()
        self._acknowledge(self._subscriber.version)
        self._register_atexit()
        if self.background:
            self._start_background_receiver()

    def _apply_first(self, weights: TensorDict) -> None:
        """Writes the first version into the model (out of place when its Parameters are on
        the meta device), then picks the route of the next ones: straight into its Parameters
        when the versions hold exactly its leaves, through a buffer otherwise."""
        model = self._model_or_none()
        if not isinstance(model, torch.nn.Module):
            self._buffer, self._direct = weights, False
            return
        params, extra = _split_extra(weights)
        live = TensorDict.from_module(model, as_module=True)
        if any(t.is_meta for t in live.values(include_nested=True, leaves_only=True)):
            # torchrl sends the policy to its workers on the meta device: the first version
            # becomes its Parameters (as torchrl's schemes do, out of place).
            params.to_module(model, inplace=False)
            live = TensorDict.from_module(model, as_module=True)
        else:  # a real policy (a policy_factory's): its Parameters keep their identity
            with torch.no_grad():
                live.update_(params)
        if extra is not None:
            model.set_extra_state(extra)
        self._params, self._params_owner = live, weakref.ref(model)
        # The direct route pulls into the module's own Parameters: the versions must hold
        # exactly its leaves. Otherwise each version lands in a buffer, copied in afterwards.
        self._direct = extra is None and _leaf_schema(live) == _leaf_schema(weights)
        self._buffer = None if self._direct else weights

    def _model_or_none(self) -> Any:
        try:
            return self.model
        except AttributeError:
            return None

    def _live_params(self, model: torch.nn.Module) -> TensorDict:
        """The module's parameters as a TensorDictParams; when torchrl swapped the model (its
        collector copied the policy to another device), the new one's, brought up to date."""
        owner = self._params_owner() if self._params_owner is not None else None
        if owner is not model:
            live = TensorDict.from_module(model, as_module=True)
            if self._params is not None:
                with torch.no_grad():
                    live.update_(self._params)
            self._params, self._params_owner = live, weakref.ref(model)
        return self._params

    def _pull_and_apply(self, timeout: float | None) -> int | None:
        """One pull: the version now in the model, or None when none came within ``timeout``."""
        with self._lock:
            sub = self._subscriber
            model = self._model_or_none()
            if self._direct and isinstance(model, torch.nn.Module):
                try:
                    version = self._pull_direct(sub, self._live_params(model), timeout)
                except errors.SchemaMismatchError:
                    self._direct = False  # the trainer changed its weights' structure
                    self._stop_zero_copy()
                else:
                    if version is not None:
                        self._applied_now(version)
                    return version
            version = None
            if self._buffer is not None:
                try:
                    version = sub.pull(self._buffer, timeout=timeout)
                except errors.SchemaMismatchError:
                    self._buffer = None
            if self._buffer is None:
                got = sub.pull(timeout=timeout)
                if got is None:
                    return None
                self._buffer, version = got, sub.version
            if version is None:
                return None
            if isinstance(model, torch.nn.Module):
                self._copy_buffer_into(model)
            self._applied_now(version)
            return version

    def _pull_direct(self, sub: Subscriber, live: TensorDict, timeout: float | None) -> Any:
        """A pull into the model's own Parameters: zero-copy when chosen, else by copy."""
        if not self._zero_copy:
            return sub.pull(live, timeout=timeout)
        try:
            return sub.pull(live, timeout=timeout, zero_copy=True)
        except (TypeError, ValueError, NotImplementedError) as e:
            # A Subscriber that takes the keyword but cannot map the trainer's memory (over a
            # socket, another host) may refuse it: by copy from now on.
            if isinstance(e, errors.MalformedPeerDataError) or "zero" not in str(e).lower():
                raise
            logger.info("%s: worker %s pulls by copy: %s", type(self).__name__,
                        self._worker_idx, e)
            self._stop_zero_copy()
            return sub.pull(live, timeout=timeout)

    def _choose_zero_copy(self) -> bool:
        """Whether the direct route's pulls are zero-copy (see ``zero_copy``)."""
        model = self._model_or_none()
        if self.zero_copy is False or not self._direct or not isinstance(model, torch.nn.Module):
            return False
        if not _pull_takes_zero_copy(self._subscriber):
            return False  # a build without shared-memory publication
        context = self.context
        if context is not None and hasattr(context, "update_policy_weights_") and \
                not _updates_only_itself(context, model):
            return False  # its update_policy_weights_ may write into the policy
        if self.zero_copy is None and next(iter(model.buffers()), None) is not None:
            return False
        return True

    def _stop_zero_copy(self) -> None:
        """Gives the policy's leaves memory of their own again (the same Parameter objects,
        ``.data`` swapped for a copy) before any pull by copy, which would unpin the slot they
        view (free then to hold a later version) and write into read-only memory. The slot is
        still pinned here: a pull that refuses leaves its TensorDict, views included, as it
        was."""
        if not self._zero_copy:
            return
        self._zero_copy = False
        if self._params is not None:
            with torch.no_grad():
                for leaf in self._params.values(include_nested=True, leaves_only=True):
                    leaf.data = leaf.detach().clone()

    def _copy_buffer_into(self, model: torch.nn.Module) -> None:
        params, extra = _split_extra(self._buffer)
        live = self._live_params(model)
        with torch.no_grad():
            live.update_(params)
        if extra is not None:
            model.set_extra_state(extra)

    def _applied_now(self, version: int) -> None:
        self._cascade()
        self._acknowledge(version)

    def _cascade(self) -> None:
        """As torchrl's schemes: the worker's collector takes the update (policy_version)."""
        context = self.context
        if context is None or not hasattr(context, "update_policy_weights_"):
            return
        model = self._model_or_none()
        if _updates_only_itself(context, model):
            # Its update_policy_weights_ would copy the model onto itself (600 leaves: ~21 ms a
            # worker, ~90 ms of each update with 4 workers on 2 cores; and a write into a
            # zero-copy view) before it bumps the version: the bump is all it adds.
            context.increment_version()
            self._cascade_route = "increment_version"
            return
        self._cascade_route = "update_policy_weights_"
        try:
            if isinstance(model, torch.nn.Module):
                import tensordict  # the reference torchrl runs on

                weights = tensordict.TensorDict.from_module(model)
            else:
                weights = self._buffer
            context.update_policy_weights_(model_id=self._model_id or "policy",
                                           policy_or_weights=weights)
        except Exception as e:  # noqa: BLE001 - the weights are in; only bookkeeping failed
            if not self._cascade_failed:
                self._cascade_failed = True
                logger.warning("%s: the worker collector's update_policy_weights_ failed (%s); "
                               "its policy_version may lag", type(self).__name__, e)
            increment = getattr(context, "increment_version", None)
            if callable(increment):
                increment()

    def _acknowledge(self, version: int) -> None:
        self._store.set(f"applied/{self._worker_idx}", str(version))

    def _background_receive_loop(self) -> None:
        stop = self._stop_event
        while not stop.is_set():
            try:
                self._pull_and_apply(self.poll_interval)
            except errors.NoPublisherError as e:
                if stop.is_set():
                    break
                if "closed" in str(e):
                    logger.debug("%s: the publisher closed; worker %s stops receiving",
                                 type(self).__name__, self._worker_idx)
                    break
                logger.warning("%s: %s", type(self).__name__, e)
            except errors.PeerLostError as e:
                if not stop.is_set():
                    logger.warning("%s: worker %s lost the trainer: %s", type(self).__name__,
                                   self._worker_idx, e)
                break
            except Exception as e:  # noqa: BLE001 - keep receiving, but never spin
                if stop.is_set():
                    break
                logger.warning("%s: worker %s could not apply a version: %s",
                               type(self).__name__, self._worker_idx, e)
                stop.wait(self.poll_interval)

    def _wait_for_instruction(self, timeout: float | None = None) -> str | None:
        return "receive"  # the loop above pulls; a pull is its own wait

    def receive(self, timeout: float | None = None) -> Any:
        """Worker: pulls a newer version (waiting up to ``timeout`` s; None: until one comes) and
        applies it; returns the weights (the model's parameters), or None when none came. The
        background thread, if any, may take a version first: each version is applied once."""
        if not self.initialized_on_receiver or self._subscriber is None:
            raise RuntimeError("Must be initialized and connected on receiver before receiving")
        if self._pull_and_apply(timeout) is None:
            return None
        return self._buffer if self._buffer is not None else self._params

    # ---- both sides ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The last version published (trainer) or applied (worker); 0 before the first."""
        if self._publisher is not None:
            return self._publisher.version
        if self._subscriber is not None:
            return self._subscriber.version
        return getattr(self, "_final", (0, 0))[0]  # after shutdown: the last one

    @property
    def epoch(self) -> int:
        """The Publisher's epoch (trainer), or that of the version applied (worker); 0 before
        connect."""
        if self._publisher is not None:
            return self._publisher.epoch
        if self._subscriber is not None:
            return self._subscriber.epoch
        return getattr(self, "_final", (0, 0))[1]

    def _register_atexit(self) -> None:
        # Stop the worker thread and close the Publisher while the interpreter still runs, so
        # that no C++ wait outlives it. Weakly: a dropped scheme is not kept alive by this.
        if self._atexit_hook is None:
            ref = weakref.ref(self)

            def hook() -> None:
                scheme = ref()
                if scheme is not None:
                    scheme.shutdown()

            self._atexit_hook = hook
            atexit.register(hook)

    def shutdown(self) -> None:
        """Stops the worker thread, closes the Publisher, drops the group and the store.
        Idempotent."""
        super().shutdown()
        if getattr(self, "_publisher", None) is not None or \
                getattr(self, "_subscriber", None) is not None:
            self._final = (self.version, self.epoch)
        publisher = getattr(self, "_publisher", None)
        if publisher is not None:
            try:
                publisher.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        hook = getattr(self, "_atexit_hook", None)
        if hook is not None:
            try:
                atexit.unregister(hook)
            except Exception:  # noqa: BLE001
                pass
        for name in ("_publisher", "_subscriber", "_group", "_atexit_hook"):
            if hasattr(self, name):
                setattr(self, name, None)
        # The store last: the master serves the workers' acknowledgements until here.
        if hasattr(self, "_store"):
            self._store = None


if register_weight_sync_backend is not None:
    register_weight_sync_backend("tensordict_cpp")(TensorDictCppWeightSyncScheme)
