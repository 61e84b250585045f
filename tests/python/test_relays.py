"""Relays (``Publisher(route="chain")``, docs/publication.md), on real processes over Gloo on
127.0.0.1, every subscriber over its socket, each playing a host of its own (the
TENSORDICT_TEST_HOST hook) but where said: a version travels once from the publisher and is
forwarded subscriber to subscriber, each holding every version exactly, the publisher's stats
naming a chain; subscribers of one host read the version from the first one's slots (one that
asks after the route was made too), and one that writes stale bytes there is caught by
checksum; a relay SIGKILLed while its pull waits costs the others that version and none after
it; a relay that forwards stale pieces (the TENSORDICT_TEST_RELAY_STALE hook) is caught by
checksum, its child completing from the publisher and the publisher naming it; thousands of
versions published as fast as possible are never pulled torn or out of order; a version of
48 MiB travels in pieces of more than 1 MiB; and the route's argument errors. Ranks sync
through a TCPStore of their own, never a collective, so that a dead rank stops nobody."""

import os
import queue
import re
import signal
import socket
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import conftest

watchdog = conftest.watchdog(120)


# --- the ranks' harness -----------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, fn, ports, env, results):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # Gloo otherwise binds to the hostname's address
    os.environ.update(env)  # before tensordict_cpp is imported or any pull (test hooks)
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=30))
        store = dist.TCPStore("127.0.0.1", ports[1], world, rank == 0,
                              timeout=timedelta(seconds=30), wait_for_workers=False)
        results.put((rank, "ok", fn(rank, world, store)))
    except BaseException:  # noqa: BLE001 - the parent reports the traceback
        results.put((rank, "error", traceback.format_exc()))
        code = 1
    finally:
        # No group teardown: after a lost peer torch's can abort a rank that has succeeded.
        results.close()
        results.join_thread()
        os._exit(code)


def spawn(fn, world, *, timeout, env=None, expect=None):
    """Runs ``fn(rank, world, store)`` on ``world`` spawned ranks (a Gloo group on a free port,
    and a TCPStore on another for the ranks to sync) and returns {rank: what fn returned}.
    Fails with a rank's traceback as soon as one raises, or when ``timeout`` passes (the ranks
    are killed either way). ``expect``: {rank: exit code} for a rank that dies on purpose."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=_rank_main,
                         args=(r, world, fn, ports, (env or {}).get(r, {}), results))
             for r in range(world)]
    for p in procs:
        p.start()
    got, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs) or not results.empty():
            try:
                rank, kind, value = results.get(timeout=0.05)
                (got if kind == "ok" else errors)[rank] = value
            except queue.Empty:
                pass
            if errors:  # the first error may be another's consequence: a second for the rest
                deadline = min(deadline, time.monotonic() + 2.0)
                if time.monotonic() >= deadline or len(got) + len(errors) == world:
                    break
                continue
            # A rank gone without a word (a crash): fail now, not at a survivor's timeout.
            dead = {r: p.exitcode for r, p in enumerate(procs)
                    if not p.is_alive() and r not in got
                    and p.exitcode != (expect or {}).get(r, 0)}
            if dead and results.empty():
                break
            assert time.monotonic() < deadline, f"ranks still running after {timeout} s: {got}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        while True:  # what came meanwhile
            try:
                rank, kind, value = results.get(timeout=0.2)
                (got if kind == "ok" else errors)[rank] = value
            except queue.Empty:
                break
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    assert not errors, "\n".join([f"exit codes {codes}"]
                                  + [f"rank {r}:\n{tb}" for r, tb in sorted(errors.items())])
    want = {r: (expect or {}).get(r, 0) for r in range(world)}
    assert codes == want, (codes, got)
    return got


def apart(world, extra=None):
    """Each subscriber on a host of its own (the TENSORDICT_TEST_HOST hook), with ``extra``
    {rank: env} besides: otherwise processes of one machine are subscribers of one host, and
    the others read the first one's slots."""
    return {r: {"TENSORDICT_TEST_HOST": f"host{r}", **(extra or {}).get(r, {})}
            for r in range(1, world)} | {0: (extra or {}).get(0, {})}


# --- helpers the ranks share ------------------------------------------------------------------

def route():
    """The publishers' route: "chain", or what TEST_ROUTE says (tests/python/test_trees.py runs
    these ranks with "tree")."""
    return os.environ.get("TEST_ROUTE", "chain")


