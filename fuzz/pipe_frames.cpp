// Fuzz target: the pipe's frame reader (src/wire/include/wire/pipe_frames.h), the bytes a
// TensorDictPipe peer sends, without UCX: flag byte, u64 length, metadata JSON, storage
// (consolidated mode), or u64 length, header JSON, leaves (uncollated mode), several messages in a
// row.
//
// Input: one control byte, then the stream. Control bit 0: uncollated mode (else
// consolidated); bit 1: pass the previous result as recv()'s `td`; bit 2: pass a consolidated
// copy of it instead (same schema, another storage); bit 3: the stream starts with the 16 bytes
// of ucxx's peer-info exchange (read_peer_info), which must pass its checksum for the frames to
// be read; bit 4: the peer joins frames (docs/wire-format.md §6.8), and before each first
// message of a TensorDict that may be joined, one stream byte picks its length (odd: the flag
// byte and the storage, even: the flag byte alone). Up to 8 messages are read, until the first
// error.
// Expected errors: c10::Error from the reader (a peer fault, after which the stream must have
// been broken with ByteSource::fail) or from the source (the input ended). Findings: crashes,
// sanitizer reports, a fault that leaves the stream unbroken, a result whose leaves leave its
// storage or whose data cannot be read.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "tensordict/consolidate.h"
#include "wire/pipe_frames.h"

using namespace tensordict;
using tensordict::wire::frames::ByteSource;
using tensordict::wire::frames::FrameLimits;
using tensordict::wire::frames::FrameReader;
using tensordict::wire::frames::PeerInfo;
using tensordict::wire::frames::read_peer_info;
using tensordict::wire::frames::write_peer_info;

namespace {

// Caps well above the seeds and well below what would make an input an OOM.
constexpr int64_t kCap = int64_t{1} << 20;

struct EndOfInput {};

class BufferSource final : public ByteSource {
 public:
  explicit BufferSource(std::string_view bytes) : bytes_(bytes) {}
  void read(void* data, size_t n, const at::Tensor& owner, const char* what) override {
    if (owner.defined()) {  // the reader must hand over memory it owns, large enough
      const auto* lo = static_cast<const char*>(owner.storage().data());
      const auto* p = static_cast<const char*>(data);
      if (n > 0 && (p < lo || p + n > lo + owner.storage().nbytes())) {
        tensordict::fuzz::fail("the reader asked for bytes outside their owner");
      }
    }
    if (n > bytes_.size() - pos_) throw EndOfInput{};
    if (n) std::memcpy(data, bytes_.data() + pos_, n);
    pos_ += n;
  }
  bool joins_frames() const override { return joins; }
  size_t read_first_joined(uint8_t* flag, const at::Tensor& flag_owner, void* data, size_t n,
                           const at::Tensor& owner, const char* what) override {
    uint8_t whole = 0;
    read(&whole, 1, at::Tensor(), what);
    read(flag, 1, flag_owner, what);
    if (!(whole & 1)) return 1;
    read(data, n, owner, what);
    return 1 + n;
  }
  void fail(const std::string&) override { failed = true; }
  [[noreturn]] void peer_left() override {
    closed = true;
    TORCH_CHECK(false, "recv: the peer closed the pipe");
  }
  std::string peer() const override { return "fuzz:0"; }

  bool joins = false;
  bool failed = false;
  bool closed = false;

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t control = data[0];
  const bool consolidated = !(control & 1);
  std::string_view stream(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (control & 8) {
    if (stream.size() < 16) return 0;
    try {
      const PeerInfo info = read_peer_info(reinterpret_cast<const uint8_t*>(stream.data()));
      uint8_t again[16];
      write_peer_info(info.tag, again);  // what was accepted is what a peer would have sent
      if (std::memcmp(again, stream.data(), 16) != 0) fuzz::fail("peer info accepted unchanged");
    } catch (const MalformedPeerDataError&) {
      return 0;  // the connection is refused
    }
    stream.remove_prefix(16);
  }
  BufferSource src(stream);
  src.joins = (control & 16) != 0;
  FrameReader reader(FrameLimits{kCap, kCap});
  std::optional<TensorDict> previous;
  for (int i = 0; i < 8; ++i) {
    std::optional<TensorDict> td;
    if (previous && consolidated && (control & 2)) td = previous;
    if (previous && consolidated && (control & 4)) {
      try {
        td = consolidate(previous->clone());
      } catch (const c10::Error&) {  // a layout the reference cannot consolidate either
      }
    }
    TensorDict out;
    try {
      out = consolidated ? reader.recv_consolidated(src, td, std::nullopt)
                         : reader.recv_uncollated(src, std::nullopt);
    } catch (const EndOfInput&) {
      return 0;
    } catch (const c10::Error& e) {
      if (!src.failed && !src.closed) {
        std::fprintf(stderr, "%s\n", e.what_without_backtrace());
        fuzz::fail("the reader threw without breaking the stream");
      }
      return 0;
    }
    if (src.failed) fuzz::fail("the reader broke the stream but returned a result");
    if (consolidated) {
      if (!is_consolidated(out)) fuzz::fail("a consolidated receive is not consolidated");
      const at::Tensor storage = consolidated_storage(out);
      fuzz::touch(out, &storage);
    } else {
      fuzz::touch(out);
    }
    previous = out;
  }
  return 0;
}
