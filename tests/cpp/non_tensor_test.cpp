// NonTensorData in its three kinds (non_tensor.h): NonTensorStack's values, batch operations and
// metadata node, MetaData's stacking and its mark in the pickle. The reference's behaviour these
// mirror is checked against the installed reference in tests/python/test_non_tensor_stack.py.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "core/metadata.h"
#include "expect_throw.h"
#include "tensordict/tensordict.h"
#include "wire/metadata_pickle.h"

using namespace at::indexing;
using tensordict::JsonValue;
using tensordict::Metadata;
using tensordict::NonTensorData;
using tensordict::TensorDict;

namespace {

NonTensorData texts(std::initializer_list<const char*> values) {
  std::vector<NonTensorData> members;
  for (const char* v : values) members.emplace_back(JsonValue(v));
  return NonTensorData::stack(std::move(members));
}

std::vector<int64_t> batch(const NonTensorData& nt) { return nt.batch_size().vec(); }

}  // namespace

TEST(NonTensorStack, ValuesAndShape) {
  const NonTensorData s = texts({"hello", "big", "world"});
  EXPECT_TRUE(s.is_stack());
  EXPECT_STREQ(s.class_name(), "NonTensorStack");
  EXPECT_EQ(batch(s), std::vector<int64_t>({3}));
  EXPECT_EQ(s.tolist(), JsonValue::list({"hello", "big", "world"}));
  EXPECT_FALSE(s.common_data().has_value());
  EXPECT_THROW_MSG(s.data(), c10::TypeError, "Cannot get the non-unique data of a NonTensorStack");
  EXPECT_EQ(texts({"a", "a"}).common_data(), JsonValue("a"));
  // Along dim 1, members of batch size [2]: values row-major whatever the stack dim.
  const NonTensorData d1 =
      NonTensorData::stack({NonTensorData("x", {2}), NonTensorData("y", {2})}, 1);
  EXPECT_EQ(batch(d1), std::vector<int64_t>({2, 2}));
  EXPECT_EQ(d1.tolist(),
            JsonValue::list({JsonValue::list({"x", "y"}), JsonValue::list({"x", "y"})}));
  EXPECT_EQ(d1.unbind(1)[1].data(), JsonValue("y"));
  EXPECT_EQ(d1.unbind(0)[0].tolist(), JsonValue::list({"x", "y"}));
  EXPECT_THROW_MSG(NonTensorData::stack({NonTensorData("x", {2}), NonTensorData("y", {3})}),
                   c10::ValueError, "different batch sizes, [2] (member 0) and [3] (member 1)");
  const NonTensorData empty = NonTensorData::stack({});
  EXPECT_EQ(batch(empty), std::vector<int64_t>({0}));
  EXPECT_EQ(empty.tolist(), JsonValue::list({}));
}

TEST(NonTensorStack, FromListNests) {
  const auto values = JsonValue::list({JsonValue::list({"a", "b"}), JsonValue::list({"c", "d"})});
  const NonTensorData grid = NonTensorData::from_list(values);
  EXPECT_EQ(batch(grid), std::vector<int64_t>({2, 2}));
  EXPECT_EQ(grid.tolist(), values);
  const NonTensorData flat = NonTensorData::from_list(values, std::nullopt, 1);
  EXPECT_EQ(batch(flat), std::vector<int64_t>({2}));
  EXPECT_EQ(flat.members()[1].data(), JsonValue::list({"c", "d"}));
  const NonTensorData ragged = NonTensorData::from_list(
      JsonValue::list({JsonValue::list({"a"}), JsonValue::list({"b", "c"})}));
  EXPECT_EQ(batch(ragged), std::vector<int64_t>({2}));  // members hold the lists
  EXPECT_THROW_MSG(NonTensorData::from_list("x"), c10::TypeError, "expected a list, got str");
}

