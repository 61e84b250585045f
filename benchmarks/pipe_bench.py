"""The pipe's benchmark: our TensorDictPipe (C++, build/pipe_bench) beside its floors and the
reference, on one host, each measured in this run under each transport setting (UCX's own
choice, and UCX_TLS=tcp):

* ucx_perftest -t tag_lat / tag_bw: the libucx-cu12 wheel's, the UCX the pipe links, with
  peer error handling (-e, and UCX_MM_ERROR_HANDLING=y, as the pipe sets it), so that UCX
  offers it the transports it offers the pipe (without it UCX adds CMA); tag_bw also with the
  pipe's TCP segment sizes;
* the reference's pipe (tensordict._ucxx.TensorDictPipe over ucxx), two Python processes;
* one raw Gloo send of the same bytes (torch.distributed, two processes; no UCX).

Cases: a 1 KB round trip (a consolidated TensorDict of 1024 bytes there and back, the schema
sent once in the warm-up) and one 100 MB TensorDict (a stream of them; time per message).
Under UCX's choice of transports, also ours from Python (send / recv and asend / arecv, two
Python processes) beside ours from C++ and the reference, in four cases: 1 KB and 100 MB,
stream and echo (the receiver sends back the TensorDict it received, as it is).
Every arm checks the data it received. The goals compare medians of one run (the pipe's,
below them, in python_table):

    1 KB round trip <= 3x ucx_perftest's (2 x tag_lat)      100 MB <= 1.25x tag_bw's time
    100 MB >= 2x faster than one raw Gloo send              >= 5x the reference at 1 KB, 2x at 100 MB

Run: .venv/bin/python benchmarks/pipe_bench.py [--quick] (benchmarks/run runs it too).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
KB, MB100, QUICK_BIG = 1024, 100 * 1024 * 1024, 4 * 1024 * 1024
SETTINGS = {"default": {}, "tcp": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}}
# The TCP segment sizes the pipe sets unless the environment does (src/pipe/ucx_worker.cpp):
# ucx_perftest runs with them too, beside its defaults, to compare like with like.
PIPE_TCP_SEGMENTS = {"UCX_TCP_TX_SEG_SIZE": "256K", "UCX_TCP_RX_SEG_SIZE": "256K"}


def libucx_dir() -> pathlib.Path:
    import libucx
    return pathlib.Path(libucx.__path__[0])


def env_for(setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.update(SETTINGS[setting], UCX_WARN_UNUSED_ENV_VARS="n", OMP_NUM_THREADS="1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- ucx_perftest ----------------------------------------------------------------------------
def perftest(test: str, nbytes: int, iters: int, env: dict) -> float:
    """tag_lat: one round trip (2 x the median one-way latency), us; tag_bw: us per message at
    the overall bandwidth."""
    exe = libucx_dir() / "bin" / "ucx_perftest"
    env = {**env, "LD_LIBRARY_PATH": str(libucx_dir() / "lib"), "UCX_MM_ERROR_HANDLING": "y"}
    final: list[str] = []
    for _ in range(3):  # a server that died before it listened (now and then): a new one
        port = free_port()
        server = subprocess.Popen([str(exe), "-p", str(port), "-e"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(50):  # the server binds after starting UCX
                time.sleep(0.1)
                out = subprocess.run([str(exe), "127.0.0.1", "-p", str(port), "-e", "-t", test,
                                      "-s", str(nbytes), "-n", str(iters)], env=env,
                                     capture_output=True, text=True, timeout=300)
                final = [line for line in out.stdout.splitlines() if line.startswith("Final:")]
                if final or server.poll() is not None:
                    break
        finally:
            server.kill()
            server.wait()
        if final:
            break
    if not final:
        raise RuntimeError(f"ucx_perftest {test} failed: {out.stdout[-500:]}{out.stderr[-500:]}")
    cols = final[-1].split()
    # Final: iterations, latency 50%ile, average, overall, bandwidth average, overall, ...
    if test == "tag_lat":
        return 2 * float(cols[2])
    return nbytes / (float(cols[6]) * 1024 * 1024) * 1e6  # MB/s is MiB/s in perftest


# ---- ours ---------------------------------------------------------------------------------------
def ours(mode: str, nbytes: int, rounds: int, env: dict) -> tuple[float, str]:
    exe = pathlib.Path(os.environ.get("TENSORDICT_BUILD_DIR", ROOT / "build")) / "pipe_bench"
    out = subprocess.run([str(exe), mode, str(nbytes), str(rounds)], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"pipe_bench {mode} failed: {out.stderr[-1000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["median_us"], result["transports"]


# ---- pipes from Python: ours (tensordict_cpp.TensorDictPipe) and the reference's (ucxx) ------
# One protocol for every Python arm, in one template: the placeholders become the arm's imports,
# the way it opens and closes a pipe, and "await " / "async " with asend / arecv for the asyncio
# arms or nothing with send / recv for our synchronous one, so that every arm runs the same lines.
PEER = r"""
import asyncio, json, sys, time, torch
IMPORTS
role, mode, nbytes, rounds, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
WARMUP = 20
def ok(td, r):
    x = td["x"]
    return int(x[0]) == r % 256 and int(x[-1]) == r % 256
