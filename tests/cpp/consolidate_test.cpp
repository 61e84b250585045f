// consolidate(): layout, views, options; metadata JSON; rebuild and its validation of
// untrusted metadata. Byte-compatibility with the reference is proven by
// tests/python/test_consolidate_compat.py; here the layout rules of docs/wire-format.md §3 are
// checked directly.
#include <ATen/ATen.h>
#include <ATen/MapAllocator.h>
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <string>

#include "core/testing.h"
#include "expect_throw.h"
#include "peak_growth.h"
#include "tensordict/consolidate.h"
#include "tensordict/tensor_dict.h"

using namespace tensordict;

namespace {

// docs/wire-format.md §3.4: a=float32[4], b=float32[4,3], c={d: int64[4]}, batch [4].
TensorDict worked_example() {
  TensorDict c({{"d", at::arange(4, at::kLong)}}, {4});
  return TensorDict(
      {{"a", at::arange(4, at::kFloat)}, {"b", at::arange(12, at::kFloat).view({4, 3})}, {"c", c}},
      {4});
}

const uint8_t* bytes(const at::Tensor& t) {
  return static_cast<const uint8_t*>(t.const_data_ptr());
}

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  auto ca = a.contiguous(), cb = b.contiguous();
  // An empty tensor's data pointer may be null, and memcmp(nullptr, ..., 0) is undefined.
  return ca.scalar_type() == cb.scalar_type() && ca.sizes() == cb.sizes() &&
         (ca.nbytes() == 0 ||
          std::memcmp(ca.const_data_ptr(), cb.const_data_ptr(), ca.nbytes()) == 0);
}

// A leaf is a view of the storage when it shares its memory and lies inside it.
bool is_view_of(const at::Tensor& leaf, const at::Tensor& storage) {
  if (!leaf.storage().is_alias_of(storage.storage())) return false;
  const auto* p = static_cast<const uint8_t*>(leaf.const_data_ptr());
  return leaf.numel() == 0 ||
         (p >= bytes(storage) && p + leaf.nbytes() <= bytes(storage) + storage.numel());
}

void expect_all_views(const TensorDict& td, const at::Tensor& storage) {
  for (const auto& [key, value] : td.items({.include_nested = true, .leaves_only = true})) {
    EXPECT_TRUE(is_view_of(value.tensor(), storage)) << key;
  }
}

void expect_same_leaves(const TensorDict& a, const TensorDict& b) {
  auto ia = a.items({.include_nested = true, .leaves_only = true});
  auto ib = b.items({.include_nested = true, .leaves_only = true});
  ASSERT_EQ(ia.size(), ib.size());
  for (size_t i = 0; i < ia.size(); ++i) {
    EXPECT_EQ(ia[i].first, ib[i].first);
    EXPECT_TRUE(same_bytes(ia[i].second.tensor(), ib[i].second.tensor())) << ia[i].first;
  }
}

}  // namespace

// ---- layout ---------------------------------------------------------------------------------

TEST(ConsolidateLayout, WorkedExample) {
  TensorDict td = worked_example();
  TensorDict c = consolidate(td);
  EXPECT_TRUE(is_consolidated(c));
  EXPECT_FALSE(is_consolidated(td));
  EXPECT_TRUE(c.is_locked());
  at::Tensor s = consolidated_storage(c);
  EXPECT_EQ(s.scalar_type(), at::kByte);
  ASSERT_EQ(s.numel(), 96);
  EXPECT_EQ(std::memcmp(bytes(s), td.get("a").tensor().const_data_ptr(), 16), 0);
  EXPECT_EQ(std::memcmp(bytes(s) + 16, td.get("b").tensor().const_data_ptr(), 48), 0);
  EXPECT_EQ(std::memcmp(bytes(s) + 64, td.get({"c", "d"}).tensor().const_data_ptr(), 32), 0);

  Metadata expected;
  expected.leaves = {{"a", {at::kFloat, {4}, 0, 16, 0}}, {"b", {at::kFloat, {4, 3}, 16, 64, 0}}};
  expected.cls_metadata = {std::nullopt, {std::nullopt}, {4}, false, 0, std::nullopt};
  Metadata child;
  child.leaves = {{"d", {at::kLong, {4}, 64, 96, 0}}};
  child.cls_metadata = expected.cls_metadata;
  expected.children = {{"c", child}};
  EXPECT_EQ(*consolidated_metadata(c), expected);
  EXPECT_EQ(metadata_of(td), expected);
  EXPECT_EQ(metadata_storage_bytes(expected), 96);
}

TEST(ConsolidateLayout, WorkedExampleSortedJsonIsThePipeLine) {
  // The 449-byte line of docs/wire-format.md §3.4 (its sha256 is checked by the Python tests).
  const std::string line =
      R"({"_device": "cpu", "_total_bytes": 96, "c": {"cls": "TensorDict", "cls_metadata": )"
      R"({"batch_size": [4], "device": null, "is_locked": false, "names": [null]}, "leaves": )"
      R"({"d": ["torch.int64", [4], 64, 96, 0]}, "non_tensors": {}}, "cls": "TensorDict", )"
      R"("cls_metadata": {"batch_size": [4], "device": null, "is_locked": false, "names": )"
      R"([null]}, "leaves": {"a": ["torch.float32", [4], 0, 16, 0], "b": ["torch.float32", )"
      R"([4, 3], 16, 64, 0]}, "non_tensors": {}})";
  ASSERT_EQ(line.size(), 449u);
  auto meta = metadata_of(worked_example());
  EXPECT_EQ(metadata_to_json(meta, true, {{"_total_bytes", int64_t{96}}, {"_device", "cpu"}}),
            line);
  TransportFields transport;
  EXPECT_EQ(metadata_from_json(line, &transport), meta);
  EXPECT_EQ(transport, (TransportFields{{"_device", "cpu"}, {"_total_bytes", int64_t{96}}}));
}

TEST(ConsolidateLayout, UnsortedJsonFollowsInsertionOrder) {
  auto json = metadata_to_json(metadata_of(worked_example()));
  EXPECT_EQ(json,
            R"({"cls": "TensorDict", "non_tensors": {}, "leaves": {"a": ["torch.float32", [4], )"
            R"(0, 16, 0], "b": ["torch.float32", [4, 3], 16, 64, 0]}, "cls_metadata": )"
            R"({"device": null, "names": [null], "batch_size": [4], "is_locked": false}, "c": )"
            R"({"cls": "TensorDict", "non_tensors": {}, "leaves": {"d": ["torch.int64", [4], )"
            R"(64, 96, 0]}, "cls_metadata": {"device": null, "names": [null], "batch_size": )"
            R"([4], "is_locked": false}}})");
}

TEST(ConsolidateLayout, PaddingIsZero) {
  // Recycle a 32-byte block full of 0xff first, so that unzeroed padding would show.
  {
    TensorDict ff({{"x", at::full({32}, 255, at::kByte)}});
    (void)consolidate(ff);
  }
  TensorDict td(
      {{"x", at::ones({3})}, {"y", at::ones({5}, at::kBool)}, {"z", at::ones({}, at::kDouble)}});
  TensorDict c = consolidate(td);
  const auto& leaves = consolidated_metadata(c)->leaves;
  EXPECT_EQ(leaves[0].second, (LeafMetadata{at::kFloat, {3}, 0, 16, 4}));
  EXPECT_EQ(leaves[1].second, (LeafMetadata{at::kBool, {5}, 16, 24, 3}));
  EXPECT_EQ(leaves[2].second, (LeafMetadata{at::kDouble, {}, 24, 32, 0}));
  at::Tensor s = consolidated_storage(c);
  ASSERT_EQ(s.numel(), 32);
  for (int i : {12, 13, 14, 15, 21, 22, 23}) EXPECT_EQ(bytes(s)[i], 0) << i;
  EXPECT_EQ(c.get("z").tensor().dim(), 0);
  expect_same_leaves(c, td);
}

