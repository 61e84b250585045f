#include "tensordict/distributed/process_group.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>
#include <unordered_map>

#include "core/env.h"
#include "gloo.h"
#include "gloo_errors.h"
#include "tensordict/log.h"
#include "tensordict/transfer_stats.h"

namespace tensordict::dist {

// ---- Group ----------------------------------------------------------------------------------

const ProcessGroupPtr& non_group_member() {
  static const ProcessGroupPtr sentinel = [] {
    auto pg = c10::make_intrusive<c10d::ProcessGroup>(0, 1);
    pg->setGroupDesc("NON_GROUP_MEMBER");
    return pg;
  }();
  return sentinel;
}

void check_group_member(const Group& group, const char* call) {
  TORCH_CHECK_VALUE(group.process_group() != non_group_member(), call,
                    ": this process is not a member of the group: new_group() gave it "
                    "non_group_member() (torch's GroupMember.NON_GROUP_MEMBER). Only the ranks "
                    "passed to new_group() may use the group.");
}

int Group::rank() const {
  check_group_member(*this, "Group::rank");
  TORCH_CHECK(*this, "Group::rank: empty group");
  return process_group_ ? process_group_->getRank() : backend_->getRank();
}

int Group::size() const {
  check_group_member(*this, "Group::size");
  TORCH_CHECK(*this, "Group::size: empty group");
  return process_group_ ? process_group_->getSize() : backend_->getSize();
}

namespace {

int64_t nbytes(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += static_cast<int64_t>(t.nbytes());
  return n;
}

int64_t nbytes(const std::vector<std::vector<at::Tensor>>& lists) {
  int64_t n = 0;
  for (const auto& l : lists) n += nbytes(l);
  return n;
}

// Every message of the process-group channel goes through here: counted, and logged at debug.
void count(const char* what, bool sent, int64_t bytes, int peer = -1, int tag = -1) {
  ::tensordict::detail::count_messages(Channel::kProcessGroup, sent, 1, bytes);
  if (!log_enabled(LogLevel::kDebug)) return;
  std::string line = c10::str("c10d ", what);
  if (peer >= 0) line += c10::str(sent ? " to rank " : " from rank ", peer);
  if (tag >= 0) line += c10::str(", tag ", tag);
  log(LogLevel::kDebug, c10::str(line, ": ", bytes, " bytes"));
}

// Gloo's posting of a send or receive raises at once, untyped, when the pair already failed
// (the peer died before this message was posted): a PeerLostError then, as the waits raise.
template <typename Post>
WorkPtr posted(const char* what, int peer, int tag, Post&& post) {
  try {
    return post();
  } catch (const std::exception& e) {
    detail::rethrow_lost(e, c10::str("lost the connection to rank ", peer, " while posting a ",
                                     what, " on tag ", tag));
  }
}

}  // namespace

WorkPtr Group::send(std::vector<at::Tensor>& tensors, int dst, int tag) const {
  check_group_member(*this, "send");
  count("send", true, nbytes(tensors), dst, tag);
  return posted("send", dst, tag, [&] {
    return process_group_ ? process_group_->send(tensors, dst, tag)
                          : backend_->send(tensors, dst, tag);
  });
}

WorkPtr Group::recv(std::vector<at::Tensor>& tensors, int src, int tag) const {
  check_group_member(*this, "recv");
  count("recv", false, nbytes(tensors), src, tag);
  return posted("receive", src, tag, [&] {
    return process_group_ ? process_group_->recv(tensors, src, tag)
                          : backend_->recv(tensors, src, tag);
  });
}

WorkPtr Group::broadcast(std::vector<at::Tensor>& tensors, int root) const {
  check_group_member(*this, "broadcast");
  count("broadcast", root == rank(), nbytes(tensors));
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  return process_group_ ? process_group_->broadcast(tensors, opts)
                        : backend_->broadcast(tensors, opts);
}

WorkPtr Group::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                         std::vector<at::Tensor>& inputs) const {
  check_group_member(*this, "allgather");
  count("allgather", true, nbytes(inputs));
  count("allgather", false, nbytes(outputs));
  return process_group_ ? process_group_->allgather(outputs, inputs)
                        : backend_->allgather(outputs, inputs);
}

