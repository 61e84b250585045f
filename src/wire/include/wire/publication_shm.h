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
#include <vector>

#include "wire/publication.h"

namespace tensordict::shm {
class Segment;
class Process;
}  // namespace tensordict::shm

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
// A relay's slots only (§9.9): the pieces and holds it took so far, which its host's
// subscribers watch for progress while it receives a version.
inline constexpr size_t kProgressAt = 144;
// Offsets in a slot record.
inline constexpr size_t kStateAt = 0, kSlotBytesAt = 8, kSchemaAt = 16, kJsonBytesAt = 24;
// A relay's slots only (§9.9): a slot's state while its version's pieces arrive (readers may
// pin it and read the pieces written so far), and how many are written.
inline constexpr uint64_t kFilling = uint64_t{1} << 62;
inline constexpr size_t kFilledAt = 32;
// A version in two lanes (Route::split): the second lane's pieces written so far, as the last
// one's index + 1 (0: none yet); kFilledAt counts the first lane's.
inline constexpr size_t kFilled2At = 40;
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

/// Where slot `i`'s record is in the slots segment, and entry `e` in the pins segment.
inline size_t record_at(uint32_t i) { return kSlotTable + kSlotRecord * i; }
inline size_t entry_at(uint32_t e) { return kEntryTable + kEntryRecord * e; }
/// Whether the entry at `entry` pins `pin` (pin_of), reading it or holding it.
inline bool pins(const uint8_t* entry, uint64_t pin) {
  return word<uint64_t>(entry, kReadingAt).load() == pin ||
         word<uint64_t>(entry, kHeldAt).load() == pin;
}

/// Where slot `i` starts (its JSON; the data follows json_cap bytes later).
inline size_t header_bytes(uint32_t slots) {
  return (record_at(slots) + kPage - 1) / kPage * kPage;
}
inline size_t slot_at(uint32_t slots, uint64_t json_cap, uint64_t data_cap, uint32_t i) {
  return header_bytes(slots) + i * (json_cap + data_cap);
}
inline size_t pins_bytes() { return entry_at(kEntries); }

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

/// A new slots segment, its header written (magic, layout, `count` slots of `json_cap` and
/// `data_cap` bytes, the token, the epoch, this process's pid; `populate` as
/// shm::Segment::create's), and a new pins segment. Throw std::system_error when the kernel
/// refuses.
std::shared_ptr<shm::Segment> create_slots(const char* name, uint32_t count, uint64_t json_cap,
                                           uint64_t data_cap, const std::array<uint8_t, 16>& token,
                                           uint64_t epoch, bool populate = true);
std::shared_ptr<shm::Segment> create_pins(const char* name, const std::array<uint8_t, 16>& token);

}  // namespace tensordict::wire::publication::shm_layout

namespace tensordict::wire::publication {

/// A relay's slots for the other subscribers of its host (docs/publication.md, "Across hosts:
/// relays"; §9.9): the first subscriber of a host that a route reaches writes each piece of a
/// version into them as it takes it, and the others of its host read the pieces there, as they
/// come, instead of over the network. The layout is the publisher's (§9.8), with kProgressAt,
/// kFilling, kFilledAt and kFilled2At; the readers claim an entry in the pins segment
/// themselves (its pid word, from 0), as no link to them carries an offer. Called by the
/// subscriber's pulling thread, but for piece() of a version in two lanes: each lane's thread
/// writes its own pieces and its own filled word.
class RelaySlots {
 public:
  /// Throws std::system_error when no shared memory can be had.
  explicit RelaySlots(uint64_t epoch);
  ~RelaySlots();  // marked closed: the readers go to the publisher
  RelaySlots(const RelaySlots&) = delete;
  RelaySlots& operator=(const RelaySlots&) = delete;

  uint64_t epoch() const { return epoch_; }
  /// Where the slots are; pid 0 before the first write.
  SlotsPlace place() const;
  /// One more piece or hold taken: the readers' sign of progress.
  void progress();
  /// Starts `version` (`bytes` whose schema hash is `schema`, in pieces of `piece_bytes`) in a
  /// slot nobody pins, a larger segment first when it does not fit (the old one marked moved).
  /// False when every slot stays pinned for a second (its readers then leave for the
  /// publisher) or no larger segment can be had: the pieces then go nowhere.
  /// `split`: the first piece of the second lane (0: one lane).
  bool begin(int64_t version, uint64_t schema, int64_t bytes, int64_t piece_bytes,
             int64_t split = 0);
  /// Piece `index` (its lane's next one: a lane's pieces come in order), `n` bytes at `data`.
  void piece(int64_t index, const uint8_t* data, int64_t n);
  /// Every piece written: the version is the newest.
  void finish();

 private:
  bool pinned(uint32_t slot, int64_t version) const;
  void reap();  // clears the entries of readers whose process exited
  void wake() const;
  uint8_t* record(uint32_t i) const;
  uint8_t* entry(uint32_t e) const;

  static constexpr uint32_t kCount = 3;  // a reader pins one while it copies
  const uint64_t epoch_;
  const std::array<uint8_t, 16> token_;
  std::shared_ptr<shm::Segment> pins_, slots_;
  uint64_t data_cap_ = 0;
  std::vector<int64_t> versions_ = std::vector<int64_t>(kCount, 0);
  uint32_t newest_ = kCount;   // none
  uint32_t filling_ = kCount;  // the slot begin() started; kCount: none
  int64_t piece_bytes_ = 0;
  int64_t split_ = 0;
};

}  // namespace tensordict::wire::publication