ASYNC def main():
    if role == "server":
        SERVER_OPEN
        for r in range(WARMUP + rounds):
            td = AWAIT pipe.RECV()
            assert ok(td, r), r
            if mode == "lat":
                AWAIT pipe.SEND(td)  # the received TensorDict, sent back as it is
            elif r in (WARMUP - 1, WARMUP + rounds - 1):
                AWAIT pipe.SEND(TensorDict(k=torch.zeros(1, dtype=torch.uint8)).consolidate())
        SLEEP
        CLOSE
        return
    CLIENT_OPEN
    td = TensorDict(x=torch.zeros(nbytes, dtype=torch.uint8)).consolidate()
    x = td["x"]
    samples = []
    def stamp(r):
        x[0] = r % 256
        x[-1] = r % 256
    if mode == "lat":
        for r in range(WARMUP + rounds):
            stamp(r)
            t0 = time.perf_counter()
            AWAIT pipe.SEND(td)
            echo = AWAIT pipe.RECV()
            t1 = time.perf_counter()
            assert ok(echo, r), r
            if r >= WARMUP:
                samples.append((t1 - t0) * 1e6)
    else:
        for r in range(WARMUP):
            stamp(r)
            AWAIT pipe.SEND(td)
        AWAIT pipe.RECV()
        t0 = time.perf_counter()
        for r in range(WARMUP, WARMUP + rounds):
            stamp(r)
            AWAIT pipe.SEND(td)
        AWAIT pipe.RECV()
        samples.append((time.perf_counter() - t0) * 1e6 / rounds)
    samples.sort()
    print(json.dumps({"median_us": samples[len(samples) // 2]}), flush=True)
    CLOSE
RUN(main())
"""
ASYNC_WORDS = {"AWAIT ": "await ", "ASYNC ": "async ", "SEND": "asend", "RECV": "arecv",
               "RUN": "asyncio.run", "SLEEP": "await asyncio.sleep(0.5)"}
OURS_OPEN = {
    "IMPORTS": "from tensordict_cpp import TensorDict, TensorDictPipe",
    "SERVER_OPEN": 'pipe = TensorDictPipe.listen_sync(port, timeout=120.0)\n'
                   '        print("listening", flush=True)',
    "CLIENT_OPEN": 'pipe = TensorDictPipe.connect_sync("127.0.0.1", port, timeout=120.0)',
    "CLOSE": "pipe.close()",
}
PEERS = {
    "sync": {**OURS_OPEN, "AWAIT ": "", "ASYNC ": "", "SEND": "send", "RECV": "recv", "RUN": "",
             "SLEEP": "time.sleep(0.5)"},
    "async": {**OURS_OPEN, **ASYNC_WORDS},
    "reference": {
        **ASYNC_WORDS,
        "IMPORTS": "import ucxx\nfrom tensordict import TensorDict\n"
                   "from tensordict._ucxx import TensorDictPipe",
        # The reference's pipe takes the endpoint of ucxx's listener callback.
        "SERVER_OPEN": "got = asyncio.get_running_loop().create_future()\n"
                       "        async def on_connect(ep):\n"
                       "            if not got.done():\n"
                       "                got.set_result(ep)\n"
                       "        listener = ucxx.create_listener(on_connect, port=port)\n"
                       '        print("listening", flush=True)\n'
                       "        pipe = TensorDictPipe(await got, listener=listener)",
        "CLIENT_OPEN": 'pipe = await TensorDictPipe.connect("127.0.0.1", port)',
        "CLOSE": "await pipe.aclose()",
    },
}


def python_peer(peer: str, mode: str, nbytes: int, rounds: int, env: dict) -> float:
    """Two Python processes running PEER as `peer` ("sync" / "async": ours with send / recv
    or asend / arecv; "reference": the reference's pipe on ucxx); the client's median, us."""
    script = PEER
    for placeholder, text in PEERS[peer].items():
        script = script.replace(placeholder, text)
    args = [mode, str(nbytes), str(rounds), str(free_port())]
    server = subprocess.Popen([sys.executable, "-c", script, "server", *args], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "listening":
            raise RuntimeError(f"{peer} pipe server failed: {server.stderr.read()[-1500:]}")
        out = subprocess.run([sys.executable, "-c", script, "client", *args], env=env,
                             capture_output=True, text=True, timeout=900)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if not lines:
            raise RuntimeError(f"{peer} pipe {mode} failed: {out.stderr[-1500:]}")
        return json.loads(lines[-1])["median_us"]
    finally:
        server.kill()
        server.wait()


def reference(mode: str, nbytes: int, rounds: int, env: dict) -> float:
    return python_peer("reference", mode, nbytes, rounds, env)


# ---- one raw Gloo send ------------------------------------------------------------------------
GLOO_PEER = r"""
import os, sys, time, json, torch, torch.distributed as dist
rank, nbytes, rounds, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
buf = torch.zeros(nbytes, dtype=torch.uint8)
ack = torch.zeros(1, dtype=torch.uint8)
samples = []
for r in range(5 + rounds):
    if rank == 0:
        buf[0] = r % 256
        t0 = time.perf_counter()
        dist.send(buf, 1)
        dist.recv(ack, 1)
        if r >= 5:
            samples.append((time.perf_counter() - t0) * 1e6)
    else:
        dist.recv(buf, 0)
        assert int(buf[0]) == r % 256
        dist.send(ack, 0)
if rank == 0:
    samples.sort()
    print(json.dumps({"median_us": samples[len(samples) // 2]}), flush=True)
dist.destroy_process_group()
"""


def gloo(nbytes: int, rounds: int) -> float:
    port = str(free_port())
    env = env_for("default")
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_PEER, str(rank), str(nbytes),
                               str(rounds), port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    lines = [line for line in outs[0][0].splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"gloo failed: {outs[0][1][-1000:]}{outs[1][1][-1000:]}")
    return json.loads(lines[-1])["median_us"]


# ---- the run ----------------------------------------------------------------------------------
def measure(quick: bool, repeats: int) -> dict:
    """Medians over `repeats` runs of every arm, per setting. --quick (the test suite's smoke
    run, which checks that every arm runs, not its speed) streams 4 MB instead of 100 MB."""
    lat_rounds, bw_rounds = (500, 5) if quick else (5000, 10)
    big = QUICK_BIG if quick else MB100
    results: dict = {"big": big, "gloo_big": []}
    for setting in SETTINGS:
        env = env_for(setting)
        r = results[setting] = {k: [] for k in ("perftest_lat", "perftest_bw", "perftest_bw_seg",
                                                "ours_lat", "ours_bw", "ref_lat", "ref_bw")}
        for _ in range(repeats):
            r["perftest_lat"].append(perftest("tag_lat", KB, lat_rounds * 4, env))
            r["perftest_bw"].append(perftest("tag_bw", big, bw_rounds * 2, env))
            if setting == "tcp":  # the segments change nothing on shared memory
                r["perftest_bw_seg"].append(perftest("tag_bw", big, bw_rounds * 2,
                                                     {**env, **PIPE_TCP_SEGMENTS}))
            lat, r["transports_lat"] = ours("lat", KB, lat_rounds, env)
            r["ours_lat"].append(lat)
            bw, r["transports_bw"] = ours("bw", big, bw_rounds, env)
            r["ours_bw"].append(bw)
            r["ref_lat"].append(reference("lat", KB, lat_rounds // 5, env))
            r["ref_bw"].append(reference("bw", big, max(2, bw_rounds // 2), env))
            if setting == "default":
                python_arms(r, env, lat_rounds, bw_rounds, big)
            print(f"pipe_bench: {setting}: " + ", ".join(
                f"{k} {v[-1]:.1f}" for k, v in r.items() if isinstance(v, list) and v),
                file=sys.stderr, flush=True)
    for _ in range(repeats):
        results["gloo_big"].append(gloo(big, 5 if quick else 10))
    return results


def mb(results: dict) -> str:
    """The large case's size, as the tables name it."""
    return f"{results['big'] >> 20} MB"


def python_arms(r: dict, env: dict, lat_rounds: int, bw_rounds: int, big: int) -> None:
    """Ours from C++, from Python (sync and asyncio) and the reference's pipe, appended to `r`
    (one run each), in four cases: 1 KB and the run's large size (`big`), each as a stream
    ("bw": time per message) and as an echo ("lat": the round trip, the receiver sending back
    the TensorDict it received)."""
    def rounds(nbytes: int) -> int:
        return lat_rounds if nbytes == KB else bw_rounds
    r.setdefault("perftest_bw1k", []).append(perftest("tag_bw", KB, lat_rounds * 4, env))
    for key, mode, nbytes in (("stream1k", "bw", KB), ("echo1k", "lat", KB),
                              ("stream_big", "bw", big), ("echo_big", "lat", big)):
        r.setdefault(f"cpp_{key}", []).append(ours(mode, nbytes, rounds(nbytes), env)[0])
        for api in ("sync", "async"):
            r.setdefault(f"py_{api}_{key}", []).append(
                python_peer(api, mode, nbytes, rounds(nbytes), env))
        r.setdefault(f"ref_{key}", []).append(
            reference(mode, nbytes, max(2, rounds(nbytes) // 5), env))


def python_table(results: dict) -> tuple[str, list[tuple[str, float, float, bool]]]:
    """The Python comparison (UCX's choice of transports) and the pipe's goals (above)."""
    med = statistics.median
    r = results["default"]
    m = {k: med(v) for k, v in r.items() if k.startswith(("cpp_", "py_", "ref_", "perftest_"))
         and isinstance(v, list) and v}
    size = mb(results)
    names = {"stream1k": "1 KB stream, per message", "echo1k": "1 KB echo, round trip",
             "stream_big": f"{size} stream, per message", "echo_big": f"{size} echo, round trip"}
    floors = {"stream1k": f"{fmt(m['perftest_bw1k'])} (tag_bw)",
              "echo1k": f"{fmt(m['perftest_lat'])} (2 x tag_lat)",
              "stream_big": f"{fmt(m['perftest_bw'])} (tag_bw)", "echo_big": ""}
    rows = ["| case | ours, C++ | ours, Python send / recv | ours, Python asend / arecv | "
            "reference pipe (asyncio) | ucx_perftest |", "|---|--:|--:|--:|--:|--:|"]
    for key, name in names.items():
        rows.append(f"| {name} | {fmt(m[f'cpp_{key}'])} | {fmt(m[f'py_sync_{key}'])} | "
                    f"{fmt(m[f'py_async_{key}'])} | {fmt(m[f'ref_{key}'])} | {floors[key]} |")
    ratio = [
        ("1 KB stream: Python asend / arecv over send / recv (goal <= 3)",
         m["py_async_stream1k"] / m["py_sync_stream1k"], 3, "<="),
        ("1 KB stream: the reference over Python asend / arecv (goal >= 10)",
         m["ref_stream1k"] / m["py_async_stream1k"], 10, ">="),
        ("1 KB echo: the reference over Python asend / arecv (goal >= 10)",
         m["ref_echo1k"] / m["py_async_echo1k"], 10, ">="),
        (f"{size} stream: Python send / recv over C++ (goal <= 1.2)",
         m["py_sync_stream_big"] / m["cpp_stream_big"], 1.2, "<="),
        (f"{size} stream: Python asend / arecv over C++ (goal <= 1.2)",
         m["py_async_stream_big"] / m["cpp_stream_big"], 1.2, "<="),
    ]
    for api, label in (("cpp", "C++"), ("py_sync", "Python send / recv"),
                       ("py_async", "Python asend / arecv")):
        ratio.append((f"{size} echo, {label}: the round trip over 2 stream messages (goal <= 1.1)",
                      m[f"{api}_echo_big"] / (2 * m[f"{api}_stream_big"]), 1.1, "<="))
    goals = [(g, v, limit, v <= limit if op == "<=" else v >= limit) for g, v, limit, op in ratio]
    goal_rows = ["| goal | measured | met |", "|---|--:|---|"]
    goal_rows += [f"| {g} | {v:.2f} | {'yes' if ok else '**no**'} |" for g, v, _, ok in goals]
    return "\n".join(rows) + "\n\n" + "\n".join(goal_rows), goals


def fmt(us: float) -> str:
    return f"{us / 1000:,.2f} ms" if us >= 1000 else f"{us:,.1f} µs"


def table(results: dict) -> tuple[str, list[tuple[str, float, float, bool]]]:
    med = statistics.median
    gloo_us, size = med(results["gloo_big"]), mb(results)
    rows = ["| UCX transports | case | ours (C++) | ucx_perftest | ucx_perftest, the pipe's TCP "
            "segments | reference pipe | raw Gloo send | lanes UCX chose |",
            "|---|---|--:|--:|--:|--:|--:|---|"]
    goals = []
    for setting in SETTINGS:
        r = results[setting]
        name = "UCX's choice" if setting == "default" else "UCX_TLS=tcp"
        lat, plat, rlat = med(r["ours_lat"]), med(r["perftest_lat"]), med(r["ref_lat"])
        bw, pbw, rbw = med(r["ours_bw"]), med(r["perftest_bw"]), med(r["ref_bw"])
        sbw = med(r["perftest_bw_seg"]) if r["perftest_bw_seg"] else None
        rows.append(f"| {name} | 1 KB round trip | {fmt(lat)} | {fmt(plat)} (2 x tag_lat) | | "
                    f"{fmt(rlat)} | | {r['transports_lat']} |")
        rows.append(f"| {name} | {size}, per message | {fmt(bw)} | {fmt(pbw)} (tag_bw) | "
                    f"{fmt(sbw) if sbw else ''} | {fmt(rbw)} | {fmt(gloo_us)} | "
                    f"{r['transports_bw']} |")
        goals += [
            (f"{name}: 1 KB round trip / ucx_perftest's (goal <= 3)", lat / plat, 3, lat / plat <= 3),
            (f"{name}: {size} / ucx_perftest tag_bw's (goal <= 1.25)", bw / pbw, 1.25,
             bw / pbw <= 1.25),
        ]
        if sbw:
            goals.append((f"{name}: {size} / ucx_perftest tag_bw's with the pipe's TCP segments "
                          "(<= 1.25)", bw / sbw, 1.25, bw / sbw <= 1.25))
        goals += [
            (f"{name}: {size}, raw Gloo send / ours (goal >= 2)", gloo_us / bw, 2, gloo_us / bw >= 2),
            (f"{name}: 1 KB, reference / ours (goal >= 5)", rlat / lat, 5, rlat / lat >= 5),
            (f"{name}: {size}, reference / ours (goal >= 2)", rbw / bw, 2, rbw / bw >= 2),
        ]
    goal_rows = ["| goal | measured | met |", "|---|--:|---|"]
    goal_rows += [f"| {g} | {v:.2f} | {'yes' if ok else '**no**'} |" for g, v, _, ok in goals]
    return "\n".join(rows) + "\n\n" + "\n".join(goal_rows), goals


def section(results: dict) -> str:
    """The Markdown of docs/benchmarks.md's pipe section: how it measures, the table, the goals."""
    md, _ = table(results)
    return (
        "`benchmarks/pipe_bench.py`: our TensorDictPipe (C++, `build/pipe_bench`, two processes) "
        "beside `ucx_perftest` (the libucx-cu12 wheel's, the UCX the pipe links, with peer error "
        "handling `-e` and `UCX_MM_ERROR_HANDLING=y` as the pipe's endpoints have them, so that "
        "UCX offers both the same transports), the reference's pipe on ucxx (two Python "
        "processes) and one raw Gloo send (two processes, no UCX), each run in this run, under "
        "UCX's own choice of transports and under `UCX_TLS=tcp`. Cases: a round trip of a "
        "consolidated 1 KB TensorDict (the schema sent once in the warm-up; each way then one "
        "tag message, the flag byte joined to the storage between peers of ours, as "
        "ucx_perftest's one message each way; the reference sends two), and one "
        f"{mb(results)} "
        "TensorDict in a stream of them (time per message; the raw Gloo send includes a 1-byte "
        "acknowledgement). The pipe sets UCX's TCP segments to 256 KiB (docs/pipe.md, "
        "\"Speed\"); ucx_perftest's tag_bw runs with UCX's defaults and with those segments. "
        "Medians of the runs' medians; the machine is a 2-core VM, where ucx_perftest's own "
        "latency is bimodal (about 0.2 or 1 µs one way).\n\n"
        + md + "\n\n"
        "From Python, under UCX's choice of transports (two processes each; the 1 KB echo is "
        "the round trip above): our pipe's `send` / `recv` and `asend` / `arecv` "
        "(tensordict_cpp.TensorDictPipe, `PEER` in benchmarks/pipe_bench.py, the "
        "reference's protocol line for line), beside the same cases from C++ and on the "
        "reference's pipe. An echo sends back the TensorDict it received, as it is.\n\n"
        + python_table(results)[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, 4 MB for 100 MB")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every arm (median)")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args()
    results = measure(args.quick, args.repeats)
    print(section(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
