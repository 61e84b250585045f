// Fuzz target: what a relayed version's receiver reads (src/wire/include/wire/publication.h,
// docs/wire-format.md §9.9): the publisher's route message after a kRelay offer, a piece's
// header, and a resume or host request, without Gloo.
//
// Input: one control byte, then the message. Control bits 0-1: 0 a route (after an offer of
// version 3 of epoch 5 answering request 1, of the storage size in the next 4 bytes, at most
// 16 MiB; the rest zero-padded or cut to the route's fixed size), 1 a piece header (56 bytes),
// 2 a request (64 bytes: a resume or a host message when its word says so).
// Expected errors: c10::Error from the readers. Findings: crashes, sanitizer reports, a route
// or a request that does not encode back to its bytes, a route whose fields break the bounds
// it was checked against (pieces, children, checksums, the slots of a parent of its epoch).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/bytes.h"
#include "fuzz_util.h"
#include "wire/publication.h"

using namespace tensordict;
namespace pub = tensordict::wire::publication;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t control = data[0] & 3;
  const uint8_t* rest = data + 1;
  const size_t left = size - 1;
  try {
    if (control == 0) {
      if (left < 4) return 0;
      pub::Offer offer;
      offer.status = pub::Status::kRelay;
      offer.seq = 1;
      offer.epoch = 5;
      offer.version = 3;
      offer.data_bytes = static_cast<int64_t>(core::get_le(rest, 4) % ((1u << 24) + 1));
      const auto n = static_cast<size_t>(pub::max_route_bytes(offer.data_bytes));
      std::vector<uint8_t> message(n, 0);
      std::memcpy(message.data(), rest + 4, std::min(n, left - 4));
      const pub::Route r = pub::decode_route("fuzz", message.data(), offer);
      if (pub::encode(r, offer.data_bytes) != std::string(message.begin(), message.end())) {
        fuzz::fail("a route does not encode back to its bytes");
      }
      const int64_t pieces = pub::piece_count(offer.data_bytes, r.piece_bytes);
      if (r.piece_bytes < pub::kMinPieceBytes || r.piece_bytes > pub::kMaxPieceBytes ||
          r.first < 0 || r.first >= pieces || r.children.size() > pub::kMaxChildren ||
          (!r.checksums.empty() && static_cast<int64_t>(r.checksums.size()) != pieces) ||
          (r.host_parent.pid != 0 && (r.parent < 0 || r.host_parent.epoch != offer.epoch))) {
        fuzz::fail("a route out of its bounds passed");
      }
      return 0;
    }
    if (control == 1) {
      std::vector<uint8_t> header(pub::kPieceHeaderBytes, 0);
      std::memcpy(header.data(), rest, std::min(header.size(), left));
      if (const auto h = pub::decode_piece_header(header.data())) {
        std::vector<uint8_t> again(pub::kPieceHeaderBytes, 0);
        pub::encode_piece_header(*h, again.data());
        if (again != header) fuzz::fail("a piece header does not encode back to its bytes");
      }
      return 0;
    }
    std::vector<uint8_t> message(pub::kMessageBytes, 0);
    std::memcpy(message.data(), rest, std::min(message.size(), left));
    const pub::Request r = pub::decode_request("fuzz", message.data());
    if (pub::encode(r) != std::string(message.begin(), message.end())) {
      fuzz::fail("a request does not encode back to its bytes");
    }
    if (r.resume != 0 && (r.epoch == 0 || r.version < 1 || r.piece < 0 || r.around < -1)) {
      fuzz::fail("a bad resume passed");
    }
  } catch (const c10::Error&) {
    // A refused message: what the readers are for.
  }
  return 0;
}
