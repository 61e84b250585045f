#pragma once
// TensorDictPipe's frames (docs/wire-format.md §6): ucxx's peer info, our tags and markers, the
// send half (FrameWriter: every message of both modes, and the close marker) and the receive
// half over an abstract byte source (FrameReader: the flag byte, the lengths, the metadata JSON
// or the uncollated header, their validation against the caps, and the storage or leaves they
// announce). No UCX here: the pipe (src/pipe/) sends a FrameWriter's messages and feeds a
// FrameReader from its endpoint; fuzz/pipe_frames.cpp reads from a buffer, and
// fuzz/pipe_frames_roundtrip.cpp reads what a FrameWriter wrote.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/byte_tensor.h"
#include "core/metadata.h"
#include "tensordict/consolidate.h"
#include "tensordict/nested_key.h"
#include "tensordict/tensor_dict.h"

namespace tensordict::wire::frames {

inline constexpr uint8_t kNewSchemaFlag = 0x00;
inline constexpr uint8_t kSameSchemaFlag = 0x01;
// Our close marker (not in the reference, which has no orderly close): the flag byte 0xff in
// consolidated mode, a header length of 2^64-1 in uncollated mode (over any cap, so never a
// real header). It lets the receiver tell a clean close from a lost peer. Only a peer of ours
// (PeerInfo::ours) gets it: the reference reads any flag but 0x00 as the same-schema flag.
inline constexpr uint8_t kCloseFlag = 0xff;
inline constexpr uint64_t kCloseLength = ~uint64_t{0};

/// Whether a whole message of `length` bytes at `message` is the peer's close marker (§6.7):
/// the flag byte 0xff alone (consolidated mode), or the header length kCloseLength, eight 0xff
/// bytes (uncollated mode). For a reader that takes whole messages of its own (publication over
/// the pipe, docs/wire-format.md §9.7), where a FrameReader would read the first message.
bool is_close_marker(const uint8_t* message, size_t length);

// ---- ucxx's peer-info exchange (docs/wire-format.md §6.6) -------------------------------------

// Revisions of our extensions, carried in our tags (make_our_tag): 0x70 the close marker; 0x71
// also joined frames. A peer reads an older revision's tag as ours and a newer one's as ucxx's
// unless it knows it, so each side uses only what both know.
inline constexpr uint8_t kCloseMarkerRevision = 0x70;
inline constexpr uint8_t kJoinedFramesRevision = 0x71;
inline constexpr uint8_t kOurRevision = kJoinedFramesRevision;
// Joined frames (docs/wire-format.md §6.8): between peers of revision 0x71 or later, a
// same-schema TensorDict whose storage is at most this many bytes goes as one message, the flag
// byte then the storage, instead of two: a small message's round trip is its messages' count.
inline constexpr int64_t kMaxJoinedStorage = 8192;

/// What the peer announced when the connection opened.
struct PeerInfo {
  uint64_t tag = 0;      // the tag the peer receives on: ours to send with
  bool ours = false;     // the peer is tensordict-cpp (its tag carries our mark)
  uint8_t revision = 0;  // of our extensions, when ours
  bool joins_frames() const { return ours && revision >= kJoinedFramesRevision; }
};

/// ucxx's hash64bits((value,)): the first 16 hex digits of the SHA-1 of Python's repr of the
/// 1-tuple, "(1234,)".
uint64_t hash64bits(uint64_t value);
/// A new tag for this process to receive on: our mark in the top 32 bits and kOurRevision in
/// the next 8 (so that a peer of ours recognises it; a ucxx peer takes any value), a
/// per-process counter below (tags of the endpoints of one worker must differ).
uint64_t make_our_tag();
/// The 16 bytes a side sends: its tag and hash64bits(tag), as little-endian u64s.
void write_peer_info(uint64_t tag, uint8_t* out);
/// Reads the peer's 16 bytes; MalformedPeerDataError ("Checksum invalid!", as ucxx raises) when
/// the checksum does not match.
PeerInfo read_peer_info(const uint8_t* in);

using core::bytes_tensor;

/// Where a FrameReader's messages come from, in order: each read is one message of exactly `n`
/// bytes (one UCX tag message). Implementations throw from read() when the message cannot come
/// (timeout, disconnect, a message of another size, end of a buffer).
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  /// Fills [data, data + n); `owner` keeps that memory alive; `what` names it for errors.
  virtual void read(void* data, size_t n, const at::Tensor& owner, const char* what) = 0;
  /// The first message of a TensorDict: where a peer may end the stream cleanly. By default
  /// the same as read().
  virtual void read_first(void* data, size_t n, const at::Tensor& owner, const char* what) {
    read(data, n, owner, what);
  }
  /// Whether the peer joins frames (PeerInfo::joins_frames): then read_first_joined is used.
  virtual bool joins_frames() const { return false; }
  /// The first message of a TensorDict from a peer that joins frames: a 1-byte message lands
  /// in `flag`, a (1 + n)-byte one in `flag` then [data, data + n). Returns its length; any
  /// other length is an error, as in read().
  virtual size_t read_first_joined(uint8_t* flag, const at::Tensor& flag_owner, void* data,
                                   size_t n, const at::Tensor& owner, const char* what);
  /// The stream is out of step (the rest of a message is left unread): break it. The reader
  /// throws right after, with `why` in its message.
  virtual void fail(const std::string& why) = 0;
  /// The peer's close marker was read: end the stream; must throw.
  [[noreturn]] virtual void peer_left() = 0;
  /// "host:port" of the peer, for messages.
  virtual std::string peer() const = 0;
};

