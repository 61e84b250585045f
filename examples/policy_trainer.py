"""One trainer, many workers (docs/publication.md): this Python trainer publishes its policy's
weights; C++ workers (examples/policy_worker.cpp) pull each new version into their own
torch::nn::Module and report its output, which the trainer compares with its own.

    python examples/policy_trainer.py --worker build/policy_worker --workers 3

The trainer never waits for a worker: publish() copies the weights into a free slot and
returns, and each worker takes the newest version when it asks, skipping those it was too slow
for. The workers' reports travel on a tag of their own.
"""
import argparse
import os
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

import tensordict_cpp as tdc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", required=True, help="the policy_worker program")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--versions", type=int, default=20)
    args = parser.parse_args()

    world = args.workers + 1
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world))
    workers = [subprocess.Popen([args.worker], env=dict(env, RANK=str(r)))
               for r in range(1, world)]
    os.environ.update(env, RANK="0")
    dist.init_process_group("gloo", init_method="env://", rank=0, world_size=world)

    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    weights = tdc.TensorDict.from_module(policy)  # the policy's own Parameters, no copy
    pub = tdc.Publisher(max_slots=2)
    x = torch.ones(1, 4)
    expected = {}  # version -> the trainer's output for it
    reports = {r: [] for r in range(1, world)}  # (version, output) per worker

    def collect(r):  # a worker's reports, until its last
        buf = torch.zeros(3)
        while True:
            dist.recv(buf, src=r, tag=1)
            if buf[0] < 0:  # it saw the publisher close
                return
            reports[r].append((int(buf[0]), buf[1:].clone()))

    threads = [threading.Thread(target=collect, args=(r,)) for r in reports]
    for t in threads:
        t.start()
    for _ in range(args.versions):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.01 * torch.randn_like(p))  # a training step
            expected[pub.publish(weights)] = policy(x).flatten()
        time.sleep(0.01)
    # Every worker has the last version (stats() is their acknowledgement), then stop them.
    deadline = time.monotonic() + 60
    while any(s["version"] != pub.version for s in pub.stats()):
        assert time.monotonic() < deadline, pub.stats()
        time.sleep(0.01)
    pub.close()  # their next pull raises NoPublisherError
    for t in threads:
        t.join(timeout=60)
    matched = 0
    for r, got in reports.items():
        assert got and got[-1][0] == pub.version, (r, got[-1:])  # every worker got the last
        for version, out in got:
            assert torch.allclose(out, expected[version]), (r, version, out)
            matched += 1
    for w in workers:
        assert w.wait(timeout=60) == 0
    print(f"{len(workers)} workers ran {matched} versions of the trainer's policy, each output "
          f"equal to the trainer's; acknowledged: {[s['version'] for s in pub.stats()]} "
          f"of {pub.version}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