def stats_of(pub):
    return {s["rank"]: s for s in pub.stats()}


def until(predicate, what, pub, seconds=20.0):
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}: {pub.stats()}"
        time.sleep(0.002)


def await_waiting(pub, ranks, acked):
    """Until each of ``ranks`` holds version ``acked`` and waits for the next: only requests
    that reach the publisher before it makes a version's route are in that route."""
    def ready():
        s = stats_of(pub)
        return all(s[r]["waiting"] and (s[r]["version"] or 0) >= acked for r in ranks)
    until(ready, f"ranks {ranks} to wait with version {acked}", pub)


def await_acked(pub, ranks, version):
    until(lambda: all((stats_of(pub)[r]["version"] or 0) >= version for r in ranks),
          f"ranks {ranks} to hold version {version}", pub)


def publish_version(pub, td, tag, version, ranks):
    """Publishes version ``version`` of round ``tag`` (leaf_values) once every one of ``ranks``
    waits for it, and returns the publisher's stats once they all hold it."""
    for i, leaf in enumerate(td.values()):
        leaf.copy_(leaf_values(tag, version, i))
    await_waiting(pub, ranks, version - 1)
    assert pub.publish(td) == version
    await_acked(pub, ranks, version)
    return stats_of(pub)


def leaves(stats, ranks, version):
    """The ranks left as relays before ``version`` (their ``routed_around`` names an earlier
    version): leaves of its route. Read from the words, since the publisher may hear that a
    relay was left after the acknowledgement of that version."""
    out = set()
    for r in ranks:
        why = stats[r]["routed_around"]
        if why and int(re.search(r"of version (\d+)", why).group(1)) < version:
            out.add(r)
    return out


def assert_route(stats, ranks, version, context=None):
    """The ranks' ``relayed_from`` is a route from the publisher (-1) that reaches each of them,
    with no leaf forwarding. With no leaf, it is one chain: one from the publisher, no relay
    feeding two."""
    every = {r: s["relayed_from"] for r, s in stats.items()}
    parents = {r: every[r] for r in ranks}
    left = leaves(stats, stats, version)
    said = (parents, sorted(left), context)
    assert all(p == -1 or (p in every and p not in left) for p in parents.values()), said
    for r in ranks:  # up to the publisher, through no rank twice
        path, at = [], r
        while at != -1:
            assert at in every and at not in path, said
            path.append(at)
            at = every[at]
    tree = any(s["relayed_second"] is not None for s in stats.values())
    if not left and tree:  # two binary trees: one root each, at most 2 children
        seconds = {r: stats[r]["relayed_second"] for r in ranks}
        for lane in (parents, seconds):
            assert list(lane.values()).count(-1) == 1, (said, seconds)
            assert all(list(lane.values()).count(p) <= 2 for p in ranks), (said, seconds)
        inner = [{p for p in lane.values() if p != -1} for lane in (parents, seconds)]
        assert not inner[0] & inner[1], (said, seconds)  # each forwards in one tree at most
    elif not left:
        assert list(parents.values()).count(-1) == 1, said
        assert len(set(parents.values())) == len(ranks), said


def finish(store, rank, subscribers, pub=None, check=None):
    """The end without a collective: each subscriber says it is done and stays (a relay may
    still be forwarding) until the publisher, having checked its stats, has closed."""
    if pub is None:
        store.set(f"done{rank}", "1")
        store.wait(["closed"], timedelta(seconds=30))
        store.set(f"bye{rank}", "1")
        return
    store.wait([f"done{r}" for r in subscribers], timedelta(seconds=30))
    out = check() if check else None
    pub.close()
    store.set("closed", "1")
    store.wait([f"bye{r}" for r in subscribers], timedelta(seconds=30))
    return out


# --- 1. a chain of three ----------------------------------------------------------------------

LEAVES, N = 4, (1 << 20) // 4  # 4 leaves of 1 MiB (float32)


def leaf_values(tag, v, i, n=N):
    return torch.arange(n, dtype=torch.float32) + tag * 100000 + v * 1000 + i


