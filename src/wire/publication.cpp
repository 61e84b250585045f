#include "wire/publication.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <cstring>
#include <variant>

#include "core/byte_tensor.h"
#include "core/bytes.h"
#include "tensordict/consolidate.h"
#include "tensordict/errors.h"
#include "wire/checked.h"

namespace tensordict::wire::publication {
namespace {

constexpr std::array<char, 8> kRequestMagic = {'T', 'D', 'P', 'U', 'B', 'R', 'E', 'Q'};
constexpr std::array<char, 8> kOfferMagic = {'T', 'D', 'P', 'U', 'B', 'O', 'F', 'R'};
constexpr uint32_t kProtocol = 1;
// A wait longer than this is refused: the publisher keeps the request that long.
constexpr int64_t kMaxWaitMs = int64_t{1} << 40;
// A request's word (offset 12): the refusal, and this bit when the subscriber can map shared
// memory; a decline of shared memory is the word kDeclineWord.
constexpr uint32_t kShmFlag = 0x100;
constexpr uint32_t kDeclineWord = 0x200;
// A request's word: the subscriber can relay (§9.9); a resume is the word kResumeWord.
constexpr uint32_t kRelayFlag = 0x400;
constexpr uint32_t kResumeWord = 0x800;
constexpr uint32_t kHelloWord = 0x1000;  // a subscriber's host (Request::host)
constexpr std::array<char, 8> kRouteMagic = {'T', 'D', 'P', 'U', 'B', 'R', 'T', 'E'};
constexpr std::array<char, 8> kPieceMagic = {'T', 'D', 'P', 'U', 'B', 'P', 'C', 'E'};
// The fields, a SlotsPlace at 88 (zero when none), the second lane's at kRouteLaneAt (zero
// when none), then the children.
constexpr int64_t kRouteLaneAt = 128, kRouteHeadBytes = 160;
constexpr uint32_t kRouteChecksums = 1, kRouteHostSource = 2, kRouteHostParent = 4;

void put(std::string& out, uint64_t v) { core::append_le(out, v, 8); }

std::string head(const std::array<char, 8>& magic, uint32_t word) {
  std::string out(magic.data(), magic.size());
  core::append_le(out, kProtocol, 4);
  core::append_le(out, word, 4);
  return out;
}

void check_head(const char* who, const char* what, const std::array<char, 8>& magic,
                const uint8_t* p) {
  TD_CHECK_PEER(std::memcmp(p, magic.data(), magic.size()) == 0, who, ": the peer's ", what,
                " does not start with the publication magic \"",
                std::string(magic.data(), magic.size()),
                "\": it is not a tensordict_cpp peer of this channel");
  const auto protocol = static_cast<uint32_t>(core::get_le(p + 8, 4));
  TD_CHECK_PEER(protocol == kProtocol, who, ": the peer's ", what, " is of protocol ", protocol,
                "; this build speaks protocol ", kProtocol);
}

int64_t field(const uint8_t* p, size_t at) { return static_cast<int64_t>(core::get_le(p + at, 8)); }

// A SlotsPlace in 40 bytes: pid and pins descriptor, slots descriptor, token, epoch.
void put_place(std::string& out, const SlotsPlace& s) {
  put(out, uint64_t{s.pid} | uint64_t{s.pins_fd} << 32);
  put(out, s.slots_fd);
  put(out, core::get_le(s.token.data()));
  put(out, core::get_le(s.token.data() + 8));
  put(out, s.epoch);
}

SlotsPlace get_place(const char* who, const char* what, const uint8_t* p) {
  SlotsPlace s;
  const uint64_t where = core::get_le(p);
  const uint64_t slots_fd = core::get_le(p + 8);
  s.pid = static_cast<uint32_t>(where);
  s.pins_fd = static_cast<uint32_t>(where >> 32);
  s.slots_fd = static_cast<uint32_t>(slots_fd);
  std::memcpy(s.token.data(), p + 16, s.token.size());
  s.epoch = core::get_le(p + 32);
  TD_CHECK_PEER(s.epoch != 0 && s.pid > 0 && s.pid <= (1u << 22) &&
                    slots_fd <= static_cast<uint64_t>(INT32_MAX) &&
                    s.pins_fd <= static_cast<uint32_t>(INT32_MAX),
                who, ": ", what, " names slots of epoch ", s.epoch, " in pid ", s.pid,
                ", descriptors ", slots_fd, " and ", s.pins_fd,
                " (a non-zero epoch, a pid up to 2^22, descriptors up to 2^31 - 1)");
  return s;
}

}  // namespace

int tag_of(int64_t channel, Kind kind) {
  return static_cast<int>(kTagBase + 8 * channel + static_cast<int64_t>(kind));
}

namespace {

int64_t room_for(int64_t n) { return std::clamp<int64_t>(n, int64_t{64} << 10, int64_t{1} << 20); }

}  // namespace

at::Tensor recv_buffer(int64_t n) { return core::fresh_bytes(n + room_for(n)).narrow(0, 0, n); }

at::Tensor piece_recv_buffer() {
  // Small pages: pieces fill only the start of each buffer, and a huge page is zeroed (and
  // compacted for, under memory pressure) 2 MiB at a time on the relay's receive path.
  constexpr int64_t n = kPieceHeaderBytes + kMaxPieceBytes;
  return at::empty({n + room_for(n)}, at::kByte).narrow(0, 0, n);
}

at::Tensor message_buffer() {
  at::Tensor t = recv_buffer(static_cast<int64_t>(kMessageBytes));
  t.zero_();
  return t;
}

const char* refusal_text(Refusal r) {
  switch (r) {
    case Refusal::kNone: return "no refusal";
    case Refusal::kOffer: return "an offer that breaks the protocol";
    case Refusal::kStorage: return "an offer whose storage is over its max_total_bytes";
    case Refusal::kSchema: return "a schema it could not read";
    case Refusal::kData: return "data shorter or longer than the offer announced";
    case Refusal::kAnswer: return "\"none\" answered before its request's wait had passed";
  }
  return "an unknown refusal";
}

const char* resume_text(uint32_t reason) {
  switch (static_cast<Resume>(reason)) {
    case Resume::kStalled: return "no piece came within the route's stall bound";
    case Resume::kSlow:
      return "its pieces came at under a third of its share of the route's rate (a lane of two: "
             "under 0.6 of the other lane's) while it queued them";
    case Resume::kLost: return "the connection to it broke";
    case Resume::kForged: return "it sent a piece that is not the version's";
  }
  return "an unknown reason";
}

const char* decline_text(uint32_t reason) {
  switch (static_cast<Decline>(reason)) {
    case Decline::kOpen: return "the subscriber could not open or map the segments";
    case Decline::kCheck: return "the segments the subscriber mapped are not the offer's";
    case Decline::kRefused: return "the subscriber takes no shared memory";
  }
  return "an unknown reason";
}

std::string encode(const Request& r) {
  if (r.host != 0) {
    std::string out = head(kRequestMagic, kHelloWord);
    put(out, r.host);
    if (r.host_slots.pid != 0) {
      put_place(out, r.host_slots);
    } else {
      for (int i = 0; i < 5; ++i) put(out, 0);
    }
    return out;
  }
  if (r.resume != 0) {
    std::string out = head(kRequestMagic, kResumeWord);
    put(out, r.seq);
    put(out, r.epoch);
    put(out, static_cast<uint64_t>(r.version));
    put(out, static_cast<uint64_t>(r.piece));
    put(out, r.resume);
    put(out, static_cast<uint64_t>(r.around));
    return out;
  }
  if (r.decline != 0) {
    std::string out = head(kRequestMagic, kDeclineWord);
    put(out, r.seq);
    put(out, r.decline);
    for (int i = 0; i < 4; ++i) put(out, 0);
    return out;
  }
  std::string out =
      head(kRequestMagic, static_cast<uint32_t>(r.refusal) | (r.shm ? kShmFlag : uint32_t{0}) |
                              (r.relay ? kRelayFlag : uint32_t{0}));
  put(out, r.seq);
  put(out, r.epoch);
  put(out, static_cast<uint64_t>(r.version));
  put(out, static_cast<uint64_t>(r.min_version));
  put(out, static_cast<uint64_t>(r.wait_ms));
  put(out, r.schema);
  return out;
}

std::string encode(const Offer& o) {
  std::string out = head(kOfferMagic, static_cast<uint32_t>(o.status));
  if (o.status == Status::kShm) {
    put(out, o.seq);
    put(out, o.epoch);
    put(out, uint64_t{o.pid} | uint64_t{o.entry} << 32);
    put(out, uint64_t{o.slots_fd} | uint64_t{o.pins_fd} << 32);
    put(out, core::get_le(o.token.data()));
    put(out, core::get_le(o.token.data() + 8));
    return out;
  }
  put(out, o.seq);
  put(out, o.epoch);
  put(out, static_cast<uint64_t>(o.version));
  put(out, static_cast<uint64_t>(o.data_bytes));
  put(out, static_cast<uint64_t>(o.schema_bytes));
  put(out, o.schema);
  return out;
}

Request decode_request(const char* who, const uint8_t* p) {
  check_head(who, "request", kRequestMagic, p);
  const auto word = static_cast<uint32_t>(core::get_le(p + 12, 4));
  Request r;
  if (word == kDeclineWord) {
    r.seq = core::get_le(p + 16);
    const uint64_t reason = core::get_le(p + 24);
    TD_CHECK_PEER(reason >= 1 && reason <= static_cast<uint32_t>(Decline::kRefused), who,
                  ": the peer declines shared memory for reason ", reason, " (1 to ",
                  static_cast<uint32_t>(Decline::kRefused), ")");
    for (size_t at = 32; at < kMessageBytes; at += 8) {
      TD_CHECK_PEER(core::get_le(p + at) == 0, who, ": the peer's decline has bytes ", at, " to ",
                    at + 7, " set (they are 0)");
    }
    r.decline = static_cast<uint32_t>(reason);
    return r;
  }
  if (word == kHelloWord) {
    r.host = core::get_le(p + 16);
    TD_CHECK_PEER(r.host != 0, who, ": the peer names host 0 (never one)");
    const bool none = std::all_of(p + 24, p + kMessageBytes, [](uint8_t b) { return b == 0; });
    if (!none) r.host_slots = get_place(who, "the peer's host message", p + 24);
    return r;
  }
  if (word == kResumeWord) {
    r.seq = core::get_le(p + 16);
    r.epoch = core::get_le(p + 24);
    r.version = field(p, 32);
    r.piece = field(p, 40);
    const uint64_t reason = core::get_le(p + 48);
    r.around = field(p, 56);
    TD_CHECK_PEER(reason >= 1 && reason <= static_cast<uint32_t>(Resume::kForged), who,
                  ": the peer resumes for reason ", reason, " (1 to ",
                  static_cast<uint32_t>(Resume::kForged), ")");
    TD_CHECK_PEER(r.epoch != 0 && r.version >= 1 && r.piece >= 0 && r.around >= -1, who,
                  ": the peer resumes version ", r.version, " of epoch ", r.epoch, " at piece ",
                  r.piece, " from rank ", r.around,
                  " (a version from 1 of a non-zero epoch, a piece from 0, a rank from -1)");
    r.resume = static_cast<uint32_t>(reason);
    return r;
  }
  const uint32_t refusal = word & ~(kShmFlag | kRelayFlag);
  TD_CHECK_PEER(refusal <= static_cast<uint32_t>(Refusal::kAnswer), who,
                ": the peer's request has refusal ", refusal, " (0 to ",
                static_cast<uint32_t>(Refusal::kAnswer), ")");
  TD_CHECK_PEER(refusal == 0 || (word & (kShmFlag | kRelayFlag)) == 0, who,
                ": the peer's refusal asks for shared memory or relays (only a request may)");
  r.refusal = static_cast<Refusal>(refusal);
  r.shm = (word & kShmFlag) != 0;
  r.relay = (word & kRelayFlag) != 0;
  r.seq = core::get_le(p + 16);
  r.epoch = core::get_le(p + 24);
  r.version = field(p, 32);
  r.min_version = field(p, 40);
  r.wait_ms = field(p, 48);
  r.schema = core::get_le(p + 56);
  TD_CHECK_PEER(r.version >= 0 && r.min_version >= 0, who, ": the peer's request holds version ",
                r.version, " and asks for at least ", r.min_version,
                " (versions are not negative)");
  TD_CHECK_PEER((r.epoch == 0) == (r.version == 0), who, ": the peer's request holds version ",
                r.version, " of epoch ", r.epoch, " (a version has an epoch, and none has 0)");
  TD_CHECK_PEER(r.wait_ms >= -1 && r.wait_ms <= kMaxWaitMs, who, ": the peer's request waits ",
                r.wait_ms, " ms (-1 to ", kMaxWaitMs, ")");
  return r;
}

Offer decode_offer(const char* who, const uint8_t* p) {
  check_head(who, "offer", kOfferMagic, p);
  Offer o;
  const auto status = static_cast<uint32_t>(core::get_le(p + 12, 4));
  TD_CHECK_PEER(status >= 1 && status <= 6, who, ": the publisher's offer has status ", status,
                " (1 to 6)");
  o.status = static_cast<Status>(status);
  o.seq = core::get_le(p + 16);
  o.epoch = core::get_le(p + 24);
  if (o.status == Status::kShm) {
    const uint64_t where = core::get_le(p + 32);
    const uint64_t fds = core::get_le(p + 40);
    o.pid = static_cast<uint32_t>(where);
    o.entry = static_cast<uint32_t>(where >> 32);
    o.slots_fd = static_cast<uint32_t>(fds);
    o.pins_fd = static_cast<uint32_t>(fds >> 32);
    std::memcpy(o.token.data(), p + 48, o.token.size());
    TD_CHECK_PEER(o.epoch != 0 && o.pid > 0 && o.pid <= (1u << 22) &&
                      o.slots_fd <= static_cast<uint32_t>(INT32_MAX) &&
                      o.pins_fd <= static_cast<uint32_t>(INT32_MAX),
                  who, ": the publisher's shared-memory offer names epoch ", o.epoch, ", pid ",
                  o.pid, " and descriptors ", o.slots_fd, " and ", o.pins_fd,
                  " (a non-zero epoch, a pid up to 2^22, descriptors up to 2^31 - 1)");
    return o;
  }
  o.version = field(p, 32);
  o.data_bytes = field(p, 40);
  o.schema_bytes = field(p, 48);
  o.schema = core::get_le(p + 56);
  return o;
}

void check_offer(const char* who, const Offer& o, const Held& held) {
  TD_CHECK_PEER(o.seq == held.seq, who, ": the publisher's offer answers request ", o.seq,
                ", not request ", held.seq, " (a message out of order)");
  TD_CHECK_PEER(o.epoch != 0, who, ": the publisher's offer has epoch 0 (never used)");
  TD_CHECK_PEER(o.version >= 1, who, ": the publisher's offer has version ", o.version,
                " (versions start at 1)");
  TD_CHECK_PEER(o.epoch != held.epoch || o.version > held.version, who,
                ": the publisher's offer of version ", o.version, " goes back from version ",
                held.version, " of the same epoch ", o.epoch, " (versions only increase)");
  TD_CHECK_PEER(o.data_bytes >= 0 && o.data_bytes <= held.max_data_bytes, who,
                ": the publisher announces a storage of ", o.data_bytes,
                " bytes; this subscriber takes 0 to ", held.max_data_bytes, " (max_total_bytes)");
  TD_CHECK_PEER(
      o.schema_bytes >= 0 && static_cast<uint64_t>(o.schema_bytes) <= kMaxMetadataJsonBytes, who,
      ": the publisher announces a schema of ", o.schema_bytes, " bytes (0 to ",
      kMaxMetadataJsonBytes, ")");
  if (o.schema_bytes == 0) {
    TD_CHECK_PEER(held.schema != 0 && o.schema == held.schema && o.data_bytes == held.data_bytes,
                  who, ": the publisher reuses a schema (hash ", o.schema, ", ", o.data_bytes,
                  " bytes) that this subscriber does not hold");
  }
}

int64_t piece_count(int64_t data_bytes, int64_t piece_bytes) {
  return std::max<int64_t>(1, (data_bytes + piece_bytes - 1) / piece_bytes);
}

int64_t max_route_bytes(int64_t data_bytes) {
  return kRouteHeadBytes + 8 * static_cast<int64_t>(kMaxChildren) +
         8 * piece_count(data_bytes, kMinPieceBytes);
}

std::string encode(const Route& r, int64_t data_bytes) {
  std::string out = head(kRouteMagic, (r.checksums.empty() ? 0 : kRouteChecksums) |
                                          (r.host_source ? kRouteHostSource : 0) |
                                          (r.host_parent.pid != 0 ? kRouteHostParent : 0));
  put(out, r.seq);
  put(out, r.epoch);
  put(out, static_cast<uint64_t>(r.version));
  put(out, static_cast<uint64_t>(r.piece_bytes));
  put(out, static_cast<uint64_t>(r.first));
  put(out, static_cast<uint64_t>(r.parent));
  put(out, static_cast<uint64_t>(r.rate));
  put(out, static_cast<uint64_t>(r.siblings));
  put(out, r.children.size());
  if (r.host_parent.pid != 0) put_place(out, r.host_parent);
  out.resize(static_cast<size_t>(kRouteLaneAt), '\0');
  if (r.split > 0) {
    put(out, static_cast<uint64_t>(r.split));
    put(out, static_cast<uint64_t>(r.second.parent));
    put(out, static_cast<uint64_t>(r.second.siblings));
    put(out, r.second.children.size());
  }
  out.resize(static_cast<size_t>(kRouteHeadBytes), '\0');
  for (const int64_t c : r.children) put(out, static_cast<uint64_t>(c));
  for (const int64_t c : r.second.children) put(out, static_cast<uint64_t>(c));
  for (const uint64_t c : r.checksums) put(out, c);
  out.resize(static_cast<size_t>(max_route_bytes(data_bytes)), '\0');  // a fixed size (§9.9)
  return out;
}

Route decode_route(const char* who, const uint8_t* p, const Offer& offer) {
  const int64_t n = max_route_bytes(offer.data_bytes);
  check_head(who, "route", kRouteMagic, p);
  const auto word = static_cast<uint32_t>(core::get_le(p + 12, 4));
  TD_CHECK_PEER((word & ~(kRouteChecksums | kRouteHostSource | kRouteHostParent)) == 0, who,
                ": the publisher's route has flags ", word, " (0 to 7)");
  Route r;
  r.seq = core::get_le(p + 16);
  r.epoch = core::get_le(p + 24);
  r.version = field(p, 32);
  r.piece_bytes = field(p, 40);
  r.first = field(p, 48);
  r.parent = field(p, 56);
  r.rate = field(p, 64);
  r.siblings = field(p, 72);
  const uint64_t children = core::get_le(p + 80);
  r.host_source = (word & kRouteHostSource) != 0;
  if (word & kRouteHostParent) {
    r.host_parent = get_place(who, "the publisher's route", p + 88);
    TD_CHECK_PEER(r.parent >= 0 && r.host_parent.epoch == offer.epoch, who,
                  ": the route reads version ", offer.version, " from the slots of rank ", r.parent,
                  " of epoch ", r.host_parent.epoch, " (a subscriber's, of the offer's epoch ",
                  offer.epoch, ")");
  } else {
    TD_CHECK_PEER(std::all_of(p + 88, p + kRouteLaneAt, [](uint8_t b) { return b == 0; }), who,
                  ": the route names no slots to read, but its bytes 88 to ", kRouteLaneAt - 1,
                  " are not zero");
  }
  TD_CHECK_PEER(r.seq == offer.seq && r.epoch == offer.epoch && r.version == offer.version, who,
                ": the route is for request ", r.seq, ", version ", r.version, " of epoch ",
                r.epoch, "; the offer answered request ", offer.seq, " with version ",
                offer.version, " of epoch ", offer.epoch);
  TD_CHECK_PEER(r.piece_bytes >= kMinPieceBytes && r.piece_bytes <= kMaxPieceBytes, who,
                ": the route's pieces are of ", r.piece_bytes, " bytes (", kMinPieceBytes, " to ",
                kMaxPieceBytes, ")");
  const int64_t pieces = piece_count(offer.data_bytes, r.piece_bytes);
  TD_CHECK_PEER(r.first >= 0 && r.first < pieces && r.parent >= -1 && r.rate >= 0 &&
                    children <= kMaxChildren && r.siblings >= 1 &&
                    r.siblings <= static_cast<int64_t>(kMaxChildren),
                who, ": the route starts at piece ", r.first, " of ", pieces, " from rank ",
                r.parent, " at ", r.rate, " bytes/s shared by ", r.siblings, ", to ", children,
                " children (1 to ", kMaxChildren, " sharing, at most ", kMaxChildren, " children)");
  r.split = field(p, kRouteLaneAt);
  uint64_t second = 0;  // the second lane's children
  if (r.split != 0) {
    r.second.parent = field(p, kRouteLaneAt + 8);
    r.second.siblings = field(p, kRouteLaneAt + 16);
    second = core::get_le(p + kRouteLaneAt + 24);
    TD_CHECK_PEER(
        r.split > 0 && r.split < pieces && r.second.parent >= -1 && r.second.siblings >= 1 &&
            r.second.siblings <= static_cast<int64_t>(kMaxChildren) &&
            second <= kMaxChildren - children,
        who, ": the route's second lane starts at piece ", r.split, " of ", pieces, " from rank ",
        r.second.parent, " shared by ", r.second.siblings, ", to ", second,
        " children (a piece after the first; at most ", kMaxChildren, " children in both lanes)");
  } else {
    TD_CHECK_PEER(
        std::all_of(p + kRouteLaneAt, p + kRouteHeadBytes, [](uint8_t b) { return b == 0; }), who,
        ": the route has one lane, but its bytes ", kRouteLaneAt, " to ", kRouteHeadBytes - 1,
        " are not zero");
  }
  const int64_t sums = (word & kRouteChecksums) ? pieces : 0;
  const int64_t expected = kRouteHeadBytes + 8 * static_cast<int64_t>(children + second) + 8 * sums;
  TD_CHECK_PEER(expected <= n, who, ": the route message's fields take ", expected,
                " bytes, more than its ", n);
  const uint8_t* q = p + kRouteHeadBytes;
  const auto read_children = [&](uint64_t count, int64_t parent, std::vector<int64_t>& out) {
    for (uint64_t i = 0; i < count; ++i, q += 8) {
      const auto c = static_cast<int64_t>(core::get_le(q));
      TD_CHECK_PEER(c >= 0 && c != parent && std::find(out.begin(), out.end(), c) == out.end(), who,
                    ": the route names child rank ", c,
                    " (ranks from 0, each once in a lane, not the lane's parent)");
      out.push_back(c);
    }
  };
  read_children(children, r.parent, r.children);
  read_children(second, r.second.parent, r.second.children);
  for (int64_t i = 0; i < sums; ++i, q += 8) r.checksums.push_back(core::get_le(q));
  TD_CHECK_PEER(std::all_of(q, p + n, [](uint8_t b) { return b == 0; }), who,
                ": the route message's padding after its ", expected, " bytes is not zero");
  return r;
}

void encode_piece_header(const PieceHeader& h, uint8_t* out) {
  std::string s = head(kPieceMagic, h.hold ? 1 : 0);
  put(s, h.epoch);
  put(s, static_cast<uint64_t>(h.version));
  put(s, static_cast<uint64_t>(h.index));
  put(s, static_cast<uint64_t>(h.bytes));
  put(s, static_cast<uint64_t>(h.queued));
  std::memcpy(out, s.data(), static_cast<size_t>(kPieceHeaderBytes));
}

std::optional<PieceHeader> decode_piece_header(const uint8_t* p) {
  const auto word = core::get_le(p + 12, 4);
  if (std::memcmp(p, kPieceMagic.data(), kPieceMagic.size()) != 0 ||
      core::get_le(p + 8, 4) != kProtocol || word > 1) {
    return std::nullopt;
  }
  return PieceHeader{core::get_le(p + 16), field(p, 24), field(p, 32),
                     field(p, 40),         field(p, 48), word == 1};
}

namespace {

// piece_checksum's lanes as four scalars, not an array: GCC at -O2 kept the array in memory and
// ran at half the speed (9 vs 19 GB/s a core, benchmarks/micro_bench.cpp's BM_PieceChecksum).
// With Copy, each word is stored into `to` from the register it is hashed from.
template <bool Copy>
uint64_t checksum_words(uint8_t* to, const uint8_t* p, size_t n) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t h0 = 0x243F6A8885A308D3ull, h1 = 0x13198A2E03707344ull, h2 = 0xA4093822299F31D0ull,
           h3 = 0x082EFA98EC4E6C89ull;
  const auto step = [](uint64_t& h, const uint8_t* at, uint8_t* out) {
    uint64_t w;
    std::memcpy(&w, at, 8);
    if constexpr (Copy) std::memcpy(out, &w, 8);
    h = (h ^ w) * kMul;
    h ^= h >> 29;
  };
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    step(h0, p + i, to + i);
    step(h1, p + i + 8, to + i + 8);
    step(h2, p + i + 16, to + i + 16);
    step(h3, p + i + 24, to + i + 24);
  }
  uint64_t out = n;
  for (; i < n; ++i) {
    if constexpr (Copy) to[i] = p[i];
    out = (out ^ p[i]) * kMul;
  }
  for (const uint64_t lane : {h0, h1, h2, h3}) {
    out = (out ^ lane) * kMul;
    out ^= out >> 31;
  }
  return out;
}

}  // namespace

