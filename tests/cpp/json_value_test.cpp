// JsonValue: accessors and their typed errors, dump() against the bytes Python's json.dumps
// writes (pinned here from the interpreter), parse() and its faults.
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <limits>
#include <string>

#include "core/excerpt.h"
#include "core/json_text.h"
#include "expect_throw.h"
#include "peak_growth.h"
#include "tensordict/errors.h"
#include "tensordict/json_value.h"

using tensordict::JsonValue;
using tensordict::KeyError;

TEST(JsonValue, KindsAndAccessors) {
  EXPECT_TRUE(JsonValue().is_null());
  EXPECT_TRUE(JsonValue(nullptr).is_null());
  EXPECT_TRUE(JsonValue(true).as_bool());
  EXPECT_EQ(JsonValue(3).as_int(), 3);
  EXPECT_EQ(JsonValue(int64_t{1} << 40).as_int(), int64_t{1} << 40);
  EXPECT_EQ(JsonValue(2.5).as_float(), 2.5);
  EXPECT_EQ(JsonValue(7).as_float(), 7.0);  // an int converts
  EXPECT_EQ(JsonValue("x").as_string(), "x");
  EXPECT_EQ(JsonValue(std::string_view("y")).as_string(), "y");
  const JsonValue list = JsonValue::list({1, "a", nullptr});
  EXPECT_EQ(list.as_list().size(), 3u);
  EXPECT_EQ(list.at(1), JsonValue("a"));
  const JsonValue map = JsonValue::map({{"b", 1}, {"a", JsonValue::list({})}});
  EXPECT_EQ(map.as_map()[0].first, "b");  // insertion order
  EXPECT_EQ(map.at("a"), JsonValue::list({}));
  EXPECT_NE(JsonValue(1), JsonValue(1.0));  // the kinds differ
}

TEST(JsonValue, TypedErrors) {
  EXPECT_THROW_MSG(JsonValue(1).as_string(), c10::TypeError, "expected str, got int");
  EXPECT_THROW_MSG(JsonValue("s").as_float(), c10::TypeError, "expected float, got str");
  EXPECT_THROW_MSG(JsonValue().as_list(), c10::TypeError, "expected list, got NoneType");
  EXPECT_THROW_MSG(JsonValue(true).as_int(), c10::TypeError, "expected int, got bool");
  EXPECT_THROW_MSG(JsonValue::list({}).at("k"), c10::TypeError, "expected dict, got list");
  EXPECT_THROW_MSG(JsonValue::map({{"a", 1}}).at("b"), KeyError, "'b'");
  EXPECT_THROW_MSG(JsonValue::list({1}).at(size_t{1}), c10::IndexError, "index 1 is out of range");
  EXPECT_THROW_MSG(JsonValue::map({{"a", 1}, {"a", 2}}), c10::ValueError, "key 'a' twice");
  JsonValue::Map many;
  for (int i = 0; i < 20; ++i) many.emplace_back(std::to_string(i % 19), i);
  EXPECT_THROW_MSG(JsonValue(std::move(many)), c10::ValueError, "key '0' twice");
}

TEST(JsonValue, DumpIsPythonsJsonDumps) {
  const double inf = std::numeric_limits<double>::infinity();
  const JsonValue v = JsonValue::map({
      {"a", JsonValue::list({1, 2.5, nullptr, true, false})},
      {"b", "h\xc3\xa9\xf0\x9f\x98\x80\"\\\n"},
      {"c", 1.0},
      {"d", 1e-07},
      {"e", 1e16},
      {"f", 1e15},
      {"g", inf},
      {"h", -inf},
      {"i", std::nan("")},
      {"j", -0.0},
      {"k", 0.1 + 0.2},
      {"l", 123456789.125},
      {"m", 5e-324},
      {"n", 1.7976931348623157e308},
      {"o", 0.0001},
      {"p", 0.00001},
      {"q", std::numeric_limits<int64_t>::min()},
      {"r", JsonValue::map({})},
      {"s", JsonValue::list({})},
  });
  // python -c 'import json; print(json.dumps({...}))' with the same values.
  EXPECT_EQ(v.dump(),
            R"({"a": [1, 2.5, null, true, false], "b": "h\u00e9\ud83d\ude00\"\\\n", "c": 1.0, )"
            R"("d": 1e-07, "e": 1e+16, "f": 1000000000000000.0, "g": Infinity, "h": -Infinity, )"
            R"("i": NaN, "j": -0.0, "k": 0.30000000000000004, "l": 123456789.125, "m": 5e-324, )"
            R"("n": 1.7976931348623157e+308, "o": 0.0001, "p": 1e-05, "q": -9223372036854775808, )"
            R"("r": {}, "s": []})");
  EXPECT_EQ(JsonValue(1e22).dump(), "1e+22");
  EXPECT_EQ(JsonValue(1.5e-10).dump(), "1.5e-10");
  EXPECT_EQ(JsonValue(123e-20).dump(), "1.23e-18");
  EXPECT_THROW_MSG(JsonValue("\xff").dump(), c10::ValueError, "not valid UTF-8");
}

