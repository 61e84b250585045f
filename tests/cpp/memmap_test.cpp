// MemoryMappedTensor and memmap / memmap_ / memmap_like / load_memmap: the files hold the raw
// bytes, writes reach them, and every bad path or meta.json is an error naming what is wrong.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/MapAllocator.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "expect_throw.h"
#include "tensordict/consolidate.h"
#include "tensordict/memmap.h"

using namespace tensordict;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test, removed afterwards.
class Memmap : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "td_memmap_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

std::string read_all(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string bytes_of(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return {static_cast<const char*>(c.data_ptr()),
          static_cast<size_t>(c.numel() * c.element_size())};
}

void write_file(const std::string& file, const std::string& text) {
  std::ofstream(file, std::ios::binary) << text;
}

}  // namespace

TEST_F(Memmap, FromTensorWritesTheRawBytesAndMapsThem) {
  // Non-contiguous input: the file is C-contiguous all the same.
  at::Tensor src = at::arange(12, at::kFloat).reshape({3, 4}).t();
  at::Tensor m = MemoryMappedTensor::from_tensor(src, path("x.memmap"));
  EXPECT_TRUE(at::equal(m, src));
  EXPECT_TRUE(m.is_contiguous());
  EXPECT_EQ(read_all(path("x.memmap")), bytes_of(src));
  EXPECT_TRUE(is_memmap(m));
  EXPECT_EQ(memmap_filename(m), fs::absolute(path("x.memmap")).lexically_normal().string());
  // Views share the mapping and know the file too.
  EXPECT_EQ(memmap_filename(m[1]), memmap_filename(m));
  EXPECT_FALSE(is_memmap(src));
  EXPECT_EQ(memmap_filename(src), std::nullopt);
}

TEST_F(Memmap, InPlaceWritesReachTheFile) {
  at::Tensor m = MemoryMappedTensor::zeros({2, 3}, at::kLong, path("z.memmap"));
  m[1][2] = 7;
  m[0].fill_(-1);
  at::Tensor expect = at::tensor({-1, -1, -1, 0, 0, 7}, at::kLong).reshape({2, 3});
  EXPECT_EQ(read_all(path("z.memmap")), bytes_of(expect));
  // And another mapping of the file sees them.
  at::Tensor again = MemoryMappedTensor::from_filename(path("z.memmap"), at::kLong, {2, 3});
  EXPECT_TRUE(at::equal(again, expect));
  again[0][0] = 42;
  EXPECT_EQ(m[0][0].item<int64_t>(), 42);
}

TEST_F(Memmap, FromFilenameReadsWhatFromTensorWrote) {
  at::Tensor src = at::randn({4, 5}, at::kDouble);
  MemoryMappedTensor::from_tensor(src, path("r.memmap"));
  at::Tensor m = MemoryMappedTensor::from_filename(path("r.memmap"), at::kDouble, {4, 5});
  EXPECT_TRUE(at::equal(m, src));
  // Another dtype and shape over the same bytes, as numpy.memmap would read them.
  at::Tensor bytes = MemoryMappedTensor::from_filename(path("r.memmap"), at::kByte, {160});
  EXPECT_EQ(bytes_of(bytes), bytes_of(src));
  // A prefix of the file.
  at::Tensor head = MemoryMappedTensor::from_filename(path("r.memmap"), at::kDouble, {2});
  EXPECT_TRUE(at::equal(head, src.flatten().slice(0, 0, 2)));
}

