#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>

#include "tensordict/consolidate.h"
#include "tensordict/tensor_dict.h"
#include "wire/metadata_pickle.h"
#include "wire/pickle.h"

namespace pk = tensordict::wire::pickle;
using pk::Value;

namespace {

#define EXPECT_VALUE_ERROR(stmt, needle)                                                 \
  do {                                                                                   \
    try {                                                                                \
      stmt;                                                                              \
      ADD_FAILURE() << "expected ValueError";                                            \
    } catch (const c10::ValueError& e) {                                                 \
      EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos) \
          << e.what_without_backtrace();                                                 \
    }                                                                                    \
  } while (0)

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int c : b) s.push_back(static_cast<char>(c));
  return s;
}

// A string literal with its NUL bytes.
template <size_t N>
std::string lit(const char (&s)[N]) {
  return std::string(s, N - 1);
}

Value sample() {
  Value d = Value::dict();
  d.set("cls", Value::from_str("TensorDict"));
  d.set("leaves", Value::dict());
  Value leaf = Value::tuple({Value::from_str("torch.float32"),
                             Value::list({Value::from_int(4), Value::from_int(3)}),
                             Value::from_int(0), Value::from_int(48), Value::from_int(0)});
  Value leaves = Value::dict();
  leaves.set("b", leaf);
  d.set("leaves", leaves);
  d.set("names", Value::list({Value()}));
  d.set("is_locked", Value::from_bool(false));
  d.set("big", Value::from_int(-(int64_t{1} << 62)));
  d.set("f", Value::from_float(0.25));
  d.set("long", Value::from_str(std::string(300, 'x')));
  d.set("t4", Value::tuple({Value(), Value(), Value(), Value()}));
  d.set("empty_t", Value::tuple());
  return d;
}

}  // namespace

TEST(Pickle, RoundTrip) {
  const Value v = sample();
  EXPECT_EQ(pk::loads(pk::dumps(v)), v);
  for (int64_t i :
       {int64_t{0}, int64_t{255}, int64_t{256}, int64_t{65535}, int64_t{65536}, int64_t{-1},
        int64_t{INT32_MIN}, int64_t{INT32_MAX} + 1, INT64_MIN, INT64_MAX}) {
    EXPECT_EQ(pk::loads(pk::dumps(Value::from_int(i))).as_int(), i) << i;
  }
}

TEST(Pickle, WriterMatchesPythonForSmallValues) {
  // pickle.dumps({'a': (1, None)}, protocol=4) without the frame and memo opcodes Python adds.
  Value d = Value::dict();
  d.set("a", Value::tuple({Value::from_int(1), Value()}));
  EXPECT_EQ(pk::dumps(d), bytes({0x80, 4, '}', '(', 0x8c, 1, 'a', 'K', 1, 'N', 0x86, 'u', '.'}));
}

TEST(Pickle, ReadsMemoAndFrames) {
  // Python 3.11: pickle.dumps({'a': 'x', 'b': 'x'}) memoizes 'x' and refers to it again.
  const std::string p =
      bytes({0x80, 4,   0x95, 0x13, 0, 0,   0,    0,    0, 0,   0,    '}', 0x94, '(', 0x8c,
             1,    'a', 0x94, 0x8c, 1, 'x', 0x94, 0x8c, 1, 'b', 0x94, 'h', 2,    'u', '.'});
  Value v = pk::loads(p);
  ASSERT_EQ(v.keys().size(), 2u);
  EXPECT_EQ(v.find("b")->as_str(), "x");
}

