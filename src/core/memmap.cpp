#include "tensordict/memmap.h"

#include <ATen/ATen.h>
#include <ATen/MapAllocator.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/excerpt.h"
#include "core/json_text.h"
#include "core/metadata.h"
#include "tensordict/dtypes.h"
#include "tensordict/errors.h"

namespace tensordict {
namespace {

namespace fs = std::filesystem;

// The strings the reference writes and reads (tensordict/_td_memmap.py _save_metadata,
// tensordict/tensorclass.py NonTensorData._memmap_).
constexpr std::string_view kTensorDictType = "<class 'tensordict._td.TensorDict'>";
constexpr std::string_view kTensorDictClass = "tensordict:TensorDict";
constexpr std::string_view kNonTensorType = "<class 'tensordict.tensorclass.NonTensorData'>";
constexpr std::string_view kMetaDataType = "<class 'tensordict.tensorclass.MetaData'>";
constexpr std::string_view kNonTensorStackType = "<class 'tensordict.tensorclass.NonTensorStack'>";
constexpr int64_t kFormatVersion = 1;
// meta.json is small (a few hundred bytes per key); a bigger one is not ours to parse.
constexpr size_t kMaxMetaBytes = size_t{64} << 20;
constexpr int kMaxDepth = 64;

// The storage context of our mappings: the deleter identifies them (is_memmap) and the
// context keeps the file name (memmap_filename), as at::MapAllocator does for torch.from_file.
struct Mapping {
  void* base = nullptr;
  size_t size = 0;
  std::string filename;  // absolute; empty for anonymous memory
  bool shared = true;    // false: copy-on-write, writes do not reach the file
};

void delete_mapping(void* ctx) {
  auto* m = static_cast<Mapping*>(ctx);
  if (m->size != 0) ::munmap(m->base, m->size);
  delete m;
}

[[noreturn]] void fail_errno(const char* fn, const char* what, const std::string& path, int err) {
  TORCH_CHECK(false, fn, ": cannot ", what, " ", path, ": ", std::strerror(err));
}

std::string absolute_path(const char* fn, const std::string& filename) {
  TORCH_CHECK_VALUE(!filename.empty(), fn, ": filename is empty");
  std::error_code ec;
  fs::path p = fs::absolute(fs::path(filename), ec);
  TORCH_CHECK(!ec, fn, ": cannot make ", filename, " absolute: ", ec.message());
  return p.lexically_normal().string();
}

size_t checked_nbytes(const char* fn, at::IntArrayRef shape, at::ScalarType dtype) {
  uint64_t n = c10::elementSize(dtype);
  for (int64_t d : shape) {
    TORCH_CHECK_VALUE(d >= 0, fn, ": negative dim ", d, " in shape ", shape);
    TORCH_CHECK_VALUE(!__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n) &&
                          n <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                      fn, ": shape ", shape, " of ", dtype_name(dtype), " overflows 64-bit bytes");
  }
  return static_cast<size_t>(n);
}

at::Tensor tensor_over(Mapping* m, at::ScalarType dtype, at::IntArrayRef shape) {
  at::DataPtr ptr(m->base, m, &delete_mapping, at::Device(at::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), m->size, std::move(ptr),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, shape);
}

// The open file `fd` (closed here) mapped as `dtype` of `shape`: shared where `writable`,
// copy-on-write otherwise. Refuses anything but a regular file long enough for the shape.
at::Tensor map_fd(const char* fn, int fd, const std::string& path, bool writable,
                  at::ScalarType dtype, at::IntArrayRef shape) {
  const size_t nbytes = checked_nbytes(fn, shape, dtype);
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail_errno(fn, "stat", path, err);
  }
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) < nbytes) {
    ::close(fd);
    TORCH_CHECK(S_ISREG(st.st_mode), fn, ": ", path, " is not a regular file");
    TORCH_CHECK(false, fn, ": ", path, " holds ", st.st_size, " bytes, too few for ",
                dtype_name(dtype), " of shape ", shape, " (", nbytes, " bytes)");
  }
  void* base = nullptr;
  if (nbytes != 0) {
    base =
        ::mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, writable ? MAP_SHARED : MAP_PRIVATE, fd, 0);
    if (base == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      fail_errno(fn, "map", path, err);
    }
  }
  ::close(fd);
  return tensor_over(new Mapping{base, nbytes, path, writable}, dtype, shape);
}