TEST_F(Memmap, FactoriesFillAndEmptyLikeKeepsShapeAndDtype) {
  EXPECT_TRUE(
      at::equal(MemoryMappedTensor::ones({3}, at::kInt, path("o")), at::ones({3}, at::kInt)));
  EXPECT_TRUE(at::equal(MemoryMappedTensor::full({2, 2}, 2.5, at::kFloat, path("f")),
                        at::full({2, 2}, 2.5, at::kFloat)));
  at::Tensor e = MemoryMappedTensor::empty_like(at::ones({2, 7}, at::kHalf), path("e"));
  EXPECT_EQ(e.sizes(), at::IntArrayRef({2, 7}));
  EXPECT_EQ(e.scalar_type(), at::kHalf);
  EXPECT_EQ(fs::file_size(path("e")), 2u * 7u * 2u);
  EXPECT_EQ(fs::file_size(path("o")), 12u);
  // Anonymous shared memory: mapped, no file.
  at::Tensor anon = MemoryMappedTensor::full({5}, 3, at::kLong);
  EXPECT_TRUE(is_memmap(anon));
  EXPECT_EQ(memmap_filename(anon), std::nullopt);
  EXPECT_TRUE(at::equal(anon, at::full({5}, 3, at::kLong)));
  // Zero bytes: an empty file.
  at::Tensor none = MemoryMappedTensor::zeros({0, 3}, at::kFloat, path("empty"));
  EXPECT_EQ(none.numel(), 0);
  EXPECT_EQ(fs::file_size(path("empty")), 0u);
}

TEST_F(Memmap, TorchFromFileTensorsAreRecognised) {
  MemoryMappedTensor::from_tensor(at::arange(4, at::kFloat), path("t.memmap"));
  at::Tensor t = at::from_file(path("t.memmap"), /*shared=*/true, /*size=*/4, at::kFloat);
  EXPECT_TRUE(is_memmap(t));
  EXPECT_EQ(memmap_filename(t), fs::absolute(path("t.memmap")).string());
  // Returned as it is when asked for its own file; another file needs copy_existing.
  EXPECT_TRUE(MemoryMappedTensor::from_tensor(t, path("t.memmap")).is_same(t));
  EXPECT_THROW_MSG(MemoryMappedTensor::from_tensor(t, path("u.memmap")), c10::Error,
                   "copy_existing");
  at::Tensor copy = MemoryMappedTensor::from_tensor(t, path("u.memmap"), {.copy_existing = true});
  EXPECT_TRUE(at::equal(copy, t));
}

TEST_F(Memmap, ExistingFilesAndSymlinksAreRefusedOrReplaced) {
  MemoryMappedTensor::zeros({4}, at::kFloat, path("a"));
  EXPECT_THROW_MSG(MemoryMappedTensor::zeros({4}, at::kFloat, path("a")), c10::Error,
                   "already exists");
  at::Tensor old = MemoryMappedTensor::from_filename(path("a"), at::kFloat, {4});
  // Replaced by a smaller file: the old mapping keeps its own bytes (no SIGBUS).
  at::Tensor now = MemoryMappedTensor::ones({1}, at::kFloat, path("a"), {.existsok = true});
  EXPECT_EQ(fs::file_size(path("a")), 4u);
  EXPECT_EQ(old.sum().item<float>(), 0.f);
  EXPECT_EQ(now.item<float>(), 1.f);
  fs::create_symlink(path("a"), path("link"));
  EXPECT_THROW_MSG(MemoryMappedTensor::zeros({1}, at::kFloat, path("link"), {.existsok = true}),
                   c10::Error, "symlink " + path("link"));
}

TEST_F(Memmap, FileSystemErrorsNameThePath) {
  const std::string missing = path("no/such/dir/x.memmap");
  EXPECT_THROW_MSG(MemoryMappedTensor::from_tensor(at::ones({2}), missing), c10::Error, missing);
  // A path under a regular file fails for root too.
  write_file(path("plain"), "x");
  EXPECT_THROW_MSG(MemoryMappedTensor::zeros({2}, at::kFloat, path("plain/x")), c10::Error,
                   path("plain/x"));
  EXPECT_THROW_MSG(MemoryMappedTensor::from_filename(path("nope"), at::kFloat, {1}), c10::Error,
                   path("nope"));
  EXPECT_THROW_MSG(memmap(TensorDict({{"a", at::ones({2})}}), path("plain/sub")), c10::Error,
                   path("plain/sub"));
  if (::geteuid() != 0) {  // root writes through permissions
    fs::create_directory(path("ro"));
    fs::permissions(path("ro"), fs::perms::owner_read | fs::perms::owner_exec);
    EXPECT_THROW_MSG(MemoryMappedTensor::zeros({2}, at::kFloat, path("ro/x")), c10::Error,
                     path("ro/x"));
    EXPECT_THROW_MSG(memmap(TensorDict({{"a", at::ones({2})}}), path("ro")), c10::Error,
                     path("ro/a.memmap"));
  }
}