// A member per use of a reused list: counted before any is built, and refused past 256 MiB of
// members beyond one per item of the distinct lists (docs/reliability.md, Shared objects).
TEST(NonTensorStack, FromListCountsReusedListsFirst) {
  JsonValue laughs(std::string(1024, 'x'));  // one str, that list 32 times, five levels
  for (int level = 0; level < 5; ++level) laughs = JsonValue(JsonValue::List(32, laughs));
  EXPECT_THROW_MSG(NonTensorData::from_list(laughs), c10::ValueError,
                   "NonTensorStack.from_list: as a NonTensorStack it would have 34636832 members");
  EXPECT_THROW_MSG(NonTensorData::from_list(laughs, std::nullopt, std::nullopt, "key 'a'"),
                   c10::ValueError, "the 160 items of its distinct lists; the limit is 268435456");
  // One level: 32 members, each holding the shared rest.
  const NonTensorData flat = NonTensorData::from_list(laughs, std::nullopt, 1);
  EXPECT_EQ(batch(flat), std::vector<int64_t>({32}));
  EXPECT_EQ(flat.members()[0].data().node(), laughs.as_list()[0].node());
  // Rows reused within the budget: the stack of every element.
  const JsonValue rows(JsonValue::List(1000, JsonValue(JsonValue::List(100, "x"))));
  const NonTensorData grid = NonTensorData::from_list(rows);
  EXPECT_EQ(batch(grid), std::vector<int64_t>({1000, 100}));
  EXPECT_EQ(grid.members()[999].members()[99].data(), JsonValue("x"));
}

TEST(NonTensorStack, BatchOperationsMoveTheElements) {
  TensorDict td({{"a", at::arange(3)}}, {3});
  td.set("s", texts({"p", "q", "r"}));
  EXPECT_EQ(td.index({1}).get_non_tensor("s"), JsonValue("q"));
  EXPECT_FALSE(td.index({1}).get("s").non_tensor().is_stack());
  EXPECT_EQ(td.index({Slice(1, None)}).get_non_tensor("s"), JsonValue::list({"q", "r"}));
  EXPECT_EQ(td.index({at::tensor({2, 0, 2})}).get_non_tensor("s"),
            JsonValue::list({"r", "p", "r"}));
  EXPECT_EQ(td.index({at::tensor({1, 0, 1}).to(at::kBool)}).get_non_tensor("s"),
            JsonValue::list({"p", "r"}));
  EXPECT_EQ(td.unsqueeze(0).get_non_tensor("s"),
            JsonValue::list({JsonValue::list({"p", "q", "r"})}));
  EXPECT_EQ(td.expand({2, 3}).index({1, 2}).get_non_tensor("s"), JsonValue("r"));
  auto parts = td.unbind(0);
  EXPECT_EQ(parts[2].get_non_tensor("s"), JsonValue("r"));
  auto halves = td.split(2);
  EXPECT_EQ(halves[1].get_non_tensor("s"), JsonValue::list({"r"}));
  TensorDict grid = tensordict::stack({td, td}, 1);
  EXPECT_EQ(grid.get("s").non_tensor().stack_dim(), 1);
  EXPECT_EQ(grid.reshape({6}).get_non_tensor("s"), JsonValue::list({"p", "p", "q", "q", "r", "r"}));
  EXPECT_EQ(grid.transpose(0, 1).index({1}).get_non_tensor("s"), JsonValue::list({"p", "q", "r"}));
  TensorDict both = tensordict::cat({td, td.index({Slice(0, 1)})});
  EXPECT_EQ(both.get_non_tensor("s"), JsonValue::list({"p", "q", "r", "p"}));
  EXPECT_EQ(td.index({Slice(0, 0)}).get("s").non_tensor().batch_size(), at::IntArrayRef({0}));
  EXPECT_EQ(td.clone().get("s").non_tensor(), td.get("s").non_tensor());
  // Equality element by element, as the reference's NonTensorStack.__eq__.
  TensorDict other = td.clone();
  other.set("s", texts({"p", "x", "r"}));
  EXPECT_TRUE(at::equal((td == other).get("s").tensor(), at::tensor({1, 0, 1}).to(at::kBool)));
}

TEST(NonTensorStack, LazyStacksReadAndWriteIt) {
  TensorDict a({}, {}), b({}, {});
  a.set_non_tensor("t", "a");
  b.set_non_tensor("t", "b");
  TensorDict lazy = tensordict::lazy_stack({a, b});
  EXPECT_EQ(lazy.get_non_tensor("t"), JsonValue::list({"a", "b"}));
  lazy.set("t", texts({"c", "d"}));
  EXPECT_EQ(a.get_non_tensor("t"), JsonValue("c"));
  EXPECT_EQ(b.get_non_tensor("t"), JsonValue("d"));
}

