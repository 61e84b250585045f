// One rank of benchmarks/hosts_bench.py in C++ (`hosts_bench.py --lang cpp`): the same steps as
// its Python rank_main, through the C++ API (tensordict/distributed/publication.h), so that the
// routes across namespace hosts are measured from C++ as well as from Python. Rank 0 publishes,
// the others pull; the ranks meet through a TCPStore on host 0 (port + 1), not the group's
// collectives (a killed rank would end those). It prints one line, "RESULT {json}", with the
// fields hosts_bench.py's summarize() reads.
//
//   hosts_rank --hosts 5 --per-host 1 --mib 64 --versions 3 --route star,chain --fault none
//              --fault-version 3 --port 29731 --_rank R --rate 400mbit --slow-rate 100mbit
//              --hosts-script scripts/hosts
#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/publication.h"
#include "tensordict/tensor_dict.h"

namespace dist = tensordict::dist;
using namespace std::chrono_literals;

namespace {

constexpr int kFaulty = 1;  // the rank a fault plays on: the chain's first relay

double now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int64_t counter(const char* name) {
  std::ifstream f(std::string("/sys/class/net/eth0/statistics/") + name);
  int64_t v = 0;
  f >> v;
  return v;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, ',');) out.push_back(part);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> a{
      {"--hosts", "5"},         {"--per-host", "1"},        {"--mib", "64"},
      {"--versions", "3"},      {"--route", "star,chain"},  {"--fault", "none"},
      {"--fault-version", "3"}, {"--port", "29731"},        {"--_rank", "0"},
      {"--rate", "400mbit"},    {"--slow-rate", "100mbit"}, {"--hosts-script", "scripts/hosts"}};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!a.count(argv[i])) {
      std::cerr << "hosts_rank: unknown argument " << argv[i] << std::endl;
      return 2;
    }
    a[argv[i]] = argv[i + 1];
  }
  const int rank = std::stoi(a["--_rank"]), hosts = std::stoi(a["--hosts"]);
  const int world = 1 + (hosts - 1) * std::stoi(a["--per-host"]);
  const int versions = std::stoi(a["--versions"]), fault_version = std::stoi(a["--fault-version"]);
  const int port = std::stoi(a["--port"]);
  const int64_t mib = std::stoll(a["--mib"]);
  const std::string fault = a["--fault"];
  const bool counts_rx = 0 < rank && rank < hosts;

  dist::init_process_group({.init_method = "tcp://10.77.0.1:" + std::to_string(port),
                            .rank = rank,
                            .world_size = world});
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port + 1);
  so.isServer = rank == 0;
  so.numWorkers = world;
  so.timeout = 600s;
  c10d::TCPStore store("10.77.0.1", so);
  const auto live = [&](const std::string& route, int v) {
    return world - (route != "star" && fault == "kill" && v >= fault_version ? 1 : 0);
  };
  const auto meet = [&](const std::string& tag, int count) {
    store.add(tag, 1);
    while (store.add(tag, 0) < count) std::this_thread::sleep_for(1ms);
  };

  const int64_t n = (mib << 20) / 4 / 4;  // four float32 leaves
  tensordict::TensorDict td;
  for (int i = 0; i < 4; ++i) td.set("w" + std::to_string(i), at::zeros({n}));
  nlohmann::json out{{"rank", rank}};
  // The floor: one paced send of the same bytes, host 0 to host 1.
  std::vector<at::Tensor> flat{at::zeros({(mib << 20) / 4})}, ack{at::zeros({1})};
  meet("p2p-ready", world);
  const auto group = dist::default_group();
  if (rank == 0) {
    const double t = now();
    group->send(flat, 1, 0)->wait();
    group->recv(ack, 1, 0)->wait();
    const double seconds = now() - t;
    out["p2p_s"] = seconds;
    const std::string text = std::to_string(seconds);
    store.set("p2p", std::vector<uint8_t>(text.begin(), text.end()));
  } else if (rank == 1) {
    group->recv(flat, 0, 0)->wait();
    group->send(ack, 0, 0)->wait();
  }
  meet("p2p-done", world);
  const auto p2p_bytes = store.get("p2p");
  const double p2p = std::stod(std::string(p2p_bytes.begin(), p2p_bytes.end()));

  const auto routes = split(a["--route"]);
  for (size_t channel = 0; channel < routes.size(); ++channel) {
    const std::string& route = routes[channel];
    const bool faulty = route != "star" && fault != "none";
    if (rank == 0) {
      dist::Publisher pub({.max_slots = 2,
                           .channel = static_cast<int64_t>(channel),
                           .transport = "socket",
                           .route = route});
      std::vector<double> starts;
      std::vector<int64_t> tx;
      for (int v = 1; v <= versions; ++v) {
        for (const auto& [key, leaf] : td.items()) leaf.tensor().fill_(v);
        if (faulty && fault == "slow" && v == fault_version) {
          const std::string cmd =
              a["--hosts-script"] + " rate " + std::to_string(kFaulty) + " " + a["--slow-rate"];
          if (std::system(cmd.c_str()) != 0) return 3;
        }
        const int64_t before = counter("tx_bytes");
        meet(route + "-ready-" + std::to_string(v), live(route, v));
        // Every live subscriber's pull waiting first, as in the Python rank.
        const auto until = std::chrono::steady_clock::now() + 5s;
        for (;;) {
          bool all = true;
          for (const auto& s : pub.stats()) {
            all = all && (s.waiting || s.lost || (!s.routed_around.empty() && fault == "kill"));
          }
          if (all || std::chrono::steady_clock::now() >= until) break;
          std::this_thread::sleep_for(1ms);
        }
        starts.push_back(now());
        pub.publish(td);
        meet(route + "-held-" + std::to_string(v), live(route, v));
        tx.push_back(counter("tx_bytes") - before);
      }
      if (faulty && fault == "slow") {
        const std::string cmd =
            a["--hosts-script"] + " rate " + std::to_string(kFaulty) + " " + a["--rate"];
        if (std::system(cmd.c_str()) != 0) return 3;
      }
      nlohmann::json stats = nlohmann::json::array();
      for (const auto& s : pub.stats()) {
        nlohmann::json one;
        one["relayed_from"] = s.relayed_from ? nlohmann::json(*s.relayed_from) : nlohmann::json();
        one["routed_around"] =
            s.routed_around.empty() ? nlohmann::json() : nlohmann::json(s.routed_around);
        stats.push_back(one);
      }
      out[route] = {{"starts", starts}, {"tx", tx}, {"stats", stats}};
      meet(route + "-end", live(route, versions));
      pub.close();
    } else {
      dist::Subscriber sub(
          {.src = 0, .channel = static_cast<int64_t>(channel), .transport = "socket"});
      std::vector<double> held;
      std::vector<int64_t> rx;
      for (int v = 1; v <= versions; ++v) {
        const int64_t before = counter("rx_bytes");
        meet(route + "-ready-" + std::to_string(v), live(route, v));
        if (faulty && rank == kFaulty && v == fault_version) {
          const auto after = std::chrono::duration<double>(0.4 * p2p);
          if (fault == "kill") {
            std::thread([after] {
              std::this_thread::sleep_for(after);
              std::raise(SIGKILL);
            }).detach();
          } else if (fault == "stop") {
            const std::string cmd = "sh -c 'sleep " + std::to_string(after.count()) +
                                    "; kill -STOP " + std::to_string(getpid()) +
                                    "; sleep 3; kill -CONT " + std::to_string(getpid()) + "' &";
            if (std::system(cmd.c_str()) != 0) return 3;
          }
        }
        const auto got = sub.pull(td, {.timeout = 300s, .min_version = v});
        const bool exact = got && *got >= v && td.get("w0").tensor().eq(*got).all().item<bool>();
        if (!exact) {
          std::cerr << "hosts_rank " << rank << ": version " << v << " not held" << std::endl;
          return 4;
        }
        held.push_back(now());
        meet(route + "-held-" + std::to_string(v), live(route, v));
        rx.push_back(counter("rx_bytes") - before);
      }
      out[route] = {{"held", held},
                    {"transport", sub.transport()},
                    {"routed_around", sub.routed_around()},
                    {"rx", counts_rx ? nlohmann::json(rx) : nlohmann::json()}};
      meet(route + "-end", live(route, versions));
    }
  }
  std::cout << "RESULT " << out.dump() << std::endl;
  // Not destroy_process_group(): with a rank killed, Gloo's teardown may wait on it.
  std::_Exit(0);
}