TEST_F(Memmap, FromFilenameRefusesAFileTooSmall) {
  MemoryMappedTensor::zeros({3}, at::kFloat, path("s"));
  EXPECT_THROW_MSG(
      MemoryMappedTensor::from_filename(path("s"), at::kFloat, {4}), c10::Error,
      path("s") + " holds 12 bytes, too few for torch.float32 of shape [4] (16 bytes)");
  EXPECT_EQ(fs::file_size(path("s")), 12u);  // not grown, as torch.from_file would
  EXPECT_THROW_MSG(MemoryMappedTensor::from_filename(path("s"), at::kFloat, {-1}), c10::ValueError,
                   "negative dim");
  EXPECT_THROW_MSG(MemoryMappedTensor::from_filename(dir_.string(), at::kFloat, {1}), c10::Error,
                   dir_.string() + ": Is a directory");
}

TEST_F(Memmap, RefusesTensorsThatCannotBeMapped) {
  at::Tensor sparse = at::eye(3).to_sparse();
  EXPECT_THROW_MSG(MemoryMappedTensor::from_tensor(sparse, path("sp")), c10::TypeError, "Sparse");
  EXPECT_THROW_MSG(MemoryMappedTensor::from_tensor(at::ones({2}).requires_grad_(), path("g")),
                   c10::Error, "requires grad");
  EXPECT_FALSE(fs::exists(path("sp")));
}

TEST_F(Memmap, TensorDictRoundTrip) {
  TensorDict td({{"a", at::arange(6, at::kFloat).reshape({2, 3})},
                 {{"b", "c"}, at::tensor({1, 2}, at::kShort)},
                 {"flag", at::tensor({1, 0}).to(at::kBool)}},
                {2});
  td.set_non_tensor("s", "hello");
  td.set_non_tensor({"b", "cfg"}, JsonValue::map({{"x", JsonValue::list({1, 2.5, nullptr})}}));
  TensorDict m = memmap(td, dir_.string());
  EXPECT_TRUE(m.is_locked());
  EXPECT_TRUE(is_memmap(m));
  EXPECT_FALSE(is_memmap(td));
  EXPECT_EQ(m.device(), at::Device(at::kCPU));
  EXPECT_EQ(memmap_filename(m.get({"b", "c"}).tensor()), (dir_ / "b" / "c.memmap").string());
  EXPECT_EQ(read_all(path("a.memmap")), bytes_of(td.get("a").tensor()));
  EXPECT_EQ(m.get_non_tensor("s"), JsonValue("hello"));

  const std::string meta = read_all(path("meta.json"));
  EXPECT_EQ(meta,
            "{\"a\": {\"device\": \"cpu\", \"shape\": [2, 3], \"dtype\": \"torch.float32\", "
            "\"is_nested\": false}, \"b\": {\"type\": \"TensorDict\"}, \"flag\": {\"device\": "
            "\"cpu\", \"shape\": [2], \"dtype\": \"torch.bool\", \"is_nested\": false}, \"s\": "
            "{\"type\": \"NonTensorData\"}, \"shape\": [2], \"device\": \"cpu\", \"_type\": "
            "\"<class 'tensordict._td.TensorDict'>\", \"_format_version\": 1, \"_class\": "
            "\"tensordict:TensorDict\"}");
  EXPECT_EQ(read_all(path("s/meta.json")),
            "{\"_type\": \"<class 'tensordict.tensorclass.NonTensorData'>\", \"data\": \"hello\", "
            "\"_metadata\": null, \"_is_non_tensor\": true}");

  TensorDict back = load_memmap(dir_.string());
  EXPECT_FALSE(back.is_locked());
  EXPECT_EQ(back.batch_size(), at::IntArrayRef({2}));
  EXPECT_TRUE(back.allclose(td));
  EXPECT_EQ(back.get({"b", "c"}).tensor().scalar_type(), at::kShort);
  EXPECT_EQ(back.get_non_tensor({"b", "cfg"}), td.get_non_tensor({"b", "cfg"}));
  EXPECT_EQ(back.get_non_tensor("s").as_string(), "hello");
  EXPECT_TRUE(is_memmap(back.get("a").tensor()));
  // A write through the loaded TensorDict reaches the file the first one maps.
  back.get("a").tensor().fill_(9);
  EXPECT_EQ(m.get("a").tensor().sum().item<float>(), 54.f);
}

