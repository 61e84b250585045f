"""Logs and counters of transfers (docs/observability.md), each case in a fresh interpreter
(TENSORDICT_LOG is read once per process): TENSORDICT_LOG=info on stderr without any logging
set-up, Python logging under "tensordict_cpp" at info and debug, the counters of the pipe and of
a two-rank Gloo transfer, and the errors of the level setter and the channel name."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

PIPE = """
import torch, tensordict_cpp
from tensordict_cpp import TensorDict, TensorDictPipe
a = TensorDictPipe.listen_sync(0, "127.0.0.1", timeout=10.0)
b = TensorDictPipe.connect_sync("127.0.0.1", a.port, timeout=10.0)
td = TensorDict(x=torch.ones(4, 2), batch_size=[4]).consolidate()
for _ in range(3):
    b.send(td)
    a.recv()
b.close(); a.close()
"""


def run(code, **env):
    full = {k: v for k, v in os.environ.items() if k != "TENSORDICT_LOG"}
    full.update(UCX_TLS="tcp", UCX_NET_DEVICES="lo", UCX_WARN_UNUSED_ENV_VARS="n", **env)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, text=True,
                       capture_output=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_env_info_writes_one_line_per_transfer_and_the_transports():
    err = run(PIPE, TENSORDICT_LOG="info").stderr
    lines = [line for line in err.splitlines() if line.startswith("tensordict_cpp: ")]
    assert any("pipe connected to 127.0.0.1:" in line and "UCX transports: tcp/lo" in line
               for line in lines), err
    assert any("pipe accepted" in line and "a tensordict-cpp peer" in line for line in lines), err
    sends = [line for line in lines if "pipe send to" in line]
    recvs = [line for line in lines if "pipe recv from" in line]
    assert len(sends) == 3 and len(recvs) == 3, err
    assert "new schema" in sends[0] and "same schema" in sends[1], sends
    assert all(" bytes in " in line and line.endswith(" us") for line in sends + recvs)


def test_off_by_default():
    assert "tensordict_cpp:" not in run(PIPE).stderr


def test_python_logging_debug_has_one_line_per_message():
    out = run(textwrap.dedent("""
        import logging, sys
        logging.basicConfig(stream=sys.stdout, level=logging.DEBUG,
                            format="%(name)s %(levelname)s %(message)s")
        import tensordict_cpp
        tensordict_cpp.set_log_level("debug")
        assert tensordict_cpp.log_level() == "debug"
    """) + PIPE).stdout
    assert "tensordict_cpp INFO pipe send to" in out, out
    debug = [line for line in out.splitlines() if line.startswith("tensordict_cpp DEBUG pipe")]
    assert len(debug) >= 6 and all(line.endswith(" bytes") for line in debug), out


def test_pipe_counters():
    out = run(PIPE + """
stats = tensordict_cpp.transfer_stats("pipe")
print(stats)
assert stats["transfers"] == 6, stats           # 3 sends and 3 receives
assert stats["messages_sent"] == stats["messages_received"] >= 3, stats
assert stats["bytes_sent"] == stats["bytes_received"] >= 3 * 32, stats
assert stats["seconds"] > 0
assert tensordict_cpp.transfer_stats("process_group")["transfers"] == 0
tensordict_cpp.reset_transfer_stats()
assert set(tensordict_cpp.transfer_stats("pipe").values()) == {0}
""").stdout
    assert "transfers" in out


def test_process_group_counters_over_two_ranks(tmp_path):
    script = tmp_path / "ranks.py"
    # Each rank writes its counters to a file of its own (two processes' prints may interleave).
    script.write_text(textwrap.dedent(f"""
        import json, torch, tensordict_cpp
        from tensordict_cpp import TensorDict
        from tensordict_cpp.distributed import run

        def worker(rank, world_size):
            td = TensorDict(a=torch.ones(4), b=torch.ones(4, 3), batch_size=[4])
            if rank == 0:
                td.send(dst=1)
                td.send(dst=1, consolidated=True)
            else:
                td.recv(src=0)
                td.consolidate().recv(src=0, consolidated=True)
            with open(f"{tmp_path}/rank{{rank}}.json", "w") as f:
                json.dump(tensordict_cpp.transfer_stats(), f)

        if __name__ == "__main__":
            run(worker, timeout=90)
    """))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, str(script)], env=env, text=True, capture_output=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    fields = ["transfers", "messages_sent", "messages_received", "bytes_sent", "bytes_received"]
    rows = {}
    for rank in (0, 1):
        stats = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert stats["seconds"] > 0, stats
        rows[rank] = [stats[k] for k in fields]
    # per leaf: 2 messages of 16 + 48 bytes; consolidated: one message of the 64-byte storage
    assert rows[0] == [2, 3, 0, 128, 0], rows
    assert rows[1] == [2, 0, 3, 0, 128], rows


def test_errors():
    import tensordict_cpp
    with pytest.raises(ValueError, match="loud"):
        tensordict_cpp.set_log_level("loud")
    with pytest.raises(ValueError, match="wire"):
        tensordict_cpp.transfer_stats("wire")
