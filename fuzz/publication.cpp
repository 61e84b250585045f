// Fuzz target: what the two sides of a publication read from each other (src/wire/include/
// wire/publication.h, docs/wire-format.md §9), without Gloo: the publisher a request, the
// subscriber an offer checked against what it holds, then the schema that follows a new
// version and the TensorDict rebuilt over a storage of the announced size.
//
// Input: one control byte, then the 64-byte message (zero-padded if the input is shorter),
// then, for an offer, the schema message. Control bit 0: the message is an offer (else a
// request); bit 1: the subscriber holds a version (epoch 5, version 3, a schema of hash 77 and
// 64 bytes); bit 2: patch the offer's schema hash to match the schema message, so that inputs
// reach the metadata reader (a publisher computes it too).
// Expected errors: c10::Error from the readers. Findings: crashes, sanitizer reports, a decoded
// message that does not encode back to its bytes, an offer accepted against its own checks
// (a version that goes back, sizes out of bounds), a leaf outside the announced storage.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "core/bytes.h"
#include "fuzz_util.h"
#include "wire/publication.h"

using namespace tensordict;
namespace pub = tensordict::wire::publication;

namespace {

constexpr int64_t kMaxData = int64_t{1} << 20;  // the subscriber's max_total_bytes here

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t control = data[0];
  std::vector<uint8_t> message(pub::kMessageBytes, 0);
  const size_t n = std::min(size - 1, pub::kMessageBytes);
  std::memcpy(message.data(), data + 1, n);
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1 + n, size - 1 - n);
  try {
    if ((control & 1) == 0) {
      const pub::Request r = pub::decode_request("fuzz", message.data());
      if (pub::encode(r) != std::string(message.begin(), message.end())) {
        fuzz::fail("a request does not encode back to its bytes");
      }
      if (r.version < 0 || r.min_version < 0 || r.wait_ms < -1) fuzz::fail("a bad request passed");
      return 0;
    }
    if (control & 4) core::put_le(message.data() + 56, pub::schema_hash(rest));
    const pub::Offer o = pub::decode_offer("fuzz", message.data());
    pub::Held held;
    held.seq = o.seq;  // the seq check is plain equality; let inputs past it
    held.max_data_bytes = kMaxData;
    if (control & 2) {
      held.epoch = 5;
      held.version = 3;
      held.schema = 77;
      held.data_bytes = 64;
    }
    if (o.status != pub::Status::kNew) return 0;
    pub::check_offer("fuzz", o, held);
    if (o.data_bytes < 0 || o.data_bytes > kMaxData) fuzz::fail("an offer's size passed");
    if (o.epoch == held.epoch && o.version <= held.version) fuzz::fail("a version went back");
    if (o.schema_bytes == 0) return 0;                                 // the held schema is reused
    if (static_cast<size_t>(o.schema_bytes) != rest.size()) return 0;  // a short message
    const core::ValidatedMetadata m = pub::read_schema("fuzz", o, rest);
    if (m.storage_bytes() > o.data_bytes) fuzz::fail("a schema larger than its storage passed");
    const at::Tensor storage = fuzz::storage_of(std::string(o.data_bytes, '\1'), 0);
    fuzz::touch(core::rebuild_validated(m, storage), &storage);
  } catch (const c10::Error&) {
    // A refused message: what the readers are for.
  }
  return 0;
}
