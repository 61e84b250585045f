#include "wire/publication_shm.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

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

std::shared_ptr<shm::Segment> create_slots(const char* name, uint32_t count, uint64_t json_cap,
                                           uint64_t data_cap, const std::array<uint8_t, 16>& token,
                                           uint64_t epoch, bool populate) {
  const size_t total = slot_at(count, json_cap, data_cap, count);
  std::shared_ptr<shm::Segment> segment = shm::Segment::create(name, total, populate);
  uint8_t* h = segment->data();
  std::memcpy(h, kSlotsMagic.data(), 8);
  word<uint32_t>(h, 8).store(kLayout);
  word<uint32_t>(h, 12).store(count);
  std::memcpy(h + kTokenAt, token.data(), 16);
  word<uint64_t>(h, kEpochAt).store(epoch);
  word<uint64_t>(h, kJsonCapAt).store(json_cap);
  word<uint64_t>(h, kDataCapAt).store(data_cap);
  word<uint64_t>(h, kBytesAt).store(total);
  word<uint32_t>(h, kPidAt).store(static_cast<uint32_t>(::getpid()));
  return segment;
}

std::shared_ptr<shm::Segment> create_pins(const char* name, const std::array<uint8_t, 16>& token) {
  std::shared_ptr<shm::Segment> segment = shm::Segment::create(name, pins_bytes());
  uint8_t* q = segment->data();
  std::memcpy(q, kPinsMagic.data(), 8);
  word<uint32_t>(q, 8).store(kLayout);
  word<uint32_t>(q, 12).store(kEntries);
  std::memcpy(q + kTokenAt, token.data(), 16);
  return segment;
}

}  // namespace tensordict::wire::publication::shm_layout

namespace tensordict::wire::publication {

namespace L = shm_layout;

RelaySlots::RelaySlots(uint64_t epoch)
    : epoch_(epoch),
      token_(shm::random_token()),
      pins_(L::create_pins("tensordict-relay-pins", token_)) {}

RelaySlots::~RelaySlots() {
  if (!slots_) return;
  L::word<uint32_t>(slots_->data(), L::kFlagsAt).fetch_or(L::kClosed);
  wake();
}

SlotsPlace RelaySlots::place() const {
  if (!slots_) return {};
  return SlotsPlace{static_cast<uint32_t>(::getpid()), static_cast<uint32_t>(slots_->fd()),
                    static_cast<uint32_t>(pins_->fd()), token_, epoch_};
}

void RelaySlots::progress() {
  if (slots_) L::word<uint64_t>(slots_->data(), L::kProgressAt).fetch_add(1);
}

uint8_t* RelaySlots::record(uint32_t i) const { return slots_->data() + L::record_at(i); }
uint8_t* RelaySlots::entry(uint32_t e) const { return pins_->data() + L::entry_at(e); }

void RelaySlots::wake() const {
  auto& changes = L::word<uint32_t>(slots_->data(), L::kChangesAt);
  changes.fetch_add(1);
  shm::futex_wake(&changes);
}

bool RelaySlots::pinned(uint32_t slot, int64_t version) const {
  if (version <= 0) return false;
  const uint64_t pin = L::pin_of(slot, version);
  for (uint32_t e = 0; e < L::kEntries; ++e) {
    const uint8_t* q = entry(e);
    if (L::word<uint32_t>(q, L::kEntryPidAt).load() != 0 && L::pins(q, pin)) return true;
  }
  return false;
}

void RelaySlots::reap() {
  for (uint32_t e = 0; e < L::kEntries; ++e) {
    uint8_t* q = entry(e);
    auto& pid = L::word<uint32_t>(q, L::kEntryPidAt);
    uint32_t p = pid.load();
    if (p == 0 || shm::Process(static_cast<pid_t>(p)).alive()) continue;
    L::word<uint64_t>(q, L::kReadingAt).store(0);
    L::word<uint64_t>(q, L::kHeldAt).store(0);
    pid.compare_exchange_strong(p, 0);  // free for another reader
  }
}

bool RelaySlots::begin(int64_t version, uint64_t schema, int64_t bytes, int64_t piece_bytes,
                       int64_t split) {
  filling_ = kCount;
  const auto need = static_cast<uint64_t>(std::max<int64_t>(bytes, 1));
  if (!slots_ || need > data_cap_) {
    const uint64_t cap = (need + L::kPage - 1) / L::kPage * L::kPage;
    std::shared_ptr<shm::Segment> grown;
    try {
      // Not populated: made as the route starts, its pages are faulted in as the pieces come
      // (populating three versions' worth at once held the relay, and its host, for 100s of ms).
      grown =
          L::create_slots("tensordict-relay-slots", kCount, L::kPage, cap, token_, epoch_, false);
    } catch (const std::exception&) {
      return false;
    }
    if (slots_) {  // its readers go to the publisher, then read the new one from the next route
      L::word<uint32_t>(slots_->data(), L::kFlagsAt).fetch_or(L::kMoved);
      wake();
    }
    slots_ = std::move(grown);
    data_cap_ = cap;
    std::fill(versions_.begin(), versions_.end(), 0);
    newest_ = kCount;
  }
  // Dekker with the readers (§9.8): the slot marked being written, then the pins looked at.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (;;) {
    for (uint32_t k = 1; k <= kCount; ++k) {
      const uint32_t i = (newest_ + k) % kCount;  // the oldest first, the newest never
      if (i == newest_) continue;
      uint8_t* r = record(i);
      auto& state = L::word<uint64_t>(r, L::kStateAt);
      const uint64_t before = state.exchange(L::kWriting);
      if (pinned(i, versions_[i])) {
        state.store(before);  // its readers go on
        continue;
      }
      L::word<uint64_t>(r, L::kSlotBytesAt).store(static_cast<uint64_t>(bytes));
      L::word<uint64_t>(r, L::kSchemaAt).store(schema);
      L::word<uint64_t>(r, L::kJsonBytesAt).store(0);  // readers hold the schema
      L::word<uint64_t>(r, L::kFilledAt).store(0);
      L::word<uint64_t>(r, L::kFilled2At).store(0);
      versions_[i] = version;
      state.store(L::kFilling | static_cast<uint64_t>(version));
      filling_ = i;
      piece_bytes_ = piece_bytes;
      split_ = split;
      wake();
      return true;
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
    reap();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void RelaySlots::piece(int64_t index, const uint8_t* data, int64_t n) {
  if (filling_ == kCount) return;
  uint8_t* to = slots_->data() + L::slot_at(kCount, L::kPage, data_cap_, filling_) + L::kPage;
  if (n > 0) std::memcpy(to + index * piece_bytes_, data, static_cast<size_t>(n));
  const size_t filled = split_ > 0 && index >= split_ ? L::kFilled2At : L::kFilledAt;
  L::word<uint64_t>(record(filling_), filled).store(static_cast<uint64_t>(index + 1));
  progress();
  wake();
}

void RelaySlots::finish() {
  if (filling_ == kCount) return;
  const int64_t version = versions_[filling_];
  L::word<uint64_t>(record(filling_), L::kStateAt).store(static_cast<uint64_t>(version));
  newest_ = filling_;
  filling_ = kCount;
  L::word<uint64_t>(slots_->data(), L::kNewestAt).store(L::pin_of(newest_, version));
  wake();
}

}  // namespace tensordict::wire::publication