TEST(Pickle, RefusesCodeExecution) {
  // GLOBAL / STACK_GLOBAL only name a class; every opcode that would call it stays refused.
  constexpr const char* kCall = "refused opcode REDUCE: it would import or call code";
  // pickle.dumps(os.system('echo'), protocol=2): GLOBAL, the argument tuple, REDUCE.
  EXPECT_VALUE_ERROR(pk::loads(lit("\x80\x02"
                                   "cos\nsystem\nq\x00X\x04\x00\x00\x00"
                                   "echoq\x01\x85q\x02R.")),
                     kCall);
  // The same with STACK_GLOBAL (protocol 4).
  const std::string stack_global = bytes(
      {0x80, 4, 0x8c, 2, 'o', 's', 0x94, 0x8c, 6, 's', 'y', 's', 't', 'e', 'm', 0x94, 0x93, 0x94});
  EXPECT_VALUE_ERROR(pk::loads(stack_global + bytes({0x8c, 4, 'e', 'c', 'h', 'o', 0x85, 'R', '.'})),
                     kCall);
  EXPECT_VALUE_ERROR(pk::loads(stack_global + bytes({')', 0x81, '.'})), "refused opcode NEWOBJ");
  EXPECT_VALUE_ERROR(pk::loads(stack_global + bytes({')', '}', 0x92, '.'})),
                     "refused opcode NEWOBJ_EX");
  EXPECT_VALUE_ERROR(pk::loads(stack_global + bytes({'}', 'b', '.'})), "refused opcode BUILD");
  EXPECT_VALUE_ERROR(pk::loads(stack_global + bytes({'(', 'o', '.'})), "refused opcode OBJ");
  EXPECT_VALUE_ERROR(pk::loads(bytes({'(', 'i', 'o', 's', '\n', 's', '\n', '.'})),
                     "refused opcode INST");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 0x82, 1, '.'})), "refused opcode EXT");
  EXPECT_VALUE_ERROR(pk::loads(bytes({'P', '1', '\n', '.'})), "refused opcode PERSID");
  // Protocol 0 (os.system('echo')): GLOBAL is read, its STRING argument is not.
  EXPECT_VALUE_ERROR(pk::loads("cos\nsystem\n(S'echo'\ntR."), "outside the supported subset");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, ')', ')', 'R', '.'})), "refused opcode REDUCE");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 'N', 'Q', '.'})), "refused opcode BINPERSID");
}

TEST(Pickle, RefusesMalformed) {
  const std::string good = pk::dumps(sample());
  for (size_t cut = 0; cut < good.size(); ++cut) {
    EXPECT_THROW(pk::loads(std::string_view(good).substr(0, cut)), c10::ValueError) << cut;
  }
  EXPECT_VALUE_ERROR(pk::loads(good + "x"), "bytes after STOP");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 'X', 0xff, 0xff, 0xff, 0x7f, '.'})),
                     "runs past the end");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 'C', 1, 'a', '.'})), "outside the supported subset");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 0x8a, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1, '.'})),
                     "exceeds int64");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, '}', 'K', 1, 'N', 's', '.'})), "only str keys");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 0x8c, 2, 0xc3, 0x28, '.'})), "not valid UTF-8");
  // What Python's strict decoder refuses too: a lead byte above U+10FFFF, an overlong form, a
  // surrogate. (A string we read must be one we can write back.)
  for (const auto& s : {bytes({0xf7, 0xbf, 0xbf, 0xbf}), bytes({0xc0, 0x80}),
                        bytes({0xed, 0xa0, 0x80}), bytes({0xf4, 0x90, 0x80, 0x80})}) {
    EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 0x8c, static_cast<int>(s.size())}) + s + "."),
                       "not valid UTF-8");
  }
  EXPECT_EQ(pk::loads(bytes({0x80, 4, 0x8c, 4, 0xf4, 0x8f, 0xbf, 0xbf, '.'})).as_str().size(), 4u);
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 9, 'N', '.'})), "unsupported protocol");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 'h', 7, '.'})), "memo entry 7 is undefined");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 'N', 'N', '.'})), "STOP with 2 values");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 'e', '.'})), "no MARK");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 'N', 'a', '.'})), "short stack");
}

TEST(Pickle, BoundsDepthAndExpansion) {
  std::string deep = bytes({0x80, 4});
  for (int i = 0; i < 100; ++i) deep += bytes({']'});
  for (int i = 0; i < 99; ++i) deep += bytes({'a'});
  deep += ".";
  EXPECT_VALUE_ERROR(pk::loads(deep), "nesting deeper than 64");
  EXPECT_NO_THROW(pk::loads(deep, {.max_depth = 200}));

  // "Billion laughs": each level is a list of the previous one twice, through the memo.
  std::string laughs = bytes({0x80, 4, 0x8c, 1, 'x', 0x94});
  for (int level = 0; level < 40; ++level) {
    laughs += bytes({']', '(', 'h', level, 'h', level, 'e', 0x94});
  }
  laughs += ".";
  EXPECT_VALUE_ERROR(pk::loads(laughs), "more than");
}

