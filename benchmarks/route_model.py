"""Model of the time to get one version of B bytes from a publisher to N subscribers, per route.

Stdlib and torch only (torch only for --measure-alpha). It prints, for each N, each route's
time, its ratio to one point-to-point send of the same bytes (B/bw + alpha), and the piece size
it uses; the project's goal is within 1.25x one send for N = 64, 256, 1000.

    python benchmarks/route_model.py --measure-alpha
    python benchmarks/route_model.py --alpha-us 30
    python benchmarks/route_model.py --bytes 67108864 --gbps 0.05 --n 4 8 --alpha-us 30

The machine model
-----------------
- N + 1 hosts: the publisher (node 0) and N subscribers. Each host's interface sends at bw
  bytes/s; sending and receiving are independent (full duplex).
- A message of c bytes occupies the sender's egress for c/bw + alpha. alpha is a per-message
  cost that the sender pays serially with the bytes (it does not overlap the wire time). This is
  the pessimistic reading; if the cost overlapped the wire, the pipelined routes would be
  faster than shown.
- A node's egress is a FIFO server: it sends its messages one after another, in a fixed order
  (piece by piece; for each piece, to its first child, then to its second).
- Store and forward: a node may forward a piece only once it has received all of it.
- Ingress: unlimited (the closed forms assume it). The simulator check also runs with it
  limited to bw (the last column of its table): a transfer then needs both the sender's
  egress and the receiver's ingress free, and holds both alone (no sharing). In the star, the chain and the binary tree every subscriber
  has one sender, whose egress already limits it to bw, so this changes nothing there; in the
  double binary tree a node has a sender in each tree, and the two can collide.
- The buffer is cut into P = ceil(B/C) pieces of C bytes. The closed forms count P pieces of C
  (exact when C divides B, an upper bound within one piece otherwise). t = C/bw + alpha is the
  time one piece holds an egress.

The routes and their closed forms (exact under the model when C divides B; the simulator
checks them for small N)
-----------------------------------------------------------------------------------------
1. Star (what the publication does today): the publisher sends all of B, as one message, to
   each subscriber in turn.  T = N * (B/bw + alpha).

2. Chain, pipelined: pieces flow publisher -> s1 -> s2 -> ... -> sN. The publisher's egress
   finishes piece p (1-based) at p*t. Induction on k: s_k holds piece p at (p + k - 1)*t.
   True for k = 1. If it holds for k: s_k got piece p-1 at (p+k-2)t, started forwarding it
   then (its egress was free, by the same argument one piece earlier) and finished at
   (p+k-1)t, the moment it holds piece p; so it forwards piece p at once and s_{k+1} holds it
   at (p+k)t. No egress ever waits, and no piece waits for an egress. The last subscriber
   holds the last piece at
       T = (P + N - 1) * t = (B/C + N - 1) * (C/bw + alpha).
   Expanding, T = B/bw + B*alpha/C + (N-1)*C/bw + (N-1)*alpha; dT/dC = 0 at
       C* = sqrt(B * alpha * bw / (N - 1)),  T* = B/bw + 2*sqrt(B*alpha*(N-1)/bw) + (N-1)*alpha.

3. Binary tree, pipelined: the publisher is the root of a binary heap over the N + 1 hosts
   (node i's children are 2i+1 and 2i+2), so the publisher and every interior subscriber send
   each piece twice: their egress carries 2B. The root finishes piece p to its k-th child
   (k = 1, 2) at (2(p-1) + k)*t, so a child of the root holds the pieces at interval 2t,
   offset k*t. A node that receives at interval 2t and has at most 2 children is never
   backlogged (it finishes piece p-1 at exactly the time piece p arrives), so it forwards
   piece p to its j-th child at (its arrival time) + j*t. By induction node v holds piece p at
   2(p-1)*t + S(v)*t, where S(v) is the sum of the child ranks (1 for a first child, 2 for a
   second) along the path from the publisher. So
       T = (2(P - 1) + S_max) * t,   S_max = max_v S(v)  (= 2*depth in a full tree),
   that is (P + depth - 1) * (2C/bw + 2 alpha) for a full tree. With K = S_max - 2:
       T = (2B/C + K)(C/bw + alpha),  C* = sqrt(2 * B * alpha * bw / K).
   The egress term is 2B/bw: a tree is at least 2x one send however small alpha is.

2b. Chain of hosts (route "chain"): N subscribers on hosts of h (--per-host, 8), a
   chain of the hosts' first subscribers; the others of a host copy each piece out of their
   first's shared memory as it is written, at mem_bw (--mem-gbps, 10 GB/s), so that the last
   of them holds the version one piece copy after its host's first:
       T = (P + ceil(N/h) - 1) * t + C/mem_bw.
   The chain's form over ceil(N/h) members; the simulator checks that form as the chain's.

4. Double binary tree (NCCL's idea, laid out as route "tree" builds it: `tree_parent` and
   `second_position` in src/wire/publication_publisher.cpp, mirrored here): two binary trees
   over the N subscribers, the first laid out in order (its leaves the odd positions), the
   second the first mirrored (position i -> N+1-i) for even N, shifted by one for odd N, so
   that every node is interior in at most one tree. Half of the pieces go down tree 1, the
   other half down tree 2 (here the even and the odd ones; route "tree" sends the first and
   the second half, each a lane of its own, at once: the same bytes at the same times). The publisher is outside both trees:
   it sends the pieces in order, piece i to the root of tree (i mod 2), so its egress carries
   B, and each tree's root receives at interval 2t (tree 1 at offset 1t, tree 2 at 2t). A node
   is interior in one tree only and has at most 2 children there, so it is never backlogged
   and its egress also carries about B (2 x B/2). The argument of route 3, per tree, gives
   node v holding piece j (1-based, of P/2) of tree x at 2(j-1)*t + (x + S_x(v))*t, so
       T = (P - 2 + max(1 + S1_max, 2 + S2_max)) * t,
   about (B/C + 2*depth) * (C/bw + alpha). With K = max(1 + S1_max, 2 + S2_max) - 2:
       T = (B/C + K)(C/bw + alpha),  C* = sqrt(B * alpha * bw / K).
   This is the chain's form with N - 1 replaced by about 2*log2(N). The closed form assumes
   unlimited ingress and disjoint interior sets; the simulator shows what ingress limited to
   bw costs.

4b. Two trees of hosts (route "tree"): the double binary tree over the ceil(N/h) hosts' first
   subscribers, the others of a host copying from their first's shared memory as in 2b:
       T = T_dbt(ceil(N/h)) + C/mem_bw.

Each route is also run in a discrete-event simulator (below, `simulate`), with the machine
model above, to check the closed forms for small N; for large N (64, 256, 1000) the table uses
the closed forms (with the exact S_max of the actual trees).

Piece sizes: each pipelined route's C is searched over a geometric grid (8 points per octave)
from 64 KiB to 64 MiB. The table reports the best C in [64 KiB, 16 MiB] (what the
implementation allows) and the unclamped best.

alpha: --alpha-us, or --measure-alpha: two processes on 127.0.0.1 over torch.distributed Gloo
measure (a) half the median round trip of a 64-byte message, and (b) the extra time to send
64 MiB as 128 pieces of 512 KiB rather than as one message, per piece, each piece one blocking
send: what a sender that waits for each piece pays. Our engine keeps pieces posted and pays
less: benchmarks/piece_cost.py measures what one piece costs it (55 us on this 2-core machine,
the figure docs/publication.md's table uses, with --alpha-us).
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
# kMinPieceBytes, kMaxPieceBytes (src/wire/include/wire/publication.h)
CLAMP = (64 * KIB, 16 * MIB)
GRID_RANGE = (64 * KIB, 64 * MIB)
GOAL = 1.25
ROUTES = ("star", "chain", "hosts", "tree", "dbt", "dbt_hosts")
ROUTE_NAMES = {"star": "star", "chain": "chain", "hosts": "chain of hosts",
               "tree": "binary tree", "dbt": "double binary tree",
               "dbt_hosts": "two trees of hosts"}
# The routes that ship, with N subscribers on hosts of PER_HOST: a chain ("chain") or two trees
# ("tree") of the hosts' first subscribers, the others of a host copying each piece from its
# first's shared memory at MEM_BW as it is written (--per-host, --mem-gbps).
PER_HOST = 8
MEM_BW = 10e9


# ---------------------------------------------------------------------------------------------
# Trees. Node 0 is the publisher; subscribers are 1..N. A tree is a dict: node -> [children],
# first child first.

def heap_tree(n: int) -> dict[int, list[int]]:
    """Binary heap over the publisher (0) and subscribers 1..n."""
    ch: dict[int, list[int]] = {i: [] for i in range(n + 1)}
    for i in range(1, n + 1):
        ch[(i - 1) // 2].append(i)
    return ch


def tree_parent(i: int, n: int) -> int:
    """The parent of position i (1 to n) in the publisher's first tree (tree_parent in
    src/wire/publication_publisher.cpp): laid out in order, its root the largest power of two
    within n, the odd positions its leaves; 0 for the root."""
    root = 1 << (n.bit_length() - 1)
    if i == root:
        return 0
    b = i & -i
    while True:
        p = i - b if i & (2 * b) else i + b
        if p <= n:
            return p
        i, b = p, 2 * b


def second_position(i: int, n: int) -> int:
    """Position i's in the second tree (second_position there): mirrored for even n, shifted
    by one for odd n, so that the first tree's leaves are the second's inner positions."""
    return n + 1 - i if n % 2 == 0 else i % n + 1


def dtree(n: int) -> tuple[dict[int, list[int]], dict[int, list[int]], int, int]:
    """The two trees route "tree" builds over subscribers 1..n (in the order they joined).

    Returns (children1, children2, root1, root2)."""
    at_second = {second_position(v, n): v for v in range(1, n + 1)}
    p1 = {v: tree_parent(v, n) for v in range(1, n + 1)}
    p2 = {v: at_second.get(tree_parent(second_position(v, n), n), 0) for v in range(1, n + 1)}
    trees = []
    for parents in (p1, p2):
        ch: dict[int, list[int]] = {v: [] for v in range(1, n + 1)}
        root = None
        for v in range(1, n + 1):
            if parents[v] == 0:
                root = v
            else:
                ch[parents[v]].append(v)
        for v in ch:
            assert len(ch[v]) <= 2, (n, v, ch[v])
        trees.append((ch, root))
    (c1, r1), (c2, r2) = trees
    for ch, root in trees:  # every subscriber reachable
        seen, stack = set(), [root]
        while stack:
            v = stack.pop()
            seen.add(v)
            stack += ch[v]
        assert len(seen) == n, (n, len(seen))
    return c1, c2, r1, r2


def rank_sum_max(ch: dict[int, list[int]], root: int, start: int = 0) -> int:
    """max over nodes of the sum of child ranks (1 first, 2 second) from root (root: start)."""
    best, stack = start, [(root, start)]
    while stack:
        v, s = stack.pop()
        best = max(best, s)
        for k, c in enumerate(ch[v], 1):
            stack.append((c, s + k))
    return best


def depth(ch: dict[int, list[int]], root: int) -> int:
    d, stack = 0, [(root, 0)]
    while stack:
        v, k = stack.pop()
        d = max(d, k)
        stack += [(c, k + 1) for c in ch[v]]
    return d


_STRUCT_CACHE: dict[int, dict] = {}


def structure(n: int) -> dict:
    """The tree constants the closed forms need, for n subscribers."""
    if n not in _STRUCT_CACHE:
        h = heap_tree(n)
        s = {"tree_smax": rank_sum_max(h, 0), "tree_depth": depth(h, 0)}
        if n >= 2:
            c1, c2, r1, r2 = dtree(n)
            s["dbt_k"] = max(1 + rank_sum_max(c1, r1), 2 + rank_sum_max(c2, r2)) - 2
            s["dbt_depth"] = 1 + max(depth(c1, r1), depth(c2, r2))  # publisher -> roots: 1
            i1 = {v for v in c1 if c1[v]}
            i2 = {v for v in c2 if c2[v]}
            s["dbt_shared_interior"] = len(i1 & i2)
        _STRUCT_CACHE[n] = s
    return _STRUCT_CACHE[n]


# ---------------------------------------------------------------------------------------------
# Closed forms. B bytes, bw bytes/s, alpha s, c piece bytes; times in s.

def p2p(b: float, bw: float, alpha: float) -> float:
    return b / bw + alpha


def closed_form(route: str, n: int, b: float, bw: float, alpha: float, c: float) -> float:
    if route == "star":
        return n * (b / bw + alpha)
    p = math.ceil(b / c)
    t = c / bw + alpha
    if route == "chain":
        return (p + n - 1) * t
    if route in ("hosts", "dbt_hosts"):
        # The last host's first holds the last piece as the route's last member; its readers
        # copy that piece a moment later.
        hosts = math.ceil(n / PER_HOST)
        copy = c / MEM_BW if n > hosts else 0.0
        if route == "hosts":
            return (p + hosts - 1) * t + copy
        return closed_form("dbt", hosts, b, bw, alpha, c) + copy
    s = structure(n)
    if route == "tree":
        return (2 * (p - 1) + s["tree_smax"]) * t
    if route == "dbt":
        if n == 1:
            return (p + 0) * t
        p = p + (p % 2)  # an even count: the halves
        return (p + s["dbt_k"]) * t
    raise ValueError(route)


def grid(lo: int, hi: int, per_octave: int = 8) -> list[int]:
    out, k = [], 0
    while True:
        c = int(round(lo * 2 ** (k / per_octave)))
        if c > hi:
            break
        out.append(c)
        k += 1
    return out


GRID = grid(*GRID_RANGE)


def best_piece(route: str, n: int, b: float, bw: float, alpha: float,
               lo: int, hi: int) -> tuple[int, float]:
    """(C, T) minimising the closed form over the grid points in [lo, hi]."""
    if route == "star":
        return int(b), closed_form("star", n, b, bw, alpha, b)
    cands = [c for c in GRID if lo <= c <= hi] or [lo]
    return min(((c, closed_form(route, n, b, bw, alpha, c)) for c in cands),
               key=lambda x: x[1])


def analytic_piece(route: str, n: int, b: float, bw: float, alpha: float) -> float | None:
    if route == "star" or alpha <= 0:
        return None
    s = structure(n)
    if route in ("chain", "hosts"):
        m = n if route == "chain" else math.ceil(n / PER_HOST)
        return math.sqrt(b * alpha * bw / (m - 1)) if m > 1 else None
    if route == "dbt_hosts":
        return analytic_piece("dbt", math.ceil(n / PER_HOST), b, bw, alpha)
    if route == "tree":
        k = s["tree_smax"] - 2
        return math.sqrt(2 * b * alpha * bw / k) if k > 0 else None
    k = s.get("dbt_k", 0)
    return math.sqrt(b * alpha * bw / k) if k > 0 else None


def max_alpha_for_goal(route: str, n: int, b: float, bw: float) -> float:
    """The largest alpha (s) at which the route, with C clamped, is within GOAL x one send."""
    def ok(a: float) -> bool:
        _, t = best_piece(route, n, b, bw, a, *CLAMP)
        return t <= GOAL * p2p(b, bw, a)
    if not ok(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    if ok(hi):
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


# ---------------------------------------------------------------------------------------------
# Discrete-event simulator.

def route_plan(route: str, n: int, pieces: int) -> tuple[dict[int, list[tuple[int, int]]], int]:
    """Each node's ordered list of sends (piece, child), and the number of pieces moved."""
    plan: dict[int, list[tuple[int, int]]] = {v: [] for v in range(n + 1)}
    if route == "star":  # one message (piece 0) to each subscriber in turn
        plan[0] = [(0, v) for v in range(1, n + 1)]
        return plan, 1
    if route == "chain":
        for v in range(n):
            plan[v] = [(p, v + 1) for p in range(pieces)]
        return plan, pieces
    if route == "tree":
        ch = heap_tree(n)
        for v in range(n + 1):
            plan[v] = [(p, c) for p in range(pieces) for c in ch[v]]
        return plan, pieces
    if route == "dbt":
        c1, c2, r1, r2 = dtree(n)
        plan[0] = [(p, r1 if p % 2 == 0 else r2) for p in range(pieces)]
        for v in range(1, n + 1):
            plan[v] = ([(p, c) for p in range(0, pieces, 2) for c in c1[v]]
                       + [(p, c) for p in range(1, pieces, 2) for c in c2[v]])
            plan[v].sort(key=lambda pc: pc[0])  # stable: piece order, child order kept
        return plan, pieces
    raise ValueError(route)