/// One message not yet received, as a look-ahead sees it (MessagePeek).
struct Peeked {
  enum State {
    kNotYet,    // not arrived, or still landing in the stash
    kLanded,    // whole in the stash: `length` bytes at `data`
    kTooLarge,  // arrived, too large for the stash: it lands only in a receive's own buffer
    kUnusable,  // the stream is closed, broken or left by the peer: a receive fails at once
  };
  State state = kNotYet;
  size_t length = 0;
  const uint8_t* data = nullptr;
};

/// A look-ahead at the messages a source has not handed to a receive yet (the pipe's endpoint,
/// for event loops: Pipe::try_recv). peek(0) is the next message, peek(1) the one after it...
class MessagePeek {
 public:
  virtual ~MessagePeek() = default;
  virtual Peeked peek(size_t i) = 0;
};

/// Whether the next TensorDict can be received without waiting for the peer (FrameReader::
/// arrival).
enum class Arrival {
  kIncomplete,     // some of its messages have not arrived (or not landed) yet
  kWhole,          // every message it needs has landed, or a receive would fail at once
  kNeedsReceiver,  // a message is too large to land before a receive posts its buffer
};

/// The caps applied before anything announced by the peer is allocated (PipeOptions' fields).
struct FrameLimits {
  int64_t max_metadata_bytes = 0;
  int64_t max_storage_bytes = 0;
};

/// What the sender of the uncollated mode (§6.2, in the form tensordict 0.15.3 sends) puts on
/// the wire after the header length: the header JSON {"keys", "dtypes", "shapes", "batch_size",
/// "unbatched", "non_tensors"}, then each tensor leaf (nested ones included, contiguous) in the
/// header's order: sorted by "."-joined key.
struct UncollatedFrame {
  std::string header;
  std::vector<at::Tensor> leaves;
};

/// The uncollated frame of `td`. `check(key, leaf)` is called on each tensor leaf, in order,
/// before it is taken: the transport's own conditions (the pipe's: CPU memory only). ValueError
/// (starting with "send") for a MetaData entry or a quantized leaf, which the format cannot
/// carry, or a key that is not valid UTF-8.
UncollatedFrame uncollated_frame(
    const TensorDict& td, const std::function<void(const NestedKey&, const at::Tensor&)>& check);

/// One message a FrameWriter wrote: `n` bytes at `data`, which `owner` keeps alive (until the
/// transport is done with it).
struct OutFrame {
  const void* data = nullptr;
  size_t n = 0;
  at::Tensor owner;
  const char* what = "";  // names it for errors ("the flag byte")
};

/// The transport's own conditions on a tensor it sends (the pipe's: CPU memory only), called
/// with the tensor and its name ("leaf ('a', 'b')", "the consolidated storage").
using SendCheck = std::function<void(const std::string& what, const at::Tensor& t)>;

/// Writes one TensorDict per call as its messages, keeping the sending side's framing state:
/// the schema last sent (consolidated mode: the metadata travels only when it changes) and the
/// buffers the small messages are built in. Not thread-safe: one call at a time (PipeImpl holds
/// its send mutex); the messages of one call are valid until the next.
class FrameWriter {
 public:
  explicit FrameWriter(bool consolidated);

  /// `td`'s messages in order (§6.1 or §6.2; joined, §6.8, when `joins` and the storage is
  /// small). The first is the TensorDict's first message (the flag byte, the header length,
  /// or a joined message), which the pipe sends as its flow control's credit. Consolidated
  /// mode: `td` is consolidated first when it is not (a copy, on its device). The schema
  /// counts as sent from here on. `new_schema` (if given) tells whether the metadata goes.
  /// ValueError for what the format cannot carry (check's, a MetaData in uncollated mode...).
  std::vector<OutFrame> write(const TensorDict& td, bool joins, const SendCheck& check,
                              bool* new_schema = nullptr);
  /// Whether write(td, /*joins=*/true, ...) would be one joined message: consolidated mode, a
  /// consolidated CPU `td` of the schema last sent, its storage at most kMaxJoinedStorage.
  bool writes_joined(const TensorDict& td) const;
  /// The close marker (§6.7) of this mode.
  OutFrame close_marker();

