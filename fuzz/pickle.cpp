// Fuzz target: the restricted pickle reader, and pickled metadata from a peer -> validation ->
// rebuild, the path of init_remote / broadcast / all_gather / scatter receivers.
//
// Input: the pickle bytes, as the peer's object collective delivers them.
// Expected errors: c10::Error (ValueError) from pickle::loads, metadata_from_pickle_bytes or
// rebuild(). Findings: crashes, sanitizer reports, and broken invariants (what loads accepts,
// dumps must write and loads read back; metadata survives a pickle round trip).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "wire/metadata_pickle.h"
#include "wire/pickle.h"

using namespace tensordict;
using namespace tensordict::wire;  // the metadata pickle (wire/metadata_pickle.h)

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);

  // 1. The reader alone, with its default bounds.
  try {
    const pickle::Value v = pickle::loads(bytes);
    const std::string once = pickle::dumps(v);
    std::string twice;
    try {
      twice = pickle::dumps(pickle::loads(once));
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "%s\n", e.what_without_backtrace());
      fuzz::fail("pickle::loads refused what pickle::dumps wrote");
    }
    if (once != twice) fuzz::fail("pickle round trip is not stable");
  } catch (const c10::ValueError&) {
    // A refusal: every check of the reader raises ValueError.
  } catch (const c10::Error& e) {
    // Anything else is a broken invariant of the reader (an internal assertion).
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    fuzz::fail("pickle::loads raised an error that is not a ValueError");
  }

  // 2. The metadata path of the object collectives' receivers: its fast path must agree with
  // the general reader (pickle::loads, then the tree) on what it accepts and what it reads,
  // except that it may read a dict the general reader's larger charges put over its budget.
  TransportFields transport, general_transport;
  std::optional<Metadata> general;
  bool over_general_budget = false;
  try {
    general =
        metadata_from_pickle(pickle::loads(bytes, metadata_pickle_limits()), &general_transport);
  } catch (const c10::Error& e) {
    over_general_budget = std::string_view(e.what()).find("the values read would take more than") !=
                          std::string_view::npos;
  }
  Metadata metadata;
  try {
    metadata = metadata_from_pickle_bytes(bytes, &transport);
  } catch (const c10::Error&) {
    if (general) fuzz::fail("metadata_from_pickle_bytes refused what the general reader read");
    return 0;
  }
  if (!general && !over_general_budget) {
    fuzz::fail("metadata_from_pickle_bytes read what the general reader refused");
  }
  if (general && (!fuzz::same_metadata(*general, metadata) || !(general_transport == transport))) {
    fuzz::fail("metadata_from_pickle_bytes read other metadata than the general reader");
  }
  Metadata again;
  try {
    again = metadata_from_pickle_bytes(pickle::dumps(metadata_to_pickle(metadata, transport)));
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    fuzz::fail("metadata_from_pickle_bytes refused what metadata_to_pickle wrote");
  }
  if (!fuzz::same_metadata(again, metadata)) fuzz::fail("pickle round trip changed the metadata");

  // A storage of the size the metadata needs (bounded: a huge but valid layout is not a bug).
  const int64_t needed = metadata_storage_bytes(metadata);
  if (needed > (int64_t{1} << 20)) return 0;
  std::string zeros(static_cast<size_t>(needed), '\x5a');
  const at::Tensor storage = fuzz::storage_of(zeros, 0);
  TensorDict td;
  try {
    td = rebuild(std::move(metadata), storage);
  } catch (const c10::Error&) {
    return 0;
  }
  if (!is_consolidated(td)) fuzz::fail("a rebuilt TensorDict is not consolidated");
  fuzz::touch(td, &storage);
  return 0;
}