def simulate(route: str, n: int, b: int, bw: float, alpha: float, c: int,
             ingress_limited: bool = False) -> float:
    """Time until every subscriber holds every piece, by discrete events.

    Greedy list schedule: repeatedly start, among the sends that can start (the node holds the
    piece, and the send is next in the node's FIFO order), the one that can start earliest, at
    max(sender's egress free, piece received, [receiver's ingress free]); it holds the egress
    (and the ingress) for size/bw + alpha."""
    if route == "star":
        sizes = [b]
    else:
        pieces = math.ceil(b / c)
        sizes = [min(c, b - i * c) for i in range(pieces)]
    plan, _ = route_plan(route, n, len(sizes))
    recv: list[dict[int, float]] = [dict() for _ in range(n + 1)]
    recv[0] = {p: 0.0 for p in range(len(sizes))}
    egress = [0.0] * (n + 1)
    ingress = [0.0] * (n + 1)
    nxt = [0] * (n + 1)
    heap: list[tuple[float, int]] = []

    def start_time(v: int) -> float | None:
        if nxt[v] >= len(plan[v]):
            return None
        p, child = plan[v][nxt[v]]
        r = recv[v].get(p)
        if r is None:
            return None
        s = max(egress[v], r)
        if ingress_limited:
            s = max(s, ingress[child])
        return s

    for v in range(n + 1):
        s = start_time(v)
        if s is not None:
            heapq.heappush(heap, (s, v))
    done = 0
    total = sum(len(x) for x in plan.values())
    while heap:
        s0, v = heapq.heappop(heap)
        s = start_time(v)
        if s is None:
            continue
        if s > s0:
            heapq.heappush(heap, (s, v))
            continue
        p, child = plan[v][nxt[v]]
        f = s + sizes[p] / bw + alpha
        egress[v] = f
        ingress[child] = f
        recv[child][p] = f
        nxt[v] += 1
        done += 1
        s = start_time(v)
        if s is not None:
            heapq.heappush(heap, (s, v))
        if nxt[child] < len(plan[child]) and plan[child][nxt[child]][0] == p:
            s = start_time(child)
            if s is not None:
                heapq.heappush(heap, (s, child))
    assert done == total, (route, done, total)
    assert all(len(recv[v]) == len(sizes) for v in range(1, n + 1))
    return max(max(recv[v].values()) for v in range(1, n + 1))