TEST_F(Memmap, InPlaceConvertsTheLeavesOfTheSameHandles) {
  TensorDict td({{"x", at::ones({3})}, {{"n", "y"}, at::zeros({3, 2})}}, {3});
  TensorDict nested = td.get("n").tensordict();
  TensorDict& out = memmap_(td, dir_.string());
  EXPECT_TRUE(&out == &td);
  EXPECT_TRUE(td.is_locked());
  EXPECT_TRUE(is_memmap(td));
  EXPECT_TRUE(is_memmap(nested.get("y").tensor()));  // the nested handle was converted
  td.get("x").tensor()[0] = 5;
  EXPECT_EQ(MemoryMappedTensor::from_filename(path("x.memmap"), at::kFloat, {3})[0].item<float>(),
            5.f);
  // Again to the same place: the leaves already map those files and are kept.
  at::Tensor before = td.get("x").tensor();
  memmap_(td, dir_.string());
  EXPECT_TRUE(td.get("x").tensor().is_same(before));
  td.unlock_();
  EXPECT_FALSE(is_memmap(td));
}

TEST_F(Memmap, LikeMakesZeroFilesOfTheSameLayout) {
  TensorDict td({{"a", at::full({4, 2}, 3.0)}, {{"b", "c"}, at::ones({4}, at::kLong)}}, {4});
  TensorDict z = memmap_like(td, dir_.string());
  EXPECT_TRUE(is_memmap(z));
  EXPECT_EQ(z.get("a").tensor().sum().item<double>(), 0.0);
  EXPECT_EQ(z.get({"b", "c"}).tensor().scalar_type(), at::kLong);
  EXPECT_EQ(fs::file_size(path("b/c.memmap")), 32u);
  EXPECT_EQ(td.get("a").tensor().sum().item<double>(), 24.0);  // the source is unchanged
  TensorDict back = load_memmap(dir_.string());
  EXPECT_EQ(back.get("a").tensor().sizes(), at::IntArrayRef({4, 2}));
}

