// Fuzz target: consolidated metadata JSON from a peer -> validation -> rebuild over a storage,
// the path of the pipe's consolidated receive and of the file variant.
//
// Input: the metadata JSON text, a 0 byte, then the storage bytes (no 0 byte: all of it is the
// text and the storage is empty). The first storage byte mod 8 also picks the storage offset of
// the view the rebuild gets (the collectives rebuild from narrowed buffers).
// Expected errors: c10::Error (ValueError) from the parser, the validation or rebuild().
// Findings: crashes, sanitizer reports, and broken invariants (the fast path reading other than
// the general reader, a parse of our own JSON output that differs, a rebuilt TensorDict that
// is not consolidated or leaves its storage).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/metadata.h"
#include "fuzz_util.h"
#include "tensordict/consolidate.h"

using namespace tensordict;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t split = input.find('\0');
  const std::string_view text = input.substr(0, split);
  const std::string_view bytes =
      split == std::string_view::npos ? std::string_view() : input.substr(split + 1);

  // The fast path must agree with the general reader on what it accepts and what it reads.
  std::optional<core::ValidatedMetadata> general;
  try {
    general = core::read_metadata_json_general(text);
  } catch (const c10::Error&) {
  }
  TransportFields transport;
  Metadata metadata;
  try {
    metadata = metadata_from_json(text, &transport);
  } catch (const c10::Error&) {
    if (general) fuzz::fail("metadata_from_json refused what the general reader read");
    return 0;  // refused, as it should be
  }
  if (!general) fuzz::fail("metadata_from_json read what the general reader refused");
  TransportFields general_transport;
  if (!fuzz::same_metadata(std::move(*general).take(&general_transport), metadata) ||
      !(general_transport == transport)) {
    fuzz::fail("metadata_from_json read other metadata than the general reader");
  }
  // What we accept we must be able to write back and read back the same: in insertion order
  // (the order is part of the layout), and sorted as the pipe writes it (stable text).
  for (const bool sort : {false, true}) {
    std::string text1;
    try {
      text1 = metadata_to_json(metadata, sort, transport);
    } catch (const c10::Error&) {
      fuzz::fail("metadata_to_json refused metadata that metadata_from_json accepted");
    }
    TransportFields transport2;
    Metadata again;
    try {
      again = metadata_from_json(text1, &transport2);
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "%s\n", e.what_without_backtrace());
      fuzz::fail("metadata_from_json refused the JSON metadata_to_json wrote");
    }
    if (sort) {
      if (metadata_to_json(again, true, transport2) != text1) {
        fuzz::fail("sorted JSON is not stable through a round trip");
      }
    } else if (!fuzz::same_metadata(again, metadata) || transport2 != transport) {
      fuzz::fail("JSON round trip changed the metadata");
    }
  }

  const int64_t needed = metadata_storage_bytes(metadata);
  const int64_t offset = bytes.empty() ? 0 : static_cast<uint8_t>(bytes[0]) % 8;
  const at::Tensor storage = fuzz::storage_of(bytes, offset);
  TensorDict td;
  try {
    td = rebuild(std::move(metadata), storage);
  } catch (const c10::Error&) {
    return 0;
  }
  if (needed > storage.numel()) fuzz::fail("rebuild accepted a storage shorter than the leaves");
  if (!is_consolidated(td)) fuzz::fail("a rebuilt TensorDict is not consolidated");
  fuzz::touch(td, &storage);
  return 0;
}