# ---------------------------------------------------------------------------------------------
# Measuring alpha over Gloo on 127.0.0.1.

def _alpha_worker(rank: int, port: int, out_path: str, pings: int, reps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    peer = 1 - rank
    small = torch.zeros(16)  # 64 bytes
    rtts = []
    for i in range(200 + pings):
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(small, peer)
            dist.recv(small, peer)
            if i >= 200:
                rtts.append(time.perf_counter() - t0)
        else:
            dist.recv(small, peer)
            dist.send(small, peer)
    big = torch.ones(64 * MIB // 4)
    parts = list(big.split(512 * KIB // 4))  # 128 contiguous pieces
    ack = torch.zeros(1)
    one, many = [], []
    for i in range(2 + reps):  # 2 warm-up rounds
        for mode in ("one", "many"):
            if rank == 0:
                t0 = time.perf_counter()
                if mode == "one":
                    dist.send(big, peer)
                else:
                    for x in parts:
                        dist.send(x, peer)
                dist.recv(ack, peer)
                if i >= 2:
                    (one if mode == "one" else many).append(time.perf_counter() - t0)
            else:
                if mode == "one":
                    dist.recv(big, peer)
                else:
                    for x in parts:
                        dist.recv(x, peer)
                dist.send(ack, peer)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"rtt": rtts, "one": one, "many": many, "pieces": len(parts)}, f)
    dist.destroy_process_group()


def measure_alpha(pings: int = 2000, reps: int = 31) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    t0 = time.time()
    try:
        mp.spawn(_alpha_worker, args=(port, path, pings, reps), nprocs=2, join=True)
        with open(path) as f:
            r = json.load(f)
    finally:
        os.unlink(path)
    half_rtt = statistics.median(r["rtt"]) / 2
    one, many = statistics.median(r["one"]), statistics.median(r["many"])
    # Each round sent one message, then the pieces: the median of the paired differences.
    diffs = sorted((m - o) / (r["pieces"] - 1) for o, m in zip(r["one"], r["many"]))
    per_piece = statistics.median(diffs)
    q1, q3 = diffs[len(diffs) // 4], diffs[(3 * len(diffs)) // 4]
    return {"half_rtt_us": half_rtt * 1e6, "per_piece_extra_us": per_piece * 1e6,
            "per_piece_extra_iqr_us": [q1 * 1e6, q3 * 1e6],
            "one_64MiB_ms": one * 1e3, "pieces_64MiB_ms": many * 1e3,
            "loopback_GBps": 64 * MIB / one / 1e9, "pieces": r["pieces"],
            "pings": pings, "reps": reps, "seconds": time.time() - t0}


# ---------------------------------------------------------------------------------------------

def fmt_bytes(c: float) -> str:
    if c >= GIB and c % GIB == 0:
        return f"{c / GIB:g} GiB"
    if c >= MIB:
        return f"{c / MIB:.3g} MiB"
    return f"{c / KIB:.3g} KiB"


def evaluate(ns: list[int], b: int, bw: float, alpha: float) -> list[dict]:
    rows = []
    one = p2p(b, bw, alpha)
    for n in ns:
        for route in ROUTES:
            c, t = best_piece(route, n, b, bw, alpha, *CLAMP)
            cu, tu = best_piece(route, n, b, bw, alpha, *GRID_RANGE)
            ca = analytic_piece(route, n, b, bw, alpha)
            rows.append({
                "n": n, "route": route, "piece": c, "ms": t * 1e3, "ratio": t / one,
                "meets": t <= GOAL * one,
                "piece_unclamped": cu, "ms_unclamped": tu * 1e3, "ratio_unclamped": tu / one,
                "meets_unclamped": tu <= GOAL * one,
                "piece_analytic": ca,
                "max_alpha_us": (max_alpha_for_goal(route, n, b, bw) * 1e6
                                 if route != "star" else None),
            })
    return rows


def check(ns: list[int], b: int, bw: float, alpha: float) -> list[dict]:
    """Closed form vs simulator, at each route's clamped best C (made to divide B: a power of 2
    when B is one) and at most 4096 pieces (a bigger C if needed, to keep it fast)."""
    out = []
    for n in ns:
        for route in ROUTES:
            if route in ("hosts", "dbt_hosts"):  # over fewer members: checked as "chain", "dbt"
                continue
            c, _ = best_piece(route, n, b, bw, alpha, *CLAMP)
            if route != "star":
                c = 1 << round(math.log2(c))
                while b / c > 4096:
                    c *= 2
            cf = closed_form(route, n, b, bw, alpha, c)
            s_free = simulate(route, n, b, bw, alpha, c, ingress_limited=False)
            s_lim = simulate(route, n, b, bw, alpha, c, ingress_limited=True)
            out.append({"n": n, "route": route, "piece": c, "closed_ms": cf * 1e3,
                        "sim_ms": s_free * 1e3, "sim_ingress_bw_ms": s_lim * 1e3,
                        "rel_err": s_free / cf - 1, "ingress_cost": s_lim / s_free - 1})
    return out


def main() -> None:
    global PER_HOST, MEM_BW
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=GIB, help="B, bytes of a version (1 GiB)")
    ap.add_argument("--gbps", type=float, default=12.5,
                    help="link bandwidth in GB/s (10^9 bytes/s), each direction (12.5)")
    ap.add_argument("--alpha-us", type=float, default=None,
                    help="per-message cost in microseconds (default: measured)")
    ap.add_argument("--measure-alpha", action="store_true",
                    help="measure alpha over Gloo on 127.0.0.1 (also the default without "
                         "--alpha-us)")
    ap.add_argument("--n", type=int, nargs="+", default=[64, 256, 1000], help="subscribers")
    ap.add_argument("--check-n", type=int, nargs="*", default=[4, 8, 16],
                    help="N at which the simulator checks the closed forms ([] to skip)")
    ap.add_argument("--per-host", type=int, default=PER_HOST,
                    help="subscribers a host, for the chain of hosts (8)")
    ap.add_argument("--mem-gbps", type=float, default=MEM_BW / 1e9,
                    help="a host's readers' copy out of shared memory, GB/s (10)")
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="print JSON (or write it to the file given)")
    a = ap.parse_args()
    PER_HOST, MEM_BW = a.per_host, a.mem_gbps * 1e9

    b, bw = a.bytes, a.gbps * 1e9
    measured = None
    if a.measure_alpha or a.alpha_us is None:
        measured = measure_alpha()
        if a.alpha_us is None:
            a.alpha_us = (measured["per_piece_extra_us"] if measured["per_piece_extra_us"] > 0
                          else measured["half_rtt_us"])
    alpha = a.alpha_us * 1e-6
    rows = evaluate(a.n, b, bw, alpha)
    checks = check(a.check_n, b, bw, alpha) if a.check_n else []
    result = {"bytes": b, "GBps": a.gbps, "alpha_us": a.alpha_us, "measured": measured,
              "p2p_ms": p2p(b, bw, alpha) * 1e3, "goal": GOAL, "clamp": CLAMP, "rows": rows,
              "checks": checks,
              "structure": {n: structure(n) for n in sorted(set(a.n) | set(a.check_n))}}
    if a.json == "-":
        print(json.dumps(result, indent=1))
        return
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)

    print(f"route_model: B = {fmt_bytes(b)}, bw = {a.gbps:g} GB/s per direction, "
          f"alpha = {a.alpha_us:.1f} us per message; the chain of hosts: {PER_HOST} "
          f"subscribers a host, copies from shared memory at {a.mem_gbps:g} GB/s")
    if measured:
        m = measured
        print(f"  measured over Gloo on 127.0.0.1 ({m['seconds']:.0f} s): half a 64-byte round "
              f"trip {m['half_rtt_us']:.1f} us (median of {m['pings']}); 64 MiB as "
              f"{m['pieces']} x 512 KiB {m['pieces_64MiB_ms']:.1f} ms vs one message "
              f"{m['one_64MiB_ms']:.1f} ms ({m['loopback_GBps']:.2f} GB/s): "
              f"{m['per_piece_extra_us']:.1f} us extra per piece (median of {m['reps']} "
              f"paired rounds, quartiles {m['per_piece_extra_iqr_us'][0]:.0f}-"
              f"{m['per_piece_extra_iqr_us'][1]:.0f} us); the model uses the per-piece figure")
    one = p2p(b, bw, alpha)
    print(f"  one point-to-point send of B: {one * 1e3:.2f} ms; goal: within {GOAL}x of it; "
          f"pieces clamped to [{fmt_bytes(CLAMP[0])}, {fmt_bytes(CLAMP[1])}], "
          f"unclamped searched in [{fmt_bytes(GRID_RANGE[0])}, {fmt_bytes(GRID_RANGE[1])}]")
    hdr = (f"  {'N':>5} {'route':<19} {'piece':>9} {'ms':>10} {'x send':>7} {'goal':>5} | "
           f"{'best piece':>10} {'ms':>10} {'x send':>7} {'goal':>5} | {'max alpha':>9}")
    print(hdr)
    print("  " + "-" * (len(hdr) - 2))
    for r in rows:
        ma = ("" if r["max_alpha_us"] is None else "never" if r["max_alpha_us"] <= 0
              else f"{r['max_alpha_us']:.1f} us")
        print(f"  {r['n']:>5} {ROUTE_NAMES[r['route']]:<19} {fmt_bytes(r['piece']):>9} "
              f"{r['ms']:>10.2f} {r['ratio']:>7.3f} {'yes' if r['meets'] else 'no':>5} | "
              f"{fmt_bytes(r['piece_unclamped']):>10} {r['ms_unclamped']:>10.2f} "
              f"{r['ratio_unclamped']:>7.3f} {'yes' if r['meets_unclamped'] else 'no':>5} | "
              f"{ma:>9}")
    print("  (piece: the best in the clamp; best piece: unclamped; max alpha: the largest "
          "per-message cost at which the route, clamped, still meets the goal)")
    for n in a.n:
        ok = [ROUTE_NAMES[r["route"]] for r in rows if r["n"] == n and r["meets"]]
        oku = [ROUTE_NAMES[r["route"]] for r in rows if r["n"] == n and r["meets_unclamped"]]
        s = structure(n)
        print(f"  N={n}: meets {GOAL}x with pieces <= {fmt_bytes(CLAMP[1])}: "
              f"{', '.join(ok) or 'none'}; "
              f"unclamped: {', '.join(oku) or 'none'}  (heap depth {s['tree_depth']}, "
              f"S_max {s['tree_smax']}; double tree depth {s.get('dbt_depth')}, "
              f"K {s.get('dbt_k')}, nodes interior in both {s.get('dbt_shared_interior')})")
    if checks:
        print("  simulator check of the closed forms (at the clamped best piece, a power of 2):")
        print(f"  {'N':>5} {'route':<19} {'piece':>9} {'closed ms':>10} {'sim ms':>10} "
              f"{'diff':>8} {'sim, ingress=bw':>16}")
        for c in checks:
            print(f"  {c['n']:>5} {ROUTE_NAMES[c['route']]:<19} {fmt_bytes(c['piece']):>9} "
                  f"{c['closed_ms']:>10.3f} {c['sim_ms']:>10.3f} {c['rel_err'] * 100:>7.3f}% "
                  f"{c['sim_ingress_bw_ms']:>10.3f} ({c['ingress_cost'] * 100:+.2f}%)")


if __name__ == "__main__":
    main()