TEST(ConsolidateLayout, DepthFirstInsertionOrder) {
  // A nested level before a leaf: its leaves come first; keys are not sorted.
  TensorDict inner({{"z", at::ones({2})}, {"a", at::ones({1}, at::kLong)}});
  TensorDict td({{"n", inner}, {"b", at::ones({3}, at::kShort)}, {"a", at::ones({1})}});
  TensorDict c = consolidate(td);
  auto m = consolidated_metadata(c);
  EXPECT_EQ(m->children[0].second.leaves[0].second.start, 0);  // n/z
  EXPECT_EQ(m->children[0].second.leaves[1].second.start, 8);  // n/a
  EXPECT_EQ(m->leaves[0],
            (std::pair<std::string, LeafMetadata>{"b", {at::kShort, {3}, 16, 24, 2}}));
  EXPECT_EQ(m->leaves[1].second.start, 24);
  std::vector<std::string> keys;
  for (const auto& [k, v] : c.entries()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"n", "b", "a"}));  // the result keeps td's order
  expect_same_leaves(c, td);
}

TEST(ConsolidateLayout, LeavesAreViewsOfTheStorage) {
  TensorDict deep({{"x", at::zeros({2, 2})}});
  TensorDict mid({{"deep", deep}, {"y", at::zeros({3}, at::kInt)}});
  TensorDict td({{"mid", mid}, {"z", at::zeros({}, at::kDouble)}});
  TensorDict c = consolidate(td);
  at::Tensor s = consolidated_storage(c);
  expect_all_views(c, s);
  // As in the reference, only the root carries the state (a rebuild marks every level).
  EXPECT_FALSE(is_consolidated(c.get("mid").tensordict()));
  s.fill_(1);  // writing the storage changes every leaf, nested ones included
  EXPECT_EQ(c.get({"mid", "deep", "x"}).tensor().view(at::kInt).eq(0x01010101).all().item<bool>(),
            true);
  EXPECT_EQ(c.get({"mid", "y"}).tensor().eq(0x01010101).all().item<bool>(), true);
  EXPECT_EQ(c.get("z").tensor().view({1}).view(at::kLong).item<int64_t>(), 0x0101010101010101);
  EXPECT_TRUE(td.get({"mid", "deep", "x"}).tensor().eq(0).all().item<bool>());  // a copy
}

TEST(ConsolidateLayout, NonContiguousLeavesAreCopiedContiguous) {
  at::Tensor base = at::arange(24, at::kFloat).view({4, 6});
  TensorDict td({{"t", base.t()},
                 {"step", base.slice(1, 0, 6, 2)},
                 {"expand", at::arange(3, at::kLong).expand({4, 3})},
                 {"offset", base.select(0, 1)},
                 {"conj", at::complex(at::ones({3}), at::arange(3, at::kFloat)).conj()},
                 {"neg", at::_neg_view(at::arange(3, at::kFloat))}});
  TensorDict c = consolidate(td);
  for (const auto& [key, value] : c.entries()) {
    const auto& t = value.tensor();
    EXPECT_TRUE(t.is_contiguous()) << key;
    EXPECT_FALSE(t.is_conj()) << key;
    EXPECT_TRUE(at::equal(t, td.get(key).tensor().resolve_conj().resolve_neg())) << key;
  }
  expect_all_views(c, consolidated_storage(c));
}

TEST(ConsolidateLayout, EmptyAndZeroDimLeaves) {
  TensorDict td({{"e", at::ones({0, 3})},
                 {"s", at::full({}, 7, at::kLong)},
                 {"e2", at::ones({0}, at::kComplexDouble)},
                 {"one", at::ones({1}, at::kByte)},
                 {"c", at::ones({2}, at::kComplexDouble)}});
  TensorDict c = consolidate(td);
  auto m = consolidated_metadata(c);
  EXPECT_EQ(m->leaves[0].second, (LeafMetadata{at::kFloat, {0, 3}, 0, 0, 0}));
  EXPECT_EQ(m->leaves[1].second, (LeafMetadata{at::kLong, {}, 0, 8, 0}));
  EXPECT_EQ(m->leaves[2].second, (LeafMetadata{at::kComplexDouble, {0}, 8, 8, 0}));
  EXPECT_EQ(m->leaves[3].second, (LeafMetadata{at::kByte, {1}, 8, 16, 7}));
  EXPECT_EQ(m->leaves[4].second, (LeafMetadata{at::kComplexDouble, {2}, 16, 48, 0}));
  expect_same_leaves(c, td);
  EXPECT_EQ(c.get("s").tensor().item<int64_t>(), 7);
  expect_same_leaves(rebuild(*m, consolidated_storage(c)), td);
}

TEST(ConsolidateLayout, EmptyTensorDictAndEmptyNestedLevel) {
  TensorDict empty;
  TensorDict c = consolidate(empty);
  EXPECT_EQ(consolidated_storage(c).numel(), 0);
  TensorDict td({{"x", at::ones({1})}, {"sub", TensorDict()}});
  auto m = metadata_of(td);
  ASSERT_EQ(m.children.size(), 1u);  // kept, as the reference keeps it
  TensorDict r = rebuild(m, consolidated_storage(consolidate(td)));
  EXPECT_TRUE(r.get("sub").is_tensordict());
}

TEST(ConsolidateLayout, EveryWireDtypeRoundTrips) {
  std::vector<TensorDict::Entry> entries;
  for (auto t : {at::kBFloat16, at::kBool, at::kComplexDouble, at::kComplexHalf, at::kComplexFloat,
                 at::kHalf, at::kFloat, at::kDouble, at::kShort, at::kInt, at::kLong, at::kChar,
                 at::kByte, at::kUInt16, at::kUInt32, at::kUInt64}) {
    // Random bytes, viewed: the round trip must keep bit patterns, NaNs included.
    const int64_t n = 3;
    auto raw =
        at::randint(0, t == at::kBool ? 2 : 256, {n * int64_t(c10::elementSize(t))}, at::kByte);
    entries.emplace_back(std::string(c10::toString(t)), raw.view(t));
  }
  TensorDict td(entries);
  TensorDict c = consolidate(td);
  expect_same_leaves(c, td);
  TensorDict r = rebuild(*consolidated_metadata(c), consolidated_storage(c).clone());
  expect_same_leaves(r, td);
}

TEST(ConsolidateLayout, BatchSizeDeviceAndLockAreRecorded) {
  TensorDict inner({{"x", at::ones({2, 3, 4})}}, {2, 3});
  TensorDict td({{"inner", inner}, {"y", at::ones({2})}}, {2}, at::Device(at::kCPU));
  td.lock_();
  auto m = metadata_of(td);
  EXPECT_EQ(m.cls_metadata, (ClsMetadata{"cpu", {std::nullopt}, {2}, true, 0, std::nullopt}));
  EXPECT_EQ(m.children[0].second.cls_metadata,
            (ClsMetadata{"cpu", {std::nullopt, std::nullopt}, {2, 3}, true, 0, std::nullopt}));
  TensorDict c = consolidate(td);
  EXPECT_EQ(c.device(), at::Device(at::kCPU));
  EXPECT_EQ(c.get("inner").tensordict().batch_size(), at::IntArrayRef({2, 3}));
}

// ---- options and identity ---------------------------------------------------------------------

TEST(ConsolidateOptions, ReturnsItselfWhenConsolidated) {
  TensorDict c = consolidate(worked_example());
  EXPECT_TRUE(consolidate(c).is_same(c));
  EXPECT_TRUE(consolidate(c, {.num_threads = 4}).is_same(c));
}