uint64_t piece_checksum(const uint8_t* p, size_t n) { return checksum_words<false>(nullptr, p, n); }

uint64_t copy_piece_checksum(uint8_t* to, const uint8_t* from, size_t n) {
  return checksum_words<true>(to, from, n);
}

Transport transport_of(const char* call, const std::string& name) {
  if (name == "auto") return Transport::kAuto;
  if (name == "shm") return Transport::kShm;
  TORCH_CHECK_VALUE(name == "socket", call,
                    ": transport must be \"auto\", \"shm\" or \"socket\", got \"", name, "\"");
  return Transport::kSocket;
}

Routing routing_of(const char* call, const std::string& name) {
  if (name == "chain") return Routing::kChain;
  if (name == "tree") return Routing::kTree;
  TORCH_CHECK_VALUE(name == "star", call, ": route must be \"star\", \"chain\" or \"tree\", got \"",
                    name, "\"");
  return Routing::kStar;
}

uint64_t schema_hash(std::string_view json) {
  const uint64_t h = checked::fnv1a(reinterpret_cast<const uint8_t*>(json.data()), json.size());
  return h == 0 ? 1 : h;  // 0 means "no schema"
}

const JsonScalar* transport_field(const core::ValidatedMetadata& m, std::string_view name) {
  for (const auto& [key, value] : m.transport()) {
    if (key == name) return &value;
  }
  return nullptr;
}

core::ValidatedMetadata read_schema(const char* who, const Offer& o, std::string_view text) {
  const uint64_t hash = schema_hash(text);
  TD_CHECK_PEER(hash == o.schema, who, ": the version's schema does not hash to the offer's (",
                hash, " against ", o.schema, ")");
  core::ValidatedMetadata m = core::read_metadata_json(text);
  const JsonScalar* total = transport_field(m, "_total_bytes");
  TD_CHECK_PEER(total != nullptr && std::holds_alternative<int64_t>(*total) &&
                    std::get<int64_t>(*total) == o.data_bytes && m.storage_bytes() <= o.data_bytes,
                who, ": the version's schema (a storage of ", m.storage_bytes(),
                " bytes) does not fit the offer's ", o.data_bytes, " bytes");
  return m;
}

}  // namespace tensordict::wire::publication