// A new file of nbytes at `path` (already absolute), mapped shared.
Mapping* map_new_file(const char* fn, const std::string& path, size_t nbytes, bool existsok) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) == 0) {
    TORCH_CHECK(!S_ISLNK(st.st_mode), fn, ": refusing to write through the symlink ", path);
    TORCH_CHECK(!S_ISDIR(st.st_mode), fn, ": ", path, " is a directory");
    TORCH_CHECK(existsok, fn, ": the file ", path, " already exists (existsok=false)");
    // A new inode: tensors still mapping the old file keep its bytes.
    if (::unlink(path.c_str()) != 0) fail_errno(fn, "replace", path, errno);
  } else if (errno != ENOENT) {
    fail_errno(fn, "stat", path, errno);
  }
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
  if (fd < 0) fail_errno(fn, "create", path, errno);
  auto fail = [&](const char* what, int err) {
    ::close(fd);
    ::unlink(path.c_str());
    fail_errno(fn, what, path, err);
  };
  void* base = nullptr;
  if (nbytes != 0) {
    // Blocks reserved now: a full disk fails here, not as SIGBUS on a later write.
    if (int err = ::posix_fallocate(fd, 0, static_cast<off_t>(nbytes)); err != 0) {
      fail("allocate", err);
    }
    base = ::mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) fail("map", errno);
  }
  ::close(fd);  // the mapping keeps the file
  return new Mapping{base, nbytes, path};
}

Mapping* map_anonymous(const char* fn, size_t nbytes) {
  void* base = nullptr;
  if (nbytes != 0) {
    base = ::mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(base != MAP_FAILED, fn, ": cannot map ", nbytes,
                " bytes of shared memory: ", std::strerror(errno));
  }
  return new Mapping{base, nbytes, {}};
}

at::Tensor make_mapped(const char* fn, at::IntArrayRef shape, at::ScalarType dtype,
                       const std::optional<std::string>& filename,
                       const MemoryMappedTensorOptions& options) {
  const size_t nbytes = checked_nbytes(fn, shape, dtype);
  Mapping* m = filename ? map_new_file(fn, absolute_path(fn, *filename), nbytes, options.existsok)
                        : map_anonymous(fn, nbytes);
  return tensor_over(m, dtype, shape);
}

void check_plain(const char* fn, const at::Tensor& t, const std::string& what) {
  TORCH_CHECK_VALUE(t.defined(), fn, ": ", what, " is an undefined tensor");
  TORCH_CHECK_TYPE(t.layout() == at::kStrided && !t.is_nested() && !t.is_quantized(), fn, ": ",
                   what, " is a ", t.layout(), t.is_nested() ? " nested" : "",
                   t.is_quantized() ? " quantized" : "",
                   " tensor; only dense strided tensors can be memory-mapped");
}

Mapping* our_mapping(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const at::DataPtr& ptr = t.storage().data_ptr();
  if (ptr.get_deleter() != &delete_mapping) return nullptr;
  return static_cast<Mapping*>(ptr.get_context());
}

at::MapAllocator* torch_file_mapping(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  at::MapAllocator* a = at::MapAllocator::fromDataPtr(t.storage().data_ptr());
  // Shared-memory segments (share_memory_, /dev/shm names) are not files of the user.
  if (a == nullptr || (a->flags() & at::ALLOCATOR_MAPPED_SHAREDMEM) != 0) return nullptr;
  return a;
}

// ---- TensorDict layout -------------------------------------------------------------------

using core::path_str;  // a file's keys are quoted through core::excerpt

// The keys the reference writes under their own name (tensordict/_utils_key_json.py
// _encode_key_for_filesystem leaves them unchanged); it percent-encodes the others, which we
// refuse instead of encoding (docs/memmap.md).
bool is_safe_key(const std::string& key) {
  if (key.empty() || key == "." || key == "..") return false;
  for (unsigned char c : key) {
    if (c < 32 || c == 127) return false;
    if (std::string_view("/<>:\"|?*\\ %").find(static_cast<char>(c)) != std::string_view::npos) {
      return false;
    }
  }
  return true;
}

// The fields of a level's meta.json beside its entries.
bool is_reserved_key(const std::string& key) {
  return key == "shape" || key == "device" || key == "_type" || key == "_format_version" ||
         key == "_class";
}

void check_key(const char* fn, const std::vector<std::string>& path, const std::string& key) {
  TORCH_CHECK_VALUE(!is_reserved_key(key), fn, ": key ", path_str(path, key),
                    " is the name of a meta.json field of its level (shape, device, _type, "
                    "_format_version, _class); rename it to memory-map it");
  TORCH_CHECK_VALUE(is_safe_key(key), fn, ": key ", path_str(path, key),
                    " is not a safe file name (empty, '.', '..', or holding '/', '\\\\', '%', a "
                    "space, a control character or one of <>:\"|?*); rename it to memory-map it");
}

