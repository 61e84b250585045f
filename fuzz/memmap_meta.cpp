// Fuzz target: load_memmap's reading of meta.json (src/core/memmap.cpp), the level files read
// member by member and the non-tensor values measured before they are built.
//
// Input: up to three meta.json texts separated by 0 bytes: the root level's, the nested
// level "n"'s and the non-tensor entry "v"'s; the folder also holds a.memmap (64 bytes) and
// n/b.memmap (64 bytes). Expected errors: c10::Error (ValueError, or RuntimeError for files).
// Findings: crashes, sanitizer reports, memory beyond libFuzzer's limit, a loaded leaf that is
// not the file's bytes.

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "tensordict/memmap.h"

using namespace tensordict;
namespace fs = std::filesystem;

namespace {

void write(const fs::path& file, std::string_view text) {
  std::ofstream f(file, std::ios::binary | std::ios::trunc);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
}

// The folder the inputs' meta.json files go into, with the level's memmap files: made on the
// first input, removed at exit (the path is never destroyed, so the exit handler can read it).
const fs::path& folder() {
  static const fs::path* dir = [] {
    std::string tmpl = (fs::temp_directory_path() / "td_fuzz_memmap_XXXXXX").string();
    auto* d = new fs::path(mkdtemp(tmpl.data()));
    fs::create_directories(*d / "n");
    fs::create_directories(*d / "v");
    write(*d / "a.memmap", std::string(64, '\x01'));
    write(*d / "n" / "b.memmap", std::string(64, '\x02'));
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(folder(), ec);
    });
    return d;
  }();
  return *dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  std::string_view parts[3];
  size_t start = 0;
  for (int i = 0; i < 3; ++i) {
    const size_t end = i < 2 ? std::min(in.find('\0', start), in.size()) : in.size();
    if (start <= in.size()) parts[i] = in.substr(start, end - start);
    start = end + 1;
  }
  write(folder() / "meta.json", parts[0]);
  write(folder() / "n" / "meta.json", parts[1]);
  write(folder() / "v" / "meta.json", parts[2]);
  TensorDict td;
  try {
    td = load_memmap(folder().string());
  } catch (const c10::Error&) {
    return 0;
  }
  fuzz::touch(td);
  return 0;
}
