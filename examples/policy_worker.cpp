// A C++ worker of "one trainer, many workers" (docs/publication.md): it subscribes to the
// policy that a Python trainer publishes (examples/policy_trainer.py starts it), and runs its
// own torch::nn::Module with each new version. The pull writes the version into the module's
// Parameters in place, so the module never sees half a version.
//
// Started by the trainer with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (env://).
// Per version it sends the trainer its policy's output on a fixed input, for the trainer to
// compare with its own; it stops when the trainer closes its Publisher.
#include <torch/torch.h>

#include <iostream>

#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/publication.h"
#include "tensordict/errors.h"
#include "tensordict/module.h"

namespace dist = tensordict::dist;
using namespace std::chrono_literals;

int main() {
  dist::init_process_group({.gloo_hostname = "127.0.0.1"});
  // The trainer's architecture: torch.nn.Sequential(Linear(4, 16), Tanh(), Linear(16, 2)).
  torch::nn::Sequential policy(torch::nn::Linear(4, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 2));
  tensordict::TensorDict weights = tensordict::from_module(*policy);  // the Parameters

  dist::Subscriber sub({.src = 0});
  const torch::Tensor x = torch::ones({1, 4});
  for (;;) {
    // Blocks until the trainer publishes a version newer than the one held.
    std::optional<int64_t> version;
    try {
      version = sub.pull(weights, {.timeout = 60s});
    } catch (const tensordict::NoPublisherError&) {
      break;  // the trainer closed its Publisher: done
    }
    if (!version) {
      std::cerr << "no new policy in 60 s" << std::endl;
      return 1;
    }
    torch::NoGradGuard no_grad;
    torch::Tensor out = policy->forward(x);
    std::vector<torch::Tensor> report{
        torch::cat({torch::full({1}, static_cast<float>(*version)), out.flatten()})};
    dist::default_group()->send(report, 0, /*tag=*/1)->wait();
  }
  std::vector<torch::Tensor> last{torch::full({3}, -1.0f)};  // "no more reports"
  dist::default_group()->send(last, 0, /*tag=*/1)->wait();
  dist::destroy_process_group();
  return 0;
}
