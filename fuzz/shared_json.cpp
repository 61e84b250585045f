// Fuzz target: data that reuses shared objects, as a pickle's memo or one Python str
// in many entries gives it: the conversion of python/csrc/tensor_dict.cpp (json_from_py) runs
// on core::SharedJsonBuilder, which this target drives with a graph of shared nodes instead of
// Python objects; then the full writes (metadata JSON, the metadata pickle, dump) that must
// measure the expansion first (core::JsonExpansion), and the readers on what they wrote.
//
// Input: a program of nodes, each naming earlier ones: a byte op (bits 0-1: 0 a str, 1 a list,
// 2 a dict, 3 an int), then for a str its length byte (x 64 when bit 2 of op is set) and a
// fill character (op >> 3), for a list its count byte (mod 33) and that many node numbers, for
// a dict its count byte (mod 17) and that many (key byte, node number) pairs, for an int one
// byte. The last node is the value; it fills two non-tensor entries of one TensorDict.
// Expected errors: c10::Error (ValueError for depth, budget, expansion, duplicate keys).
// Findings: crashes, sanitizer reports, a build over its budget that was not refused, shared
// and expanded builds that differ, a write that does not read back equal.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/json_text.h"
#include "fuzz_util.h"
#include "tensordict/consolidate.h"
#include "wire/metadata_pickle.h"

using namespace tensordict;
using namespace tensordict::wire;  // the metadata pickle (wire/metadata_pickle.h)

namespace {

// The expansion each input may reach: large enough for every shape of sharing, small enough
// that the expanded build and the round trips below stay fast under ASan.
constexpr size_t kMaxExpansion = size_t{1} << 16;

struct Node {
  int op = 3;
  std::string text;               // str; an int's value as text
  std::vector<size_t> items;      // list / dict values: earlier node numbers
  std::vector<std::string> keys;  // dict keys
};

// Builds node `i` as json_from_py builds a Python object: once per node with `shared`.
JsonValue build(const std::vector<Node>& nodes, size_t i, size_t depth,
                core::SharedJsonBuilder* shared, size_t& made) {
  TORCH_CHECK_VALUE(++made <= kMaxExpansion, "the expanded build is too large");
  const Node& n = nodes[i];
  if (shared) shared->enter(depth, "");
  if (n.op == 3) return JsonValue(static_cast<int64_t>(n.text.size()));
  if (shared) {
    if (const JsonValue* done = shared->find(&n)) return *done;
  }
  JsonValue out;
  if (n.op == 0) {
    if (shared) shared->charge(core::SharedJsonBuilder::string_bytes(n.text.size()));
    out = JsonValue(n.text);
  } else if (n.op == 1) {
    if (shared) shared->charge(core::kSharedNodeBytes);
    JsonValue::List items;
    for (size_t k : n.items) items.push_back(build(nodes, k, depth + 1, shared, made));
    out = JsonValue(std::move(items));
  } else {
    if (shared) shared->charge(core::kSharedNodeBytes);
    JsonValue::Map items;
    for (size_t k = 0; k < n.items.size(); ++k) {
      if (shared)
        shared->charge(core::SharedJsonBuilder::key_bytes(n.keys[k].size()) - sizeof(JsonValue));
      items.emplace_back(n.keys[k], build(nodes, n.items[k], depth + 1, shared, made));
    }
    out = JsonValue(std::move(items));
  }
  if (shared && out.node() != nullptr) return shared->remember(&n, std::move(out));
  return out;
}

std::vector<Node> program(const uint8_t* data, size_t size) {
  std::vector<Node> nodes;
  size_t pos = 0;
  const auto next = [&]() -> uint8_t { return pos < size ? data[pos++] : 0; };
  while (pos < size && nodes.size() < 4096) {
    Node n;
    const uint8_t op = next();
    n.op = op & 3;
    if (n.op != 3 && nodes.empty()) n.op = 0;  // a container needs earlier nodes
    if (n.op == 0) {
      const size_t len = next() * ((op & 4) ? 64u : 1u);
      n.text.assign(len, static_cast<char>('a' + (op >> 3) % 26));
    } else if (n.op == 3) {
      n.text.assign(next(), '1');
    } else {
      const size_t count = n.op == 1 ? next() % 33 : next() % 17;
      for (size_t k = 0; k < count; ++k) {
        if (n.op == 2) n.keys.push_back("k" + std::to_string(next()));
        n.items.push_back(next() % nodes.size());
      }
    }
    nodes.push_back(std::move(n));
  }
  return nodes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<Node> nodes = program(data, size);
  if (nodes.empty()) return 0;
  try {
    const size_t budget = (size_t{1} << 20) + 64 * size;
    core::SharedJsonBuilder shared({.max_depth = 64, .max_bytes = budget},
                                   [] { return std::string("fuzz value"); });
    size_t made = 0;
    const JsonValue value = build(nodes, nodes.size() - 1, 0, &shared, made);
    if (shared.bytes() > budget) fuzz::fail("a build over its budget was not refused");

    Metadata m;
    m.non_tensors.emplace_back("a", NonTensorMetadata{value, {}, std::nullopt, false});
    m.non_tensors.emplace_back("b", NonTensorMetadata{value, {}, std::nullopt, false});
    // Small expansions only: the full writes below must then pass the measure.
    core::JsonExpansion small(kMaxExpansion);
    small.add(value, [] { return std::string("fuzz"); });
    small.add(value, [] { return std::string("fuzz"); });

    size_t unshared_made = 0;
    const JsonValue expanded = build(nodes, nodes.size() - 1, 0, nullptr, unshared_made);
    if (!(expanded == value) || !core::json_identical(expanded, value)) {
      fuzz::fail("the shared build differs from the expanded one");
    }
    const std::string text = value.dump();
    if (text != expanded.dump()) fuzz::fail("dump of the shared build differs");
    if (!(JsonValue::parse(text) == value)) fuzz::fail("dump does not parse back equal");
    if (!(metadata_from_json(metadata_to_json(m)) == m)) fuzz::fail("JSON round trip");
    if (!(metadata_from_pickle_bytes(metadata_pickle_bytes(m)) == m)) {
      fuzz::fail("pickle round trip");
    }
  } catch (const c10::Error&) {
    // expected: too deep, over budget, expanding too much, a duplicate key
  }
  return 0;
}