TEST(JsonValue, ParseRoundTripsDump) {
  const std::string text =
      R"({"a": [1, 2.5, null, true, false], "b": "h\u00e9\ud83d\ude00\"\\\n", "c": -Infinity, )"
      R"("d": NaN, "e": {"x": []}, "f": -9223372036854775808})";
  const JsonValue v = JsonValue::parse(text);
  EXPECT_EQ(v.at("b").as_string(), "h\xc3\xa9\xf0\x9f\x98\x80\"\\\n");
  EXPECT_TRUE(std::isnan(v.at("d").as_float()));
  EXPECT_EQ(v.dump(), text);
  // json.loads: whitespace anywhere between tokens; a repeated key keeps its first place and
  // its last value; "1e400" overflows to inf.
  EXPECT_EQ(JsonValue::parse(" {\"a\" :1 ,\"b\":2,\"a\":3}\n").dump(), R"({"a": 3, "b": 2})");
  EXPECT_EQ(JsonValue::parse("1e400").as_float(), std::numeric_limits<double>::infinity());
  EXPECT_EQ(JsonValue::parse("-0").as_int(), 0);
  EXPECT_TRUE(JsonValue::parse("1E2").is_float());
}

TEST(JsonValue, ParseFaults) {
  for (const char* bad : {"", "{", "[1,]", "{\"a\" 1}", "tru", "01", "1.", "\"\\x\"", "\"a",
                          "[1] 2", "{1: 2}", "\"\\ud800\"", "nan", "+1", "\"\x01\"", "\"\xff\""}) {
    SCOPED_TRACE(bad);
    EXPECT_THROW_MSG(JsonValue::parse(bad), c10::ValueError, "invalid JSON");
  }
  EXPECT_THROW_MSG(JsonValue::parse("18446744073709551616"), c10::ValueError, "out of range");
  EXPECT_THROW_MSG(JsonValue::parse(std::string(100000, '[')), c10::ValueError,
                   "nested deeper than");
}

// A refused text is quoted by its first bytes and its length (core/excerpt.h), however long:
// a 250 MiB integer made a message of 262 million characters, copied into the exception (a
// consolidated file holding one: +1,782 MB, now +251 MB, the text read).
TEST(JsonValue, ARefusedNumberIsQuotedByItsStartAndLength) {
  std::string digits;
  digits.reserve(size_t{250} << 20);
  while (digits.size() < (size_t{250} << 20)) digits += "1234567890";
  digits.resize(size_t{250} << 20);
  std::string message;
  const int64_t growth = peak_growth([&] {
    try {
      JsonValue::parse(digits);
    } catch (const c10::ValueError& e) {
      message = e.what_without_backtrace();
    }
  });
  std::cout << "a 250 MiB integer: \"" << message << "\" -- peak growth " << growth / 1e6
            << " MB\n";
  EXPECT_NE(message.find("the integer " + digits.substr(0, tensordict::core::kExcerptBytes) +
                         "...(262144000 bytes) is out of range (int64)"),
            std::string::npos)
      << message;
  EXPECT_LT(message.size(), 300u);
  EXPECT_LT(growth, 16 << 20);
}