// Memory a peer can make the reader spend is budgeted as it reads: memo copies count whole.
TEST(Pickle, BudgetsTheBytesItMaterialises) {
  // One 1 MiB string read back 100 times: 100 MiB from a pickle of 1 MiB.
  std::string body = bytes({0x80, 4, ']', '(', 'X'});
  const uint32_t n = 1 << 20;
  for (int i = 0; i < 4; ++i) body.push_back(static_cast<char>(n >> (8 * i)));
  body += std::string(n, 's') + bytes({0x94});
  for (int i = 0; i < 99; ++i) body += bytes({'h', 0});
  body += "e.";
  EXPECT_VALUE_ERROR(pk::loads(body), "the values read would take more than");
  // The budget is the caller's to raise.
  EXPECT_EQ(pk::loads(body, {.max_bytes = size_t{256} << 20}).items().size(), 100u);

  // Cheap values in bulk: a million Nones cost far more than the million bytes they take.
  const std::string nones = bytes({0x80, 4, ']', '('}) + std::string(1'000'000, 'N') + "e.";
  EXPECT_VALUE_ERROR(pk::loads(nones), "budget for a pickle of 1000006 bytes");

  // A metadata pickle of 20,000 leaves, as a sender writes it, reads within the default.
  tensordict::Metadata m;
  for (int i = 0; i < 20000; ++i) {
    const int64_t start = 8 * i;
    m.leaves.push_back({"leaf_" + std::to_string(i), {at::kFloat, {2}, start, start + 8, 0}});
  }
  const std::string big = pk::dumps(tensordict::wire::metadata_to_pickle(m, {}));
  EXPECT_EQ(tensordict::wire::metadata_from_pickle_bytes(big).leaves.size(), 20000u);
}

TEST(Pickle, AccessorsNameKinds) {
  EXPECT_VALUE_ERROR(Value::from_int(1).as_str(), "expected a str, got a int");
  EXPECT_VALUE_ERROR(Value().keys(), "expected a dict, got a None");
  EXPECT_EQ(Value::from_int(2).as_float(), 2.0);
  Value d = Value::dict();
  d.set("a", Value::from_int(1));
  d.set("b", Value::from_int(2));
  d.set("a", Value::from_int(3));
  EXPECT_EQ(d.keys(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(d.find("a")->as_int(), 3);
  EXPECT_TRUE(d.erase("a"));
  EXPECT_FALSE(d.erase("a"));
  EXPECT_EQ(d.find("a"), nullptr);
}

// ---- class references (a tensorclass node's "cls") -------------------------------------------

TEST(Pickle, ReadsClassReferencesAsInertValues) {
  // pickle.dumps(Inner) for a class __main__.Inner (protocol 4, as the reference's metadata).
  const Value ref =
      pk::loads(bytes({0x80, 4,    0x8c, 8,   '_', '_', 'm', 'a', 'i',  'n',  '_',  '_',
                       0x94, 0x8c, 5,    'I', 'n', 'n', 'e', 'r', 0x94, 0x93, 0x94, '.'}));
  ASSERT_EQ(ref.kind(), Value::Kind::ClassRef);
  EXPECT_EQ(ref.ref_module(), "__main__");
  EXPECT_EQ(ref.ref_qualname(), "Inner");
  EXPECT_EQ(ref, Value::class_ref("__main__", "Inner"));
  EXPECT_VALUE_ERROR(ref.as_str(), "expected a str, got a class reference");
  // Protocol 2's GLOBAL, a nested qualname, memoized and referred to again.
  const Value pair =
      pk::loads(lit("\x80\x02"
                    "cpkg.mod\nOuter.Inner\nq\x00h\x00\x86q\x01."));
  ASSERT_EQ(pair.items().size(), 2u);
  EXPECT_EQ(pair.items()[1], Value::class_ref("pkg.mod", "Outer.Inner"));
  // The writer emits STACK_GLOBAL; the reader reads it back equal.
  Value d = Value::dict();
  d.set("cls", ref);
  EXPECT_EQ(pk::loads(pk::dumps(d)), d);
  EXPECT_EQ(pk::dumps(ref), bytes({0x80, 4,    0x8c, 8,   '_', '_', 'm', 'a', 'i',  'n', '_',
                                   '_',  0x8c, 5,    'I', 'n', 'n', 'e', 'r', 0x93, '.'}));
}

TEST(Pickle, RefusesMalformedClassReferences) {
  const auto stack_global = [](const std::string& module, const std::string& name) {
    Value t = Value::tuple({Value::from_str(module), Value::from_str(name)});
    std::string p = pk::dumps(t);  // PROTO 4, str, str, TUPLE2, STOP: swap TUPLE2 for STACK_GLOBAL
    p[p.size() - 2] = static_cast<char>(0x93);
    return p;
  };
  EXPECT_EQ(pk::loads(stack_global("a.b_1", "C")), Value::class_ref("a.b_1", "C"));
  EXPECT_VALUE_ERROR(pk::loads(stack_global(std::string(5000, 'a'), "C")),
                     "module of 5000 bytes is longer than 4096 bytes");
  EXPECT_VALUE_ERROR(pk::loads(stack_global("m", std::string(4097, 'C'))),
                     "qualname of 4097 bytes is longer than 4096 bytes");
  EXPECT_NO_THROW(pk::loads(stack_global(std::string(4096, 'a'), "C")));
  for (const char* bad : {"", "os system", "1abc", "a..b", "a.", ".a", "a-b", "f.<locals>.C",
                          "caf\xc3\xa9", "a\nb"}) {
    SCOPED_TRACE(bad);
    EXPECT_VALUE_ERROR(pk::loads(stack_global(bad, "C")), "is not a dotted name");
    EXPECT_VALUE_ERROR(pk::loads(stack_global("m", bad)), "is not a dotted name");
  }
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 'K', 1, 0x8c, 1, 'C', 0x93, '.'})),
                     "STACK_GLOBAL needs two str, got a int and a str");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 0x8c, 1, 'C', 0x93, '.'})), "short stack");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 0x8c, 1, 'm', '(', 0x8c, 1, 'C', 0x93, '.'})),
                     "short stack");  // not across a MARK
  // GLOBAL: bounded lines.
  EXPECT_VALUE_ERROR(pk::loads("\x80\x02"
                               "c" +
                               std::string(5000, 'a') + "\nC\n."),
                     "GLOBAL module is longer than 4096 bytes");
  EXPECT_VALUE_ERROR(pk::loads("\x80\x02"
                               "cos\nsystem"),
                     "GLOBAL qualname has no end of line");
  EXPECT_VALUE_ERROR(pk::loads("\x80\x02"
                               "cos sys\nsystem\n."),
                     "is not a dotted name");
  EXPECT_VALUE_ERROR(pk::loads(lit("\x80\x02"
                                   "cos\x00\nsystem\n.")),
                     "module 'os\\x00' is not a dotted name");
  Value::class_ref("a", "b");
  EXPECT_VALUE_ERROR(Value::class_ref("a b", "c"), "dotted names");
}