 private:
  std::vector<OutFrame> write_consolidated(const TensorDict& td, bool joins, const SendCheck& check,
                                           bool* new_schema);
  std::vector<OutFrame> write_uncollated(const TensorDict& td, const SendCheck& check);
  // Whether `state`'s schema differs from the one last sent (remembering it).
  bool schema_changes(const ConsolidatedState& state);

  const bool consolidated_;
  at::Tensor scratch_;  // 16 bytes: the flag byte or a length, and the metadata length
  at::Tensor joined_;   // 1 + kMaxJoinedStorage bytes: a joined message, reused when free
  at::Tensor text_;     // the metadata JSON or the uncollated header of the last call
  bool sent_once_ = false;
  std::shared_ptr<const Metadata> last_metadata_;
  std::string last_schema_;  // its sorted JSON
};

/// Reads one TensorDict per call from a ByteSource, keeping the consolidated mode's receive
/// state (the last schema and the TensorDict a same-schema message lands in). Not thread-safe:
/// one call at a time (PipeImpl holds its recv mutex).
class FrameReader {
 public:
  explicit FrameReader(FrameLimits limits);

  /// Consolidated mode (§6.1): a flag byte, then on a new schema the u64 length, the metadata
  /// JSON (validated: the safe rebuild) and a storage allocated on `device` (default: the
  /// sender's, which must be the CPU); on the same schema the storage lands in `td` when it
  /// matches the last schema, else in the previous result. Throws RuntimeError for an unknown
  /// flag, a length over the caps, or a same-schema message with nothing to receive into;
  /// ValueError for invalid metadata; whatever the source throws. Before throwing for a fault
  /// of the peer's bytes, it calls src.fail(); on the close marker, src.peer_left().
  /// `new_schema` (if given) tells whether the message carried metadata.
  TensorDict recv_consolidated(ByteSource& src, const std::optional<TensorDict>& td,
                               std::optional<at::Device> device, bool* new_schema = nullptr);

  /// Whether the next recv_consolidated / recv_uncollated (per `consolidated`) would find
  /// every message it reads landed in `src`'s look-ahead, walking the framing as the receive
  /// would (the flag, the lengths, the uncollated header's leaves); a message that a receive
  /// would refuse at once (a wrong length, an unknown flag, a size over the caps, bad JSON)
  /// counts as kWhole. Reads nothing and changes no state.
  Arrival arrival(MessagePeek& src, bool consolidated) const;

  /// Uncollated mode (§6.2, and the form tensordict 0.15.3 sends): the u64 header length, the
  /// header JSON (validated), then each leaf. A new TensorDict on `device` (CPU only). Same
  /// errors as recv_consolidated.
  TensorDict recv_uncollated(ByteSource& src, std::optional<at::Device> device);

 private:
  // `first`: the first message of a TensorDict (uncollated header length), which may be the
  // close marker.
  uint64_t read_length(ByteSource& src, const char* what, bool first);
  void check_storage_cap(ByteSource& src, int64_t n, const char* what);
  bool can_recv_into(const TensorDict& td) const;
  // The consolidated mode's two cases, after the flag byte: the storage into `target` (already
  // in it when `joined`), or a new schema, then its storage.
  TensorDict recv_same_schema(ByteSource& src, const std::optional<TensorDict>& target,
                              bool joined);
  TensorDict recv_new_schema(ByteSource& src, const std::optional<TensorDict>& td,
                             std::optional<at::Device> device);
  // A new schema's metadata message, validated, with its transport fields.
  struct NewSchema {
    core::ValidatedMetadata metadata;
    int64_t total = -1;                 // _total_bytes
    std::string sender_device = "cpu";  // _device
  };
  NewSchema read_new_schema(ByteSource& src);
  // Where the storage goes: `device`, else the sender's; the CPU only in this build.
  static at::Device storage_device(ByteSource& src, const std::string& sender_device,
                                   std::optional<at::Device> device);

  const FrameLimits limits_;
  at::Tensor scratch_;  // 16 bytes: the flag byte and the lengths, never reallocated
  bool have_schema_ = false;
  std::string schema_;  // sorted JSON of the last received metadata, transport keys removed
  int64_t total_bytes_ = 0;
  at::Device device_ = at::kCPU;
  std::optional<TensorDict> td_;  // the TensorDict a same-schema message lands in
};

}  // namespace tensordict::wire::frames
