// Publication's contract (publication_contract.h) over the loopback link (publication_links.h):
// the engine with nothing between its two ends but the faults injected, and the loopback's own
// clean close; and the relay scenarios, over a mesh of loopbacks.

#include <map>
#include <memory>
#include <utility>

#include "publication_contract.h"

namespace publication_contract {
namespace {

struct LoopbackTransport {
  static constexpr const char* kName = "loopback";
  Connection connect() {
    auto wire = std::make_shared<LoopbackWire>();
    return {std::make_shared<LoopbackLink>(wire, Side::kPublisher),
            std::make_shared<LoopbackLink>(wire, Side::kSubscriber),
            [wire](Side side) { wire->close(side); }};
  }
  /// The publisher's links to each subscriber as connect()'s; between two subscribers, one
  /// LoopbackWire a direction (LoopbackPeerLink).
  Mesh mesh(int n) {
    auto made = std::make_shared<std::map<std::pair<int, int>, std::shared_ptr<pub::Link>>>();
    for (int r = 1; r < n; ++r) {
      Connection c = connect();
      (*made)[{0, r}] = c.publisher;
      (*made)[{r, 0}] = c.subscriber;
    }
    for (int a = 1; a < n; ++a) {
      for (int b = a + 1; b < n; ++b) {
        auto ab = std::make_shared<LoopbackWire>(), ba = std::make_shared<LoopbackWire>();
        (*made)[{a, b}] = std::make_shared<LoopbackPeerLink>(ab, ba, c10::str("subscriber ", b));
        (*made)[{b, a}] = std::make_shared<LoopbackPeerLink>(ba, ab, c10::str("subscriber ", a));
      }
    }
    return {[made](int from, int to) { return made->at({from, to}); }, made};
  }
};

}  // namespace

INSTANTIATE_PUBLICATION_CONTRACT(Loopback, LoopbackTransport);
INSTANTIATE_RELAY_CONTRACT(Loopback, LoopbackTransport);

}  // namespace publication_contract