TEST(Pickle, ValidDottedName) {
  for (const char* ok : {"a", "_", "A1", "__main__", "pkg.mod", "Outer.Inner", "a.b.c_9"}) {
    EXPECT_TRUE(pk::valid_dotted_name(ok)) << ok;
  }
  for (const char* bad : {"", ".", "a.", ".a", "a..b", "9a", "a.9b", "a b", "a$", "a/b"}) {
    EXPECT_FALSE(pk::valid_dotted_name(bad)) << bad;
  }
}

// ---- metadata with a tensorclass node ----------------------------------------------------------

namespace {

// The reference 0.15.3: pickle.dumps(TensorDict(inner=Inner(q=torch.zeros(3, 2), batch_size=[3]),
// batch_size=[3]).consolidate(metadata=True)._consolidated["metadata"]), Inner a @tensorclass of
// __main__: the nested node's "cls" is the class, pickled as STACK_GLOBAL.
const std::string kReferenceTensorclassNode =
    lit("\x80\x04\x95\xe5\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x03"
        "cls\x94\x8c\x0aTensorDict"
        "\x94\x8c\x0bnon_tensors\x94}\x94\x8c\x06leaves\x94}\x94\x8c\x0c"
        "cls_metadata\x94}\x94("
        "\x8c\x06"
        "device\x94N\x8c\x05names\x94]\x94Na\x8c\x0a"
        "batch_size\x94]\x94K\x03"
        "a\x8c"
        "\x09is_locked\x94\x89u\x8c\x05inner\x94}\x94(h\x01\x8c\x08__main__\x94\x8c\x05Inner\x94"
        "\x93\x94h\x03}\x94h\x05}\x94\x8c\x01q\x94(\x8c\x0dtorch.float32\x94]\x94(K\x03K\x02"
        "eK"
        "\x00K\x18K\x00t\x94sh\x07}\x94(h\x09Nh\x0a]\x94Nah\x0c]\x94K\x03"
        "ah\x0e\x89uuu.");

}  // namespace

