// A program written against the installed package, as README.md and docs/publication.md show
// it. It runs the core; the transports' publication classes are compiled and linked (each
// built in a branch that never runs: a run would need peers).
#include <ATen/ATen.h>

#include <chrono>
#include <iostream>
#include <optional>

#include "tensordict/publication.h"
#include "tensordict/tensordict.h"
#ifdef CONSUMER_WITH_DIST
#include "tensordict/distributed/publication.h"
#endif
#ifdef CONSUMER_WITH_PIPE
#include "tensordict/pipe/publication.h"
#endif

using namespace std::chrono_literals;

#ifdef CONSUMER_WITH_DIST
// docs/publication.md, "C++": the group's publication.
void over_a_group(const tensordict::TensorDict& td) {
  namespace dist = tensordict::dist;
  dist::Publisher pub({.max_slots = 2});  // on rank 0
  const int64_t v = pub.publish(td);
  pub.wait_for_subscribers(30s);
  dist::Subscriber sub({.src = 0});  // on a worker
  std::optional<tensordict::Pulled> first = sub.pull({.timeout = 30s});
  std::optional<int64_t> next = sub.pull(first->td, {.timeout = 0ms, .min_version = v});
  std::cout << next.value_or(0) << pub.stats().size() << "\n";
}
#endif

#ifdef CONSUMER_WITH_PIPE
// docs/publication.md, "Over the pipe": the same over a server's pipes.
void over_the_pipe(const tensordict::TensorDict& td) {
  namespace pipe = tensordict::pipe;
  pipe::TensorDictServer server(5555, "0.0.0.0");
  pipe::Publisher pub(server, {.max_slots = 2});
  pub.publish(td);
  pub.wait_for_subscribers(30s, /*count=*/1);
  pipe::Subscriber sub(pipe::Pipe::connect("127.0.0.1", 5555));
  std::optional<tensordict::Pulled> first = sub.pull({.timeout = 30s});
  std::optional<int64_t> next = sub.pull(first->td, {.timeout = 0ms});
  std::cout << next.value_or(0) << pub.stats().size() << "\n";
}
#endif

int main(int argc, char** /*argv*/) {
  tensordict::TensorDict td({{"a", at::ones({4})}, {"b", at::ones({4, 3})}}, {4});
  const float sum = td.get("b").tensor().sum().item<float>();
  std::cout << "consumer: sum of b = " << sum << "\n";
  if (argc > 1000) {  // never: these need peers
#ifdef CONSUMER_WITH_DIST
    over_a_group(td);
#endif
#ifdef CONSUMER_WITH_PIPE
    over_the_pipe(td);
#endif
  }
  return sum == 12.0f ? 0 : 1;
}
