// Fuzz target: the pipe's two halves against each other (src/wire/include/wire/pipe_frames.h):
// what a FrameWriter writes, a FrameReader reads back unchanged, for every frame kind of both
// modes (docs/wire-format.md §6.1, §6.2): a new schema (flag, length, metadata, storage), the
// same schema (flag, storage), joined frames (§6.8), the uncollated header and leaves, and the
// close marker (§6.7) last.
//
// Input: one control byte, then the TensorDicts' recipe. Control bit 0: uncollated mode (else
// consolidated); bit 1: the peer joins frames. Then up to 6 TensorDicts, each from the next
// bytes: one byte of what changes (bit 0: a new structure, else the previous one's with new
// values; bit 1: received into the previous result); for a new structure a batch size byte (0
// to 3) and an entry count byte (1 to 5), then per entry a kind byte (low nibble: a dtype, 11
// and up a str non-tensor entry; 0x10: nested one level down; 0x20: a trailing dim, whose size
// byte follows); then a seed byte for the leaves' values and a length byte per str.
// Expected errors: none; the writer's ValueError for what a mode cannot carry ends the input.
// Findings: a message the reader takes for another, a TensorDict that comes back with other
// keys, dtypes, shapes, bytes or non-tensor values, a same-schema TensorDict that does not land
// in place, a close marker the reader does not read as the peer's clean close.

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "tensordict/consolidate.h"
#include "tensordict/non_tensor.h"
#include "wire/leaf_order.h"
#include "wire/pipe_frames.h"

using namespace tensordict;
using namespace tensordict::wire::frames;

namespace {

constexpr int64_t kCap = int64_t{1} << 20;

// The writer's messages, in order, as a reader's source: each read must be the next message,
// whole; any other length is a finding.
class MessageQueue final : public ByteSource {
 public:
  void push(const OutFrame& f) { messages_.emplace_back(static_cast<const char*>(f.data), f.n); }
  void read(void* data, size_t n, const at::Tensor&, const char*) override {
    const std::string m = pop();
    if (m.size() != n) fuzz::fail("a message read with another length than written");
    if (n) std::memcpy(data, m.data(), n);
  }
  bool joins_frames() const override { return joins; }
  size_t read_first_joined(uint8_t* flag, const at::Tensor&, void* data, size_t n,
                           const at::Tensor&, const char*) override {
    const std::string m = pop();
    if (m.size() != 1 && m.size() != 1 + n) fuzz::fail("a joined message of a wrong length");
    flag[0] = static_cast<uint8_t>(m[0]);
    if (m.size() > 1 && n) std::memcpy(data, m.data() + 1, n);
    return m.size();
  }
  void fail(const std::string& why) override {
    std::fprintf(stderr, "%s\n", why.c_str());
    fuzz::fail("the reader refused what the writer wrote");
  }
  [[noreturn]] void peer_left() override {
    closed = true;
    throw Closed{};
  }
  std::string peer() const override { return "fuzz:0"; }
  bool empty() const { return messages_.empty(); }

  struct Closed {};
  bool joins = false;
  bool closed = false;

