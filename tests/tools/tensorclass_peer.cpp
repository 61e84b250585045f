// Rank 1 of a C++ <-> Python tensorclass exchange (tests/python/test_tensorclass_cpp_peer.py):
// joins the default group through env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), receives
// the reference's `__main__.MyDistData` with from_remote_init, and sends back a changed one
// with init_remote, which carries the same class name.
#include <ATen/ATen.h>

#include <iostream>

#include "tensordict/distributed/runner.h"
#include "tensordict/distributed/tensorclass.h"

namespace dist = tensordict::dist;

TENSORDICT_TENSORCLASS_NAMED(MyDistData, "__main__.MyDistData", (at::Tensor, obs),
                             (at::Tensor, reward), (std::string, label), (int64_t, step));

int main() {
  dist::run(
      [](int rank, int) {
        TORCH_CHECK(rank == 1, "tensorclass_peer runs rank 1; the Python reference is rank 0");
        MyDistData got = dist::from_remote_init<MyDistData>(0);
        std::cout << got.label() << " " << got.step() << " " << got.obs().sum().item<float>()
                  << std::endl;
        MyDistData reply(got.obs() + 1, got.reward() * 2, got.label() + " and C++", got.step() + 1,
                         got.batch_size());
        dist::init_remote(reply, 0);
      },
      2);
  return 0;
}
