#include "gloo_errors.h"

#include <c10/util/Exception.h>

#include <string_view>

#include "tensordict/errors.h"

namespace tensordict::dist::detail {
namespace {

bool contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

}  // namespace

std::string message_of(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  return c10_error ? c10_error->msg() : e.what();
}

GlooFailure classify(const std::exception& e) {
  if (dynamic_cast<const TimeoutError*>(&e) != nullptr ||
      dynamic_cast<const PeerLostError*>(&e) != nullptr ||
      dynamic_cast<const MalformedPeerDataError*>(&e) != nullptr) {
    return GlooFailure::kOther;  // typed by us already
  }
  const std::string text = message_of(e);
  // Gloo's texts: "Timed out waiting 30000ms for recv operation to complete" (gloo's pair),
  // "... timed out ..." and "Timeout" (the store and c10d's wrappers).
  if (contains(text, "Timed out") || contains(text, "timed out") || contains(text, "Timeout")) {
    return GlooFailure::kTimeout;
  }
  if (dynamic_cast<const c10::Error*>(&e) == nullptr ||
      contains(text, "Connection closed by peer") || contains(text, "Connection reset by peer")) {
    return GlooFailure::kLost;
  }
  return GlooFailure::kOther;
}

void rethrow_lost(const std::exception& e, const std::string& where) {
  if (classify(e) == GlooFailure::kOther) throw;
  TD_THROW(PeerLostError, where, ": ", message_of(e));
}

}  // namespace tensordict::dist::detail