WorkPtr Group::scatter(std::vector<at::Tensor>& outputs,
                       std::vector<std::vector<at::Tensor>>& inputs, int root) const {
  check_group_member(*this, "scatter");
  if (root == rank()) count("scatter", true, nbytes(inputs));
  c10d::ScatterOptions opts;
  opts.rootRank = root;
  count("scatter", false, nbytes(outputs));
  return process_group_ ? process_group_->scatter(outputs, inputs, opts)
                        : backend_->scatter(outputs, inputs, opts);
}

WorkPtr Group::gather(std::vector<std::vector<at::Tensor>>& outputs,
                      std::vector<at::Tensor>& inputs, int root) const {
  check_group_member(*this, "gather");
  count("gather", true, nbytes(inputs));
  if (root == rank()) count("gather", false, nbytes(outputs));
  c10d::GatherOptions opts;
  opts.rootRank = root;
  return process_group_ ? process_group_->gather(outputs, inputs, opts)
                        : backend_->gather(outputs, inputs, opts);
}

WorkPtr Group::allreduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) const {
  check_group_member(*this, "allreduce");
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  count("allreduce", true, nbytes(tensors));
  count("allreduce", false, nbytes(tensors));
  return process_group_ ? process_group_->allreduce(tensors, opts)
                        : backend_->allreduce(tensors, opts);
}

WorkPtr Group::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op, int root) const {
  check_group_member(*this, "reduce");
  count("reduce", root != rank(), nbytes(tensors));
  c10d::ReduceOptions opts;
  opts.reduceOp = op;
  opts.rootRank = root;
  return process_group_ ? process_group_->reduce(tensors, opts) : backend_->reduce(tensors, opts);
}

