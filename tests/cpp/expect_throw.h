#pragma once
// Shared by the GoogleTest suites: asserts that `stmt` throws `E` whose message (without the
// backtrace) contains `needle`, and shows the message when it does not.

#include <gtest/gtest.h>

#include <string>

#define EXPECT_THROW_MSG(stmt, E, needle)                                                \
  do {                                                                                   \
    try {                                                                                \
      stmt;                                                                              \
      ADD_FAILURE() << "expected " #E;                                                   \
    } catch (const E& e) {                                                               \
      EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos) \
          << e.what_without_backtrace();                                                 \
    }                                                                                    \
  } while (0)