TEST(ConsolidateOptions, ThreadsGiveTheSameBytes) {
  std::vector<TensorDict::Entry> entries;
  for (int i = 0; i < 12; ++i) {
    // Odd sizes so that pads fall inside the chunks; a transposed leaf takes the slow path.
    entries.emplace_back("k" + std::to_string(i),
                         at::randint(0, 255, {(i + 1) * 300001 + i}, at::kByte));
  }
  entries.emplace_back("t", at::randn({300, 500}).t());
  TensorDict td(entries);
  at::Tensor one = consolidated_storage(consolidate(td));
  for (int threads : {2, 3, 8}) {
    TensorDict c = consolidate(td, {.num_threads = threads});
    EXPECT_TRUE(at::equal(consolidated_storage(c), one)) << threads;
    expect_same_leaves(c, td);
  }
  EXPECT_THROW_MSG(consolidate(td, {.num_threads = -1}), c10::ValueError, "num_threads");
}

TEST(ConsolidateOptions, ShareMemoryUsesASharedMapping) {
  TensorDict c = consolidate(worked_example(), {.share_memory = true});
  at::Tensor s = consolidated_storage(c);
  auto* map = at::MapAllocator::fromDataPtr(s.storage().data_ptr());
  ASSERT_NE(map, nullptr);
  EXPECT_TRUE(map->flags() & at::ALLOCATOR_MAPPED_SHAREDMEM);
  expect_same_leaves(c, worked_example());
  expect_all_views(c, s);
}

TEST(ConsolidateOptions, DeviceOption) {
  TensorDict c = consolidate(worked_example(), {.device = at::Device(at::kCPU)});
  EXPECT_TRUE(consolidated_storage(c).is_cpu());
  EXPECT_FALSE(c.device().has_value());  // the TensorDict had none
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  TensorDict g = consolidate(worked_example(), {.device = at::Device(at::kCUDA, 0)});
  EXPECT_TRUE(consolidated_storage(g).is_cuda());
  expect_same_leaves(g.to(at::Device(at::kCPU)), worked_example());
}

TEST(ConsolidateOptions, StaleBatchSizeIsRefreshed) {
  TensorDict c = consolidate(worked_example());
  c.unlock_();
  TensorDict(c.get("c").tensordict()).set_batch_size({});
  c.set_batch_size({});
  TensorDict again = consolidate(c);
  EXPECT_EQ(consolidated_metadata(again)->cls_metadata.batch_size, std::vector<int64_t>{});
  EXPECT_EQ(consolidated_metadata(again)->children[0].second.cls_metadata.names.size(), 0u);
}

// ---- consolidate errors ---------------------------------------------------------------------

TEST(ConsolidateErrors, DtypeWithoutWireName) {
  TensorDict td({{"f8", at::zeros({2}).to(at::kFloat8_e4m3fn)}});
  EXPECT_THROW_MSG(consolidate(td), c10::ValueError, "torch.float8_e4m3fn");
}

TEST(ConsolidateErrors, MisalignedWideElement) {
  // complex128 at byte 8: the reference's view(dtype) fails the same way.
  TensorDict td({{"a", at::ones({2})}, {"b", at::ones({1}, at::kComplexDouble)}});
  EXPECT_THROW_MSG(consolidate(td), c10::ValueError,
                   "'b' (torch.complex128) would start at byte 8");
}

TEST(ConsolidateErrors, NestedKeyNamedLikeAMetadataField) {
  TensorDict td({{"leaves", TensorDict({{"x", at::ones({1})}})}});
  EXPECT_THROW_MSG(consolidate(td), c10::ValueError, "'leaves' collides");
}

TEST(ConsolidateErrors, SparseLeaf) {
  TensorDict td({{"s", at::eye(3).to_sparse()}});
  EXPECT_THROW_MSG(consolidate(td), c10::TypeError, "only strided");
}

// ---- JSON --------------------------------------------------------------------------------------