namespace {

// ---- the registry (torch's _world) ----------------------------------------------------------

struct Registered {
  ProcessGroupPtr group;
  std::vector<int64_t> global_ranks;              // by group rank
  std::unordered_map<int64_t, int64_t> to_group;  // global rank -> group rank
};

struct World {
  std::mutex mutex;
  ProcessGroupPtr default_pg;
  c10::intrusive_ptr<c10d::Store> default_store;  // already under the "default_pg" prefix
  std::string backend;
  std::chrono::milliseconds timeout{kDefaultGroupTimeout};
  std::string gloo_hostname;
  int64_t group_count = 0;                                 // names groups "0", "1", ... like torch
  std::map<const c10d::ProcessGroup*, Registered> groups;  // subgroups only
};

World& world() {
  static World* w = new World();  // leaked on purpose: ranks may exit with groups alive
  return *w;
}

constexpr const char* kNotInitialized =
    "Default process group has not been initialized, please make sure to call "
    "init_process_group.";

using core::env;

int64_t parse_int(const std::string& text, const std::string& what) {
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK_VALUE(used == text.size() && !text.empty(), "init_process_group: ", what,
                    " must be an integer, got '", text, "'");
  return value;
}

// "key=value&key=value" after a '?' in an init_method URL (torch's _query_to_dict).
std::map<std::string, std::string> split_query(std::string& url) {
  std::map<std::string, std::string> query;
  const auto q = url.find('?');
  if (q == std::string::npos) {
    return query;
  }
  std::string_view rest(url);
  rest.remove_prefix(q + 1);
  while (!rest.empty()) {
    auto amp = rest.find('&');
    auto item = rest.substr(0, amp);
    auto eq = item.find('=');
    if (eq != std::string_view::npos) {
      query.emplace(std::string(item.substr(0, eq)), std::string(item.substr(eq + 1)));
    }
    rest = amp == std::string_view::npos ? std::string_view() : rest.substr(amp + 1);
  }
  url.resize(q);
  return query;
}

c10::intrusive_ptr<c10d::Store> make_tcp_store(const std::string& host, int64_t port, int64_t rank,
                                               int64_t world_size,
                                               std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(port >= 0 && port < 65536, "port must have value from 0 to 65535 but was ",
                    port, ".");
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.numWorkers = static_cast<size_t>(world_size);
  opts.timeout = timeout;
  // torchrun's agent already serves the store; otherwise rank 0 does (torch's
  // _create_c10d_store).
  if (env("TORCHELASTIC_USE_AGENT_STORE") == std::optional<std::string>("True")) {
    opts.isServer = false;
  } else {
    opts.isServer = rank == 0;
    opts.multiTenant = true;
  }
  return c10::make_intrusive<c10d::TCPStore>(host, opts);
}

// torch.distributed.rendezvous: the store, the rank and the world size.
c10::intrusive_ptr<c10d::Store> rendezvous(const InitOptions& options, int64_t& rank,
                                           int64_t& world_size) {
  std::string url = options.init_method;
  auto query = split_query(url);
  auto from = [&](int64_t given, const char* key, const char* var) -> int64_t {
    if (given >= 0) {
      return given;
    }
    if (auto it = query.find(key); it != query.end()) {
      return parse_int(it->second, key);
    }
    if (auto value = env(var)) {
      return parse_int(*value, var);
    }
    C10_THROW_ERROR(ValueError, c10::str("init_process_group: ", key, " not given (pass it, put ",
                                         "it in the init_method query or set ", var, ")"));
  };
  rank = from(options.rank, "rank", "RANK");
  world_size = from(options.world_size, "world_size", "WORLD_SIZE");
  TORCH_CHECK_VALUE(world_size > 0 && rank >= 0 && rank < world_size, "init_process_group: rank ",
                    rank, " is not in [0, world_size = ", world_size, ")");
  if (options.store) {
    return options.store;
  }
  if (url.rfind("file://", 0) == 0) {
    std::string path = url.substr(7);
    TORCH_CHECK_VALUE(!path.empty(), "file:// rendezvous: path missing");
    return c10::make_intrusive<c10d::FileStore>(path, static_cast<int>(world_size));
  }
  if (url.rfind("tcp://", 0) == 0) {
    std::string hostport = url.substr(6);
    auto colon = hostport.rfind(':');
    TORCH_CHECK_VALUE(colon != std::string::npos, "tcp:// rendezvous: port number missing");
    std::string host = hostport.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);  // [::1]
    }
    return make_tcp_store(host, parse_int(hostport.substr(colon + 1), "port"), rank, world_size,
                          options.timeout);
  }
  if (url.rfind("env://", 0) == 0) {
    auto addr = env("MASTER_ADDR");
    auto port = env("MASTER_PORT");
    TORCH_CHECK_VALUE(addr,
                      "Error initializing torch.distributed using env:// rendezvous: "
                      "environment variable MASTER_ADDR expected, but not set");
    TORCH_CHECK_VALUE(port,
                      "Error initializing torch.distributed using env:// rendezvous: "
                      "environment variable MASTER_PORT expected, but not set");
    return make_tcp_store(*addr, parse_int(*port, "MASTER_PORT"), rank, world_size,
                          options.timeout);
  }
  C10_THROW_ERROR(ValueError,
                  c10::str("init_process_group: unsupported init_method '", options.init_method,
                           "' (use env://, tcp://host:port or file:///path)"));
}

// torch's _new_process_group_helper for one device type (CPU): prefixes "<name>/" and "cpu/".
ProcessGroupPtr make_group(const c10::intrusive_ptr<c10d::Store>& store, const std::string& name,
                           int rank, int size, std::chrono::milliseconds timeout,
                           const std::string& backend, const std::string& gloo_hostname) {
  auto prefix_store = c10::make_intrusive<c10d::PrefixStore>(name + "/", store);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(prefix_store, rank, size);
  TORCH_INTERNAL_ASSERT(backend == "gloo");
  auto backend_store = c10::make_intrusive<c10d::PrefixStore>("cpu/", prefix_store);
  auto gloo = detail::make_gloo_backend(backend_store, rank, size, timeout, gloo_hostname);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  pg->setGroupName(name);
  return pg;
}