void validate(const char* fn, const TensorDict& td, std::vector<std::string>& path) {
  TORCH_CHECK_VALUE(path.size() < kMaxDepth, fn, ": more than ", kMaxDepth, " nested levels");
  // Its entries are its members: written as a TensorDict they would make a wrong directory.
  TORCH_CHECK_NOT_IMPLEMENTED(!td.is_lazy_stack(), fn, ": ",
                              path.empty() ? std::string("the TensorDict") : NestedKey(path).str(),
                              " is a LazyStackedTensorDict, which cannot be memory-mapped yet; "
                              "memory-map its contiguous() copy or each of its tensordicts()");
  for (const auto& [key, value] : td.entries()) {
    check_key(fn, path, key);
    if (value.is_tensordict()) {
      path.push_back(key);
      validate(fn, value.tensordict(), path);
      path.pop_back();
    } else if (value.is_tensor()) {
      check_plain(fn, value.tensor(), "key " + path_str(path, key));
    }
  }
}

JsonValue shape_json(at::IntArrayRef shape) {
  JsonValue::List out;
  for (int64_t d : shape) out.emplace_back(d);
  return JsonValue(std::move(out));
}

void write_text(const char* fn, const fs::path& file, const std::string& text) {
  const std::string path = file.string();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0666);
  if (fd < 0) fail_errno(fn, "write", path, errno);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail_errno(fn, "write", path, err);
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) fail_errno(fn, "write", path, errno);
}

void make_dir(const char* fn, const fs::path& dir, bool nested) {
  std::error_code ec;
  if (nested) {
    TORCH_CHECK(!fs::is_symlink(fs::symlink_status(dir, ec)), fn,
                ": refusing to write a nested TensorDict through the symlink ", dir.string());
  }
  fs::create_directories(dir, ec);
  TORCH_CHECK(!ec, fn, ": cannot create the directory ", dir.string(), ": ", ec.message());
  TORCH_CHECK(fs::is_directory(dir, ec), fn, ": ", dir.string(), " is not a directory");
}

enum class Fill { kCopy, kZeros };

struct Writer {
  const char* fn;
  Fill fill;
  MemmapOptions options;

  at::Tensor leaf(const at::Tensor& t, const std::optional<fs::path>& file) const {
    std::optional<std::string> name;
    if (file) name = file->string();
    MemoryMappedTensorOptions o{.existsok = options.existsok,
                                .copy_existing = options.copy_existing};
    if (fill == Fill::kZeros) return make_mapped(fn, t.sizes(), t.scalar_type(), name, o);
    // Gradients do not travel into files (the reference maps value.data).
    return MemoryMappedTensor::from_tensor(t.requires_grad() ? t.detach() : t, name, o);
  }

  // Writes one level; returns the new TensorDict of its mapped leaves.
  TensorDict level(const TensorDict& td, const std::optional<fs::path>& dir, bool nested) const {
    if (dir) make_dir(fn, *dir, nested);
    JsonValue::Map meta;
    std::vector<TensorDict::Entry> out;
    for (const auto& [key, value] : td.entries()) {
      std::optional<fs::path> sub;
      if (dir) sub = *dir / key;
      if (value.is_tensordict()) {
        TensorDict child = level(value.tensordict(), sub, /*nested=*/true);
        if (dir) meta.emplace_back(key, JsonValue::map({{"type", "TensorDict"}}));
        out.emplace_back(key, child);
      } else if (value.is_non_tensor()) {
        if (dir) {
          // The reference's layouts: a stack's values in one meta.json, as tolist() gives them.
          const NonTensorData& v = value.non_tensor();
          make_dir(fn, *sub, /*nested=*/true);
          JsonValue nt;
          if (v.is_stack()) {
            nt =
                JsonValue::map({{"_type", std::string(kNonTensorStackType)},
                                {"_format_version", kFormatVersion},
                                {"_class", "tensordict:NonTensorStack"},
                                {"stack_dim", v.stack_dim()},
                                {"device", v.device() ? JsonValue(v.device()->str()) : JsonValue()},
                                {"data", v.tolist()}});
          } else {
            nt = JsonValue::map(
                {{"_type", std::string(v.is_metadata() ? kMetaDataType : kNonTensorType)},
                 {"data", v.data()},
                 {"_metadata", nullptr},
                 {"_is_non_tensor", true}});
          }
          // Its text is held whole before it is written: bounded where shared values expand.
          core::JsonExpansion().add(
              nt, [&] { return c10::str(fn, ": the non-tensor value of key ", quote_key(key)); });
          write_text(fn, *sub / "meta.json", nt.dump());
          meta.emplace_back(key, JsonValue::map({{"type", v.class_name()}}));
        }
        out.emplace_back(key, value);
      } else {
        TORCH_CHECK_NOT_IMPLEMENTED(!value.is_unbatched(),
                                    "UnbatchedTensor entries cannot be "
                                    "memory-mapped yet, but ",
                                    quote_key(key),
                                    " is one. Exclude "
                                    "it first, e.g. with td.exclude('",
                                    key, "').");
        const at::Tensor& t = value.tensor();
        std::optional<fs::path> file;
        if (dir) file = *dir / (key + ".memmap");
        at::Tensor mapped = leaf(t, file);
        if (dir) {
          meta.emplace_back(key, JsonValue::map({{"device", t.device().str()},
                                                 {"shape", shape_json(t.sizes())},
                                                 {"dtype", dtype_name(t.scalar_type())},
                                                 {"is_nested", false}}));
        }
        out.emplace_back(key, std::move(mapped));
      }
    }
    if (dir) {
      meta.emplace_back("shape", shape_json(td.batch_size()));
      meta.emplace_back("device", "cpu");
      meta.emplace_back("_type", std::string(kTensorDictType));
      meta.emplace_back("_format_version", kFormatVersion);
      meta.emplace_back("_class", std::string(kTensorDictClass));
      write_text(fn, *dir / "meta.json", JsonValue(std::move(meta)).dump());
    }
    return TensorDict(std::move(out), td.batch_size(), at::Device(at::kCPU));
  }
};

