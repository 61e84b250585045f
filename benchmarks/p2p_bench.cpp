// Point-to-point transfer cost against raw c10d calls, measured in one run on two ranks (Gloo
// over 127.0.0.1). Each timed transfer ends with a small ack from the receiver, so the time is
// sender start -> data fully received -> ack back. Variants alternate transfer by transfer so
// that drift on a shared machine hits them alike; the table shows medians. The last line is
// JSON for benchmarks/p2p_bench.py, which adds the reference tensordict's numbers.
//
//   p2p_bench [--rounds N]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tensordict/consolidate.h"
#include "tensordict/distributed/p2p.h"
#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/runner.h"
#include "tensordict/distributed/tags.h"

using tensordict::TensorDict;
namespace dist = tensordict::dist;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kAckTag = 1 << 30;  // far above the transfers' tags

struct Variant {
  std::string name;
  std::function<void()> send;  // rank 0
  std::function<void()> recv;  // rank 1
  std::function<bool()> check = [] { return true; };  // rank 1, after the last round
};

struct Scenario {
  std::string name;
  int iters;  // timed transfers per variant per round
  std::vector<Variant> variants;  // variants[0] is the floor the others are divided by
};

void wait_all(const std::vector<dist::WorkPtr>& works) {
  for (const auto& w : works) w->wait();
}

std::vector<dist::WorkPtr> raw_post(bool sending, std::vector<at::Tensor>& leaves, int peer) {
  auto pg = dist::default_group();
  std::vector<dist::WorkPtr> works;
  works.reserve(leaves.size());
  for (size_t i = 0; i < leaves.size(); ++i) {
    std::vector<at::Tensor> one{leaves[i]};
    works.push_back(sending ? pg->send(one, peer, static_cast<int>(i))
                            : pg->recv(one, peer, static_cast<int>(i)));
  }
  return works;
}

TensorDict leaves_td(int n, int64_t floats, double value) {
  std::vector<TensorDict::Entry> entries;
  for (int i = 0; i < n; ++i) {
    entries.emplace_back(c10::str("leaf", 1000 + i), at::full({floats}, value));
  }
  return TensorDict(entries, {});
}

