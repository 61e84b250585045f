"""A C++ tensorclass (tests/tools/tensorclass_peer.cpp) and a reference-tensordict tensorclass
exchange data both ways with init_remote / from_remote_init: the class name travels as
"_tensorclass_type" ("__main__.MyDistData"), the non-tensor fields in the metadata."""
import os
import socket
import subprocess
import sys

from conftest import built

REFERENCE = r'''
import datetime
import torch
import torch.distributed as dist
from tensordict import TensorDict, tensorclass


@tensorclass
class MyDistData:
    obs: torch.Tensor
    reward: torch.Tensor
    label: str
    step: int


torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="env://", rank=0, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
MyDistData(obs=torch.arange(6.0).view(3, 2), reward=torch.ones(3), label="Python", step=4,
           batch_size=[3]).init_remote(dst=1)
back = TensorDict.from_remote_init(src=1)   # imports __main__ for "__main__.MyDistData"
assert type(back) is MyDistData, type(back)
assert torch.equal(back.obs, torch.arange(6.0).view(3, 2) + 1), back.obs
assert torch.equal(back.reward, torch.full((3,), 2.0)), back.reward
assert back.label == "Python and C++", back.label
assert back.step == 5, back.step
assert back.batch_size == torch.Size([3])
print("reference ok")
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpp_tensorclass_and_reference_tensorclass(tmp_path):
    script = tmp_path / "reference.py"
    script.write_text(REFERENCE)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    ref = subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK="0"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cpp = subprocess.run([str(built("tensorclass_peer"))], env=dict(env, RANK="1"),
                             capture_output=True, text=True, timeout=90)
        ref_out, ref_err = ref.communicate(timeout=90)
    finally:
        ref.kill()
    assert cpp.returncode == 0, cpp.stderr
    assert ref.returncode == 0, ref_err
    assert cpp.stdout.split("\n")[0] == "Python 4 15", cpp.stdout
    assert "reference ok" in ref_out