TensorDict write_all(const char* fn, const TensorDict& td, const std::optional<std::string>& prefix,
                     const Writer& writer) {
  std::vector<std::string> path;
  validate(fn, td, path);
  std::optional<fs::path> dir;
  if (prefix) dir = fs::path(absolute_path(fn, *prefix));
  TensorDict out = writer.level(td, dir, /*nested=*/false);
  out.lock_();
  return out;
}

// Points every leaf of `td` at the leaf of `mapped` (same structure) at the same key, through
// the nested levels' own handles. Nothing here can fail halfway: the files are written already.
void swap_in(TensorDict td, const TensorDict& mapped) {
  for (const auto& [key, value] : td.entries()) {
    if (value.is_tensordict()) {
      swap_in(value.tensordict(), mapped.get(key).tensordict());
    } else if (value.is_tensor()) {
      td.set(key, mapped.get(key).tensor());
    }
  }
}

// ---- loading -----------------------------------------------------------------------------
// Every file and folder a load opens is reached from the folder it was given, one name at a
// time, never through a symbolic link (refused by fstatat, then O_NOFOLLOW on the open itself)
// and only as a regular file or a directory: a link planted in a saved folder cannot make a
// load read or map a file outside it (nor later writes through the loaded tensors reach one),
// and a FIFO or a device cannot block it.