TEST(JsonValue, ExcerptsQuoteTheStartAndTheLength) {
  using tensordict::core::excerpt;
  using tensordict::core::json_excerpt;
  using tensordict::core::quoted_excerpt;
  EXPECT_EQ(excerpt("torch.foo"), "torch.foo");
  EXPECT_EQ(excerpt(std::string(80, 'x')), std::string(80, 'x'));
  EXPECT_EQ(excerpt(std::string(81, 'x')), std::string(80, 'x') + "...(81 bytes)");
  // A UTF-8 sequence is kept whole: 79 bytes and a 2-byte "é" that would end at byte 81.
  EXPECT_EQ(excerpt(std::string(79, 'x') + "\xc3\xa9" + "y"),
            std::string(79, 'x') + "...(82 bytes)");
  EXPECT_EQ(quoted_excerpt("it's"), "\"it's\"");
  EXPECT_EQ(quoted_excerpt(std::string(100, 'k')), "'" + std::string(80, 'k') + "...(100 bytes)'");
  using tensordict::core::key_path_excerpt;
  EXPECT_EQ(key_path_excerpt({}, "a"), "'a'");
  EXPECT_EQ(key_path_excerpt({"a"}, "b"), "('a', 'b')");
  EXPECT_EQ(key_path_excerpt({"a", "b"}, std::string(90, 'c')),
            "('a', 'b', '" + std::string(80, 'c') + "...(90 bytes)')");
  EXPECT_EQ(key_path_excerpt({"a", "b"}), "('a', 'b')");
  EXPECT_EQ(json_excerpt(JsonValue::list({1, "a", nullptr})), R"([1, "a", null])");
  const auto map = JsonValue::map({{"k\n", std::string(200, 'v')}, {"n", 1.5}});
  EXPECT_EQ(json_excerpt(map),
            map.dump().substr(0, 80) + "...(" + std::to_string(map.dump().size()) + " bytes)");
  // One 1 KiB str referenced 32 times, that list 32 times, five levels: 34 GB of text, whose
  // length is counted once per node (two levels are small enough to write out and compare).
  JsonValue laughs(std::string(1024, 'x'));
  size_t length = 1026;
  for (int level = 0; level < 5; ++level) {
    laughs = JsonValue(JsonValue::List(32, laughs));
    length = 2 + 32 * length + 31 * 2;
    if (level == 1) {
      ASSERT_EQ(length, laughs.dump().size());
    }
  }
  EXPECT_EQ(json_excerpt(laughs),
            "[[[[[\"" + std::string(74, 'x') + "...(" + std::to_string(length) + " bytes)");
}

// Shared nodes (data that reuses one object many times): a copy shares; a value built from shared
// objects holds them once; writing it out in full is measured first.
TEST(JsonValue, CopiesShareTheirNodes) {
  const JsonValue big(std::string(1 << 20, 'x'));
  const JsonValue copy = big;  // NOLINT(performance-unnecessary-copy-initialization)
  EXPECT_NE(big.node(), nullptr);
  EXPECT_EQ(copy.node(), big.node());
  EXPECT_EQ(&copy.as_string(), &big.as_string());
  EXPECT_EQ(JsonValue("short").node(), nullptr);  // held inline
  // Equality is by contents, whether the nodes are shared or not.
  EXPECT_EQ(JsonValue::list({big, 1}), JsonValue::list({JsonValue(std::string(1 << 20, 'x')), 1}));
  EXPECT_NE(JsonValue::list({big}), JsonValue::list({JsonValue(std::string(1 << 20, 'y'))}));
  EXPECT_EQ(JsonValue::list({std::string(20, 'a')}), JsonValue::list({std::string(20, 'a')}));
}

TEST(JsonValue, SharedDataIsHeldOnceAndMeasuredBeforeAFullWrite) {
  // One 1 KiB str referenced 32 times, that list 32 times, five levels: 32 GiB of text.
  tensordict::core::SharedJsonBuilder builder({}, [] { return std::string("laughs"); });
  JsonValue value(std::string(1024, 'x'));
  for (int level = 0; level < 5; ++level) {
    JsonValue::List items(32, value);
    value = JsonValue(std::move(items));
    builder.charge(32 * sizeof(JsonValue));
  }
  EXPECT_LT(tensordict::core::json_memory(value), 10'000u);  // 5 lists and one str
  EXPECT_LT(builder.bytes(), 10'000u);
  tensordict::core::JsonExpansion written;
  EXPECT_THROW_MSG(written.add(value, [] { return std::string("write of 'a'"); }), c10::ValueError,
                   "write of 'a': writing it out in full would take about");
  // Without reuse nothing is an expansion, however large.
  tensordict::core::JsonExpansion plain(0);
  plain.add(JsonValue(std::string(4 << 20, 'y')), [] { return std::string("plain"); });
  plain.add(JsonValue::list({1, 2, "abc"}), [] { return std::string("plain"); });
  // A builder refuses past its budget and its depth.
  tensordict::core::SharedJsonBuilder small({.max_depth = 2, .max_bytes = 100},
                                            [] { return std::string("small"); });
  EXPECT_THROW_MSG(small.charge(200), c10::ValueError, "small would take more than 100 bytes");
  EXPECT_THROW_MSG(small.enter(3, ""), c10::ValueError, "small is nested deeper than 2 levels");
  // find() gives the value remembered for an object, charging a node.
  int object = 0;
  tensordict::core::SharedJsonBuilder memo({}, [] { return std::string("memo"); });
  EXPECT_EQ(memo.find(&object), nullptr);
  memo.remember(&object, value);
  ASSERT_NE(memo.find(&object), nullptr);
  EXPECT_EQ(memo.find(&object)->node(), value.node());
  EXPECT_EQ(memo.bytes(), 2 * sizeof(JsonValue));
}