TEST_F(Memmap, WithoutAPrefixTheLeavesAreAnonymousMappings) {
  TensorDict m = memmap(TensorDict({{"a", at::arange(3)}}));
  EXPECT_TRUE(is_memmap(m.get("a").tensor()));
  EXPECT_EQ(memmap_filename(m.get("a").tensor()), std::nullopt);
  EXPECT_TRUE(at::equal(m.get("a").tensor(), at::arange(3)));
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(Memmap, ConsolidateKeepsTheValuesOfMappedLeaves) {
  TensorDict m = memmap(
      TensorDict({{"a", at::arange(4, at::kFloat)}, {"b", at::ones({4, 2})}}, {4}), dir_.string());
  TensorDict c = consolidate(m);
  EXPECT_TRUE(c.allclose(m));
  EXPECT_FALSE(is_memmap(c.get("a").tensor()));  // copied into the flat storage
}

TEST_F(Memmap, UnsafeAndReservedKeysAreRefusedBeforeAnythingIsWritten) {
  for (const std::string key : {"a/b", "..", "", "x y", "50%", "q?", "shape", "_type"}) {
    TensorDict td({{"ok", at::ones({1})}, {{"n", key}, at::ones({1})}});
    EXPECT_THROW_MSG(memmap(td, dir_.string()), c10::ValueError, "('n', '" + key + "')");
  }
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(Memmap, LoadRefusesBadMetadataNamingPathAndKey) {
  memmap(TensorDict({{"a", at::ones({2, 2})}, {{"n", "b"}, at::ones({2})}}, {2}), dir_.string());
  const std::string meta = path("meta.json");
  const std::string good = read_all(meta);
  auto with = [&](const std::string& from, const std::string& to) {
    std::string text = good;
    text.replace(text.find(from), from.size(), to);
    write_file(meta, text);
  };
  with("torch.float32", "torch.evil");
  EXPECT_THROW_MSG(load_memmap(dir_.string()), c10::ValueError, "unknown dtype 'torch.evil'");
  with("[2, 2]", "[2, -2]");
  EXPECT_THROW_MSG(load_memmap(dir_.string()), c10::ValueError, meta + ": key 'a'");
  with("[2, 2]", "[2, 3]");  // the file is too small for it
  EXPECT_THROW_MSG(load_memmap(dir_.string()), c10::Error, "too few");
  with("\"a\": {", "\"../a\": {");
  EXPECT_THROW_MSG(load_memmap(dir_.string()), c10::ValueError, "'../a' is not a safe file name");
  with("\"type\": \"TensorDict\"", "\"type\": \"LazyStackedTensorDict\"");
  EXPECT_THROW_MSG(load_memmap(dir_.string()), c10::ValueError, "LazyStackedTensorDict");
  with("\"_format_version\": 1", "\"_format_version\": 9");
  EXPECT_THROW_MSG(load_memmap(dir_.string()), c10::ValueError, "format version 9");
  {
    std::string text = good;
    text.replace(text.find("tensordict._td.TensorDict"), 25, "x.Y");
    text.replace(text.find("tensordict:TensorDict"), 21, "x:Y");
    write_file(meta, text);
    EXPECT_THROW_MSG(load_memmap(dir_.string()), c10::ValueError, "does not hold a TensorDict");
  }
  write_file(meta, good.substr(0, 20));
  EXPECT_THROW_MSG(load_memmap(dir_.string()), c10::ValueError, meta + " is not valid JSON");
  write_file(meta, good);
  fs::remove(path("n/b.memmap"));
  EXPECT_THROW_MSG(load_memmap(dir_.string()), c10::Error, path("n/b.memmap"));
  EXPECT_THROW_MSG(load_memmap(path("missing")), c10::Error, path("missing/meta.json"));
}

// A load reaches every file from the folder it was given, never through a link, and opens
// only regular files and directories (docs/reliability.md).
TEST_F(Memmap, LoadFollowsNoLinkAndOpensOnlyRegularFiles) {
  const TensorDict td({{"a", at::ones({2})}, {{"n", "b"}, at::ones({2})}}, {2});
  write_file(path("outside"), std::string(8, 'x'));
  auto fresh = [&](const std::string& name) {
    memmap(td, path(name));
    return path(name);
  };
  std::string d = fresh("leaf");
  fs::remove(d + "/a.memmap");
  fs::create_symlink(path("outside"), d + "/a.memmap");
  EXPECT_THROW_MSG(load_memmap(d), c10::Error, d + "/a.memmap is a symbolic link");
  d = fresh("level");
  fs::rename(d + "/n", path("n_elsewhere"));
  fs::create_directory_symlink(path("n_elsewhere"), d + "/n");
  EXPECT_THROW_MSG(load_memmap(d), c10::Error, d + "/n is a symbolic link");
  d = fresh("meta");
  fs::rename(d + "/meta.json", path("m.json"));
  fs::create_symlink(path("m.json"), d + "/meta.json");
  EXPECT_THROW_MSG(load_memmap(d), c10::Error, d + "/meta.json is a symbolic link");
  for (const char* name : {"meta.json", "a.memmap", "n/meta.json"}) {
    d = fresh(std::string("fifo_") + (name[0] == 'n' ? "n" : name));
    fs::remove(d + "/" + name);
    ASSERT_EQ(::mkfifo((d + "/" + name).c_str(), 0600), 0);
    EXPECT_THROW_MSG(load_memmap(d), c10::Error, d + "/" + name + " is not a regular file");
  }
  EXPECT_EQ(read_all(path("outside")), std::string(8, 'x'));
}

// meta.json costs memory within a bound: a non-tensor value is measured before it is built.
TEST_F(Memmap, NonTensorValuesAreBudgetedBeforeTheyAreBuilt) {
  TensorDict big;
  big.set_non_tensor("v", JsonValue::list({1}));
  memmap(big, path("big"));
  std::string text = read_all(path("big/v/meta.json"));
  std::string many = "[1";
  for (int i = 0; i < 3'000'000; ++i) many += ", 1";
  text.replace(text.find("[1]"), 3, many + "]");
  write_file(path("big/v/meta.json"), text);
  EXPECT_THROW_MSG(load_memmap(path("big")), c10::ValueError, "bytes per byte of meta.json read");
  // A level's entries are loaded as they are read: the first bad one of a million ends it.
  std::string level = "{";
  for (int i = 0; i < 1'000'000; ++i) level += "\"k" + std::to_string(i) + "\": {}, ";
  level += "\"shape\": []}";
  write_file(path("big/meta.json"), level);
  EXPECT_THROW_MSG(load_memmap(path("big")), c10::ValueError, "key 'k0' has no dtype name");
  // A long string costs its bytes: loaded.
  const std::string s(1 << 20, 'x');
  TensorDict ok;
  ok.set_non_tensor("s", s);
  memmap(ok, path("ok"));
  EXPECT_EQ(load_memmap(path("ok")).get_non_tensor("s"), JsonValue(s));
}

TEST_F(Memmap, ExistingFilesAndMappedLeavesFollowTheOptions) {
  TensorDict td({{"a", at::arange(3, at::kFloat)}});
  memmap(td, path("p"));
  EXPECT_THROW_MSG(memmap(td, path("p"), {.existsok = false}), c10::Error,
                   path("p/a.memmap") + " already exists");
  // Leaves mapped to other files need copy_existing to be copied elsewhere.
  TensorDict loaded = load_memmap(path("p"));
  EXPECT_THROW_MSG(memmap(loaded, path("q")), c10::Error, "copy_existing");
  EXPECT_FALSE(fs::exists(path("q/a.memmap")));
  TensorDict copied = memmap(loaded, path("q"), {.copy_existing = true});
  EXPECT_EQ(memmap_filename(copied.get("a").tensor()), path("q/a.memmap"));
  EXPECT_TRUE(copied.allclose(td));
}

TEST_F(Memmap, AReadOnlyFileIsMappedCopyOnWrite) {
  if (::geteuid() == 0) GTEST_SKIP() << "root opens read-only files for writing";
  MemoryMappedTensor::from_tensor(at::ones({2}), path("ro.memmap"));
  fs::permissions(path("ro.memmap"), fs::perms::owner_read);
  at::Tensor t = MemoryMappedTensor::from_filename(path("ro.memmap"), at::kFloat, {2});
  t.fill_(5);  // stays in memory
  EXPECT_EQ(read_all(path("ro.memmap")), bytes_of(at::ones({2})));
  EXPECT_EQ(memmap_filename(t), path("ro.memmap"));
}
