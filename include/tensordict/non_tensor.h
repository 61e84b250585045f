#pragma once
// NonTensorData: a non-tensor entry of a TensorDict (a label, an id, a small config value), as
// the reference's NonTensorData: JSON-like data plus the batch size and device of the level that
// holds it. Per-leaf transfers and reductions skip it without consuming a tag; consolidate()
// records it in the metadata's "non_tensors" and rebuild() restores it, so init_remote, the
// collectives and the pipe deliver it.

#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "tensordict/json_value.h"

namespace tensordict {

class NonTensorData {
 public:
  explicit NonTensorData(JsonValue data, std::vector<int64_t> batch_size = {},
                         std::optional<at::Device> device = std::nullopt)
      : data_(std::move(data)), batch_size_(std::move(batch_size)), device_(device) {}

  const JsonValue& data() const { return data_; }
  at::IntArrayRef batch_size() const { return batch_size_; }
  std::optional<at::Device> device() const { return device_; }

  bool operator==(const NonTensorData& other) const = default;

 private:
  JsonValue data_;
  std::vector<int64_t> batch_size_;
  std::optional<at::Device> device_;
};

}  // namespace tensordict