def relay_rounds(rank, world, store):
    """Five versions, each published once every subscriber waits for it; each subscriber checks
    every version it pulls. Rank 0 returns the publisher's stats after each version."""
    from tensordict_cpp import Publisher, Subscriber, TensorDict
    subs, versions = list(range(1, world)), 5
    td = TensorDict({f"w{i}": torch.zeros(N) for i in range(LEAVES)}, batch_size=[])
    if rank == 0:
        pub = Publisher(max_slots=2, transport="socket", route=route())
        rounds = [publish_version(pub, td, 0, v, subs) for v in range(1, versions + 1)]
        return finish(store, rank, subs, pub, lambda: rounds)
    sub = Subscriber(src=0, transport="socket")
    for v in range(1, versions + 1):
        assert sub.pull(td, timeout=30, min_version=v) == v
        for i, leaf in enumerate(td.values()):
            assert torch.equal(leaf, leaf_values(0, v, i)), (rank, v, i)
    finish(store, rank, subs)
    return sub.routed_around


def routes_of(rounds):
    return [{r: (s["relayed_from"], s["routed_around"]) for r, s in stats.items()}
            for stats in rounds]


def test_a_chain_of_three_holds_every_version_exactly():
    got = spawn(relay_rounds, 4, timeout=60, env=apart(4))
    for v, stats in enumerate(got[0], start=1):
        # A chain; though this 2-core machine now and then makes a relay crawl, and the one it
        # feeds leaves it: a leaf from then on.
        assert_route(stats, [1, 2, 3], v, routes_of(got[0]))


# --- 2. a relay killed while its pull waits ---------------------------------------------------

def relay_killed(rank, world, store):
    from tensordict_cpp import Publisher, Subscriber, TensorDict
    subs, alive, last = list(range(1, world)), list(range(2, world)), 11
    td = TensorDict({f"w{i}": torch.zeros(N) for i in range(LEAVES)}, batch_size=[])
    if rank == 0:
        pub = Publisher(max_slots=2, transport="socket", route=route())
        # Rank 1's request is in before it dies: it would be in the next route.
        await_waiting(pub, subs, 0)
        store.set("seen", "1")
        store.wait(["dying"], timedelta(seconds=20))
        # At once, rank 1 is in the first route, dead: its child leaves it within the version.
        # After 0.3 s the publisher has seen it lost, and it is in no route.
        in_route = os.environ.get("RELAY_KILLED_IN_ROUTE") == "1"
        if not in_route:
            time.sleep(0.3)
        routes = []
        t0 = time.monotonic()
        for v in range(1, last + 1):
            s = publish_version(pub, td, 0, v, alive)
            routes.append({r: (s[r]["relayed_from"], s[r]["routed_around"], s[r]["lost"])
                           for r in subs})
            # The survivors' route (rank 1 is in none once it is lost).
            if not in_route:
                assert_route(s, alive, v, routes)
        took = time.monotonic() - t0

        def check():
            s = stats_of(pub)
            # Rank 1 is named: lost, or left by its child, saying why.
            assert s[1]["lost"] or s[1]["routed_around"], s[1]
            assert s[1]["version"] is None, s[1]
            return routes, took, s[1]
        return finish(store, rank, alive, pub, check)
    sub = Subscriber(src=0, transport="socket")
    if rank == 1:
        threading.Thread(target=sub.pull, args=(td,), kwargs={"timeout": 30}, daemon=True).start()
        store.wait(["seen"], timedelta(seconds=20))
        store.set("dying", "1")
        os.kill(os.getpid(), signal.SIGKILL)
    for v in range(1, last + 1):
        assert sub.pull(td, timeout=30, min_version=v) == v
        for i, leaf in enumerate(td.values()):
            assert torch.equal(leaf, leaf_values(0, v, i)), (rank, v, i)
    finish(store, rank, alive)
    return sub.routed_around


@pytest.mark.parametrize("in_route", [False, True], ids=["before_the_route", "in_the_route"])
def test_a_relay_killed_while_its_pull_waits_costs_the_others_nothing(in_route):
    got = spawn(relay_killed, 4, timeout=40, expect={1: -signal.SIGKILL},
                env=apart(4, {0: {"RELAY_KILLED_IN_ROUTE": "1" if in_route else "0"}}))
    routes, took, rank1 = got[0]
    assert len(routes) == 11 and took < 20, (took, routes)  # each route checked as it came


# --- 3. a relay that forwards stale pieces ----------------------------------------------------