// Memory for meta.json: all the files of one load are read within kMaxMetaTotalBytes, and the
// values of non-tensor entries (the part of them the load keeps) may take kValueBytesPerMetaByte
// bytes per byte read, plus kValueAllowance; docs/reliability.md gives these figures.
constexpr size_t kMaxMetaTotalBytes = size_t{256} << 20;
constexpr size_t kValueBytesPerMetaByte = core::kValueBytesPerTextByte;
constexpr size_t kValueAllowance = core::kValueAllowanceBytes;
// A level's entry ({"dtype", "shape", ...}) or field is read on its own, within these bounds.
constexpr core::JsonLimits kEntryLimits{
    .max_depth = 8, .max_values = 4096, .max_bytes = size_t{1} << 20};

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd& operator=(Fd&&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// A folder of the load: its descriptor and its path (for messages and file names).
struct Dir {
  Fd fd;
  std::string path;
};

struct Budget {
  size_t read = 0;    // bytes of meta.json read, every level
  size_t values = 0;  // memory taken by the non-tensor values loaded
};

const char* type_word(mode_t type) { return type == S_IFDIR ? "directory" : "regular file"; }

// `name` inside `dir`, opened with `flags`: refused (naming its path) when it is a symbolic
// link or not of `type` (S_IFDIR or S_IFREG). O_NONBLOCK: a FIFO swapped in after the check
// does not block the open; the type is checked again on what was opened. With `writable`,
// opened for writing if allowed, else read-only (*writable false).
int open_in(const Dir& dir, const std::string& name, mode_t type, int flags,
            bool* writable = nullptr) {
  const std::string path = dir.path + "/" + name;
  struct stat st{};
  if (::fstatat(dir.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    fail_errno("load_memmap", "read", path, errno);
  }
  TORCH_CHECK(!S_ISLNK(st.st_mode), "load_memmap: ", path,
              " is a symbolic link; a load "
              "follows none, so that it never leaves the folder it was given");
  TORCH_CHECK((st.st_mode & S_IFMT) == type, "load_memmap: ", path, " is not a ", type_word(type));
  const int common = O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | (type == S_IFDIR ? O_DIRECTORY : 0);
  int fd = ::openat(dir.fd.get(), name.c_str(), flags | common);
  if (fd < 0 && writable != nullptr && (errno == EACCES || errno == EROFS || errno == EPERM)) {
    *writable = false;
    fd = ::openat(dir.fd.get(), name.c_str(), O_RDONLY | common);
  }
  if (fd < 0) fail_errno("load_memmap", "open", path, errno);
  if (::fstat(fd, &st) != 0 || (st.st_mode & S_IFMT) != type) {
    ::close(fd);
    TORCH_CHECK(false, "load_memmap: ", path, " is not a ", type_word(type));
  }
  return fd;
}

Dir open_dir(const Dir& parent, const std::string& name) {
  return {Fd(open_in(parent, name, S_IFDIR, O_RDONLY)), parent.path + "/" + name};
}

// `dir`'s meta.json, within the load's budget of bytes read.
std::string read_meta(const Dir& dir, Budget& budget) {
  const std::string path = dir.path + "/meta.json";
  const Fd fd(open_in(dir, "meta.json", S_IFREG, O_RDONLY));
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) fail_errno("load_memmap", "read", path, errno);
  const auto size = static_cast<size_t>(st.st_size);
  TORCH_CHECK_VALUE(size <= kMaxMetaBytes, "load_memmap: ", path, " holds ", size,
                    " bytes; a meta.json may hold at most ", kMaxMetaBytes);
  TORCH_CHECK_VALUE(budget.read + size <= kMaxMetaTotalBytes, "load_memmap: ", path, " holds ",
                    size, " bytes, which would take the meta.json files of this load past ",
                    kMaxMetaTotalBytes, " bytes in all");
  budget.read += size;
  std::string text(size, '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail_errno("load_memmap", "read", path, n < 0 ? errno : EIO);
    done += static_cast<size_t>(n);
  }
  return text;
}

const JsonValue* find(const JsonValue& map, std::string_view key) {
  for (const auto& [k, v] : map.as_map()) {
    if (k == key) return &v;
  }
  return nullptr;
}

std::vector<int64_t> shape_from(const JsonValue* v, const std::string& file,
                                const std::string& what) {
  TORCH_CHECK_VALUE(v != nullptr && v->is_list(), "load_memmap: ", file, ": ", what,
                    " has no shape list");
  std::vector<int64_t> shape;
  for (const auto& d : v->as_list()) {
    TORCH_CHECK_VALUE(d.is_int() && d.as_int() >= 0, "load_memmap: ", file, ": ", what,
                      " has a shape entry that is not a non-negative integer");
    shape.push_back(d.as_int());
  }
  return shape;
}

// The tensor of the file `key`.memmap in `dir` (an empty tensor where the reference writes no
// file), mapped shared where the file is writable, copy-on-write otherwise.
at::Tensor load_leaf(const Dir& dir, const std::string& key, const JsonValue& entry,
                     const std::string& where) {
  const std::string meta_file = dir.path + "/meta.json";
  const JsonValue* dtype_v = find(entry, "dtype");
  TORCH_CHECK_VALUE(dtype_v != nullptr && dtype_v->is_string(), "load_memmap: ", meta_file,
                    ": key ", where, " has no dtype name");
  const auto dtype = dtype_from_name(dtype_v->as_string());
  TORCH_CHECK_VALUE(dtype.has_value(), "load_memmap: ", meta_file, ": key ", where,
                    " has the unknown dtype ", core::quoted_excerpt(dtype_v->as_string()));
  const auto shape = shape_from(find(entry, "shape"), meta_file, "key " + where);
  const JsonValue* nested = find(entry, "is_nested");
  TORCH_CHECK_VALUE(nested == nullptr || (nested->is_bool() && !nested->as_bool()),
                    "load_memmap: ", meta_file, ": key ", where,
                    " is a nested tensor, which is not supported");
  const std::string name = key + ".memmap";
  const size_t nbytes = checked_nbytes("load_memmap", shape, *dtype);
  struct stat st{};
  if (nbytes == 0 && ::fstatat(dir.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 &&
      errno == ENOENT) {
    return at::empty(shape, at::TensorOptions().dtype(*dtype));
  }
  try {
    bool writable = true;  // as the reference's mode=None: a read-only file maps copy-on-write
    const int fd = open_in(dir, name, S_IFREG, O_RDWR, &writable);
    return map_fd("load_memmap", fd, dir.path + "/" + name, writable, *dtype, shape);
  } catch (const c10::Error& e) {
    std::string_view why = e.what_without_backtrace();
    if (why.starts_with("load_memmap: ")) why.remove_prefix(13);  // said once, in front
    TORCH_CHECK(false, "load_memmap: key ", where, ": ", why);
  }
}

// A non-tensor entry's folder: `kind` is the parent's "type" of it (NonTensorData, MetaData or
// NonTensorStack), whose _type its meta.json must repeat. A stack is read from its values, as the
// reference reads it (its stack_dim is not kept: the values come back stacked along dim 0).
// Its values are measured before they are built, within the load's budget.
NonTensorData load_non_tensor(const Dir& dir, const std::string& where, std::string_view kind,
                              Budget& budget) {
  const std::string file = dir.path + "/meta.json";
  JsonValue meta;
  {
    const std::string text = read_meta(dir, budget);
    const size_t allowed = kValueBytesPerMetaByte * budget.read + kValueAllowance;
    const std::string who = c10::str("load_memmap: ", file);
    const core::JsonLimits limits{.max_depth = 256, .max_bytes = allowed - budget.values};
    size_t bytes = 0;
    try {
      bytes = core::json_bytes(text, limits, who.c_str());
    } catch (const c10::ValueError& e) {
      TORCH_CHECK_VALUE(false, e.msg(), " (a load spends at most ", kValueBytesPerMetaByte,
                        " bytes per byte of meta.json read, plus ", kValueAllowance,
                        ", on the values of non-tensor entries: docs/reliability.md)");
    }
    budget.values += bytes;
    meta = core::parse_json(text, limits, who.c_str());
  }
  TORCH_CHECK_VALUE(meta.is_map(), "load_memmap: ", file, " does not hold a JSON object");
  const JsonValue* type = find(meta, "_type");
  const std::string_view want = kind == "MetaData"         ? kMetaDataType
                                : kind == "NonTensorStack" ? kNonTensorStackType
                                                           : kNonTensorType;
  TORCH_CHECK_VALUE(type != nullptr && type->is_string() && type->as_string() == want,
                    "load_memmap: ", file, ": key ", where, " is not a ", kind,
                    " entry (its _type is not ", want, ")");
  const JsonValue* data = find(meta, "data");
  struct stat st{};
  const bool pickled = kind == "NonTensorStack"
                           ? data != nullptr && data->is_string()
                           : ::fstatat(dir.fd.get(), "other.pickle", &st, AT_SYMLINK_NOFOLLOW) == 0;
  TORCH_CHECK_VALUE(data != nullptr && !pickled, "load_memmap: ", file, ": key ", where,
                    " holds pickled data, which is not loaded; only JSON data is");
  if (kind == "NonTensorStack") {
    TORCH_CHECK_VALUE(data->is_list(), "load_memmap: ", file, ": key ", where,
                      ": the data of a NonTensorStack must be a list");
    return NonTensorData::from_list(*data);
  }
  return NonTensorData(*data, {}, std::nullopt,
                       kind == "MetaData" ? NonTensorKind::kMetaData : NonTensorKind::kData);
}

// A level: its meta.json read member by member, each entry loaded as it is read (a leaf
// mapped, a nested level or non-tensor entry loaded from its folder), so that no tree of the
// entries is ever held: what a level costs beyond its text is what it loads. A repeated key
// keeps its first place and its last value, as json.loads does.
TensorDict load_level(const Dir& dir, std::vector<std::string>& path, Budget& budget) {
  TORCH_CHECK_VALUE(path.size() < kMaxDepth, "load_memmap: more than ", kMaxDepth,
                    " nested levels under ", dir.path);
  const std::string file_s = dir.path + "/meta.json";
  JsonValue::Map fields;
  std::vector<TensorDict::Entry> entries;
  std::unordered_map<std::string, size_t> at;
  auto load_entry = [&](const std::string& key, const JsonValue& entry) -> Value {
    const std::string where = path_str(path, key);
    TORCH_CHECK_VALUE(is_safe_key(key), "load_memmap: ", file_s, ": key ", where,
                      " is not a safe file name");
    const JsonValue* t = find(entry, "type");
    if (t == nullptr) return load_leaf(dir, key, entry, where);
    TORCH_CHECK_VALUE(t->is_string(), "load_memmap: ", file_s, ": key ", where,
                      " has a type that is not a string");
    if (t->as_string() == "TensorDict") {
      path.push_back(key);
      TensorDict level = load_level(open_dir(dir, key), path, budget);
      path.pop_back();
      return level;
    }
    TORCH_CHECK_VALUE(t->as_string() == "NonTensorData" || t->as_string() == "MetaData" ||
                          t->as_string() == "NonTensorStack",
                      "load_memmap: ", file_s, ": key ", where, " is a ",
                      core::quoted_excerpt(t->as_string()),
                      ", which is not supported (TensorDict, NonTensorData, MetaData and "
                      "NonTensorStack are)");
    return load_non_tensor(open_dir(dir, key), where, t->as_string(), budget);
  };
  {
    // The level's text is held while its entries load (its levels below included): at most
    // kMaxMetaTotalBytes of text in all. The parser names its own faults "FILE is not valid
    // JSON"; an entry's fault leaves it as it is.
    const std::string text = read_meta(dir, budget);
    const std::string who = c10::str("load_memmap: ", file_s, " is not valid JSON");
    core::parse_json_members(
        text, kEntryLimits, who.c_str(), [&](std::string key, JsonValue value) {
          if (!value.is_map()) {  // the level's own fields ("shape", "device", "_type", ...)
            fields.emplace_back(std::move(key), std::move(value));
            return;
          }
          Value loaded = load_entry(key, value);
          if (auto it = at.find(key); it != at.end()) {
            entries[it->second].second = std::move(loaded);
          } else {
            at.emplace(key, entries.size());
            entries.emplace_back(std::move(key), std::move(loaded));
          }
        });
  }
  auto field = [&](std::string_view name) -> const JsonValue* {
    const JsonValue* out = nullptr;  // the last one, as json.loads keeps
    for (const auto& [k, v] : fields) {
      if (k == name) out = &v;
    }
    return out;
  };
  if (const JsonValue* v = field("_format_version"); v != nullptr && v->is_int()) {
    TORCH_CHECK_VALUE(v->as_int() <= kFormatVersion, "load_memmap: ", file_s,
                      " was saved in the format version ", v->as_int(), "; this reads up to ",
                      kFormatVersion);
  }
  const JsonValue* type = field("_type");
  const JsonValue* cls = field("_class");
  const bool is_td =
      (type != nullptr && type->is_string() && type->as_string() == kTensorDictType) ||
      (cls != nullptr && cls->is_string() && cls->as_string() == kTensorDictClass);
  TORCH_CHECK_VALUE(
      is_td, "load_memmap: ", file_s, " does not hold a TensorDict (its _type is ",
      type != nullptr && type->is_string() ? core::quoted_excerpt(type->as_string()) : "missing",
      "); only TensorDict directories are loaded");
  const auto batch_size = shape_from(field("shape"), file_s, "the TensorDict");
  if (const JsonValue* d = field("device"); d != nullptr) {
    TORCH_CHECK_VALUE(
        d->is_null() || (d->is_string() && (d->as_string() == "cpu" || d->as_string() == "None")),
        "load_memmap: ", file_s, ": device ",
        d->is_string() ? core::quoted_excerpt(d->as_string()) : "?",
        " is not supported (only cpu)");
  }
  try {
    return TensorDict(std::move(entries), batch_size, at::Device(at::kCPU));
  } catch (const c10::Error& e) {
    TORCH_CHECK_VALUE(false, "load_memmap: ", file_s, ": ", e.what_without_backtrace());
  }
}

}  // namespace

// ---- MemoryMappedTensor --------------------------------------------------------------------

at::Tensor MemoryMappedTensor::from_tensor(const at::Tensor& tensor,
                                           const std::optional<std::string>& filename,
                                           const MemoryMappedTensorOptions& options) {
  constexpr const char* fn = "MemoryMappedTensor.from_tensor";
  check_plain(fn, tensor, "the input");
  TORCH_CHECK(!tensor.requires_grad(), fn, ": the input requires grad; pass tensor.detach()");
  if (is_memmap(tensor)) {
    const auto existing = memmap_filename(tensor);
    if (!filename && !existing) return tensor;
    if (filename && existing) {
      // A copy-on-write mapping may hold writes its file lacks: it is written out instead.
      const Mapping* m = our_mapping(tensor);
      if (absolute_path(fn, *filename) == *existing && (m == nullptr || m->shared)) return tensor;
      TORCH_CHECK(options.copy_existing || absolute_path(fn, *filename) == *existing, fn,
                  ": the tensor is mapped to ", *existing,
                  " already; pass copy_existing to copy it to ", *filename);
    }
  }
  at::Tensor out = make_mapped(fn, tensor.sizes(), tensor.scalar_type(), filename, options);
  out.copy_(tensor);
  return out;
}

at::Tensor MemoryMappedTensor::from_filename(const std::string& filename, at::ScalarType dtype,
                                             at::IntArrayRef shape) {
  constexpr const char* fn = "MemoryMappedTensor.from_filename";
  checked_nbytes(fn, shape, dtype);
  const std::string path = absolute_path(fn, filename);
  bool writable = true;
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0 && (errno == EACCES || errno == EROFS || errno == EPERM)) {
    // As the reference's mode=None: a file we cannot write is mapped copy-on-write.
    writable = false;
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  }
  if (fd < 0) fail_errno(fn, "open", path, errno);
  return map_fd(fn, fd, path, writable, dtype, shape);
}

