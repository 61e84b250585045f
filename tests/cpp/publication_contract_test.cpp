// Publication's contract (publication_contract.h) over the loopback link (publication_links.h):
// the engine with nothing between its two ends but the faults injected, and the loopback's own
// clean close.

#include <memory>

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
};

}  // namespace

INSTANTIATE_PUBLICATION_CONTRACT(Loopback, LoopbackTransport);

}  // namespace publication_contract