TEST(MetaData, StacksIntoOneWhenEqual) {
  TensorDict a({{"x", at::zeros({3})}}, {3});
  a.set("cfg", NonTensorData::metadata("c", {3}));
  TensorDict s = tensordict::stack({a, a.clone()});
  const NonTensorData cfg = s.get("cfg").non_tensor();
  EXPECT_TRUE(cfg.is_metadata());
  EXPECT_EQ(batch(cfg), std::vector<int64_t>({2, 3}));
  EXPECT_TRUE(s.index({0, 1}).get("cfg").non_tensor().is_metadata());
  TensorDict b = a.clone();
  b.set("cfg", NonTensorData::metadata("other", {3}));
  EXPECT_TRUE(tensordict::stack({a, b}).get("cfg").non_tensor().is_stack());
}

TEST(NonTensorStack, ConsolidatesAndRebuildsAsTheReference) {
  TensorDict td({{"a", at::arange(3, at::kFloat)}}, {3});
  td.set("names", texts({"a", "b", "c"}));
  td.set("grid", NonTensorData::stack(
                     {NonTensorData::stack({NonTensorData("x", {}), NonTensorData("y", {})}),
                      NonTensorData::stack({NonTensorData("z", {}), NonTensorData("w", {})}),
                      NonTensorData::stack({NonTensorData("u", {}), NonTensorData("v", {})})}));
  td.set("cfg", NonTensorData::metadata("c", {3}));
  TensorDict c = tensordict::consolidate(td);
  // The reference's json.dumps of td.consolidate()._consolidated["metadata"].
  EXPECT_EQ(
      tensordict::metadata_to_json(*tensordict::consolidated_metadata(c)),
      "{\"cls\": \"TensorDict\", \"non_tensors\": {\"cfg\": [\"c\", [3], null]}, \"leaves\": "
      "{\"a\": [\"torch.float32\", [3], 0, 16, 4]}, \"cls_metadata\": {\"device\": null, "
      "\"names\": [null], \"batch_size\": [3], \"is_locked\": false}, \"names\": {\"cls\": "
      "\"NonTensorStack\", \"non_tensors\": {\"0\": [\"a\", [], null], \"1\": [\"b\", [], null], "
      "\"2\": [\"c\", [], null]}, \"leaves\": {}, \"cls_metadata\": {\"stack_dim\": 0, "
      "\"stack_dim_name\": null, \"is_locked\": false}}, \"grid\": {\"cls\": \"NonTensorStack\", "
      "\"non_tensors\": {}, \"leaves\": {}, \"cls_metadata\": {\"stack_dim\": 0, "
      "\"stack_dim_name\": null, \"is_locked\": false}, \"0\": {\"cls\": \"NonTensorStack\", "
      "\"non_tensors\": {\"0\": [\"x\", [], null], \"1\": [\"y\", [], null]}, \"leaves\": {}, "
      "\"cls_metadata\": {\"stack_dim\": 0, \"stack_dim_name\": null, \"is_locked\": false}}, "
      "\"1\": {\"cls\": \"NonTensorStack\", \"non_tensors\": {\"0\": [\"z\", [], null], \"1\": "
      "[\"w\", [], null]}, \"leaves\": {}, \"cls_metadata\": {\"stack_dim\": 0, "
      "\"stack_dim_name\": null, \"is_locked\": false}}, \"2\": {\"cls\": \"NonTensorStack\", "
      "\"non_tensors\": {\"0\": [\"u\", [], null], \"1\": [\"v\", [], null]}, \"leaves\": {}, "
      "\"cls_metadata\": {\"stack_dim\": 0, \"stack_dim_name\": null, \"is_locked\": false}}}}");
  EXPECT_TRUE(tensordict::is_consolidated(c));
  EXPECT_EQ(c.get("names").non_tensor(), td.get("names").non_tensor());
  // Through JSON (the pipe) and the pickle (init_remote, the collectives).
  const auto& meta = *tensordict::consolidated_metadata(c);
  for (const Metadata& back : {tensordict::metadata_from_json(tensordict::metadata_to_json(meta)),
                               tensordict::wire::metadata_from_pickle_bytes(
                                   tensordict::wire::metadata_pickle_bytes(meta))}) {
    TensorDict r = tensordict::rebuild(back, tensordict::consolidated_storage(c));
    EXPECT_EQ(r.get_non_tensor("names"), JsonValue::list({"a", "b", "c"}));
    EXPECT_EQ(r.get("grid").non_tensor().tolist(), td.get("grid").non_tensor().tolist());
    EXPECT_EQ(r.index({2}).get("grid").non_tensor().unbind(0)[1].data(), JsonValue("v"));
  }
  // JSON has no room for MetaData's mark: the reference's NonTensorData comes back; the pickle
  // keeps it (a list, not the reference's tuple: docs/wire-format.md §3.7).
  EXPECT_FALSE(
      tensordict::rebuild(tensordict::metadata_from_json(tensordict::metadata_to_json(meta)),
                          tensordict::consolidated_storage(c))
          .get("cfg")
          .non_tensor()
          .is_metadata());
  EXPECT_TRUE(tensordict::rebuild(tensordict::wire::metadata_from_pickle_bytes(
                                      tensordict::wire::metadata_pickle_bytes(meta)),
                                  tensordict::consolidated_storage(c))
                  .get("cfg")
                  .non_tensor()
                  .is_metadata());
}