std::vector<at::Tensor> tensors_of(const TensorDict& td) {
  std::vector<at::Tensor> out;
  for (auto& [path, t] : dist::wire_order(td)) out.push_back(t);
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

std::vector<Scenario> scenarios(int rank) {
  std::vector<Scenario> out;
  const bool sender = rank == 0;
  // ---- 100 leaves of 1 KB, one message each ----
  {
    auto td = std::make_shared<TensorDict>(leaves_td(100, 256, sender ? 1.0 : 0.0));
    auto raw = std::make_shared<std::vector<at::Tensor>>(tensors_of(leaves_td(100, 256, sender ? 1.0 : 0.0)));
    out.push_back({"per-leaf 100 x 1 KB", 40,
                   {{"raw c10d (100 sends posted, then waited)",
                     [raw] { wait_all(raw_post(true, *raw, 1)); },
                     [raw] { wait_all(raw_post(false, *raw, 0)); },
                     [raw] { return (*raw)[99].eq(1.0).all().item<bool>(); }},
                    {"dist::send / dist::recv", [td] { dist::send(*td, 1); },
                     [td] { dist::recv(*td, 0); },
                     [td] { return (*td == 1.0).all(); }},
                    {"dist::send / recv, pseudo_rand", [td] { dist::send(*td, 1, {.pseudo_rand = true}); },
                     [td] { dist::recv(*td, 0, {.pseudo_rand = true}); }}}});
  }
  // ---- the same 100 KB as one consolidated message ----
  {
    auto plain = std::make_shared<TensorDict>(leaves_td(100, 256, sender ? 2.0 : 0.0));
    auto cons = std::make_shared<TensorDict>(tensordict::consolidate(*plain));
    auto storage = std::make_shared<std::vector<at::Tensor>>(
        std::vector<at::Tensor>{at::empty({100 * 1024}, at::kByte).fill_(sender ? 7 : 0)});
    out.push_back({"consolidated 100 x 1 KB", 40,
                   {{"raw c10d (one 100 KB send)",
                     [storage] { dist::default_group()->send(*storage, 1, 0)->wait(); },
                     [storage] { dist::default_group()->recv(*storage, 0, 0)->wait(); }},
                    {"dist::send(consolidated), consolidated TD",
                     [cons] { dist::send(*cons, 1, {.consolidated = true}); },
                     [cons] { dist::recv(*cons, 0, {.consolidated = true}); },
                     [cons] { return (*cons == 2.0).all(); }},
                    {"dist::send(consolidated), consolidating each time",
                     [plain] { dist::send(*plain, 1, {.consolidated = true}); },
                     [cons] { dist::recv(*cons, 0, {.consolidated = true}); }}}});
  }
  // ---- one 100 MB leaf ----
  {
    const int64_t floats = 25 * 1000 * 1000;
    auto td = std::make_shared<TensorDict>(TensorDict({{"big", at::full({floats}, sender ? 3.0 : 0.0)}}, {}));
    auto raw = std::make_shared<std::vector<at::Tensor>>(
        std::vector<at::Tensor>{at::full({floats}, sender ? 3.0 : 0.0)});
    out.push_back({"1 x 100 MB", 4,
                   {{"raw c10d (one send)", [raw] { dist::default_group()->send(*raw, 1, 0)->wait(); },
                     [raw] { dist::default_group()->recv(*raw, 0, 0)->wait(); }},
                    {"dist::send / dist::recv", [td] { dist::send(*td, 1); },
                     [td] { dist::recv(*td, 0); },
                     [td] { return (*td == 3.0).all(); }}}});
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 7;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::atoi(argv[i + 1]);
  }
  dist::run(
      [rounds](int rank, int) {
        at::set_num_threads(1);
        auto pg = dist::default_group();
        std::vector<at::Tensor> ack{at::zeros({1})};
        auto list = scenarios(rank);
        std::map<std::string, std::vector<double>> times;  // "scenario|variant" -> us
        for (auto& sc : list) {
          for (int round = -1; round < rounds; ++round) {  // round -1 warms up
            // Variants alternate transfer by transfer, so that both see the same machine.
            for (int it = 0; it < sc.iters; ++it) {
              for (auto& v : sc.variants) {
                if (rank == 0) {
                  const auto t0 = Clock::now();
                  v.send();
                  pg->recv(ack, 1, kAckTag)->wait();
                  const double us =
                      std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
                  if (round >= 0) times[sc.name + "|" + v.name].push_back(us);
                } else {
                  v.recv();
                  pg->send(ack, 0, kAckTag)->wait();
                }
              }
            }
          }
          if (rank == 1) {
            for (auto& v : sc.variants) {
              TORCH_CHECK(v.check(), "benchmark data check failed: ", sc.name, " / ", v.name);
            }
          }
        }
        if (rank != 0) return;
        // Tag generation, per tag.
        const int kTags = 1000000;
        int64_t tag = -1, sum = 0;
        const auto t0 = Clock::now();
        for (int i = 0; i < kTags; ++i) sum += (tag = dist::next_tag(tag, true));
        const double ns_per_tag =
            std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / kTags;

        std::printf("\n%-26s %-50s %12s %8s\n", "scenario", "variant", "median us", "ratio");
        std::string json = "{";
        for (auto& sc : list) {
          const double floor = median(times[sc.name + "|" + sc.variants[0].name]);
          for (auto& v : sc.variants) {
            const double m = median(times[sc.name + "|" + v.name]);
            std::printf("%-26s %-50s %12.1f %8.3f\n", sc.name.c_str(), v.name.c_str(), m,
                        m / floor);
            json += c10::str("\"", sc.name, "|", v.name, "\": ", m, ", ");
          }
        }
        std::printf("%-26s %-50s %12.4f\n", "tags", "int_generator, ns per tag", ns_per_tag);
        json += c10::str("\"ns_per_tag\": ", ns_per_tag, ", \"checksum\": ", sum % 7, "}");
        std::printf("JSON %s\n", json.c_str());
        std::fflush(stdout);
      },
      2, {.timeout = std::chrono::minutes(10), .group_timeout = std::chrono::seconds(120)});
  return 0;
}
