"""Our pseudo-random tag generator (C++) against the reference's, which is numpy itself."""
import os
import pathlib
import random
import subprocess

import numpy as np
import pytest

from tensordict.utils import _int_generator

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _cli():
    build = pathlib.Path(os.environ.get("TENSORDICT_BUILD_DIR", ROOT / "build"))
    cli = build / "dist_tag_cli"
    if not cli.exists():
        pytest.fail(f"{cli} is missing: build the dist_tag_cli target")
    return str(cli)


def _ours(seeds):
    out = subprocess.run(
        [_cli()], input="\n".join(map(str, seeds)), capture_output=True, text=True,
        check=True, timeout=120,
    ).stdout
    return [int(x) for x in out.split()]


def _numpy(seed):
    # The reference's definition, written out rather than imported, so that a change in the
    # reference shows up in the test below instead of silently changing both sides.
    return int.from_bytes(np.random.default_rng(seed).bytes(8), "big") % 10_000


def test_reference_is_numpy():
    for seed in (0, 1, 10, 9999, 2**31, 2**40 + 5):
        assert _int_generator(seed) == _numpy(seed)


def test_every_seed_a_tag_chain_can_reach():
    # After the first leaf, every seed is previous_tag + 1, so 1..10000 covers them all.
    seeds = list(range(0, 10_001))
    assert _ours(seeds) == [_numpy(s) for s in seeds]


def test_random_seeds_up_to_int64():
    rng = random.Random(20240611)
    seeds = [rng.randrange(0, 2**31) for _ in range(3000)]
    seeds += [rng.randrange(2**31, 2**63) for _ in range(3000)]
    seeds += [2**32 - 1, 2**32, 2**32 + 1, 2**63 - 1, 2**62]
    assert _ours(seeds) == [_numpy(s) for s in seeds]


@pytest.mark.parametrize("init_tag", [0, 5, 10, 100, 2**31 - 1])
def test_leaf_tag_chain(init_tag):
    n = 250  # past the 107-leaf cycle from init_tag 0
    out = subprocess.run([_cli(), "--chain", str(n), str(init_tag)], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    tag, expected = init_tag - 1, []
    for _ in range(n):
        tag = _int_generator(tag + 1)
        expected.append(tag)
    assert [int(x) for x in out.split()] == expected
