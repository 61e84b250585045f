// Reads a pickle on stdin with our restricted reader and writes it back with our writer, so that
// tests/python/test_pickle_compat.py can check both against Python's pickle. With --metadata
// the pickle is read as consolidated metadata (validated) and written back from our Metadata.
// Exit 2 with the error on stderr when the input is refused.
#include <cstring>
#include <iostream>
#include <iterator>
#include <string>

#include <c10/util/Exception.h>

#include "wire/metadata_pickle.h"

int main(int argc, char** argv) {
  const bool metadata = argc > 1 && std::strcmp(argv[1], "--metadata") == 0;
  std::string in((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  try {
    if (metadata) {
      tensordict::TransportFields transport;
      const auto meta = tensordict::wire::metadata_from_pickle_bytes(in, &transport);
      std::cout << tensordict::wire::pickle::dumps(
          tensordict::wire::metadata_to_pickle(meta, transport));
    } else {
      std::cout << tensordict::wire::pickle::dumps(tensordict::wire::pickle::loads(in));
    }
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 2;
  }
  return 0;
}