TEST(ConsolidateJson, EscapesLikePython) {
  Metadata m;
  m.leaves = {{"\xc3\xa9\x7f\xe2\x80\xa8\xf0\x9f\x98\x80\"\\\n\x01", {at::kFloat, {0}, 0, 0, 0}}};
  auto json = metadata_to_json(m);
  EXPECT_NE(json.find(R"("\u00e9\u007f\u2028\ud83d\ude00\"\\\n\u0001": ["torch.float32")"),
            std::string::npos)
      << json;
  EXPECT_EQ(metadata_from_json(json), m);
}

TEST(ConsolidateJson, InvalidUtf8KeyIsRefused) {
  Metadata m;
  m.leaves = {{"bad\xff", {at::kFloat, {0}, 0, 0, 0}}};
  EXPECT_THROW_MSG(metadata_to_json(m), c10::ValueError, "not valid UTF-8");
  m.leaves = {{"\xed\xa0\x80", {at::kFloat, {0}, 0, 0, 0}}};  // an encoded surrogate
  EXPECT_THROW_MSG(metadata_to_json(m), c10::ValueError, "not valid UTF-8");
}

TEST(ConsolidateJson, RoundTripSortedAndUnsorted) {
  TensorDict inner({{"q", at::ones({2, 2}, at::kBool)}}, {2});
  TensorDict td({{"z", at::ones({2, 3})}, {"A", inner}, {"_p", TensorDict({}, {2})}}, {2});
  auto m = metadata_of(td);
  for (bool sort : {false, true}) {
    EXPECT_EQ(metadata_from_json(metadata_to_json(m, sort)), m) << sort;
  }
}

TEST(ConsolidateJson, NonTensorEntriesSurviveTheText) {
  Metadata m;
  m.non_tensors = {
      {"s", {JsonValue::parse(R"({"b": [1, 2.5, "x"], "a": null})"), {}, std::nullopt}}};
  auto json = metadata_to_json(m);
  EXPECT_NE(json.find(R"("non_tensors": {"s": [{"b": [1, 2.5, "x"], "a": null}, [], null]})"),
            std::string::npos)
      << json;
  EXPECT_NE(metadata_to_json(m, true).find(R"([{"a": null, "b": [1, 2.5, "x"]}, [], null])"),
            std::string::npos);
  EXPECT_EQ(metadata_from_json(json), m);
}

// A peer's object with many keys keeps its order (keys found through an index, not a scan),
// and a repeated key keeps its first place with its last value, as Python's json.loads does.
TEST(ConsolidateJson, ManyKeysKeepTheirOrderAndRepeatsTakeTheLastValue) {
  Metadata m;
  for (int i = 0; i < 100000; ++i) {
    m.leaves.push_back({"k" + std::to_string((i * 7919) % 100000), {at::kByte, {0}, 0, 0, 0}});
  }
  EXPECT_EQ(metadata_from_json(metadata_to_json(m)), m);
  auto json = metadata_to_json(m);
  const std::string repeat = R"("k0": ["torch.uint8", [5], 0, 5, 0], )";
  json.insert(json.find("\"leaves\": {") + 11, repeat);
  auto repeated = metadata_from_json(json);
  ASSERT_EQ(repeated.leaves.size(), m.leaves.size());
  EXPECT_EQ(repeated.leaves[0].first, "k0");
  EXPECT_EQ(repeated.leaves[0].second.shape, std::vector<int64_t>{0});  // the last value
  EXPECT_EQ(repeated.leaves[1].first, m.leaves[1].first);
}

// ---- rebuild -----------------------------------------------------------------------------------

TEST(ConsolidateRebuild, LeavesAreViewsAndEveryLevelIsConsolidated) {
  TensorDict c = consolidate(worked_example());
  at::Tensor s = consolidated_storage(c).clone();
  auto m = *consolidated_metadata(c);
  m.children[0].second.cls_metadata.is_locked = true;
  m.cls_metadata.device = "cpu";
  TensorDict r = rebuild(m, s);
  expect_same_leaves(r, worked_example());
  expect_all_views(r, s);
  EXPECT_TRUE(is_consolidated(r));
  EXPECT_FALSE(r.is_locked());
  EXPECT_EQ(r.device(), at::Device(at::kCPU));
  TensorDict sub = r.get("c").tensordict();
  EXPECT_TRUE(sub.is_locked());
  EXPECT_TRUE(is_consolidated(sub));
  EXPECT_EQ(*consolidated_metadata(sub), m.children[0].second);  // its own node
  EXPECT_TRUE(consolidated_storage(sub).is_same(s));             // the whole storage
  s[64] = 9;
  EXPECT_EQ(sub.get("d").tensor()[0].item<int64_t>(), 9);
}

TEST(ConsolidateRebuild, MutationEndsConsolidation) {
  TensorDict c = consolidate(worked_example());
  at::Tensor s = consolidated_storage(c);
  TensorDict r = rebuild(*consolidated_metadata(c), s);  // unlocked, as the metadata says
  TensorDict sub = r.get("c").tensordict();
  sub.set("e", at::ones({4}));  // through the nested level's own handle
  EXPECT_FALSE(is_consolidated(sub));
  EXPECT_FALSE(is_consolidated(r));
  TensorDict again = consolidate(r);
  EXPECT_FALSE(again.is_same(r));
  EXPECT_EQ(consolidated_storage(again).numel(), 96 + 16);
  TensorDict r2 = rebuild(*consolidated_metadata(c), s);
  r2.set("a", at::zeros({4}));  // replaced by a tensor outside the storage
  EXPECT_FALSE(is_consolidated(r2));
  TensorDict r3 = rebuild(*consolidated_metadata(c), s);
  r3.set_("a", at::zeros({4}));  // written in place: still the same views
  EXPECT_TRUE(is_consolidated(r3));
  EXPECT_TRUE(consolidate(r3).is_same(r3));
}

// is_consolidated() trusts a checked consolidation until some level's entries change; every
// change through any level's handle must still be seen, and a state from outside is checked.
TEST(ConsolidateRebuild, ChecksAgainAfterAnyChangeOfEntries) {
  TensorDict deep({{"e", at::arange(4, at::kFloat)}}, {4});
  TensorDict td({{"a", at::arange(4, at::kFloat)},
                 {"c", TensorDict({{"d", at::arange(4, at::kLong)}, {"deep", deep}}, {4})}},
                {4});
  TensorDict c = consolidate(td);
  c.unlock_();
  TensorDict grandchild = c.get({"c", "deep"}).tensordict();
  ASSERT_TRUE(is_consolidated(c));
  grandchild.set("e", at::zeros({4}));  // two levels down, through its own handle
  EXPECT_FALSE(is_consolidated(c));
  EXPECT_FALSE(consolidate(c).is_same(c));

  // Put back the same view through the level's own handle (a set through the root ends the
  // consolidation outright): the generations changed, the leaf-by-leaf check still holds, and
  // consolidate() reuses the state and remembers that it matched.
  TensorDict c2 = consolidate(td);
  c2.unlock_();
  TensorDict deep2 = c2.get({"c", "deep"}).tensordict();
  deep2.set("e", deep2.get("e"));
  EXPECT_TRUE(is_consolidated(c2));
  EXPECT_TRUE(consolidate(c2).is_same(c2));
  EXPECT_TRUE(is_consolidated(c2));
  TensorDict(c2.get("c").tensordict()).erase("d");
  EXPECT_FALSE(is_consolidated(c2));

  // A change to another consolidated TensorDict makes the next call walk the levels, which
  // still agree.
  TensorDict c3 = consolidate(td);
  TensorDict c4 = consolidate(td);
  ASSERT_TRUE(is_consolidated(c3));
  c4.unlock_();
  TensorDict(c4.get("c").tensordict()).set("d", at::zeros({4}, at::kLong));
  EXPECT_TRUE(is_consolidated(c3));
  EXPECT_FALSE(is_consolidated(c4));

  // A state set from outside is not trusted: its views are checked.
  TensorDict other = consolidate(td);
  TensorDict plain = td.clone();
  plain.set_consolidated_state(TestKey{}, other.consolidated_state());
  EXPECT_FALSE(is_consolidated(plain));
  TensorDict same = consolidate(td);
  TensorDict alias({{"a", same.get("a")}, {"c", same.get("c")}}, {4});
  alias.set_consolidated_state(TestKey{}, same.consolidated_state());
  EXPECT_TRUE(is_consolidated(alias));  // the same views: it does describe them
}

TEST(ConsolidateRebuild, TransportKeysAndSizeAreIgnored) {
  TensorDict c = consolidate(worked_example());
  auto json = metadata_to_json(*consolidated_metadata(c), false,
                               {{"_total_bytes", int64_t{96}},
                                {"_storage_device", "cpu"},
                                {"_tensorclass_type", "m.C"},
                                {"size", int64_t{96}}});
  TransportFields transport;
  auto m = metadata_from_json(json, &transport);
  EXPECT_EQ(transport.size(), 3u);
  EXPECT_EQ(m, *consolidated_metadata(c));
  expect_same_leaves(rebuild(m, consolidated_storage(c)), worked_example());
}

TEST(ConsolidateRebuild, UnderscoreObjectAtTheTopIsANestedLevel) {
  TensorDict td({{"_private", TensorDict({{"x", at::ones({2})}})}});
  TensorDict c = consolidate(td);
  TransportFields transport;
  auto m = metadata_from_json(metadata_to_json(*consolidated_metadata(c)), &transport);
  EXPECT_TRUE(transport.empty());
  expect_same_leaves(rebuild(m, consolidated_storage(c)), td);
}

TEST(ConsolidateRebuild, StorageWithAnOffset) {
  // Bounds and alignment are judged against the storage view, not its allocation.
  TensorDict c = consolidate(worked_example());
  at::Tensor big = at::zeros({200}, at::kByte);
  big.narrow(0, 8, 96).copy_(consolidated_storage(c));
  expect_same_leaves(rebuild(*consolidated_metadata(c), big.narrow(0, 8, 96)), worked_example());
  EXPECT_THROW_MSG(rebuild(*consolidated_metadata(c), big.narrow(0, 8, 95)), c10::ValueError,
                   "past the end of the 95-byte storage");
  Metadata m;
  m.leaves = {{"d", {at::kDouble, {1}, 0, 8, 0}}};
  EXPECT_THROW_MSG(rebuild(m, big.narrow(0, 4, 16)), c10::ValueError,
                   "starts at byte 4 of its storage");
}

TEST(ConsolidateRebuild, BadStorage) {
  Metadata m;
  EXPECT_THROW_MSG(rebuild(m, at::zeros({8})), c10::ValueError, "1-D contiguous uint8");
  EXPECT_THROW_MSG(rebuild(m, at::zeros({2, 4}, at::kByte)), c10::ValueError,
                   "1-D contiguous uint8");
  EXPECT_THROW_MSG(rebuild(m, at::zeros({16}, at::kByte).slice(0, 0, 16, 2)), c10::ValueError,
                   "1-D contiguous uint8");
  EXPECT_THROW_MSG(rebuild(m, at::Tensor()), c10::ValueError, "undefined");
}

TEST(ConsolidateRebuild, NestedKeyNamedLikeAField) {
  Metadata m;
  m.children = {{"cls_metadata", Metadata{}}};
  EXPECT_THROW_MSG(rebuild(m, at::zeros({0}, at::kByte)), c10::ValueError,
                   "'cls_metadata' collides");
}

TEST(ConsolidateRebuild, TooDeep) {
  Metadata m;
  for (int i = 0; i <= kMaxMetadataDepth; ++i) {
    Metadata parent;
    parent.children = {{"n", std::move(m)}};
    m = std::move(parent);
  }
  EXPECT_THROW_MSG(metadata_storage_bytes(m), c10::ValueError, "deeper than 64");
  EXPECT_THROW_MSG(metadata_from_json(metadata_to_json(m)), c10::ValueError, "deeper than 64");
}

TEST(ConsolidateRebuild, TooManyEntries) {
  Metadata m;
  m.leaves.resize(kMaxMetadataEntries);
  for (size_t i = 0; i < m.leaves.size(); ++i) {
    m.leaves[i] = {std::to_string(i), {at::kFloat, {0}, 0, 0, 0}};
  }
  EXPECT_THROW_MSG(metadata_storage_bytes(m), c10::ValueError, "entries");
}

TEST(ConsolidateRebuild, NonTensorsComeFirstAsInTheReference) {
  Metadata m;
  m.cls_metadata.batch_size = {2};
  m.cls_metadata.names = {std::nullopt};
  m.leaves = {{"a", {at::kFloat, {2}, 0, 8, 0}}};
  m.non_tensors = {{"s", {JsonValue("hi"), {2}, std::nullopt}},
                   {"t", {JsonValue::list({1, nullptr}), {2, 3}, std::string("cpu")}}};
  TensorDict td = rebuild(m, at::zeros({8}, at::kByte));
  ASSERT_EQ(td.entries().size(), 3u);
  EXPECT_EQ(td.entries()[0].first, "s");
  EXPECT_EQ(td.entries()[1].first, "t");
  EXPECT_EQ(td.entries()[2].first, "a");
  EXPECT_EQ(td.get_non_tensor("s"), JsonValue("hi"));
  const Value tv = td.get("t");  // get() returns a copy: keep it alive
  const NonTensorData& t = tv.non_tensor();
  EXPECT_EQ(t.data(), JsonValue::list({1, nullptr}));
  EXPECT_EQ(t.batch_size(), at::IntArrayRef({2, 3}));
  EXPECT_EQ(t.device(), at::Device(at::kCPU));
  EXPECT_FALSE(td.get("s").non_tensor().device().has_value());
  EXPECT_TRUE(is_consolidated(td));
}

TEST(ConsolidateRebuild, NonTensorBatchSizeIsValidated) {
  Metadata m;
  m.cls_metadata.batch_size = {2};
  m.cls_metadata.names = {std::nullopt};
  m.non_tensors = {{"s", {JsonValue("hi"), {3}, std::nullopt}}};
  EXPECT_THROW_MSG(rebuild(m, at::zeros({0}, at::kByte)), c10::ValueError,
                   "non-tensor entry 's' has batch_size [3], which does not start with");
  m.non_tensors = {{"s", {JsonValue("hi"), {2, -1}, std::nullopt}}};
  EXPECT_THROW_MSG(rebuild(m, at::zeros({0}, at::kByte)), c10::ValueError, "negative dim");
  m.non_tensors = {{"s", {JsonValue("hi"), {2}, std::string("gpu?")}}};
  EXPECT_THROW_MSG(rebuild(m, at::zeros({0}, at::kByte)), c10::ValueError, "not a device name");
}

// ---- malformed metadata text: one test per fault --------------------------------------------

namespace {

struct Malformed {
  const char* name;
  std::string json;
  const char* needle;
};

// Keeps CTest's test names readable (gtest would otherwise print the struct's bytes).
void PrintTo(const Malformed& m, std::ostream* os) { *os << m.name; }

std::string node(const std::string& leaves, const std::string& cls_metadata = {},
                 const std::string& extra = {}) {
  return R"({"cls": "TensorDict", "non_tensors": {}, "leaves": )" + leaves +
         R"(, "cls_metadata": )" +
         (cls_metadata.empty()
              ? std::string(
                    R"({"device": null, "names": [], "batch_size": [], "is_locked": false})")
              : cls_metadata) +
         extra + "}";
}

std::string leaf(const std::string& entry) { return R"({"a": )" + entry + "}"; }

std::string nested(int levels) {
  std::string s = node("{}");
  for (int i = 0; i < levels; ++i) s = node("{}", {}, R"(, "n": )" + s);
  return s;
}

const std::vector<Malformed> kMalformed = {
    {"UnknownDtype", node(leaf(R"(["torch.foo", [2], 0, 8, 0])")), "unknown dtype 'torch.foo'"},
    {"DtypeNotOnTheWire", node(leaf(R"(["torch.float8_e4m3fn", [8], 0, 8, 0])")), "cannot carry"},
    {"QuantizedDtype", node(leaf(R"(["torch.qint8", [8], 0, 8, 0])")), "quantized"},
    {"DtypeNotAString", node(leaf(R"([7, [2], 0, 8, 0])")), "dtype of leaf 'a' must be a string"},
    {"StopPastTheEnd", node(leaf(R"(["torch.float32", [20], 0, 80, 0])")),
     "past the end of the 64-byte"},
    {"StartPastTheEnd", node(leaf(R"(["torch.float32", [0], 72, 72, 0])")), "past the end"},
    {"NegativeStart", node(leaf(R"(["torch.float32", [2], -8, 0, 0])")), "0 <= start <= stop"},
    {"StopBeforeStart", node(leaf(R"(["torch.float32", [2], 16, 8, 0])")), "0 <= start <= stop"},
    {"StartNotMultipleOf8", node(leaf(R"(["torch.float32", [2], 4, 12, 0])")), "multiples of 8"},
    {"StopNotMultipleOf8", node(leaf(R"(["torch.uint8", [3], 0, 3, 0])")), "multiples of 8"},
    {"MisalignedForElementSize",
     node(R"({"a": ["torch.float32", [2], 0, 8, 0], "b": ["torch.complex128", [1], 8, 24, 0]})"),
     "not a multiple of the 16-byte element size"},
    {"OverlappingRanges",
     node(R"({"a": ["torch.float32", [4], 0, 16, 0], "b": ["torch.float32", [4], 8, 24, 0]})"),
     "leaves 'a' [0, 16) and 'b' [8, 24) overlap"},
    {"OverlapAcrossLevels",
     node(R"({"a": ["torch.float32", [4], 16, 32, 0]})", {},
          R"(, "n": )" + node(R"({"b": ["torch.float32", [2], 24, 32, 0]})")),
     "('n', 'b') [24, 32) overlap"},
    {"SizeDisagreesWithRange", node(leaf(R"(["torch.float32", [3], 0, 16, 0])")), "(12 bytes)"},
    {"PadTooLarge", node(leaf(R"(["torch.uint8", [0], 0, 8, 8])")), "with pad 8"},
    {"NegativePad", node(leaf(R"(["torch.uint8", [16], 0, 8, -8])")), "with pad -8"},
    {"NegativeDim", node(leaf(R"(["torch.float32", [-2], 0, 8, 0])")), "negative dim"},
    {"ShapeProductOverflows", node(leaf(R"(["torch.float32", [4294967296, 4294967296], 0, 8, 0])")),
     "overflows"},
    {"ByteSizeOverflows", node(leaf(R"(["torch.float64", [4611686018427387904], 0, 8, 0])")),
     "byte size overflows"},
    {"IntegerOutOfRange", node(leaf(R"(["torch.float32", [2], 0, 18446744073709551615, 0])")),
     "out of range"},
    {"HugeNumber", node(leaf(R"(["torch.float32", [2], 0, 99999999999999999999, 0])")),
     "out of range"},
    {"HugeFloat", node(leaf(R"(["torch.float32", [2], 0, 1e30, 0])")), "must be an integer"},
    {"FloatOffset", node(leaf(R"(["torch.float32", [2], 0.0, 8, 0])")),
     "start of leaf 'a' must be an integer"},
    {"BoolOffset", node(leaf(R"(["torch.float32", [2], 0, true, 0])")),
     "stop of leaf 'a' must be an integer"},
    {"ShapeNotAList", node(leaf(R"(["torch.float32", 2, 0, 8, 0])")), "must be a list of integers"},
    {"LeafNotAList", node(leaf("{}")), "must be [dtype, shape, start, stop, pad]"},
    {"LeafTooShort", node(leaf(R"(["torch.float32", [2], 0, 8])")), "got 4 elements"},
    {"JaggedLeaf", node(leaf(R"(["torch.int64", [1], 0, 8, 0, 1])")), "jagged"},
    {"LeavesNotAnObject", node("[]"), "leaves of the root must be an object"},
    {"ShapeWithoutBatchPrefix",
     node(leaf(R"(["torch.float32", [2], 0, 8, 0])"),
          R"({"device": null, "names": [null], "batch_size": [3], "is_locked": false})"),
     "does not start with the batch size [3]"},
    {"ChildBatchWithoutPrefix",
     node("{}", R"({"device": null, "names": [null], "batch_size": [2], "is_locked": false})",
          R"(, "n": )" +
              node("{}",
                   R"({"device": null, "names": [null], "batch_size": [5], "is_locked": false})")),
     "does not start with its parent's [2]"},
    {"NegativeBatchDim",
     node("{}", R"({"device": null, "names": [null], "batch_size": [-1], "is_locked": false})"),
     "negative batch dim"},
    {"NamesCountMismatch",
     node("{}",
          R"({"device": null, "names": [null, null], "batch_size": [2], "is_locked": false})"),
     "2 names for 1 batch dims"},
    {"BadDeviceString",
     node("{}", R"({"device": "nonsense:7", "names": [], "batch_size": [], "is_locked": false})"),
     "device 'nonsense:7', which is not a device name"},
    {"DeviceNotAString",
     node("{}", R"({"device": 5, "names": [], "batch_size": [], "is_locked": false})"),
     "must be a string or null"},
    {"IsLockedNotABool",
     node("{}", R"({"device": null, "names": [], "batch_size": [], "is_locked": 1})"),
     "is_locked in cls_metadata of the root must be a bool"},
    {"UnexpectedClsMetadataField",
     node("{}", R"({"device": null, "names": [], "batch_size": [], "is_locked": false, "x": 1})"),
     "unexpected field 'x'"},
    {"MissingBatchSize", node("{}", R"({"device": null, "names": [], "is_locked": false})"),
     "has no batch_size"},
    {"ClsNotAString",
     R"({"cls": 1, "non_tensors": {}, "leaves": {}, "cls_metadata": {"batch_size": []}})",
     "cls of the root must be a string"},
    {"ClsNotSupported",
     R"({"cls": "NonTensorData", "non_tensors": {}, "leaves": {}, "cls_metadata": {"batch_size": []}})",
     "only TensorDict, LazyStackedTensorDict and NonTensorStack nodes"},
    {"NonTensorStackRoot",
     R"({"cls": "NonTensorStack", "non_tensors": {"0": ["a", [], null]}, "leaves": {}, "cls_metadata": {"stack_dim": 0, "stack_dim_name": null, "is_locked": false}})",
     "the root is a NonTensorStack"},
    {"LazyStackWithATensorDictsFields",
     R"({"cls": "LazyStackedTensorDict", "non_tensors": {}, "leaves": {}, "cls_metadata": {"batch_size": []}})",
     "of a lazy stack has the unexpected field 'batch_size'"},
    {"MissingField", R"({"cls": "TensorDict", "leaves": {}, "cls_metadata": {"batch_size": []}})",
     "lacks one of"},
    {"NodeNotAnObject", "[1, 2]", "must be an object, got array"},
    {"ScalarWhereANodeBelongs", node("{}", {}, R"(, "x": 5)"),
     "'x' holds a number, not a nested node"},
    {"UnderscoreScalarBelowTheTop",
     node("{}", {}, R"(, "n": )" + node("{}", {}, R"(, "_total_bytes": 5)")),
     "('n', '_total_bytes') holds a number"},
    {"DuplicateKey",
     node(leaf(R"(["torch.float32", [2], 0, 8, 0])"), {}, R"(, "a": )" + node("{}")),
     "'a' appears twice"},
    {"InvalidJson", R"({"cls": )", "invalid JSON"},
    {"JsonTooDeep", std::string(1000, '[') + std::string(1000, ']'), "JSON nested deeper"},
    {"NodesTooDeep", nested(kMaxMetadataDepth + 1), "deeper than 64 levels"},
    {"NonTensorMalformed",
     R"({"cls": "TensorDict", "non_tensors": {"s": [1]}, "leaves": {}, "cls_metadata": {"batch_size": []}})",
     "must be [data, batch_size, device]"},
    {"NonTensorBatchSizeNotInts",
     R"({"cls": "TensorDict", "non_tensors": {"s": ["hi", "x", null]}, "leaves": {}, "cls_metadata": {"batch_size": []}})",
     "batch_size of non-tensor entry 's' must be a list of integers"},
    {"NonTensorBatchWithoutPrefix",
     R"({"cls": "TensorDict", "non_tensors": {"s": ["hi", [], null]}, "leaves": {}, "cls_metadata": {"batch_size": [2]}})",
     "non-tensor entry 's' has batch_size [], which does not start with"},
    {"NonTensorDeviceNotAString",
     R"({"cls": "TensorDict", "non_tensors": {"s": ["hi", [], 7]}, "leaves": {}, "cls_metadata": {"batch_size": []}})",
     "device of non-tensor entry 's' must be a string or null"},
    {"NonTensorDataTooDeep",
     R"({"cls": "TensorDict", "non_tensors": {"s": [)" + std::string(200, '[') +
         std::string(200, ']') +
         R"(, [], null]}, "leaves": {}, "cls_metadata": {"batch_size": []}})",
     "JSON nested deeper"},
    {"NonTensorDuplicatesALeaf",
     R"({"cls": "TensorDict", "non_tensors": {"a": [1, [], null]}, "leaves": {"a": ["torch.uint8", [0], 0, 0, 0]}, "cls_metadata": {"batch_size": []}})",
     "'a' appears twice"},
};

class ConsolidateMalformed : public ::testing::TestWithParam<Malformed> {};

}  // namespace

TEST_P(ConsolidateMalformed, IsRefusedWithValueError) {
  const auto& c = GetParam();
  at::Tensor storage = at::zeros({64}, at::kByte);
  EXPECT_THROW_MSG(rebuild(metadata_from_json(c.json), storage), c10::ValueError, c.needle);
}

INSTANTIATE_TEST_SUITE_P(Consolidate, ConsolidateMalformed, ::testing::ValuesIn(kMalformed),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(ConsolidateMalformedSanity, TheBaseTextIsValid) {
  // The malformed cases differ from valid text only in the fault they name.
  at::Tensor storage = at::zeros({64}, at::kByte);
  EXPECT_NO_THROW(
      rebuild(metadata_from_json(node(leaf(R"(["torch.float32", [2], 0, 8, 0])"))), storage));
  EXPECT_NO_THROW(rebuild(metadata_from_json(nested(kMaxMetadataDepth)), storage));
  EXPECT_NO_THROW(rebuild(
      metadata_from_json(node(
          R"({"a": ["torch.float32", [4], 0, 16, 0], "b": ["torch.complex128", [1], 16, 32, 0]})")),
      storage));
}

// A peer's text in a refused position is quoted by its first bytes and its length
// (core/excerpt.h): a 250 MiB dtype name, field name, device or key costs the value the parser
// builds (250 MiB; a device is also copied into the metadata that validation refuses), not a
// message as long again and its copies in the exception.
TEST(ConsolidateRefusedText, IsQuotedByItsStartAndLength) {
  const std::string big(size_t{250} << 20, 'x');
  const std::string quoted = "'" + std::string(80, 'x') + "...(262144000 bytes)'";
  const std::string cls = R"({"device": null, "names": [], "batch_size": [], "is_locked": false)";
  const struct {
    const char* name;
    std::string json;
    std::string needle;
    int64_t copies;  // of the 250 MiB value, held while the error is made
  } cases[] = {
      {"dtype", node(leaf(R"([")" + big + R"(", [2], 0, 8, 0])")),
       "leaf 'a' has the unknown dtype " + quoted, 1},
      {"field", node("{}", cls + R"(, ")" + big + R"(": 1})"), "has the unexpected field " + quoted,
       1},
      {"device", node("{}", R"({"device": ")" + big + R"(", "names": [], "batch_size": []})"),
       "has device " + quoted + ", which is not a device name", 2},
      {"key", node("{}", {}, R"(, ")" + big + R"(": 5)"), "the key " + quoted + " holds a number",
       1},
  };
  at::Tensor storage = at::zeros({64}, at::kByte);
  for (const auto& c : cases) {
    std::string message;
    const int64_t growth = peak_growth([&] {
      try {
        rebuild(metadata_from_json(c.json), storage);
      } catch (const c10::ValueError& e) {
        message = e.what_without_backtrace();
      }
    });
    std::cout << "a 250 MiB " << c.name << ": \"" << message << "\" -- peak growth " << growth / 1e6
              << " MB\n";
    EXPECT_NE(message.find(c.needle), std::string::npos) << c.name << ": " << message;
    EXPECT_LT(message.size(), 400u) << c.name;
    if (kMeasureMemory) {
      EXPECT_LT(growth, c.copies * (int64_t{250} << 20) + (int64_t{64} << 20)) << c.name;
    }
  }
}

// ---- non-tensor entries -----------------------------------------------------------------------

TEST(ConsolidateNonTensor, RecordedKeptAndRebuilt) {
  TensorDict td = worked_example();
  td.set_non_tensor("label", "hi");
  td.set_non_tensor({"c", "cfg"},
                    JsonValue::map({{"nan", std::nan("")}, {"l", JsonValue::list({1})}}));
  TensorDict c = consolidate(td);
  // NaN is never == itself, yet the entry is unchanged: still consolidated, reused as is.
  EXPECT_TRUE(is_consolidated(c));
  EXPECT_TRUE(consolidate(c).is_same(c));
  EXPECT_EQ(consolidated_storage(c).numel(), 96);  // no bytes for them
  EXPECT_EQ(c.entries()[3].first, "label");        // the result keeps td's insertion order
  const auto m = consolidated_metadata(c);
  ASSERT_EQ(m->non_tensors.size(), 1u);
  EXPECT_EQ(m->non_tensors[0].first, "label");
  EXPECT_EQ(m->non_tensors[0].second.batch_size, std::vector<int64_t>({4}));
  EXPECT_EQ(m->children[0].second.non_tensors[0].first, "cfg");
  const std::string json = metadata_to_json(*m);
  EXPECT_NE(json.find(R"("non_tensors": {"label": ["hi", [4], null]})"), std::string::npos) << json;
  EXPECT_NE(json.find(R"("non_tensors": {"cfg": [{"nan": NaN, "l": [1]}, [4], null]})"),
            std::string::npos)
      << json;
  TensorDict r = rebuild(metadata_from_json(json), consolidated_storage(c));
  EXPECT_TRUE(is_consolidated(r));
  EXPECT_EQ(r.entries()[0].first, "label");  // non-tensor entries first, as the reference's
  EXPECT_EQ(r.get_non_tensor("label"), JsonValue("hi"));
  EXPECT_TRUE(std::isnan(r.get_non_tensor({"c", "cfg"}).at("nan").as_float()));
  // A changed entry, set through the nested level's own handle, ends the consolidation.
  TensorDict nested = c.get("c").tensordict();
  nested.unlock_();
  nested.set_non_tensor("cfg", 1);
  EXPECT_FALSE(is_consolidated(c));
}

// ---- consolidate(filename=...) and from_consolidated ------------------------------------------

namespace {

// A fresh directory per test, removed afterwards.
class ConsolidateFile : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (std::filesystem::temp_directory_path() / "td_consolidate_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

std::string read_file(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const std::string& file, const std::string& bytes) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(int64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(static_cast<uint64_t>(v) >> (8 * i));
  return out;
}

std::string storage_bytes(const at::Tensor& storage) {
  return {reinterpret_cast<const char*>(bytes(storage)), static_cast<size_t>(storage.numel())};
}

// Nested levels, non-tensor entries, several dtypes (odd sizes, so that pads are needed).
TensorDict file_sample() {
  TensorDict deeper(
      {{"h", at::arange(6, at::kHalf).view({3, 2})}, {"bf", at::full({3}, 1.5, at::kBFloat16)}},
      {3});
  TensorDict inner({{"i", at::arange(3, at::kInt)}, {"deeper", deeper}}, {3});
  TensorDict td({{"f", at::arange(12, at::kFloat).view({3, 4})},
                 {"b", at::tensor({1, 0, 1}, at::kByte).to(at::kBool)},
                 {"u8", at::arange(3, at::kByte)},
                 {"d", at::arange(3, at::kDouble) / 3},
                 {"l", at::arange(6, at::kLong).view({3, 2}) - 3},
                 {"c", at::complex(at::ones({3}), at::full({3}, 2.0))},
                 {"inner", inner}},
                {3});
  td.set_non_tensor("label", "hello");
  td.set_non_tensor({"inner", "cfg"}, JsonValue::map({{"k", JsonValue::list({1, 2})}}));
  return td;
}

// Same keys (leaves by value, dtype and shape; non-tensors by value) and batch sizes, whatever
// the order of the entries.
void expect_same_content(const TensorDict& got, const TensorDict& want) {
  EXPECT_EQ(got.batch_size(), want.batch_size());
  const auto g = got.items({.include_nested = true});
  const auto w = want.items({.include_nested = true});
  ASSERT_EQ(g.size(), w.size());
  for (const auto& [key, value] : w) {
    ASSERT_TRUE(got.contains(key)) << key.str();
    const Value v = got.get(key);
    if (value.is_tensor()) {
      ASSERT_TRUE(v.is_tensor()) << key.str();
      EXPECT_TRUE(same_bytes(v.tensor(), value.tensor())) << key.str();
    } else if (value.is_non_tensor()) {
      ASSERT_TRUE(v.is_non_tensor()) << key.str();
      EXPECT_EQ(got.get_non_tensor(key), want.get_non_tensor(key)) << key.str();
    } else {
      ASSERT_TRUE(v.is_tensordict()) << key.str();
      EXPECT_EQ(v.tensordict().batch_size(), value.tensordict().batch_size()) << key.str();
    }
  }
}

// fn throws a c10::Error whose message names `file`; returns the message.
std::string error_naming(const std::function<void()>& fn, const std::string& file) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    return msg;
  }
  ADD_FAILURE() << "expected a c10::Error naming " << file;
  return "";
}

}  // namespace

TEST_F(ConsolidateFile, LayoutIsLeavesThenJsonThenItsLength) {
  const TensorDict td = file_sample();
  const TensorDict mem = consolidate(td);
  const TensorDict c = consolidate(td, {.filename = path("td.bin")});
  EXPECT_TRUE(is_consolidated(c));
  expect_same_content(c, td);

  const std::string file = read_file(path("td.bin"));
  const std::string storage = storage_bytes(consolidated_storage(mem));
  const std::string json = metadata_to_json(*consolidated_metadata(mem));
  ASSERT_EQ(file.size(), storage.size() + json.size() + 8);
  EXPECT_EQ(file.substr(0, storage.size()), storage);
  EXPECT_EQ(file.substr(storage.size(), json.size()), json);
  EXPECT_EQ(file.substr(file.size() - 8), le64(static_cast<int64_t>(json.size())));
  // The result's storage is the leaves' part of the file.
  EXPECT_EQ(consolidated_storage(c).numel(), static_cast<int64_t>(storage.size()));
  EXPECT_EQ(*consolidated_metadata(c), *consolidated_metadata(mem));
}

TEST_F(ConsolidateFile, RoundTripsAndIsReproducible) {
  const TensorDict td = file_sample();
  consolidate(td, {.filename = path("one.bin")});
  const TensorDict back = from_consolidated(path("one.bin"));
  expect_same_content(back, td);
  EXPECT_TRUE(is_consolidated(back));
  EXPECT_FALSE(back.is_locked());  // as the reference's
  EXPECT_EQ(back.get({"inner", "deeper"}).tensordict().batch_size(), at::IntArrayRef({3}));
  expect_all_views(back, consolidated_storage(back));
  // A second consolidation, of the original or of what was read, writes the same bytes.
  consolidate(td, {.filename = path("two.bin")});
  consolidate(back, {.filename = path("three.bin")});
  EXPECT_EQ(read_file(path("one.bin")), read_file(path("two.bin")));
  EXPECT_EQ(read_file(path("one.bin")), read_file(path("three.bin")));
  // An already consolidated TensorDict is still written (unlocked: the lock is recorded).
  TensorDict mem = consolidate(td);
  consolidate(mem, {.filename = path("locked.bin")});
  EXPECT_NE(read_file(path("locked.bin")).find(R"("is_locked": true)"), std::string::npos);
  mem.unlock_();
  EXPECT_TRUE(is_consolidated(mem));
  consolidate(mem, {.filename = path("four.bin")});
  EXPECT_EQ(read_file(path("one.bin")), read_file(path("four.bin")));
  // An empty TensorDict: no leaves, metadata only.
  consolidate(TensorDict(), {.filename = path("empty.bin")});
  EXPECT_TRUE(from_consolidated(path("empty.bin")).entries().empty());
}

TEST_F(ConsolidateFile, WritesToTheResultReachTheFileButNotToWhatWasRead) {
  const TensorDict td = file_sample();
  const TensorDict c = consolidate(td, {.filename = path("td.bin")});
  // consolidate's result is a shared mapping: writes reach the file.
  c.get("f").tensor().fill_(7);
  EXPECT_TRUE(from_consolidated(path("td.bin")).get("f").tensor().eq(7).all().item<bool>());

  const std::string before = read_file(path("td.bin"));
  const TensorDict back = from_consolidated(path("td.bin"));
  back.get("f").tensor().fill_(-1);
  back.get({"inner", "i"}).tensor().fill_(-1);
  EXPECT_TRUE(back.get("f").tensor().eq(-1).all().item<bool>());
  EXPECT_EQ(read_file(path("td.bin")), before);
  EXPECT_TRUE(from_consolidated(path("td.bin")).get("f").tensor().eq(7).all().item<bool>());

  // Writing the file again makes a new file: a mapping of the old one keeps its data.
  const TensorDict old = from_consolidated(path("td.bin"));
  consolidate(TensorDict({{"f", at::full({3, 4}, 3.0)}}, {3}), {.filename = path("td.bin")});
  EXPECT_TRUE(old.get("f").tensor().eq(7).all().item<bool>());
  EXPECT_TRUE(from_consolidated(path("td.bin")).get("f").tensor().eq(3).all().item<bool>());
}

TEST_F(ConsolidateFile, RefusalsWhenWriting) {
  // Unbatched leaves, as the reference; nothing is written.
  TensorDict u({{"a", at::zeros({2})}, {"u", Value::unbatched(at::ones({3}))}}, {2});
  EXPECT_THROW_MSG(consolidate(u, {.filename = path("u.bin")}), c10::NotImplementedError,
                   "'u' is one");
  EXPECT_FALSE(std::filesystem::exists(path("u.bin")));
  // A device other than the CPU.
  EXPECT_THROW_MSG(
      consolidate(file_sample(), {.device = at::Device(at::kMeta), .filename = path("m.bin")}),
      c10::ValueError, "device and filename are mutually exclusive arguments.");
  EXPECT_NO_THROW(
      consolidate(file_sample(), {.device = at::Device(at::kCPU), .filename = path("cpu.bin")}));
  // A directory where the file should be, and a missing parent directory.
  std::filesystem::create_directory(path("dir"));
  error_naming([&] { consolidate(file_sample(), {.filename = path("dir")}); }, path("dir"));
  error_naming([&] { consolidate(file_sample(), {.filename = path("no/such/f.bin")}); },
               path("no/such/f.bin"));
}

TEST_F(ConsolidateFile, ForgedOrTruncatedFilesAreCleanErrorsNamingTheFile) {
  const TensorDict td({{"a", at::arange(12, at::kFloat).view({4, 3})}}, {4});
  consolidate(td, {.filename = path("good.bin")});
  const std::string good = read_file(path("good.bin"));
  const std::string storage = good.substr(0, 48);
  const std::string json = metadata_to_json(*consolidated_metadata(consolidate(td)));
  ASSERT_EQ(good, storage + json + le64(static_cast<int64_t>(json.size())));
  const auto assemble = [&](const std::string& s, const std::string& j) {
    return s + j + le64(static_cast<int64_t>(j.size()));
  };
  const auto edited = [&](const std::string& from, const std::string& to) {
    std::string j = json;
    const auto at = j.find(from);
    EXPECT_NE(at, std::string::npos) << from << " in " << j;
    j.replace(at, from.size(), to);
    return assemble(storage, j);
  };
  ASSERT_NE(json.find(R"("a": ["torch.float32", [4, 3], 0, 48, 0])"), std::string::npos) << json;

  const std::vector<std::pair<std::string, std::string>> cases = {
      {"empty", ""},
      {"seven_bytes", good.substr(0, 7)},
      {"eight_zero_bytes", std::string(8, '\0')},
      {"trailer_too_long", storage + le64(static_cast<int64_t>(good.size()) * 2)},
      {"trailer_zero", storage + le64(0)},
      {"trailer_negative", storage + le64(-5)},
      {"trailer_huge", storage + le64(std::numeric_limits<int64_t>::max())},
      {"garbage_json", assemble(storage, "{not json")},
      {"json_not_object", assemble(storage, "[1, 2]")},
      {"json_cut", assemble(storage, json.substr(0, json.size() / 2))},
      {"cut_in_storage", good.substr(24)},
      {"range_past_storage", edited("[4, 3], 0, 48, 0]", "[4, 3], 0, 112, 0]")},
      {"shape_past_storage", edited("[4, 3], 0, 48, 0]", "[4, 3000], 0, 48, 0]")},
      {"range_backwards", edited("[4, 3], 0, 48, 0]", "[4, 3], 40, 0, 0]")},
      {"negative_shape", edited("[4, 3], 0, 48, 0]", "[-4, 3], 0, 48, 0]")},
      {"bad_dtype", edited("torch.float32", "torch.evil")},
      {"no_leaves_node", edited(R"("leaves")", R"("leafs")")},
      {"storage_missing", assemble("", json)},
  };
  for (const auto& [name, bytes] : cases) {
    SCOPED_TRACE(name);
    const std::string file = path(name + ".bin");
    write_file(file, bytes);
    ASSERT_EQ(std::filesystem::file_size(file), bytes.size());
    const std::string msg = error_naming([&] { from_consolidated(file); }, file);
    EXPECT_EQ(msg.rfind("from_consolidated: ", 0), 0u) << msg;
  }
  // The untouched file still reads, and is what was written.
  expect_same_content(from_consolidated(path("good.bin")), td);
}

TEST_F(ConsolidateFile, MissingDirectoryFifoAndMetadataBound) {
  const std::string missing = path("nope.bin");
  EXPECT_NE(error_naming([&] { from_consolidated(missing); }, missing).find("No such file"),
            std::string::npos);
  EXPECT_NE(error_naming([&] { from_consolidated(dir_.string()); }, dir_.string())
                .find("not a regular file"),
            std::string::npos);
  const std::string fifo = path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(error_naming([&] { from_consolidated(fifo); }, fifo).find("not a regular file"),
            std::string::npos);
  consolidate(file_sample(), {.filename = path("good.bin")});
  EXPECT_NE(error_naming([&] { from_consolidated(path("good.bin"), {.max_metadata_bytes = 16}); },
                         path("good.bin"))
                .find("max_metadata_bytes"),
            std::string::npos);
  // A symlink is followed.
  std::filesystem::create_symlink(path("good.bin"), path("link.bin"));
  expect_same_content(from_consolidated(path("link.bin")), file_sample());
}
