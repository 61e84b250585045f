#include "wire/publication_shm.h"

#include <cstring>

#include "core/bytes.h"
#include "shm/segment.h"

namespace tensordict::wire::publication::shm_layout {

Checked check_segments(const shm::Segment& slots, const shm::Segment& pins,
                       const std::array<uint8_t, 16>& token, uint64_t epoch, uint32_t entry) {
  Checked c;
  const uint8_t* h = slots.data();
  const uint8_t* q = pins.data();
  if (slots.size() < kPage || pins.size() < pins_bytes()) {
    c.why = "a segment is smaller than its header";
    return c;
  }
  if (std::memcmp(h, kSlotsMagic.data(), 8) != 0 || std::memcmp(q, kPinsMagic.data(), 8) != 0) {
    c.why = "a segment does not start with the publication magic";
    return c;
  }
  if (core::get_le(h + 8, 4) != kLayout || core::get_le(q + 8, 4) != kLayout) {
    c.why = "a segment is of another layout";
    return c;
  }
  if (std::memcmp(h + kTokenAt, token.data(), 16) != 0 ||
      std::memcmp(q + kTokenAt, token.data(), 16) != 0) {
    c.why = "the segments' token is not the offer's";
    return c;
  }
  if (core::get_le(h + kEpochAt) != epoch) {
    c.why = "the segment's epoch is not the offer's";
    return c;
  }
  c.slots = static_cast<uint32_t>(core::get_le(h + 12, 4));
  c.json_cap = core::get_le(h + kJsonCapAt);
  c.data_cap = core::get_le(h + kDataCapAt);
  c.pid = static_cast<uint32_t>(core::get_le(h + kPidAt, 4));
  const uint32_t entries = static_cast<uint32_t>(core::get_le(q + 12, 4));
  // Every size bounded before it is multiplied: the slots fit in the mapping.
  const bool sizes = c.slots >= 1 && c.slots <= kMaxSlots && c.json_cap % kPage == 0 &&
                     c.data_cap % kPage == 0 && c.json_cap <= slots.size() &&
                     c.data_cap <= slots.size() && core::get_le(h + kBytesAt) == slots.size() &&
                     slot_at(c.slots, c.json_cap, c.data_cap, c.slots) <= slots.size() &&
                     entries == kEntries && entry < entries;
  if (!sizes) c.why = "the segment's slot count or capacities do not fit its size";
  return c;
}

}  // namespace tensordict::wire::publication::shm_layout
