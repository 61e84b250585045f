"""Relays along two trees (``Publisher(route="tree")``, docs/publication.md), on real processes
over Gloo on 127.0.0.1, through the ranks of tests/python/test_relays.py with TEST_ROUTE=tree:
half of each version's pieces go down each of two binary trees, in which every subscriber
forwards in one at most, each tree's lane taken by a thread of its own; every subscriber holds
every version exactly; a relay SIGKILLed in the route, or one that forwards stale pieces, is
left in its lane for the publisher while the other lane flows; the readers of a host's first
subscriber's slots follow both lanes there; versions published as fast as possible are never
pulled torn."""

import signal

import pytest

import conftest
from test_relays import (apart, assert_route, big_rounds, never_torn, relay_killed, relay_rounds, routes_of,
                         spawn, stale_relay)

watchdog = conftest.watchdog(120)

TREE = {"TEST_ROUTE": "tree"}


def trees(world, extra=None):
    """Every rank told the route, each subscriber on a host of its own but where ``extra``
    says otherwise."""
    env = apart(world, extra)
    return {r: {**TREE, **e} for r, e in env.items()}


def seconds_of(stats):
    return {r: s["relayed_second"] for r, s in stats.items()}


def test_two_trees_of_eight_hold_every_version_exactly():
    # relay_rounds checks every pulled version's values; assert_route (there) each version's two
    # trees: one root each, at most two children, nobody forwarding in both.
    got = spawn(relay_rounds, 9, timeout=90, env=trees(9))
    for v, stats in enumerate(got[0], start=1):
        assert_route(stats, list(range(1, 9)), v, routes_of(got[0]))
    last = got[0][-1]
    assert sorted(seconds_of(last).values()).count(-1) == 1, seconds_of(last)
    assert [s["relayed_from"] for s in last.values()].count(-1) == 1, last


@pytest.mark.parametrize("in_route", [False, True], ids=["before_the_route", "in_the_route"])
def test_a_relay_killed_in_a_tree_costs_the_others_nothing(in_route):
    # Rank 1 SIGKILLed while its pull waits: in the route (its lane's children leave it for the
    # publisher, the other lane flows on) or before it; 11 versions reach the others.
    env = trees(5, {0: {"RELAY_KILLED_IN_ROUTE": "1" if in_route else "0"}})
    got = spawn(relay_killed, 5, timeout=60, expect={1: -signal.SIGKILL}, env=env)
    routes, took, rank1 = got[0]
    assert len(routes) == 11 and took < 20, (took, routes)


def test_a_stale_relay_in_a_tree_is_caught_by_checksum_and_named():
    # Four subscribers: each forwards in one tree (an even count), so rank 1's stale pieces
    # always reach a child, which catches them, takes its lane's rest from the publisher, and
    # names rank 1 (stale_relay checks every version and that the publisher names rank 1).
    got = spawn(stale_relay, 5, timeout=90,
                env=trees(5, {1: {"TENSORDICT_TEST_RELAY_STALE": "1"}}))
    for k in range(3):
        said = [e for r in (2, 3, 4) for e in got[r][k] if e.startswith("rank 1 ")]
        assert said and all("checksum" in e for e in said), [got[r][k] for r in (2, 3, 4)]


def test_the_readers_of_a_hosts_slots_follow_both_lanes():
    # Two hosts of two: from version 3 the trees join the hosts' first subscribers, and each
    # host's other reads both lanes' pieces from its first's slots (relay_rounds checks them).
    hosts = {1: "a", 2: "a", 3: "b", 4: "b"}
    env = {0: dict(TREE)} | {r: {**TREE, "TENSORDICT_TEST_HOST": h} for r, h in hosts.items()}
    got = spawn(relay_rounds, 5, timeout=90, env=env)
    routes = routes_of(got[0])
    for v, stats in enumerate(got[0][2:], start=3):
        firsts = [r for r, s in stats.items() if s["relayed_second"] is not None]
        readers = {r: s["relayed_from"] for r, s in stats.items() if s["relayed_second"] is None}
        assert len(firsts) == 2 and len(readers) == 2, (v, routes)
        assert all(hosts[r] == hosts[parent] for r, parent in readers.items()), (v, routes)
    assert all(not got[r] for r in (1, 2, 3, 4)), got  # nobody was routed around


def test_versions_published_as_fast_as_possible_through_trees_are_never_torn():
    got = spawn(never_torn, 4, timeout=75, env=trees(4))
    versions, relayed, checks, stats = got[0]
    pulls = {r: len(got[r][0]) for r in (1, 2, 3)}
    assert all(got[r][0][-1] == versions for r in (1, 2, 3)), (versions, pulls)
    assert relayed > 0, (versions, relayed, checks)


def test_a_large_version_travels_down_both_trees():
    # 48 MiB to two subscribers: each is one tree's root and the other's leaf.
    got = spawn(big_rounds, 3, timeout=90, env=trees(3))
    sizes, stats = got[0]
    lanes = {r: (s["relayed_from"], s["relayed_second"]) for r, s in stats.items()}
    root = next(r for r, (first, _) in lanes.items() if first == -1)
    assert lanes == {root: (-1, 3 - root), 3 - root: (root, -1)}, lanes