at::Tensor MemoryMappedTensor::empty(at::IntArrayRef shape, at::ScalarType dtype,
                                     const std::optional<std::string>& filename,
                                     const MemoryMappedTensorOptions& options) {
  return make_mapped("MemoryMappedTensor.empty", shape, dtype, filename, options);
}

at::Tensor MemoryMappedTensor::zeros(at::IntArrayRef shape, at::ScalarType dtype,
                                     const std::optional<std::string>& filename,
                                     const MemoryMappedTensorOptions& options) {
  // A new file or anonymous mapping reads as zeros already.
  return make_mapped("MemoryMappedTensor.zeros", shape, dtype, filename, options);
}

at::Tensor MemoryMappedTensor::ones(at::IntArrayRef shape, at::ScalarType dtype,
                                    const std::optional<std::string>& filename,
                                    const MemoryMappedTensorOptions& options) {
  return make_mapped("MemoryMappedTensor.ones", shape, dtype, filename, options).fill_(1);
}

at::Tensor MemoryMappedTensor::full(at::IntArrayRef shape, const at::Scalar& fill_value,
                                    at::ScalarType dtype,
                                    const std::optional<std::string>& filename,
                                    const MemoryMappedTensorOptions& options) {
  return make_mapped("MemoryMappedTensor.full", shape, dtype, filename, options).fill_(fill_value);
}