TEST(NonTensorStack, MalformedNodesAreRefused) {
  const std::string head =
      R"({"cls": "TensorDict", "non_tensors": {}, "leaves": {}, "cls_metadata": {"batch_size": [2]}, "s": )";
  const auto refused = [&](const std::string& node, const char* needle) {
    EXPECT_THROW_MSG(tensordict::metadata_from_json(head + node + "}"), c10::ValueError, needle);
  };
  const std::string cm =
      R"("cls_metadata": {"stack_dim": 0, "stack_dim_name": null, "is_locked": false})";
  refused(
      R"({"cls": "NonTensorStack", "non_tensors": {"0": ["a", [], null], "2": ["b", [], null]}, "leaves": {}, )" +
          cm + "}",
      "member key '2'");
  refused(
      R"({"cls": "NonTensorStack", "non_tensors": {"0": ["a", [], null], "1": ["b", [1], null]}, "leaves": {}, )" +
          cm + "}",
      "different batch sizes");
  refused(R"({"cls": "NonTensorStack", "non_tensors": {"0": ["a", [], null]}, "leaves": {}, )" +
              cm + "}",
          "does not start with its parent's [2]");
  refused(
      R"({"cls": "NonTensorStack", "non_tensors": {"0": ["a", [], null], "1": ["b", [], null]}, "leaves": {}, "cls_metadata": {"stack_dim": 1, "stack_dim_name": null, "is_locked": false}})",
      "stack_dim 1 for members with 0 batch dims");
  refused(
      R"({"cls": "NonTensorStack", "non_tensors": {"0": ["a", [], null]}, "leaves": {}, )" + cm +
          R"(, "1": {"cls": "TensorDict", "non_tensors": {}, "leaves": {}, "cls_metadata": {"batch_size": []}}})",
      "a member is a non-tensor entry or a NonTensorStack");
  refused(
      R"({"cls": "NonTensorStack", "non_tensors": {"00": ["a", [], null], "1": ["b", [], null]}, "leaves": {}, )" +
          cm + "}",
      "member key '00'");
}

TEST(NonTensorStack, MemmapRoundTrips) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("td_nts_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  TensorDict td({{"a", at::arange(3, at::kFloat)}}, {3});
  td.set("names", texts({"a", "b", "c"}));
  td.set("cfg", NonTensorData::metadata("c", {3}));
  tensordict::memmap(td, dir.string());
  TensorDict back = tensordict::load_memmap(dir.string());
  EXPECT_EQ(back.get_non_tensor("names"), JsonValue::list({"a", "b", "c"}));
  EXPECT_TRUE(back.get("cfg").non_tensor().is_metadata());
  std::filesystem::remove_all(dir);
}
