// Two ranks exchange a tensorclass: a per-leaf send into an instance of the same structure,
// then init_remote / from_remote_init (the receiver needs no structure; the class name
// travels), then consolidated sends into the same storage. Rank 1 prints "fake 6" (per-leaf
// sends carry tensors only) and "real 2".
// Run it as is (dist::run starts both ranks, Gloo over 127.0.0.1), or under torchrun:
// torchrun --standalone --nproc-per-node 2 --no-python ./tensorclass
#include <ATen/ATen.h>

#include <iostream>

#include "tensordict/distributed/runner.h"
#include "tensordict/distributed/tensorclass.h"
#include "tensordict/tensorclass.h"

namespace dist = tensordict::dist;

TENSORDICT_TENSORCLASS(Pose, (at::Tensor, q));

// A Python peer declares `@tensorclass class MyData` in its script: "__main__.MyData".
TENSORDICT_TENSORCLASS_NAMED(
    MyData, "__main__.MyData", (at::Tensor, obs), (at::Tensor, reward),
    (std::string, source),  // non-tensor: travels with init_remote, not with per-leaf sends
    (Pose, pose));

MyData make(float fill, const std::string& source) {
  return MyData(at::full({3, 4}, fill), at::full({3}, fill), source,
                Pose(at::full({3, 2}, fill), {3}), /*batch_size=*/{3});
}

int main() {
  dist::run(
      [](int rank, int /*world_size*/) {
        // Per-leaf send / recv: the receiver holds an instance of the same structure.
        if (rank == 0) {
          dist::send(make(1, "real"), /*dst=*/1);
        } else {
          MyData data = make(0, "fake");
          dist::recv(data, /*src=*/0);
          std::cout << data.source() << " " << data.pose().q().sum().item<float>() << std::endl;
        }
        // init_remote: consolidate once, then each send is one message and copies nothing.
        if (rank == 0) {
          MyData sent = dist::init_remote(make(2, "real"), /*dst=*/1);
          for (int step = 0; step < 3; ++step) {
            sent.obs().fill_(step);  // in place: the fields are views of the sent storage
            dist::send(sent, 1, {.consolidated = true});
          }
        } else {
          MyData data = dist::from_remote_init<MyData>(/*src=*/0);
          for (int step = 0; step < 3; ++step) {
            dist::recv(data, 0, {.consolidated = true});  // into the same storage
          }
          std::cout << data.source() << " " << data.obs()[0][0].item<float>() << std::endl;
        }
      },
      /*world_size=*/2);
  return 0;
}