void check_backend(const std::string& backend) {
  TORCH_CHECK_VALUE(backend == "gloo" && detail::gloo_available(), "init_process_group: backend '",
                    backend, "' is not available in this build (available: gloo)");
}

const Registered* find_registered(World& w, const Group& group) {
  if (!group.process_group()) {
    return nullptr;
  }
  auto it = w.groups.find(group.process_group().get());
  return it == w.groups.end() ? nullptr : &it->second;
}

bool is_default(World& w, const Group& group) {
  return !group || (w.default_pg && group.process_group() == w.default_pg);
}

std::string describe(const Group& group) {
  if (group.process_group()) {
    return c10::str("ProcessGroup '", group.process_group()->getGroupName(), "'");
  }
  return c10::str("Backend ", group.backend()->getBackendName());
}

// The registration of `group`, or nullptr for the default group (which must exist);
// ValueError for a group that new_group() did not make.
const Registered* registered_or_default(World& w, const Group& group, const char* call) {
  check_group_member(group, call);
  if (is_default(w, group)) {
    TORCH_CHECK_VALUE(w.default_pg, kNotInitialized);
    return nullptr;
  }
  const Registered* reg = find_registered(w, group);
  TORCH_CHECK_VALUE(reg, "Group ", describe(group),
                    " is not registered, please create group with new_group");
  return reg;
}

}  // namespace

void init_process_group(const InitOptions& options) {
  check_backend(options.backend);
  {
    std::lock_guard<std::mutex> lock(world().mutex);
    TORCH_CHECK_VALUE(!world().default_pg, "trying to initialize the default process group twice!");
  }
  int64_t rank = -1;
  int64_t world_size = -1;
  auto store = rendezvous(options, rank, world_size);
  store->setTimeout(options.timeout);
  // The same key layout as torch.distributed, so Python ranks can join the group.
  auto default_store = c10::make_intrusive<c10d::PrefixStore>("default_pg", store);

  std::lock_guard<std::mutex> lock(world().mutex);
  World& w = world();
  TORCH_CHECK_VALUE(!w.default_pg, "trying to initialize the default process group twice!");
  auto pg = make_group(default_store, std::to_string(w.group_count), static_cast<int>(rank),
                       static_cast<int>(world_size), options.timeout, options.backend,
                       options.gloo_hostname);
  pg->setGroupDesc("default_pg");
  ++w.group_count;
  w.default_pg = std::move(pg);
  w.default_store = std::move(default_store);
  w.backend = options.backend;
  w.timeout = options.timeout;
  w.gloo_hostname = options.gloo_hostname;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(world().mutex);
  return static_cast<bool>(world().default_pg);
}

ProcessGroupPtr default_group() {
  std::lock_guard<std::mutex> lock(world().mutex);
  TORCH_CHECK_VALUE(world().default_pg, kNotInitialized);
  return world().default_pg;
}

ProcessGroupPtr new_group(std::vector<int64_t> ranks,
                          std::optional<std::chrono::milliseconds> timeout) {
  std::unique_lock<std::mutex> lock(world().mutex);
  World& w = world();
  TORCH_CHECK_VALUE(w.default_pg, kNotInitialized);
  const int64_t world_size = w.default_pg->getSize();
  const int64_t my_rank = w.default_pg->getRank();
  if (ranks.empty()) {
    for (int64_t r = 0; r < world_size; ++r) {
      ranks.push_back(r);
    }
  }
  std::sort(ranks.begin(), ranks.end());
  TORCH_CHECK_VALUE(std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end(),
                    "new_group: ranks must be unique");
  TORCH_CHECK_VALUE(ranks.front() >= 0 && ranks.back() < world_size,
                    "The new group's rank should be within the world_size set by "
                    "init_process_group");
  // Every rank counts the group, members or not, so that names agree everywhere.
  const std::string name = std::to_string(w.group_count++);
  auto me = std::find(ranks.begin(), ranks.end(), my_rank);
  if (me == ranks.end()) {
    return non_group_member();
  }
  auto store = w.default_store;
  auto backend = w.backend;
  auto hostname = w.gloo_hostname;
  auto group_timeout = timeout.value_or(w.timeout);
  lock.unlock();  // the rendezvous blocks on the other members

  auto pg = make_group(store, name, static_cast<int>(me - ranks.begin()),
                       static_cast<int>(ranks.size()), group_timeout, backend, hostname);
  Registered reg{pg, ranks, {}};
  for (size_t i = 0; i < ranks.size(); ++i) {
    reg.to_group.emplace(ranks[i], static_cast<int64_t>(i));
  }
  lock.lock();
  w.groups.emplace(pg.get(), std::move(reg));
  return pg;
}