def stale_relay(rank, world, store):
    from tensordict_cpp import Publisher, Subscriber, TensorDict
    subs, rounds, versions = list(range(1, world)), 3, 2
    td = TensorDict({f"w{i}": torch.zeros(N) for i in range(LEAVES)}, batch_size=[])
    seen = []
    for k in range(rounds):
        # A new Publisher on a channel of its own: a new route, where rank 1 is no leaf yet.
        if rank == 0:
            pub = Publisher(max_slots=2, transport="socket", route=route(), channel=k)
            routes = []
            for v in range(1, versions + 1):
                s = publish_version(pub, td, k + 1, v, subs)
                routes.append({r: (s[r]["relayed_from"], s[r]["routed_around"]) for r in subs})
            s = stats_of(pub)
            assert s[1]["routed_around"] is not None, routes
            seen.append(routes)
            store.wait([f"round{k}.{r}" for r in subs], timedelta(seconds=30))
            pub.close()
            store.set(f"closed{k}", "1")
        else:
            sub = Subscriber(src=0, transport="socket", channel=k)
            for v in range(1, versions + 1):
                assert sub.pull(td, timeout=30, min_version=v) == v
                for i, leaf in enumerate(td.values()):
                    assert torch.equal(leaf, leaf_values(k + 1, v, i)), (rank, k, v, i)
            seen.append(sub.routed_around)
            store.set(f"round{k}.{rank}", "1")
            store.wait([f"closed{k}"], timedelta(seconds=30))
    return seen


def test_a_stale_relay_is_caught_by_checksum_and_named():
    got = spawn(stale_relay, 4, timeout=60,
                env=apart(4, {1: {"TENSORDICT_TEST_RELAY_STALE": "1"}}))
    for k, routes in enumerate(got[0]):
        first = routes[0]
        # Version 1's route starts at rank 1; its child took the forged pieces from it.
        assert first[1][0] == -1, (k, routes)
        child = next(r for r, (parent, _) in first.items() if parent == 1)
        left = got[child][k]
        assert any(e.startswith("rank 1 ") and "checksum" in e for e in left), (k, child, left)
        # The publisher names rank 1, left by that child, and makes it a leaf of version 2.
        assert routes[-1][1][1].startswith(f"rank {child} left it"), (k, routes)
        assert all(parent != 1 for parent, _ in routes[-1].values()), (k, routes)


# --- 4. never torn ----------------------------------------------------------------------------

# At least 2,000 versions, and on until every subscriber has pulled PULLS times (2,000 alone
# take ~50 ms here: a handful of pulls), at most FAST_SECONDS.
MIN_VERSIONS, PULLS, FAST_SECONDS, SMALL = 2000, 200, 25.0, (64 << 10) // 4


def never_torn(rank, world, store):
    from tensordict_cpp import Publisher, Subscriber, TensorDict
    subs = list(range(1, world))
    td = TensorDict({f"w{i}": torch.zeros(SMALL) for i in range(3)}, batch_size=[])
    if rank == 0:
        pub = Publisher(max_slots=2, transport="socket", route=route())
        await_waiting(pub, subs, 0)  # the first route has them all
        relayed = checks = v = 0
        end = time.monotonic() + FAST_SECONDS
        stop = False
        while not stop:
            v += 1
            if v % 50 == 0:  # now and then: is a chain in use, have they pulled enough?
                s = pub.stats()
                checks += 1
                relayed += any(x["relayed_from"] not in (None, -1) for x in s)
                stop = (v >= MIN_VERSIONS and all(x["pulls"] >= PULLS + 10 for x in s)
                        or time.monotonic() > end)
            if stop:  # said before it is published: a subscriber that pulls it knows it is last
                store.set("last", str(v))
            for leaf in td.values():
                leaf.fill_(v)
            assert pub.publish(td, timeout=20) == v
        return finish(store, rank, subs, pub, lambda: (v, relayed, checks, pub.stats()))
    sub = Subscriber(src=0, transport="socket")
    pulled, last, final = [], 0, None
    while final is None or last < final:
        got = sub.pull(td, timeout=20)
        assert got is not None and got > last, (rank, got, last)
        # One whole version: every leaf holds its number, nothing of another.
        held = [leaf.unique()[:8].tolist() for leaf in td.values()]
        assert all(h == [float(got)] for h in held), (
            f"rank {rank}: pull returned {got} but the leaves hold {held} (pulled before: "
            f"{pulled[-3:]}, sub.version {sub.version}, left {sub.routed_around[-2:]})")
        pulled.append(got)
        last = got
        if final is None and store.check(["last"]):
            final = int(store.get("last"))
    finish(store, rank, subs)
    return pulled, sub.routed_around


