#pragma once
// The messages of publication (docs/wire-format.md §9, docs/publication.md): a subscriber's
// request and the publisher's offer, 64 bytes each, and the reading of both, with every check
// a peer's bytes must pass. No transport here, so that fuzz/publication.cpp reads a peer's
// bytes exactly as the two sides do. Used by publication's two ends (publication_publisher.h,
// publication_subscriber.h) and the transports' links (src/distributed/group_link.cpp,
// src/pipe/pipe_link.cpp).

#include <ATen/core/Tensor.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/metadata.h"

namespace tensordict::wire::publication {

inline constexpr size_t kMessageBytes = 64;

/// The four messages of a pull share one channel's tags: kTagBase + 8 * channel + kind.
/// Far above the reference's tags (init_tag + leaf index, pseudo-random tags below 10,000),
/// so a publication and the reference's transfers share a group without meeting. Nothing is
/// ever sent on kWatch: a c10d link keeps a receive posted there, which Gloo fails when the
/// connection is lost even while the message in progress would never be failed.
inline constexpr int64_t kTagBase = 0x7E000000;
inline constexpr int64_t kMaxChannel = 0xFFFF;
/// kRoute and kPiece carry relayed versions (§9.9): a kRelay offer's route from the publisher,
/// and the pieces, from the publisher or from the subscriber the route names as the parent;
/// kPiece2 the pieces of a route's second lane (Route::split), on a tag of their own so that
/// the two lanes' pieces between two ranks never meet.
enum class Kind : int64_t {
  kRequest = 0,
  kOffer = 1,
  kSchema = 2,
  kData = 3,
  kWatch = 4,
  kRoute = 5,
  kPiece = 6,
  kPiece2 = 7,
};
int tag_of(int64_t channel, Kind kind);
/// The kind of a route's lane's pieces: kPiece for the first (or only) lane, kPiece2 for the
/// second.
inline Kind piece_kind(int lane) { return lane == 0 ? Kind::kPiece : Kind::kPiece2; }
inline bool is_piece(Kind kind) { return kind == Kind::kPiece || kind == Kind::kPiece2; }

/// Receive buffers are posted with room after the bytes expected (a view of the first `n`
/// bytes of a larger allocation), so that a link whose transport aborts on a longer message
/// (Gloo) can take it and name it instead: 64 KiB to 1 MiB of room, as long as `n`.
at::Tensor recv_buffer(int64_t n);
/// A piece receive's buffer (recv_buffer's of the largest piece message, in small pages).
at::Tensor piece_recv_buffer();
/// The 64 bytes of a request or an offer, zeroed (a shorter message leaves zeros, which the
/// decoders refuse), with room.
at::Tensor message_buffer();

/// Why a subscriber refused what a publisher sent; a refusal travels as a request (below).
enum class Refusal : uint32_t {
  kNone = 0,     // a request: the subscriber pulls
  kOffer = 1,    // the offer broke docs/wire-format.md §9.6
  kStorage = 2,  // the offer announced a storage over the subscriber's max_total_bytes
  kSchema = 3,   // the schema message was refused
  kData = 4,     // the data message was shorter or longer than announced
  kAnswer = 5,   // a "none" answered before the request's wait had passed
};
/// The refusal in words, for the publisher's stats().
const char* refusal_text(Refusal r);

/// Where a process's slots in shared memory are (§9.8): its pid, the descriptors of its slots
/// and pins segments, the token both start with, and the epoch of the versions they hold. A
/// relay's slots for the subscribers of its host travel this way (§9.9). pid 0: none.
struct SlotsPlace {
  uint32_t pid = 0;
  uint32_t slots_fd = 0;
  uint32_t pins_fd = 0;
  std::array<uint8_t, 16> token{};
  uint64_t epoch = 0;
  bool operator==(const SlotsPlace&) const = default;
};

/// What a subscriber asks for: the newest version newer than the one it holds (and at least
/// min_version), waiting up to wait_ms for one (-1: for ever; 0: answer at once).
struct Request {
  /// kNone: a pull's request. Otherwise the subscriber refuses the offer that answered
  /// request `seq` (it posts no receive for what the offer announced) and pulls no more on
  /// this link; the other fields are what it held.
  Refusal refusal = Refusal::kNone;
  uint64_t seq = 0;         // the subscriber's count of requests; the offer repeats it
  uint64_t epoch = 0;       // the epoch of the version it holds; 0: it holds none
  int64_t version = 0;      // the version it holds (0: none)
  int64_t min_version = 0;  // 0: any newer
  int64_t wait_ms = 0;      // -1: until one is published
  uint64_t schema = 0;      // the hash of the schema it holds; 0: none
  /// A pull's request only: the subscriber can map the publisher's shared memory (same host,
  /// Linux); the publisher may answer Status::kShm (§9.8).
  bool shm = false;
  /// Not a request: the subscriber declines the kShm offer that answered request `seq` (it
  /// could not map or check the segments), for the reason `decline` (Decline); it pulls over
  /// this link from its next request. The other fields are 0.
  uint32_t decline = 0;
  /// A pull's request only: the subscriber can take a version in pieces from another
  /// subscriber and forward them (§9.9); the publisher may answer Status::kRelay.
  bool relay = false;
  /// Not a request: during the relayed version `version` of `epoch` (the answer to a request
  /// or a resume before it), the subscriber stopped taking pieces from rank `around` (-1: the
  /// publisher), for `reason` (Resume); it asks the publisher for the pieces from `piece` on.
  /// `seq` is new, as a request's; the other fields are 0.
  uint32_t resume = 0;
  int64_t piece = 0;
  int64_t around = -1;
  /// Not a request: the subscriber's network host (shm::host_fingerprint), sent before its
  /// first request after a relayed version, and answered by nothing: a route visits the
  /// subscribers of one host one after another, so each host's interface receives a version
  /// once. The other fields are 0, but `host_slots`: the slots this subscriber keeps for the
  /// others of its host (§9.9), once a route asked it to (pid 0: none yet).
  uint64_t host = 0;
  SlotsPlace host_slots{};
};

/// Why a subscriber stopped taking a relayed version from its parent (a resume's reason).
enum class Resume : uint32_t {
  kStalled = 1,  // no piece within the route's stall bound (a stopped or dead relay, a lost link)
  kSlow = 2,    // pieces at under a third of its share of the route's rate (or of the other lane's)
  kLost = 3,    // the connection to the parent broke
  kForged = 4,  // a piece that is not the version's: another version's, or its checksum wrong
};
const char* resume_text(uint32_t reason);

/// Why a subscriber declined shared memory (a decline's reason).
enum class Decline : uint32_t {
  kOpen = 1,     // the segments could not be opened or mapped (another host, user or namespace)
  kCheck = 2,    // what it mapped is not what the offer announced (token, epoch, layout)
  kRefused = 3,  // the subscriber takes no shared memory after all (reserved)
};
const char* decline_text(uint32_t reason);

enum class Status : uint32_t {
  kNew = 1,      // a version follows: its schema (when schema_bytes > 0), then its data
  kNone = 2,     // nothing newer within wait_ms
  kClosed = 3,   // the publisher is closing
  kRefused = 4,  // the request was malformed (the publisher stops serving this subscriber)
  kShm = 5,      // to a request with `shm`: map the slots in shared memory (§9.8), pull there
  kRelay = 6,    // to a request with `relay`, or a resume: kNew, but the data comes in pieces
                 // as the route message that follows the schema says (§9.9)
};

/// The publisher's answer to one request.
struct Offer {
  Status status = Status::kNone;
  uint64_t seq = 0;          // the request's
  uint64_t epoch = 0;        // the publisher's: random, never 0, new for each Publisher
  int64_t version = 0;       // kNew: the version that follows (>= 1, increasing in an epoch)
  int64_t data_bytes = 0;    // kNew: the consolidated storage's size
  int64_t schema_bytes = 0;  // kNew: the metadata JSON's size; 0 when the request's schema is
                             // the version's (the subscriber reuses what it holds)
  uint64_t schema = 0;       // kNew: the hash of the version's metadata JSON
  // kShm: where the segments are (the publisher's pid and descriptors), the subscriber's entry
  // in the pins segment, and the token both segments start with.
  uint32_t pid = 0;
  uint32_t entry = 0;
  uint32_t slots_fd = 0;
  uint32_t pins_fd = 0;
  std::array<uint8_t, 16> token{};
};

std::string encode(const Request& r);
std::string encode(const Offer& o);

/// A peer's kMessageBytes, validated: magic, protocol, every field in range.
/// MalformedPeerDataError naming `who` ("Publisher (rank 2's request)") otherwise.
Request decode_request(const char* who, const uint8_t* p);
Offer decode_offer(const char* who, const uint8_t* p);

/// What the subscriber holds, to check an offer against.
struct Held {
  uint64_t seq = 0;    // the request the offer answers
  uint64_t epoch = 0;  // 0: nothing held
  int64_t version = 0;
  uint64_t schema = 0;
  int64_t data_bytes = 0;      // the held schema's storage size
  int64_t max_data_bytes = 0;  // the subscriber's bound on a storage
};

/// The route of a relayed version (§9.9): where its pieces come from and go, sent by the
/// publisher after a kRelay offer's schema, never by a relay.
struct Route {
  uint64_t seq = 0;  // the request's (or the resume's) that the offer answered
  uint64_t epoch = 0;
  int64_t version = 0;
  int64_t piece_bytes = 0;  // every piece's but the last's
  int64_t first = 0;        // the first piece the parent sends (a resume's piece; else 0)
  int64_t parent = -1;      // the rank the pieces come from; -1: the publisher
  int64_t rate = 0;         // the publisher's estimate of a link's bytes per second; 0: none
  int64_t siblings = 1;     // the parent's children (this one among them): they share its link
  std::vector<int64_t> children;    // the ranks this subscriber forwards every piece to
  std::vector<uint64_t> checksums;  // one per piece (piece_checksum), or none
  /// The subscriber writes each piece it takes into slots of its own in shared memory, for the
  /// subscribers of its host (it then says where they are in its host message).
  bool host_source = false;
  /// The parent is on this subscriber's host: the version is read from its slots, there
  /// (pid 0: the parent sends pieces).
  SlotsPlace host_parent{};
  /// Two lanes (a publisher's route "tree"): pieces [0, split) come and go along the first
  /// tree (first, parent, siblings, children above), on kPiece; pieces [split, P) along the
  /// second (`second`), on kPiece2. 0: one lane, every piece on kPiece. A resume's route
  /// describes the lane of its first piece in the fields above.
  int64_t split = 0;
  struct Lane {
    int64_t parent = -1;
    int64_t siblings = 1;
    std::vector<int64_t> children;
    bool operator==(const Lane&) const = default;
  };
  Lane second;
};

inline constexpr int64_t kMinPieceBytes = int64_t{64} << 10;
/// Pieces of several MiB are what a fast link and a long route need (benchmarks/route_model.py:
/// 1 GiB at 12.5 GB/s through 8 hosts takes pieces of 6-12 MiB); every piece receive is posted
/// with room for this size (a receive left posted takes any later route's piece).
inline constexpr int64_t kMaxPieceBytes = int64_t{16} << 20;
inline constexpr size_t kMaxChildren = 64;
/// A piece message: this header, then its bytes.
inline constexpr int64_t kPieceHeaderBytes = 56;

/// The pieces of a storage of `data_bytes` in pieces of `piece_bytes` (at least 1).
int64_t piece_count(int64_t data_bytes, int64_t piece_bytes);
/// The size of every route message for a storage of `data_bytes`: the most its fields can
/// take (kMaxChildren children in both lanes together, a checksum per kMinPieceBytes),
/// zero-padded, so that the receiver posts exactly its size.
int64_t max_route_bytes(int64_t data_bytes);
std::string encode(const Route& r, int64_t data_bytes);
/// A route message (max_route_bytes), validated against the offer it follows: its request, epoch,
/// version, a piece size within bounds, a first piece within the storage, a split within it,
/// at most kMaxChildren children in all (distinct in each lane, none its lane's parent), one
/// checksum per piece or none. MalformedPeerDataError naming `who`.
Route decode_route(const char* who, const uint8_t* p, const Offer& offer);

/// A piece's header: the version it belongs to and where it lies, and what the sender saw.
struct PieceHeader {
  uint64_t epoch = 0;
  int64_t version = 0;
  int64_t index = 0;
  int64_t bytes = 0;
  /// The sender's pieces not yet taken by the receivers it forwards to, when it sent this one:
  /// a relay whose own link is slow queues them (its input outruns it); one that only waits
  /// for its parent queues none. A receiver blames a slow parent only on this.
  int64_t queued = 0;
  /// Not a piece: the sender stopped taking pieces from its own parent and waits for the
  /// publisher's (a resume); its receivers wait with it rather than leave it. No bytes follow.
  bool hold = false;
};
void encode_piece_header(const PieceHeader& h, uint8_t* out);
/// The header at `p`, or why it is not one (the magic, the protocol); its fields unchecked.
std::optional<PieceHeader> decode_piece_header(const uint8_t* p);
/// 64-bit hash of a piece's bytes (four lanes of multiply-xorshift; not cryptographic: it
/// catches a relay's mistakes and stale bytes, and a forger who does not see the route).
uint64_t piece_checksum(const uint8_t* p, size_t n);
/// Copies n bytes from `from` to `to` (not overlapping) and returns their piece_checksum, in one
/// pass: a relay reads each piece once (from its own receive buffer, which nobody else writes).
uint64_t copy_piece_checksum(uint8_t* to, const uint8_t* from, size_t n);

/// Checks that a kNew offer may follow what the subscriber holds: the request it answers, a
/// version that goes forward within an epoch, sizes within the bounds, a schema reused only
/// when it is the held one and of the held size. MalformedPeerDataError naming `who`.
void check_offer(const char* who, const Offer& o, const Held& held);

/// The schema message that follows a kNew offer: its hash checked against the offer's, read
/// and validated as every peer's metadata JSON is (core::read_metadata_json), and fitting the
/// offer's storage ("_total_bytes" equal to data_bytes). MalformedPeerDataError, or the
/// reader's ValueError, otherwise.
core::ValidatedMetadata read_schema(const char* who, const Offer& o, std::string_view text);

/// The transport field `name` of a peer's metadata ("_total_bytes", "_tensorclass_type"), or
/// null.
const JsonScalar* transport_field(const core::ValidatedMetadata& m, std::string_view name);

/// 64-bit FNV-1a of a metadata JSON: the schema hash both sides compute.
uint64_t schema_hash(std::string_view json);

/// How a publisher serves a subscriber on its host (the options' `transport`): kAuto maps the
/// slots in shared memory when the subscriber can, else the link; kShm insists (a subscriber
/// raises when it cannot map them); kSocket never offers or asks for shared memory.
enum class Transport { kAuto, kShm, kSocket };
/// "auto", "shm" or "socket"; ValueError naming `call` otherwise.
Transport transport_of(const char* call, const std::string& name);

/// How a publisher routes a version to the subscribers that wait for it (the options' `route`):
/// kStar sends it whole to each; kChain sends it once, in pieces, through them (§9.9); kTree
/// too, half of the pieces along each of two binary trees in which every subscriber but a few
/// forwards in one only (a double binary tree: many hosts).
enum class Routing { kStar, kChain, kTree };
/// "star", "chain" or "tree"; ValueError naming `call` otherwise.
Routing routing_of(const char* call, const std::string& name);

}  // namespace tensordict::wire::publication
