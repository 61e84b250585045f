// td_layout: consolidated layouts as files, so that tests/python/test_consolidate_compat.py
// can compare ours with the reference tensordict's, byte for byte, in both directions.
//
//   td_layout consolidate SPEC.json DATA.bin OUT [--threads N]
//       Builds the TensorDict that SPEC describes (leaf bytes from DATA.bin), consolidates it
//       and writes OUT.json (json.dumps order), OUT.sorted.json (sort_keys) and OUT.bin.
//   td_layout rebuild META.json STORAGE.bin OUT
//       Rebuilds a TensorDict from a consolidated pair, checks that every leaf is a view of the
//       storage, and writes OUT.json (its structure, as describe() in the test) and OUT.bin (the
//       leaves' bytes, in that order).
//   td_layout dumps META.json [--sort]
//       Parses metadata (with its transport fields) and prints it again.
// SPEC: node = {"batch_size": [..], "device": str|null, "locked": bool, "entries": [[key, item]]},
// item = node | {"non_tensor": data, "batch_size": [..] (optional: the level's)} |
// {"dtype": "torch.float32", "shape": [..], "offset": byte offset in DATA.bin,
// "ops": [["t", d0, d1] | ["slice", dim, start, stop, step] | ["select", dim, i] |
// ["expand", [..]]]}: the leaf is DATA[offset:] viewed as dtype and shape, then the ops applied.
// Errors: "<Python exception name>: message" on stderr, exit status 2.

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <sstream>

#include "tensordict/consolidate.h"
#include "tensordict/dtypes.h"
#include "tensordict/tensor_dict.h"

namespace {

using namespace tensordict;
using Json = nlohmann::ordered_json;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const void* data, size_t n) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  if (!f) throw std::runtime_error("cannot write " + path);
}

at::Tensor bytes_tensor(const std::string& data) {
  auto t = at::empty({static_cast<int64_t>(data.size())}, at::kByte);
  std::memcpy(t.data_ptr(), data.data(), data.size());
  return t;
}

TensorDict build(const Json& node, const at::Tensor& data) {
  std::vector<TensorDict::Entry> entries;
  for (const auto& e : node.at("entries")) {
    const std::string key = e.at(0).get<std::string>();
    const Json& item = e.at(1);
    if (item.contains("entries")) {
      entries.emplace_back(key, build(item, data));
      continue;
    }
    if (item.contains("non_tensor")) {
      entries.emplace_back(key, NonTensorData(JsonValue::parse(item.at("non_tensor").dump()),
                                              item.value("batch_size", std::vector<int64_t>{})));
      continue;
    }
    const auto dtype = *dtype_from_name(item.at("dtype").get<std::string>());
    const auto shape = item.at("shape").get<std::vector<int64_t>>();
    int64_t numel = 1;
    for (auto d : shape) numel *= d;
    const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
    // A fresh contiguous copy, then the ops: as the Python side builds its tensor.
    at::Tensor t =
        data.narrow(0, item.at("offset").get<int64_t>(), nbytes).clone().view(dtype).view(shape);
    for (const auto& op : item.value("ops", Json::array())) {
      const auto name = op.at(0).get<std::string>();
      if (name == "t") {
        t = t.transpose(op.at(1).get<int64_t>(), op.at(2).get<int64_t>());
      } else if (name == "slice") {
        t = t.slice(op.at(1).get<int64_t>(), op.at(2).get<int64_t>(), op.at(3).get<int64_t>(),
                    op.at(4).get<int64_t>());
      } else if (name == "select") {
        t = t.select(op.at(1).get<int64_t>(), op.at(2).get<int64_t>());
      } else if (name == "expand") {
        t = t.expand(op.at(1).get<std::vector<int64_t>>());
      } else {
        throw std::runtime_error("unknown op " + name);
      }
    }
    entries.emplace_back(key, t);
  }
  std::optional<at::Device> device;
  if (!node.at("device").is_null()) device = at::Device(node.at("device").get<std::string>());
  return TensorDict(std::move(entries), node.at("batch_size").get<std::vector<int64_t>>(), device);
}

