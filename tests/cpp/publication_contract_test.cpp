// Publication's contract (publication_contract.h) over the loopback link (publication_links.h):
// the engine with nothing between its two ends but the faults injected, and the loopback's own
// clean close; and the relay scenarios, over a mesh of loopbacks. And the piece checksum held to
// its definition in docs/wire-format.md §9.9.

#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "publication_contract.h"
#include "wire/publication.h"

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

// §9.9's checksum as the text says it, word by word: what both ends of every relay compute, so
// that a change in the fast one (lanes held otherwise, a copy fused in) cannot pass unnoticed.
uint64_t checksum_as_written(const std::vector<uint8_t>& b) {
  constexpr uint64_t kK = 0x9E3779B97F4A7C15ull;
  uint64_t lane[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                      0x082EFA98EC4E6C89ull};
  const size_t blocks = b.size() / 32;
  for (size_t k = 0; k < blocks; ++k) {
    for (size_t l = 0; l < 4; ++l) {
      uint64_t w = 0;
      for (size_t j = 0; j < 8; ++j) w |= static_cast<uint64_t>(b[32 * k + 8 * l + j]) << (8 * j);
      lane[l] = (lane[l] ^ w) * kK;
      lane[l] ^= lane[l] >> 29;
    }
  }
  uint64_t out = b.size();
  for (size_t i = 32 * blocks; i < b.size(); ++i) out = (out ^ b[i]) * kK;
  for (const uint64_t h : lane) {
    out = (out ^ h) * kK;
    out ^= out >> 31;
  }
  return out;
}

TEST(PieceChecksum, IsTheWireFormatsAndTheCopyingOneCopiesExactly) {
  for (const size_t n : {0, 1, 31, 32, 33, 4096, (1 << 20) + 13}) {
    std::vector<uint8_t> b(n);
    for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
    const uint64_t want = checksum_as_written(b);
    EXPECT_EQ(pub::piece_checksum(b.data(), n), want) << n << " bytes";
    std::vector<uint8_t> to(n + 1, 0xAB);
    EXPECT_EQ(pub::copy_piece_checksum(to.data(), b.data(), n), want) << n << " bytes";
    EXPECT_TRUE(std::equal(b.begin(), b.end(), to.begin())) << n << " bytes";
    EXPECT_EQ(to[n], 0xAB) << n << " bytes: written past the end";
    if (n > 0) {
      b[n / 2] ^= 1;
      EXPECT_NE(pub::piece_checksum(b.data(), n), want) << n << " bytes, one bit flipped";
    }
  }
}

}  // namespace

INSTANTIATE_PUBLICATION_CONTRACT(Loopback, LoopbackTransport);
INSTANTIATE_RELAY_CONTRACT(Loopback, LoopbackTransport);

}  // namespace publication_contract
