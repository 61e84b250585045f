// Publication's contract (publication_contract.h) over a c10d group's GroupLink
// (src/distributed/group_link.h): four ProcessGroupGloo backends in this process over one
// HashStore (the publisher's rank 0 and three subscriber ranks), each built on a thread of its
// own, each connection a channel of its own between rank 0 and one of the others; the relay
// scenarios over a channel of their own between every two of the four.

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <vector>

#include "distributed/group_link.h"
#include "publication_contract.h"
#include "tensordict/distributed/process_group.h"

namespace publication_contract {
namespace {

constexpr int kRanks = 4;

// Built once, kept for the life of the process: what the tests parked lives as long as its group.
const std::array<tensordict::dist::Group, kRanks>& groups() {
  static const auto* made = [] {
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<std::future<tensordict::dist::BackendPtr>> ranks;
    for (int r = 0; r < kRanks; ++r) {
      ranks.push_back(std::async(std::launch::async, [store, r] {
        return tensordict::dist::make_gloo_backend(store, r, kRanks, std::chrono::seconds(30),
                                                   "127.0.0.1");
      }));
    }
    auto* g = new std::array<tensordict::dist::Group, kRanks>;
    for (int r = 0; r < kRanks; ++r) (*g)[r] = ranks[r].get();
    return g;
  }();
  return *made;
}

std::atomic<int64_t> next_channel{1};

struct GlooTransport {
  static constexpr const char* kName = "gloo";
  Connection connect() {
    const int64_t channel = next_channel++;
    const int rank = 1 + static_cast<int>(channel % (kRanks - 1));
    const auto& g = groups();
    return {std::make_shared<tensordict::dist::detail::GroupLink>(g[0], rank, channel),
            std::make_shared<tensordict::dist::detail::GroupLink>(g[rank], 0, channel)};
  }
  /// The four ranks on a channel of their own, rank i's link to rank j on it: as
  /// dist::Publisher and dist::Subscriber make theirs (src/distributed/publication.cpp).
  Mesh mesh(int n) {
    TORCH_CHECK(n <= kRanks, "a Gloo mesh of ", n, " ranks: the groups have ", kRanks);
    const int64_t channel = next_channel++;
    return {[channel](int from, int to) -> std::shared_ptr<pub::Link> {
      return std::make_shared<tensordict::dist::detail::GroupLink>(groups()[from], to, channel);
    }};
  }
};

}  // namespace

INSTANTIATE_PUBLICATION_CONTRACT(Gloo, GlooTransport);
INSTANTIATE_RELAY_CONTRACT(Gloo, GlooTransport);

}  // namespace publication_contract