 private:
  std::string pop() {
    if (messages_.empty()) fuzz::fail("the reader read past what the writer wrote");
    std::string m = std::move(messages_.front());
    messages_.pop_front();
    return m;
  }
  std::deque<std::string> messages_;
};

class Recipe {
 public:
  explicit Recipe(std::string_view bytes) : bytes_(bytes) {}
  bool more() const { return pos_ < bytes_.size(); }
  uint8_t next() { return more() ? static_cast<uint8_t>(bytes_[pos_++]) : 0; }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

constexpr at::ScalarType kDtypes[] = {at::kFloat, at::kDouble, at::kLong,        at::kInt,
                                      at::kByte,  at::kBool,   at::kBFloat16,    at::kHalf,
                                      at::kShort, at::kChar,   at::kComplexFloat};

// One entry of a structure: a leaf (dtype, trailing shape) or a str under `key`.
struct Field {
  NestedKey key;
  std::optional<at::ScalarType> dtype;
  std::vector<int64_t> trailing;
};

std::vector<Field> structure(Recipe& r, int64_t* batch) {
  *batch = r.next() % 4;
  std::vector<Field> fields;
  const int n = 1 + r.next() % 5;
  for (int i = 0; i < n; ++i) {
    const uint8_t kind = r.next();
    std::vector<std::string> path{std::string(1, static_cast<char>('a' + i))};
    if (kind & 0x10) path.insert(path.begin(), "inner");
    Field f{NestedKey(path), std::nullopt, {}};
    if ((kind & 0x0f) < 11) {
      f.dtype = kDtypes[kind & 0x0f];
      if (kind & 0x20) f.trailing.push_back(1 + r.next() % 5);
    }
    fields.push_back(std::move(f));
  }
  return fields;
}

TensorDict build(const std::vector<Field>& fields, int64_t batch, Recipe& r) {
  TensorDict td({}, batch > 0 ? std::vector<int64_t>{batch} : std::vector<int64_t>{});
  uint32_t state = 0x9e3779b9u ^ r.next();  // the values: xorshift32 from the seed byte
  for (const auto& f : fields) {
    if (!f.dtype) {
      td.set(f.key, Value(NonTensorData(JsonValue(std::string(1 + r.next() % 7, 'x')))));
      continue;
    }
    std::vector<int64_t> shape;
    if (batch > 0) shape.push_back(batch);
    shape.insert(shape.end(), f.trailing.begin(), f.trailing.end());
    at::Tensor t = at::empty(shape, *f.dtype);
    auto* p = static_cast<uint8_t*>(t.data_ptr());
    for (size_t i = 0; i < t.nbytes(); ++i) {
      state ^= state << 13;
      state ^= state >> 17;
      state ^= state << 5;
      p[i] = static_cast<uint8_t>(state);
    }
    if (*f.dtype == at::kBool) t = t.ne(0);  // only 0 and 1 are bools
    td.set(f.key, Value(t));
  }
  return td;
}

void check_same(const TensorDict& sent, const TensorDict& got) {
  const auto a = wire::leaves_in_order(sent);
  const auto b = wire::leaves_in_order(got);
  if (a.size() != b.size()) fuzz::fail("a leaf lost or gained");
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first) fuzz::fail("a leaf's key changed");
    const at::Tensor& x = a[i].second;
    const at::Tensor& y = b[i].second;
    if (x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes()) {
      fuzz::fail("a leaf's dtype or shape changed");
    }
    const at::Tensor xc = x.contiguous(), yc = y.contiguous();
    if (xc.nbytes() != yc.nbytes() ||
        (xc.nbytes() && std::memcmp(xc.const_data_ptr(), yc.const_data_ptr(), xc.nbytes()))) {
      fuzz::fail("a leaf's bytes changed");
    }
  }
  for (const auto& [key, value] : sent.items({.include_nested = true})) {
    if (!value.is_non_tensor()) continue;
    if (!got.contains(key) || !(got.get(key).non_tensor().data() == value.non_tensor().data())) {
      fuzz::fail("a non-tensor entry changed");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool consolidated = !(data[0] & 1);
  Recipe r(std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1));
  FrameWriter writer(consolidated);
  FrameReader reader(FrameLimits{kCap, kCap});
  MessageQueue queue;
  queue.joins = (data[0] & 2) != 0;
  const SendCheck any = [](const std::string&, const at::Tensor&) {};
  std::vector<Field> fields;
  int64_t batch = 0;
  std::optional<TensorDict> previous;
  for (int i = 0; i < 6 && r.more(); ++i) {
    const uint8_t step = r.next();
    if (fields.empty() || (step & 1)) fields = structure(r, &batch);
    const TensorDict td = build(fields, batch, r);
    std::vector<OutFrame> frames;
    try {
      frames = writer.write(td, queue.joins, any);
    } catch (const c10::Error&) {
      return 0;  // what this mode cannot carry (a key of invalid UTF-8, ...)
    }
    for (const auto& f : frames) queue.push(f);
    const bool into = consolidated && previous && (step & 2);
    TensorDict got =
        consolidated ? reader.recv_consolidated(queue, into ? previous : std::nullopt, std::nullopt)
                     : reader.recv_uncollated(queue, std::nullopt);
    if (!queue.empty()) fuzz::fail("the reader left messages of a TensorDict unread");
    check_same(td, got);
    if (consolidated) {
      const at::Tensor storage = consolidated_storage(got);
      fuzz::touch(got, &storage);
    }
    previous = got;
  }
  queue.push(writer.close_marker());
  try {
    if (consolidated) {
      reader.recv_consolidated(queue, previous, std::nullopt);
    } else {
      reader.recv_uncollated(queue, std::nullopt);
    }
  } catch (const MessageQueue::Closed&) {
  }
  if (!queue.closed) fuzz::fail("the close marker was not read as the peer's close");
  return 0;
}