@pytest.mark.parametrize("hosts", ["apart", "one"])
def test_versions_published_as_fast_as_possible_are_never_torn(hosts):
    """At least 2,000 versions (3 leaves of 64 KiB, each filled with the version's number)
    published back to back, until each of a chain of 3 subscribers pulling in loops has pulled
    200 times (25 s at most): every pull is one whole version, the one it says, newer than the
    one before. On hosts apart, through a chain; on one host, through the first one's slots."""
    got = spawn(never_torn, 4, timeout=75, env=apart(4) if hosts == "apart" else None)
    versions, relayed, checks, stats = got[0]
    pulls = {r: len(got[r][0]) for r in (1, 2, 3)}
    said = (f"{versions} versions published, pulls per subscriber {pulls}, a relay in use at "
            f"{relayed} of {checks} looks; left relays {[got[r][1] for r in (1, 2, 3)]}")
    print(said)
    assert versions >= MIN_VERSIONS, said
    assert all(got[r][0][-1] == versions for r in (1, 2, 3)), said
    assert min(pulls.values()) >= PULLS, said
    assert relayed > 0, said


# --- 5. one host: the first subscriber's slots ---------------------------------------------

def test_subscribers_of_one_host_read_the_first_ones_slots():
    # Version 1 is a chain (the hosts are not known yet); from version 2 the first of the host
    # writes its versions into its slots, which the others read once the publisher knows where
    # they are (version 3 on): one copy crosses the host's socket.
    got = spawn(relay_rounds, 4, timeout=60)
    routes = routes_of(got[0])
    for v, route in enumerate(routes[2:], start=3):
        parents = [parent for parent, _ in route.values()]
        first = next(r for r, (parent, _) in route.items() if parent == -1)
        assert parents.count(-1) == 1 and parents.count(first) == 2, (v, routes)
    assert all(not got[r] for r in (1, 2, 3)), got  # nobody was routed around


def test_stale_bytes_in_a_hosts_slots_are_caught_by_checksum():
    # Every subscriber writes the bytes of the version before into its slots (the hook): from
    # version 3, the readers of the first one's slots catch them, leave it for the publisher and
    # still hold every version exactly; the first is named.
    got = spawn(relay_rounds, 4, timeout=60,
                env={r: {"TENSORDICT_TEST_RELAY_STALE": "slots"} for r in (1, 2, 3)})
    routes = routes_of(got[0])
    first = next(r for r, (parent, _) in routes[2].items() if parent == -1)
    readers = [r for r in (1, 2, 3) if r != first]
    for r in readers:
        said = [e for e in got[r] if "of version 3" in e]
        assert said and said[0].startswith(f"rank {first} ") and "checksum" in said[0], got[r]
    around = routes[-1][first][1]
    assert around is not None and "left it at piece 0 of version 3" in around, routes


def late_reader(rank, world, store):
    """Versions 1-3 to three subscribers of one host; version 4 published while one of the
    first's readers does not wait, which asks only once the others hold it."""
    from tensordict_cpp import Publisher, Subscriber, TensorDict
    subs = list(range(1, world))
    td = TensorDict({f"w{i}": torch.zeros(N) for i in range(LEAVES)}, batch_size=[])
    if rank == 0:
        pub = Publisher(max_slots=2, transport="socket", route=route())
        for v in (1, 2, 3):
            stats = publish_version(pub, td, 0, v, subs)
        first = next(r for r in subs if stats[r]["relayed_from"] == -1)
        late = next(r for r in subs if r != first)
        store.set("late", str(late))
        on_time = [r for r in subs if r != late]
        stats = publish_version(pub, td, 0, 4, on_time)
        store.set("published", "1")
        await_acked(pub, subs, 4)
        return finish(store, rank, subs, pub, lambda: (first, late, stats, stats_of(pub)))
    sub = Subscriber(src=0, transport="socket")
    for v in (1, 2, 3, 4):
        if v == 4 and int(store.get("late")) == rank:
            store.wait(["published"], timedelta(seconds=30))
        assert sub.pull(td, timeout=30, min_version=v) == v
        for i, leaf in enumerate(td.values()):
            assert torch.equal(leaf, leaf_values(0, v, i)), (rank, v, i)
    finish(store, rank, subs)
    return sub.routed_around