Json describe(const TensorDict& td, const at::Tensor& storage, std::string& blob) {
  Json entries = Json::array();
  for (const auto& [key, value] : td.entries()) {
    if (value.is_tensordict()) {
      entries.push_back({key, describe(value.tensordict(), storage, blob)});
      continue;
    }
    if (value.is_non_tensor()) {
      const NonTensorData& nt = value.non_tensor();
      entries.push_back({key,
                         {{"non_tensor", Json::parse(nt.data().dump())},
                          {"batch_size", nt.batch_size().vec()},
                          {"device", nt.device() ? Json(nt.device()->str()) : Json(nullptr)}}});
      continue;
    }
    const at::Tensor& t = value.tensor();
    const auto* p = static_cast<const char*>(t.const_data_ptr());
    const auto* s = static_cast<const char*>(storage.const_data_ptr());
    if (t.numel() > 0 && (!t.storage().is_alias_of(storage.storage()) || p < s ||
                          p + t.nbytes() > s + storage.numel())) {
      throw std::runtime_error("leaf '" + key + "' is not a view of the storage");
    }
    auto c = t.contiguous();
    Json leaf = {{"dtype", dtype_name(t.scalar_type())},
                 {"shape", t.sizes().vec()},
                 {"offset", blob.size()},
                 {"nbytes", c.nbytes()}};
    blob.append(static_cast<const char*>(c.const_data_ptr()), c.nbytes());
    entries.push_back({key, leaf});
  }
  const auto bs = td.batch_size();
  return {{"batch_size", std::vector<int64_t>(bs.begin(), bs.end())},
          {"device", td.device() ? Json(td.device()->str()) : Json(nullptr)},
          {"locked", td.is_locked()},
          {"consolidated", is_consolidated(td)},
          {"entries", entries}};
}

int run(const std::vector<std::string>& args) {
  if (args.size() >= 4 && args[0] == "consolidate") {
    const Json spec = Json::parse(read_file(args[1]));
    const at::Tensor data = bytes_tensor(read_file(args[2]));
    TensorDict td = build(spec, data);
    if (spec.value("locked", false)) td.lock_();
    ConsolidateOptions options;
    if (args.size() == 6 && args[4] == "--threads") options.num_threads = std::stoi(args[5]);
    TensorDict c = consolidate(td, options);
    const auto meta = consolidated_metadata(c);
    const auto unsorted = metadata_to_json(*meta), sorted = metadata_to_json(*meta, true);
    const at::Tensor storage = consolidated_storage(c);
    write_file(args[3] + ".json", unsorted.data(), unsorted.size());
    write_file(args[3] + ".sorted.json", sorted.data(), sorted.size());
    write_file(args[3] + ".bin", storage.const_data_ptr(), storage.numel());
    return 0;
  }
  if (args.size() == 4 && args[0] == "rebuild") {
    TensorDict td =
        rebuild(metadata_from_json(read_file(args[1])), bytes_tensor(read_file(args[2])));
    std::string blob;
    const std::string text = describe(td, consolidated_storage(td), blob).dump();
    write_file(args[3] + ".json", text.data(), text.size());
    write_file(args[3] + ".bin", blob.data(), blob.size());
    return 0;
  }
  if ((args.size() == 2 || args.size() == 3) && args[0] == "dumps") {
    TransportFields transport;
    const Metadata m = metadata_from_json(read_file(args[1]), &transport);
    std::cout << metadata_to_json(m, args.size() == 3 && args[2] == "--sort", transport);
    return 0;
  }
  std::cerr << "usage: td_layout consolidate SPEC DATA OUT [--threads N] | rebuild META STORAGE OUT"
               " | dumps META [--sort]\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const tensordict::KeyError& e) {
    std::cerr << "KeyError: " << e.what_without_backtrace() << "\n";
  } catch (const c10::ValueError& e) {
    std::cerr << "ValueError: " << e.what_without_backtrace() << "\n";
  } catch (const c10::TypeError& e) {
    std::cerr << "TypeError: " << e.what_without_backtrace() << "\n";
  } catch (const c10::Error& e) {
    std::cerr << "RuntimeError: " << e.what_without_backtrace() << "\n";
  } catch (const std::exception& e) {
    std::cerr << "Error: " << e.what() << "\n";
  }
  return 2;
}
