#include <gtest/gtest.h>

#include "tensordict/pickle.h"

namespace pk = tensordict::pickle;
using pk::Value;

namespace {

#define EXPECT_VALUE_ERROR(stmt, needle)                                                    \
  do {                                                                                      \
    try {                                                                                   \
      stmt;                                                                                 \
      ADD_FAILURE() << "expected ValueError";                                               \
    } catch (const c10::ValueError& e) {                                                    \
      EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos)    \
          << e.what_without_backtrace();                                                    \
    }                                                                                       \
  } while (0)

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int c : b) s.push_back(static_cast<char>(c));
  return s;
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
  for (int64_t i : {int64_t{0}, int64_t{255}, int64_t{256}, int64_t{65535}, int64_t{65536},
                    int64_t{-1}, int64_t{INT32_MIN}, int64_t{INT32_MAX} + 1, INT64_MIN, INT64_MAX}) {
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
  const std::string p = bytes({0x80, 4, 0x95, 0x13, 0, 0, 0, 0, 0, 0, 0, '}', 0x94, '(', 0x8c, 1,
                               'a', 0x94, 0x8c, 1, 'x', 0x94, 0x8c, 1, 'b', 0x94, 'h', 2, 'u', '.'});
  Value v = pk::loads(p);
  ASSERT_EQ(v.keys().size(), 2u);
  EXPECT_EQ(v.find("b")->as_str(), "x");
}

TEST(Pickle, RefusesCodeExecution) {
  // pickle.dumps of os.system('echo') as a protocol-0 GLOBAL + REDUCE.
  EXPECT_VALUE_ERROR(pk::loads("cos\nsystem\n(S'echo'\ntR."), "refused opcode GLOBAL");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 0x8c, 1, 'o', 0x8c, 1, 's', 0x93, '.'})),
                     "refused opcode STACK_GLOBAL");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, ')', ')', 'R', '.'})), "refused opcode REDUCE");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 'N', 'Q', '.'})), "refused opcode BINPERSID");
}

TEST(Pickle, RefusesMalformed) {
  const std::string good = pk::dumps(sample());
  for (size_t cut = 0; cut < good.size(); ++cut) {
    EXPECT_THROW(pk::loads(std::string_view(good).substr(0, cut)), c10::ValueError) << cut;
  }
  EXPECT_VALUE_ERROR(pk::loads(good + "x"), "bytes after STOP");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 'X', 0xff, 0xff, 0xff, 0x7f, '.'})), "runs past the end");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 'C', 1, 'a', '.'})), "outside the supported subset");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 0x8a, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1, '.'})),
                     "exceeds int64");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, '}', 'K', 1, 'N', 's', '.'})), "only str keys");
  EXPECT_VALUE_ERROR(pk::loads(bytes({0x80, 4, 0x8c, 2, 0xc3, 0x28, '.'})), "not valid UTF-8");
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
