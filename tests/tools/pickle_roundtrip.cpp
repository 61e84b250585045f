// Reads a pickle on stdin with our restricted reader and writes it back with our writer, so that
// tests/python/test_pickle_compat.py can check both against Python's pickle. Exit 2 with the
// error on stderr when the reader refuses the input.
#include <iostream>
#include <iterator>
#include <string>

#include <c10/util/Exception.h>

#include "tensordict/pickle.h"

int main() {
  std::string in((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  try {
    std::cout << tensordict::pickle::dumps(tensordict::pickle::loads(in));
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 2;
  }
  return 0;
}
