// Two ranks: rank 0 sends a TensorDict, rank 1 receives it into zeros of the same structure.
// Run it as is (dist::run starts both ranks on this host, Gloo over 127.0.0.1), or under
// torchrun: torchrun --standalone --nproc-per-node 2 --no-python ./send_recv
#include <ATen/ATen.h>

#include <iostream>

#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/runner.h"
#include "tensordict/tensor_dict.h"

using tensordict::TensorDict;
namespace dist = tensordict::dist;

int main() {
  dist::run(
      [](int rank, int /*world_size*/) {
        if (rank == 0) {
          TensorDict td({{"a", at::ones({4})}, {"b", at::ones({4, 3})}}, {4});
          dist::send(td, /*dst=*/1);
        } else if (rank == 1) {
          TensorDict td({{"a", at::zeros({4})}, {"b", at::zeros({4, 3})}}, {4});
          dist::recv(td, /*src=*/0);
          std::cout << td.get("b").tensor().sum().item<double>() << std::endl;  // 12
        }
      },
      /*world_size=*/2);
  return 0;
}
