#pragma once
// Internal (not installed): how an error message quotes what a peer or a file supplied (a
// number, a string, a key, a value): at most kExcerptBytes of it, then its length, so that a
// refused 250 MB number makes a message of a hundred bytes rather than one of 250 MB (and the
// copies an exception makes of it). Every reader quotes through these, so the bound holds in
// one place.

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "tensordict/json_value.h"

namespace tensordict::core {

/// The most bytes of a peer's text that a message quotes.
inline constexpr size_t kExcerptBytes = 80;

/// `text` when it has at most kExcerptBytes bytes; else its first bytes (at most
/// kExcerptBytes, a UTF-8 sequence kept whole) and "...(N bytes)", N its length:
/// "1234567890...(262144000 bytes)".
std::string excerpt(std::string_view text);

/// quote_key(excerpt(text)): a peer's string or key as messages print a key, 'torch.foo' or
/// 'xxxx...(262144000 bytes)'.
std::string quoted_excerpt(std::string_view text);

/// A key path as NestedKey::str() prints it, 'a' or ('a', 'b'), each part a quoted_excerpt;
/// with `key`, the path to that key of the level at `path` (no part is copied whole).
std::string key_path_excerpt(const std::vector<std::string>& path);
std::string key_path_excerpt(const std::vector<std::string>& path, std::string_view key);

/// excerpt(json.dumps(value)), found without writing more of the text than the excerpt shows:
/// its length is counted, each shared node once (O(distinct nodes), however often they are
/// reused).
std::string json_excerpt(const JsonValue& value);

}  // namespace tensordict::core
