// Reads seeds (one per line) from stdin and prints int_generator(seed) for each, one per line;
// with "--chain N INIT" prints the N pseudo-random leaf tags that follow init_tag INIT.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

#include "tensordict/distributed/tags.h"

int main(int argc, char** argv) {
  using tensordict::dist::int_generator;
  using tensordict::dist::next_tag;
  if (argc == 4 && std::strcmp(argv[1], "--chain") == 0) {
    const long n = std::stol(argv[2]);
    int64_t tag = std::stoll(argv[3]) - 1;
    for (long i = 0; i < n; ++i) {
      tag = next_tag(tag, true);
      std::printf("%lld\n", static_cast<long long>(tag));
    }
    return 0;
  }
  std::ios::sync_with_stdio(false);
  std::string line;
  std::string out;
  while (std::getline(std::cin, line)) {
    if (line.empty()) {
      continue;
    }
    out += std::to_string(int_generator(std::stoll(line)));
    out += '\n';
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}