int64_t get_rank(const Group& group) { return group ? group.rank() : default_group()->getRank(); }

int64_t get_world_size(const Group& group) {
  return group ? group.size() : default_group()->getSize();
}

int64_t get_group_rank(const Group& group, int64_t global_rank) {
  std::lock_guard<std::mutex> lock(world().mutex);
  const Registered* reg = registered_or_default(world(), group, "get_group_rank");
  if (!reg) return global_rank;
  auto it = reg->to_group.find(global_rank);
  TORCH_CHECK_VALUE(it != reg->to_group.end(), "Global rank ", global_rank,
                    " is not part of group ", describe(group));
  return it->second;
}

int64_t get_global_rank(const Group& group, int64_t group_rank) {
  std::lock_guard<std::mutex> lock(world().mutex);
  const Registered* reg = registered_or_default(world(), group, "get_global_rank");
  if (!reg) return group_rank;
  TORCH_CHECK_VALUE(group_rank >= 0 && group_rank < static_cast<int64_t>(reg->global_ranks.size()),
                    "Group rank ", group_rank, " is not part of group ", describe(group));
  return reg->global_ranks[group_rank];
}

std::vector<int64_t> get_process_group_ranks(const Group& group) {
  std::lock_guard<std::mutex> lock(world().mutex);
  World& w = world();
  const Registered* reg = registered_or_default(w, group, "get_process_group_ranks");
  if (!reg) {
    std::vector<int64_t> ranks(w.default_pg->getSize());
    for (size_t i = 0; i < ranks.size(); ++i) {
      ranks[i] = static_cast<int64_t>(i);
    }
    return ranks;
  }
  return reg->global_ranks;
}

BackendPtr make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                             std::chrono::milliseconds timeout, const std::string& gloo_hostname) {
  TORCH_CHECK_VALUE(store, "make_gloo_backend: store is null");
  TORCH_CHECK_VALUE(size > 0 && rank >= 0 && rank < size, "make_gloo_backend: rank ", rank,
                    " is not in [0, size = ", size, ")");
  return detail::make_gloo_backend(store, rank, size, timeout, gloo_hostname);
}

void destroy_process_group(const Group& group) {
  // Every rank may destroy what new_group() gave it: a non-member has nothing to destroy.
  if (group.process_group() == non_group_member()) return;
  std::vector<ProcessGroupPtr> doomed;
  {
    std::lock_guard<std::mutex> lock(world().mutex);
    World& w = world();
    if (is_default(w, group)) {
      TORCH_CHECK_VALUE(w.default_pg, kNotInitialized);
      for (auto& [ptr, reg] : w.groups) {
        doomed.push_back(reg.group);
      }
      doomed.push_back(w.default_pg);
      w.groups.clear();
      w.default_pg.reset();
      w.default_store.reset();
      w.group_count = 0;
    } else {
      auto it = group.process_group() ? w.groups.find(group.process_group().get()) : w.groups.end();
      TORCH_CHECK_VALUE(it != w.groups.end(), "Invalid process group specified");
      doomed.push_back(it->second.group);
      w.groups.erase(it);
    }
  }
  for (auto& pg : doomed) {
    pg->shutdown();
  }
}

}  // namespace tensordict::dist