TEST(MetadataPickle, ReadsTheReferencesTensorclassNodeAsATensorDict) {
  using namespace tensordict;
  using namespace tensordict::wire;
  const Metadata m = metadata_from_pickle_bytes(kReferenceTensorclassNode);
  EXPECT_EQ(m.cls, "TensorDict");
  ASSERT_EQ(m.children.size(), 1u);
  const Metadata& inner = m.children[0].second;
  EXPECT_EQ(m.children[0].first, "inner");
  EXPECT_EQ(inner.cls, "__main__.Inner");
  ASSERT_EQ(inner.leaves.size(), 1u);
  EXPECT_EQ(inner.leaves[0].second.stop, 24);
  // Written back (JSON, pickle) as the TensorDict it is rebuilt as: never a class reference.
  const std::string json = metadata_to_json(m);
  EXPECT_EQ(json.find("__main__"), std::string::npos) << json;
  const Metadata again = metadata_from_pickle_bytes(pk::dumps(metadata_to_pickle(m)));
  EXPECT_EQ(again.children.at(0).second.cls, "TensorDict");
  EXPECT_EQ(metadata_to_json(again), json);
  // Rebuilt as a plain nested TensorDict over the storage.
  const at::Tensor storage = at::arange(24, at::kByte);
  const TensorDict td = rebuild(m, storage);
  const auto nested = td.get("inner");
  ASSERT_TRUE(nested.is_tensordict());
  EXPECT_EQ(nested.tensordict().get("q").tensor().sizes(), at::IntArrayRef({3, 2}));
  EXPECT_EQ(nested.tensordict().batch_size(), at::IntArrayRef({3}));
}

TEST(MetadataPickle, RefusesClassReferencesOutsideANodesCls) {
  using namespace tensordict;
  using namespace tensordict::wire;
  const pk::Value good = pk::loads(kReferenceTensorclassNode);
  const pk::Value ref = pk::Value::class_ref("__main__", "Inner");
  const auto with = [&](auto edit) {
    pk::Value v = good;
    edit(v);
    return v;
  };
  const auto inner = [](pk::Value& v) -> pk::Value& {
    return const_cast<pk::Value&>(*v.find("inner"));
  };
  struct Case {
    pk::Value value;
    const char* where;
  };
  const Case cases[] = {
      {with([&](pk::Value& v) {
         pk::Value leaves = *inner(v).find("leaves");
         const_cast<pk::Value&>(*leaves.find("q")).items()[0] = ref;
         inner(v).set("leaves", leaves);
       }),
       "at [\"inner\"][\"leaves\"][\"q\"][0] is refused"},
      {with([&](pk::Value& v) {
         pk::Value nt = pk::Value::dict();
         nt.set("label", pk::Value::tuple({ref, pk::Value::list(), pk::Value()}));
         v.set("non_tensors", nt);
       }),
       "at [\"non_tensors\"][\"label\"][0] is refused"},
      {with([&](pk::Value& v) { v.set("_tensorclass_type", ref); }),
       "at [\"_tensorclass_type\"] is refused"},
      {with([&](pk::Value& v) {
         pk::Value cm = *v.find("cls_metadata");
         cm.set("cls", ref);
         v.set("cls_metadata", cm);
       }),
       "at [\"cls_metadata\"][\"cls\"] is refused"},
      {with([&](pk::Value& v) { inner(v).set("extra", ref); }), "at [\"inner\"][\"extra\"]"},
      {ref, "expected a dict"},
  };
  for (const auto& c : cases) {
    EXPECT_VALUE_ERROR(metadata_from_pickle(c.value), c.where);
  }
  EXPECT_VALUE_ERROR(metadata_from_pickle(cases[0].value), "the class reference __main__.Inner at");
  EXPECT_VALUE_ERROR(metadata_from_pickle(cases[0].value),
                     "only a node's \"cls\" may name a class");
  // The root's "cls" may be a class reference too (the reference's own rebuild accepts it).
  EXPECT_EQ(metadata_from_pickle(with([&](pk::Value& v) { v.set("cls", ref); })).cls,
            "__main__.Inner");
  // A dotted str is not a class reference: refused as before.
  EXPECT_VALUE_ERROR(metadata_from_pickle(with([&](pk::Value& v) {
                       inner(v).set("cls", pk::Value::from_str("__main__.Inner"));
                     })),
                     "only TensorDict nodes are supported");
  EXPECT_VALUE_ERROR(
      metadata_from_json(
          metadata_to_json(metadata_from_pickle(good))
              .replace(metadata_to_json(metadata_from_pickle(good)).rfind("TensorDict"), 10,
                       "a.Inner")),
      "only TensorDict nodes are supported");
}

