// Fuzz target: what a checked-transfer receiver reads from its peer (src/distributed/
// src/wire/include/wire/checked.h): the 64-byte header, the schema, the comparison with its own
// TensorDict and the plan of the payload messages it then drains, without Gloo.
//
// Input: one control byte, then the header (64 bytes, zero-padded if the input is shorter),
// then what the peer's schema message carries. Control bit 0: the receiver is consolidated
// (else per leaf); bit 1: patch the schema hash and the header hash to match, so that inputs
// reach the schema reader (a peer computes them too); bit 2: the receiver's schema is empty.
// A schema message shorter than the header announces is a short message: by 8 bytes or more,
// the receiver's stamp refuses it (as TailStamp does); by less, the last bytes of the buffer
// keep stamp bytes, which the reader then sees.
// Expected errors: c10::Error from the header, the hash check or the schema reader. Findings:
// crashes, sanitizer reports, a message size outside [1, chunk], messages that do not add up
// to the announced payload, a mismatch without words.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/bytes.h"
#include "fuzz_util.h"
#include "wire/checked.h"

using namespace tensordict;
using namespace tensordict::wire::checked;

namespace {

struct TooManyMessages {};

// The receiver's own side: a nested TensorDict of two leaves, as wire_order() lists them.
Schema mine(bool consolidated, bool empty) {
  if (empty) return schema_of({}, nullptr);
  static const TensorDict td = [] {
    TensorDict inner({{"c", at::arange(4)}}, {});
    return consolidate(TensorDict({{"a", at::zeros({2, 3})}, {"b", inner}}, {}));
  }();
  WireLeaves leaves = {{{"a"}, td.get("a").tensor()},
                       {{"b", "c"}, td.get("b").tensordict().get("c").tensor()}};
  if (!consolidated) return schema_of(leaves, nullptr);
  const at::Tensor storage = consolidated_storage(td);
  return schema_of(leaves, &storage);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t control = data[0];
  std::vector<uint8_t> header(kCheckedHeaderBytes, 0);
  const size_t header_in = std::min(size - 1, kCheckedHeaderBytes);
  if (header_in) std::memcpy(header.data(), data + 1, header_in);
  const uint8_t* rest = data + 1 + header_in;
  const size_t rest_size = size - 1 - header_in;

  // The schema size the header announces (bytes 24..31), as the receiver posts it.
  uint64_t announced = 0;
  for (int i = 0; i < 8; ++i) announced |= uint64_t{header[24 + i]} << (8 * i);
  if (announced > rest_size + 8 || announced > kMaxSchemaBytes) return 0;  // refused unread
  std::vector<uint8_t> blob(announced);
  const size_t got = std::min<size_t>(rest_size, announced);
  if (got) std::memcpy(blob.data(), rest, got);
  for (size_t i = got; i < blob.size(); ++i) blob[i] = static_cast<uint8_t>(0xa5 ^ i);  // stamp

  if (control & 2) {
    core::put_le(header.data() + 32, fnv1a(blob.data(), blob.size()));
    core::put_le(header.data() + 56, fnv1a(header.data(), 56));
  }
  Header h;
  try {
    h = decode_header("recv", header.data());
  } catch (const c10::Error&) {
    return 0;
  }
  if (h.schema_bytes != announced) fuzz::fail("decode_header read another schema size");
  if (h.chunk_bytes < kMinChunkBytes || h.chunk_bytes > kMaxChunkBytes) {
    fuzz::fail("decode_header accepted a chunk size outside the bounds");
  }
  if (fnv1a(blob.data(), blob.size()) != h.schema_hash) return 0;  // the receiver's hash check

  const Schema own = mine(control & 1, control & 4);
  try {
    if (describe_mismatch("recv", h, blob.data(), own).empty()) {
      fuzz::fail("a mismatch without words");
    }
  } catch (const c10::Error&) {
    return 0;
  }
  // The drain plan: every message within one chunk, adding up to the announced payload. A
  // real receiver waits on the network for each; here the count is capped.
  uint64_t total = 0;
  size_t count = 0;
  try {
    for_each_message("recv", h, blob.data(), [&](int64_t n) {
      if (n < 1 || static_cast<uint64_t>(n) > h.chunk_bytes) {
        fuzz::fail("a drained message outside [1, chunk]");
      }
      total += static_cast<uint64_t>(n);
      if (++count > (1u << 16)) throw TooManyMessages{};
    });
  } catch (const TooManyMessages&) {
    return 0;
  } catch (const c10::Error&) {
    fuzz::fail("the schema reader refused on the second pass what it read on the first");
  }
  if (total != h.payload_bytes) fuzz::fail("the drained messages do not add up to the payload");
  return 0;
}
