#pragma once
// Publication's slots in shared memory (docs/publication.md "Shared memory", docs/wire-format.md
// §9.8): the layout of the two segments a publisher makes and the subscriber's checks of what it
// reads there. The slots segment (header, slot table, each slot's schema JSON and data) is
// written by the publisher only and mapped read-only by subscribers; the pins segment holds one
// entry per subscriber, written by that subscriber (its pid, the slots it pins, what it pulled).
// The segments themselves are src/shm's.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace tensordict::shm {
class Segment;
}

namespace tensordict::wire::publication::shm_layout {

inline constexpr std::array<char, 8> kSlotsMagic = {'T', 'D', 'P', 'U', 'B', 'S', 'H', 'M'};
inline constexpr std::array<char, 8> kPinsMagic = {'T', 'D', 'P', 'U', 'B', 'P', 'I', 'N'};
inline constexpr uint32_t kLayout = 1;
inline constexpr size_t kPage = 4096;
inline constexpr uint32_t kMaxSlots = 1024;
inline constexpr uint32_t kEntries = 256;  // subscribers mapped at once, per publisher
inline constexpr size_t kSlotTable = 256;  // where the slot table starts
inline constexpr size_t kSlotRecord = 64;
inline constexpr size_t kEntryTable = 64;
inline constexpr size_t kEntryRecord = 64;
inline constexpr uint64_t kWriting = uint64_t{1} << 63;  // a slot's state while it is filled
inline constexpr int kVersionBits = 48;                  // a pin: (slot + 1) << 48 | version
inline constexpr uint32_t kClosed = 1, kMoved = 2;       // the header's flags

// Offsets in the slots segment's header.
inline constexpr size_t kTokenAt = 16, kEpochAt = 32, kJsonCapAt = 40, kDataCapAt = 48,
                        kBytesAt = 56, kPidAt = 64, kChangesAt = 128, kFlagsAt = 132,
                        kNewestAt = 136;
// Offsets in a slot record.
inline constexpr size_t kStateAt = 0, kSlotBytesAt = 8, kSchemaAt = 16, kJsonBytesAt = 24;
// Offsets in an entry record.
inline constexpr size_t kEntryPidAt = 0, kReadingAt = 8, kHeldAt = 16, kEntryVersionAt = 24,
                        kPullsAt = 32, kWaitingAt = 40;

inline uint64_t pin_of(uint32_t slot, int64_t version) {
  return (uint64_t{slot} + 1) << kVersionBits | static_cast<uint64_t>(version);
}

/// The atomic word at `at` of a mapping (aligned by the layout).
template <typename T>
std::atomic<T>& word(uint8_t* base, size_t at) {
  return *reinterpret_cast<std::atomic<T>*>(base + at);
}
template <typename T>
const std::atomic<T>& word(const uint8_t* base, size_t at) {
  return *reinterpret_cast<const std::atomic<T>*>(base + at);
}

/// Where slot `i` starts (its JSON; the data follows json_cap bytes later).
inline size_t header_bytes(uint32_t slots) {
  return (kSlotTable + kSlotRecord * slots + kPage - 1) / kPage * kPage;
}
inline size_t slot_at(uint32_t slots, uint64_t json_cap, uint64_t data_cap, uint32_t i) {
  return header_bytes(slots) + i * (json_cap + data_cap);
}
inline size_t pins_bytes() { return kEntryTable + kEntryRecord * kEntries; }

/// What a subscriber read from a slots segment and a pins segment it mapped, checked: the
/// magics, the layout, the token and epoch of the offer, the slot count and capacities within
/// the mapping's size. Empty `why` when they hold; otherwise what broke.
struct Checked {
  uint32_t slots = 0;
  uint64_t json_cap = 0, data_cap = 0;
  uint32_t pid = 0;
  std::string why;
};
Checked check_segments(const shm::Segment& slots, const shm::Segment& pins,
                       const std::array<uint8_t, 16>& token, uint64_t epoch, uint32_t entry);

}  // namespace tensordict::wire::publication::shm_layout