namespace {

// The bytes Python's pickler (protocol 4, as torch's send_object_list and the reference's
// init_remote use it) writes for the metadata of a TensorDict holding an n-member
// NonTensorStack of strings at "a": everything memoized, and the stack's dict filled by
// SETITEMS batches of 1000, each batch after the items of its values' tuples.
std::string pickler_stack(int64_t n) {
  std::string out = "\x80\x04";
  const auto op = [&](int code) { out.push_back(static_cast<char>(code)); };
  const auto memo = [&] { op(0x94); };
  const auto str = [&](std::string_view s) {  // SHORT_BINUNICODE: s is short here
    op(0x8c);
    op(static_cast<int>(s.size()));
    out += s;
    memo();
  };
  const auto integer = [&](int64_t v) {  // BININT
    op('J');
    for (int b = 0; b < 4; ++b) op(static_cast<int>((v >> (8 * b)) & 0xff));
  };
  const auto empty_dict = [&] {
    op('}');
    memo();
  };
  op('}');
  memo();
  op('(');
  str("cls");
  str("TensorDict");
  str("non_tensors");
  empty_dict();
  str("leaves");
  empty_dict();
  str("cls_metadata");
  empty_dict();
  op('(');
  str("device");
  op('N');
  str("names");
  op(']');
  memo();
  op('N');
  op('a');
  str("batch_size");
  op(']');
  memo();
  integer(n);
  op('a');
  str("is_locked");
  op(0x89);
  op('u');
  str("a");
  empty_dict();
  op('(');
  str("cls");
  str("NonTensorStack");
  str("non_tensors");
  empty_dict();
  for (int64_t i = 0; i < n; i += 1000) {
    op('(');
    for (int64_t k = i; k < std::min(n, i + 1000); ++k) {
      str(std::to_string(k));
      str("s" + std::to_string(k));
      op(']');
      memo();
      op('N');
      op(0x87);
      memo();  // (value, [], None)
    }
    op('u');
  }
  str("leaves");
  empty_dict();
  str("cls_metadata");
  empty_dict();
  op('(');
  str("stack_dim");
  op('K');
  op(0);
  str("stack_dim_name");
  op('N');
  str("is_locked");
  op(0x89);
  op('u');
  op('u');
  str("_total_bytes");
  op('K');
  op(0);
  op('u');
  op('.');
  return out;
}

}  // namespace

// A hostile case: the reference's init_remote of a 1,000,000-member NonTensorStack took 18 s to be
// refused. The reader copied the stack's dict to the end of its arena after every SETITEMS of
// 1000 (their values' tuples were written in between) and hashed all its keys again: quadratic,
// and past its budget from 100,000 members, where the general reader refuses the pickle too.
TEST(MetadataPickle, ReadsPythonsBatchedDictsInLinearTime) {
  using namespace tensordict;
  using namespace tensordict::wire;
  using clock = std::chrono::steady_clock;
  constexpr int64_t kMembers = 200'000;
  const std::string batched = pickler_stack(kMembers);
  TransportFields transport;
  const Metadata m = metadata_from_pickle_bytes(batched, &transport);
  ASSERT_EQ(m.children.size(), 1u);
  const auto& members = m.children[0].second.non_tensors;
  ASSERT_EQ(members.size(), static_cast<size_t>(kMembers));
  for (int64_t i : {int64_t{0}, int64_t{999}, int64_t{1000}, kMembers - 1}) {
    EXPECT_EQ(members[i].first, std::to_string(i));
    EXPECT_EQ(members[i].second.data.as_string(), "s" + std::to_string(i));
  }
  EXPECT_EQ(m.children[0].second.cls_metadata.batch_size, std::vector<int64_t>{kMembers});
  // The same metadata as one SETITEMS (our writer): read as fast, give or take noise, where a
  // quadratic step makes the batched form 20 times slower at this size.
  const std::string single = metadata_pickle_bytes(m, transport);
  EXPECT_EQ(metadata_to_json(metadata_from_pickle_bytes(single)), metadata_to_json(m));
  const auto fastest = [](const std::string& bytes) {
    double best = 1e9;
    for (int r = 0; r < 3; ++r) {
      const auto start = clock::now();
      (void)metadata_from_pickle_bytes(bytes);
      best = std::min(best, std::chrono::duration<double>(clock::now() - start).count());
    }
    return best;
  };
  const double t_single = fastest(single);
  const double t_batched = fastest(batched);
  EXPECT_LT(t_batched, 3 * t_single)
      << "batched " << t_batched << " s, one SETITEMS " << t_single << " s";
}
