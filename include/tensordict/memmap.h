#pragma once
// Memory-mapped tensors and TensorDicts on disk, as the reference's MemoryMappedTensor and
// TensorDict.memmap / memmap_ / memmap_like / load_memmap, with its on-disk layout
// (docs/memmap.md): a directory per level holding meta.json and one raw file `<key>.memmap` per
// leaf, so that a directory written by either library loads in the other.

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <string>

#include "tensordict/tensor_dict.h"

namespace tensordict {

/// Options of the MemoryMappedTensor factories, named like the reference's keywords.
struct MemoryMappedTensorOptions {
  bool existsok = false;       // replace an existing file at `filename` instead of refusing it
  bool copy_existing = false;  // from_tensor: copy a tensor mapped to another file
};

/// Factories of memory-mapped tensors. Each returns a plain CPU at::Tensor, C-contiguous, whose
/// storage is a shared mapping: of the file `filename` when one is given (writes reach the file;
/// the file holds the tensor's raw bytes and nothing else, the reference's layout), else of
/// anonymous shared memory (no file; it lives as long as the tensor). The mapping is released
/// when the last tensor viewing the storage goes. is_memmap() / memmap_filename() recognise
/// these tensors, and also those torch.from_file(..., shared=True) makes (the reference's).
///
/// A file is created fresh: an existing one is refused (RuntimeError naming the path) unless
/// existsok, and then it is unlinked and created again, so that tensors still mapping the old
/// file keep their bytes (no SIGBUS from a file shrunk under them). A path that is a symlink is
/// refused. A missing or read-only directory: RuntimeError naming the path and the reason. A
/// zero-byte tensor gets an empty file. The factories may be called from several threads at
/// once (for different files); the tensors they return are as thread-safe as any tensor.
class MemoryMappedTensor final {
 public:
  MemoryMappedTensor() = delete;

  /// A copy of `tensor` (any device, any strides; it is read, not changed). When `tensor` is
  /// already mapped to `filename` it is returned as it is; mapped to another file: RuntimeError
  /// unless copy_existing. TypeError for a sparse, quantized or nested tensor.
  static at::Tensor from_tensor(const at::Tensor& tensor,
                                const std::optional<std::string>& filename = std::nullopt,
                                const MemoryMappedTensorOptions& options = {});
  /// Maps the existing file `filename` as a tensor of `dtype` and `shape`, shared (writes reach
  /// the file) when the file is writable, copy-on-write otherwise (as the reference's mode=None).
  /// RuntimeError naming the path when it is missing or unreadable, or when the file is smaller
  /// than numel * element size (a larger file is mapped from its start, as the reference does).
  /// ValueError for a negative dim or a size that overflows.
  static at::Tensor from_filename(const std::string& filename, at::ScalarType dtype,
                                  at::IntArrayRef shape);
  /// A new mapping of `shape` and `dtype`: empty() leaves the bytes as the mapping has them (a new
  /// file or anonymous memory reads as zeros), the others fill it.
  static at::Tensor empty(at::IntArrayRef shape, at::ScalarType dtype,
                          const std::optional<std::string>& filename = std::nullopt,
                          const MemoryMappedTensorOptions& options = {});
  static at::Tensor zeros(at::IntArrayRef shape, at::ScalarType dtype,
                          const std::optional<std::string>& filename = std::nullopt,
                          const MemoryMappedTensorOptions& options = {});
  static at::Tensor ones(at::IntArrayRef shape, at::ScalarType dtype,
                         const std::optional<std::string>& filename = std::nullopt,
                         const MemoryMappedTensorOptions& options = {});
  static at::Tensor full(at::IntArrayRef shape, const at::Scalar& fill_value, at::ScalarType dtype,
                         const std::optional<std::string>& filename = std::nullopt,
                         const MemoryMappedTensorOptions& options = {});
  /// A new mapping with the shape and dtype of `tensor` (its values are not copied).
  static at::Tensor empty_like(const at::Tensor& tensor,
                               const std::optional<std::string>& filename = std::nullopt,
                               const MemoryMappedTensorOptions& options = {});
};

/// True when `tensor`'s storage is a shared memory mapping made by MemoryMappedTensor (with or
/// without a file) or a file mapping made by torch.from_file / at::MapAllocator.
bool is_memmap(const at::Tensor& tensor);
/// The absolute path of the file `tensor`'s storage maps; nullopt for anonymous memory and for
/// tensors that are not memory-mapped.
std::optional<std::string> memmap_filename(const at::Tensor& tensor);

/// Options of memmap(), memmap_() and memmap_like(), named like the reference's keywords (and
/// with its defaults).
struct MemmapOptions {
  bool copy_existing = false;  // copy leaves already mapped to other files (else RuntimeError)
  bool existsok = true;        // replace existing leaf files (else RuntimeError naming the file)
};

/// Writes `td` under the directory `prefix` (created with its parents when missing) in the
/// reference's layout and returns a new TensorDict of the same structure whose leaves are
/// memory-mapped tensors of those files, on the CPU (device cpu at every level), locked, as the
/// reference's memmap returns. Non-tensor entries are written as the reference writes a
/// NonTensorData (a subdirectory with its meta.json) and kept in the result. Without a prefix the
/// leaves are copied into anonymous shared memory and nothing is written, as the reference does.
///
/// Every key is checked before anything is written: a key that the reference would not use as a
/// file name unchanged (empty, ".", "..", or holding '/', '\\', '%', a space, a control character
/// or one of <>:"|?*) is refused with a ValueError naming its path, and so are sparse, quantized
/// and nested leaves (TypeError). A file-system failure (a read-only directory, a path under a
/// file, a full disk) is a RuntimeError naming the path; the files written before it stay.
TensorDict memmap(const TensorDict& td, const std::optional<std::string>& prefix = std::nullopt,
                  const MemmapOptions& options = {});
/// memmap() in place: the same files, then every leaf of `td` (at every level, through the
/// nested TensorDicts' own handles) is replaced by its memory-mapped tensor, and `td` is locked.
/// Returns `td`. The batch size and the device `td` reports are unchanged (the leaves are on
/// the CPU).
TensorDict& memmap_(TensorDict& td, const std::optional<std::string>& prefix = std::nullopt,
                    const MemmapOptions& options = {});
/// memmap() without copying the values: the same layout, keys, dtypes and shapes, every file
/// (or anonymous mapping) filled with zeros. `td` is only read for its structure.
TensorDict memmap_like(const TensorDict& td,
                       const std::optional<std::string>& prefix = std::nullopt,
                       const MemmapOptions& options = {});
/// Loads a directory written by memmap() here or by the reference: a TensorDict (not locked)
/// whose leaves map the files (shared when writable, copy-on-write otherwise), with nested
/// TensorDicts and non-tensor entries (JSON data) as saved. meta.json is untrusted input: a
/// missing or unreadable file, bad JSON, an unknown "_type" or entry "type", an unknown dtype
/// name, a bad shape, an unsafe key, a nested tensor, a missing leaf file or one too small for
/// its dtype and shape are each an error naming the path and key (ValueError for bad content,
/// RuntimeError for file-system failures); nothing is returned half-loaded.
TensorDict load_memmap(const std::string& prefix);
/// The reference's TensorDict.is_memmap() as far as a TensorDict without a memmap flag can tell:
/// true when `td` is locked and every tensor leaf, at every level, is memory-mapped (what
/// memmap(), memmap_() and memmap_like() return; unlocking ends it, as in the reference).
bool is_memmap(const TensorDict& td);

}  // namespace tensordict