at::Tensor MemoryMappedTensor::empty_like(const at::Tensor& tensor,
                                          const std::optional<std::string>& filename,
                                          const MemoryMappedTensorOptions& options) {
  constexpr const char* fn = "MemoryMappedTensor.empty_like";
  check_plain(fn, tensor, "the input");
  return make_mapped(fn, tensor.sizes(), tensor.scalar_type(), filename, options);
}

bool is_memmap(const at::Tensor& tensor) {
  return our_mapping(tensor) != nullptr || torch_file_mapping(tensor) != nullptr;
}

std::optional<std::string> memmap_filename(const at::Tensor& tensor) {
  if (const Mapping* m = our_mapping(tensor)) {
    if (m->filename.empty()) return std::nullopt;
    return m->filename;
  }
  if (const at::MapAllocator* a = torch_file_mapping(tensor)) {
    return absolute_path("memmap_filename", a->filename());
  }
  return std::nullopt;
}

// ---- TensorDict ----------------------------------------------------------------------------

TensorDict memmap(const TensorDict& td, const std::optional<std::string>& prefix,
                  const MemmapOptions& options) {
  return write_all("memmap", td, prefix, Writer{"memmap", Fill::kCopy, options});
}

TensorDict& memmap_(TensorDict& td, const std::optional<std::string>& prefix,
                    const MemmapOptions& options) {
  // Every file first, so that a failure leaves `td` as it was.
  const TensorDict mapped =
      write_all("memmap_", td, prefix, Writer{"memmap_", Fill::kCopy, options});
  // Leaves are replaced through set(), which a lock forbids; memmap_ locks at the end anyway.
  td.unlock_();
  swap_in(td, mapped);
  td.lock_();
  return td;
}

TensorDict memmap_like(const TensorDict& td, const std::optional<std::string>& prefix,
                       const MemmapOptions& options) {
  return write_all("memmap_like", td, prefix, Writer{"memmap_like", Fill::kZeros, options});
}

TensorDict load_memmap(const std::string& prefix) {
  const std::string root = absolute_path("load_memmap", prefix);
  // The folder given is opened as named (a link to it is the caller's choice); nothing below
  // it is reached through a link.
  const int fd = ::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail_errno("load_memmap", "read", root + "/meta.json", errno);
  std::vector<std::string> path;
  Budget budget;
  return load_level(Dir{Fd(fd), root}, path, budget);
}

bool is_memmap(const TensorDict& td) {
  if (!td.is_locked()) return false;
  for (const auto& [key, value] : td.entries()) {  // the leaves where they are (no stacking)
    if (value.is_tensor() ? !is_memmap(value.tensor())
                          : value.is_tensordict() && !is_memmap(value.tensordict())) {
      return false;
    }
  }
  return true;
}

}  // namespace tensordict
