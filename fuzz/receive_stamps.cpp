// Fuzz target: the stamps that tell a receiver how long a message was, where the transport does
// not say (Gloo; src/wire/include/wire/tail_stamp.h): a buffer of the bytes expected, posted
// with room after it (with_room), a TailStamp at its end and one over the room's first 8 bytes
// (stamp_beyond). Any message that fits the posted buffer is written into it as Gloo would,
// then both stamps are read.
//
// Input: 2 bytes of the expected length (1 to 4096), 2 bytes of the message's length, then
// the message's bytes (repeated to its length). The allocation holds the expected bytes and
// 0 to 1023 bytes of room (the low bits of the third byte, when present).
// Expected errors: none. Findings: a message shorter than expected by 8 bytes or more that the
// end stamp misses; one of the expected length or longer that it calls short; one longer than
// expected by 8 bytes or more that the room's stamp misses; one that is not longer that it
// calls long; a posted buffer past the allocation or past room_for.

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/byte_tensor.h"
#include "fuzz_util.h"
#include "wire/tail_stamp.h"

using namespace tensordict;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const int64_t expected = 1 + (data[0] | (data[1] << 8)) % 4096;
  const int64_t spare = size > 4 ? (data[4] | (data[2] << 8)) % 1024 : 0;
  const at::Tensor allocation = core::bytes_tensor(static_cast<size_t>(expected + spare));
  const at::Tensor buffer = allocation.narrow(0, 0, expected);
  const at::Tensor posted = wire::with_room(buffer, wire::room_for(expected));
  const int64_t room = posted.numel() - expected;
  if (room != 0 && (room < 8 || room > spare || room > wire::room_for(expected))) {
    fuzz::fail("with_room posted a room it should not have");
  }
  const wire::TailStamp end(buffer);
  std::optional<wire::TailStamp> beyond;
  if (room > 0) beyond.emplace(wire::stamp_beyond(posted, expected));
  // The message: any length that fits what was posted (a longer one is Gloo's abort).
  const int64_t length = (data[2] | (data[3] << 8)) % (posted.numel() + 1);
  auto* p = posted.data_ptr<uint8_t>();
  const uint8_t* body = data + 4;
  const size_t body_size = size - 4;
  for (int64_t i = 0; i < length; ++i) p[i] = body_size ? body[i % body_size] : 0;
  const bool is_short = end.short_message();
  if (expected >= 8 && length <= expected - 8 && !is_short) fuzz::fail("a short message passed");
  if (length >= expected && is_short) fuzz::fail("a whole message was called short");
  if (beyond) {
    const bool is_long = wire::long_message(*beyond);
    if (length >= expected + 8 && !is_long) fuzz::fail("a long message passed");
    if (length <= expected && is_long) fuzz::fail("a message that fits was called long");
  }
  return 0;
}