def test_a_subscriber_that_asks_after_the_route_was_made_reads_its_hosts_slots():
    got = spawn(late_reader, 4, timeout=60)
    first, late, before, after = got[0]
    # Version 4's route was made without it (the others held the version before it asked);
    # it read the version from its host's first's slots, not sent whole by the publisher.
    assert before[late]["relayed_from"] != -1 and before[late]["version"] == 3, before
    assert after[late]["version"] == 4 and after[late]["relayed_from"] == first, after
    assert all(not got[r] for r in (1, 2, 3)), got  # nobody was routed around


# --- 6. large versions: pieces of several MiB --------------------------------------------------

BIG = (24 << 20) // 4  # 2 leaves of 24 MiB (float32)
PIECE_SEND = re.compile(r"c10d send to rank \d+, tag \d+: (\d+) bytes")


def big_rounds(rank, world, store):
    """Three versions of 48 MiB through a chain of two; the publisher records the size of every
    message it sends (its debug log), the subscribers check every version."""
    import logging
    from tensordict_cpp import Publisher, Subscriber, TensorDict, set_log_level
    subs = list(range(1, world))
    td = TensorDict({f"w{i}": torch.zeros(BIG) for i in range(2)}, batch_size=[])
    if rank == 0:
        sizes = []

        class Sizes(logging.Handler):
            def emit(self, record):
                m = PIECE_SEND.search(record.getMessage())
                if m:
                    sizes.append(int(m.group(1)))

        logging.getLogger("tensordict_cpp").addHandler(Sizes())
        pub = Publisher(max_slots=2, transport="socket", route=route())
        for v in range(1, 4):
            for i, leaf in enumerate(td.values()):
                leaf.copy_(leaf_values(1, v, i, BIG))
            await_waiting(pub, subs, v - 1)
            set_log_level("debug")
            assert pub.publish(td) == v
            await_acked(pub, subs, v)
            set_log_level("off")
        return finish(store, rank, subs, pub, lambda: (sizes, stats_of(pub)))
    sub = Subscriber(src=0, transport="socket")
    for v in range(1, 4):
        assert sub.pull(td, timeout=30, min_version=v) == v
        for i, leaf in enumerate(td.values()):
            assert torch.equal(leaf, leaf_values(1, v, i, BIG)), (rank, v, i)
    finish(store, rank, subs)


def test_a_large_version_travels_in_pieces_of_several_mib():
    got = spawn(big_rounds, 3, timeout=90, env=apart(3))
    sizes, stats = got[0]
    # The publisher sent pieces (56-byte header + C bytes), each over 1 MiB, within 16 MiB: a
    # piece size the route sized for 48 MiB through two on a loopback (docs/publication.md);
    # never the whole version, which a star would send.
    pieces = [n for n in sizes if n > (1 << 20) + 56]
    assert pieces and max(pieces) <= (16 << 20) + 56, sizes
    assert max(sizes) < 48 << 20, sizes
    parents = {r: s["relayed_from"] for r, s in stats.items()}
    first = next(r for r, parent in parents.items() if parent == -1)
    assert parents == {first: -1, 3 - first: first}, stats  # a chain: 0 -> first -> other
    print(f"piece messages: {len(pieces)}, {sorted(set(pieces))} bytes")


# --- 7. argument errors -----------------------------------------------------------------------

def bad_route(rank, world, store):
    from tensordict_cpp import Publisher
    if rank == 0:
        with pytest.raises(ValueError, match=r"route.*star.*chain|route.*chain.*star"):
            Publisher(route="ring", transport="socket")
    store.set(f"checked{rank}", "1")
    store.wait([f"checked{r}" for r in range(world)], timedelta(seconds=20))


def test_an_unknown_route_and_a_route_over_a_server_are_refused():
    spawn(bad_route, 2, timeout=30)
    from tensordict_cpp import Publisher, TensorDictServer
    with TensorDictServer(0, timeout=10.0) as server:
        # A server's clients pull whole: no route to choose.
        with pytest.raises(ValueError, match="route"):
            Publisher(server=server, route="chain")
        with pytest.raises(ValueError, match="route"):
            Publisher(server, route="chain")
