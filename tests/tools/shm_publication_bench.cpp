// Publication over shared memory, measured (issue 52's figures; docs/publication.md "Shared
// memory"): five processes over Gloo on 127.0.0.1, rank 0 publishing.
//   - 64 MiB (4 leaves) to 4 subscribers until every one holds it, by copy and zero-copy over
//     shared memory, and by copy over the socket (transport "socket"), each against one memcpy
//     of 64 MiB measured in the same run (a ratio);
//   - a 1 KB version's pull p50 (the version published before the pull starts) and a poll that
//     finds nothing new, p50;
//   - torn versions: 3 subscribers (2 by copy, 1 zero-copy) pulling for `seconds` while the
//     publisher publishes 4 KiB versions back to back, every element of each pull checked.
// Medians over the rounds; each round's data checked (every element the round's number).
//   shm_publication_bench [rounds] [seconds]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "tensordict/distributed/process_group.h"
#include "tensordict/distributed/publication.h"
#include "tensordict/distributed/runner.h"
#include "tensordict/tensor_dict.h"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using tensordict::TensorDict;
namespace dist = tensordict::dist;

constexpr int kWorld = 5;
constexpr int64_t kLeaf = int64_t{4} << 20;  // float32: 16 MiB a leaf, 4 leaves

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// This process's memory in MiB: its private pages (Private_Clean + Private_Dirty), and all it
// maps that is resident (Rss, shared pages included).
struct Memory {
  double private_mib = 0, rss_mib = 0;
};
Memory memory() {
  Memory m;
  std::FILE* f = std::fopen("/proc/self/smaps_rollup", "r");
  if (f == nullptr) return m;
  char line[256];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    long long kb = 0;
    if (std::sscanf(line, "Private_Clean: %lld kB", &kb) == 1 ||
        std::sscanf(line, "Private_Dirty: %lld kB", &kb) == 1) {
      m.private_mib += static_cast<double>(kb) / 1024;
    } else if (std::sscanf(line, "Rss: %lld kB", &kb) == 1) {
      m.rss_mib = static_cast<double>(kb) / 1024;
    }
  }
  std::fclose(f);
  return m;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void barrier() {
  std::vector<at::Tensor> t{at::zeros({1})};
  dist::default_group()->allreduce(t)->wait();
}

TensorDict big(float v) {
  return TensorDict({{"a", at::full({kLeaf}, v)},
                     {"b", at::full({kLeaf}, v)},
                     {"c", at::full({kLeaf}, v)},
                     {"d", at::full({kLeaf}, v)}},
                    {});
}

void fill(TensorDict& td, float v) {
  for (const char* k : {"a", "b", "c", "d"}) td.get(k).tensor().fill_(v);
}

bool holds(const TensorDict& td, float v) {
  for (const char* k : {"a", "b", "c", "d"}) {
    if (!td.get(k).tensor().eq(v).all().item<bool>()) return false;
  }
  return true;
}

// Rank 0 gathers each subscriber's time of holding the round's version (CLOCK_MONOTONIC is
// one clock for every process of the host).
int64_t latest_from_subscribers() {
  int64_t latest = 0;
  for (int r = 1; r < kWorld; ++r) {
    std::vector<at::Tensor> t{at::zeros({1}, at::kLong)};
    dist::default_group()->recv(t, r, 77)->wait();
    latest = std::max(latest, t[0].item<int64_t>());
  }
  return latest;
}

void report_time(int64_t t) {
  std::vector<at::Tensor> v{at::full({1}, t, at::kLong)};
  dist::default_group()->send(v, 0, 77)->wait();
}

// One memcpy of 64 MiB (into memory already touched), measured on rank 0 before the rounds
// (between them, the subscribers still check the last round's data).
std::vector<double>& memcpy_times() {
  static std::vector<double> ms;
  return ms;
}
void measure_memcpy() {
  static const at::Tensor from = at::full({4 * kLeaf}, 1.0f), to = at::zeros({4 * kLeaf});
  const auto t0 = Clock::now();
  to.copy_(from);
  memcpy_times().push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
}

// One way of moving 64 MiB: `rounds` rounds, the median time until every subscriber holds it.
double fan_out(int rank, int rounds, const std::string& transport, bool zero_copy, float base) {
  TensorDict td = big(0);
  const Memory before = memory();  // with its TensorDict
  std::optional<dist::Publisher> pub;
  std::optional<dist::Subscriber> sub;
  if (rank == 0) {
    pub.emplace(dist::PublisherOptions{.max_slots = 3, .transport = transport});
  } else {
    sub.emplace(dist::SubscriberOptions{.src = 0, .transport = transport});
  }
  std::vector<double> ms;
  constexpr int kWarmUp = 3;  // every slot written once, the subscribers' mappings made
  for (int round = 1 - kWarmUp; round <= rounds; ++round) {
    const float v = base + static_cast<float>(round + kWarmUp);
    if (rank == 0) fill(td, v);
    barrier();
    if (rank == 0) {
      const int64_t t0 = now_ns();
      pub->publish(td, 30s);
      const int64_t done = latest_from_subscribers();
      if (round > 0) ms.push_back(static_cast<double>(done - t0) / 1e6);
    } else {
      const auto got = sub->pull(td, {.timeout = 30s, .zero_copy = zero_copy});
      report_time(now_ns());
      if (!got || !holds(td, v)) {
        std::fprintf(stderr, "rank %d: round %d not whole\n", rank, round);
        std::exit(2);
      }
    }
  }
  const Memory after = memory();
  if (rank <= 1) {
    std::printf(
        "  memory (%s%s), rank %d beyond its TensorDict: private %+.1f MiB, resident "
        "%+.1f MiB (max_slots 3 x 64 MiB = 192 MiB)\n",
        transport.c_str(), zero_copy ? ", zero-copy" : "", rank,
        after.private_mib - before.private_mib, after.rss_mib - before.rss_mib);
    std::fflush(stdout);
  }
  barrier();
  if (rank != 0) {
    const std::string t = sub->transport();
    if (t != transport && !(transport == "auto" && t == "shm")) {
      std::fprintf(stderr, "rank %d: transport %s\n", rank, t.c_str());
      std::exit(2);
    }
  }
  return rank == 0 ? median(ms) : 0;
}

// Rank 0 publishes 4 KiB versions back to back for `seconds`, then one whose elements are
// negative (the last); ranks 1 and 2 pull by copy, rank 3 zero-copy, each checking that every
// element of what it pulled is its version's.
void torn_check(int rank, double seconds) {
  if (rank == 0) {
    dist::Publisher pub({.max_slots = 4, .subscribers = {1, 2, 3}});
    TensorDict td({{"w", at::zeros({1024})}}, {});
    const auto end = Clock::now() + std::chrono::duration<double>(seconds);
    int64_t v = 0;
    while (Clock::now() < end) {
      td.get("w").tensor().fill_(static_cast<float>(++v));
      pub.publish(td, 10s);
    }
    td.get("w").tensor().fill_(-static_cast<float>(++v));
    pub.publish(td, 10s);
    barrier();
    std::printf("torn check: %lld versions published back to back in %.0f s\n",
                static_cast<long long>(v), seconds);
    std::fflush(stdout);
    barrier();
    return;
  }
  if (rank == 4) {
    barrier();
    barrier();
    return;
  }
  dist::Subscriber sub({.src = 0});
  TensorDict td({{"w", at::zeros({1024})}}, {});
  int64_t pulls = 0, torn = 0;
  for (;;) {
    const auto v = sub.pull(td, {.timeout = 30s, .zero_copy = rank == 3});
    if (!v) std::exit(2);
    ++pulls;
    const at::Tensor w = td.get("w").tensor();
    const float first = w[0].item<float>();
    const bool last = first < 0;
    torn += !w.eq(last ? -static_cast<float>(*v) : static_cast<float>(*v)).all().item<bool>();
    if (last) break;
  }
  barrier();
  std::printf("torn check: rank %d (%s%s): %lld pulls, %lld torn\n", rank, sub.transport().c_str(),
              rank == 3 ? ", zero-copy" : "", static_cast<long long>(pulls),
              static_cast<long long>(torn));
  std::fflush(stdout);
  barrier();
}

void bench(int rank, int, int rounds, double seconds) {
  at::set_num_threads(1);
  if (rank == 0) {
    for (int i = 0; i < 15; ++i) measure_memcpy();
  }
  const double copy = fan_out(rank, rounds, "auto", false, 100);
  const double zero = fan_out(rank, rounds, "auto", true, 200);
  const double socket = fan_out(rank, rounds, "socket", false, 300);
  if (rank == 0) {
    const double memcpy_ms = median(memcpy_times());
    std::printf("one memcpy of 64 MiB: %.2f ms (median of 15, before the rounds)\n", memcpy_ms);
    std::printf("64 MiB to 4 subscribers, until each holds it (median of %d rounds):\n", rounds);
    std::printf("  shared memory, by copy:   %8.2f ms  %5.2fx memcpy  (goal 3x)\n", copy,
                copy / memcpy_ms);
    std::printf("  shared memory, zero-copy: %8.2f ms  %5.2fx memcpy  (goal 1.5x)\n", zero,
                zero / memcpy_ms);
    std::printf(
        "  socket (Gloo), by copy:   %8.2f ms  %5.2fx memcpy; shared memory by copy "
        "%.1fx faster, zero-copy %.1fx (goal 10x)\n",
        socket, socket / memcpy_ms, socket / copy, socket / zero);
    std::fflush(stdout);
  }
  // A 1 KB version: rank 1 times its pulls (the version published before each) and its polls.
  std::optional<dist::Publisher> pub;
  std::optional<dist::Subscriber> sub;
  if (rank == 0) pub.emplace(dist::PublisherOptions{.max_slots = 3, .subscribers = {1}});
  if (rank == 1) sub.emplace(dist::SubscriberOptions{.src = 0});
  TensorDict small({{"w", at::zeros({256})}}, {});
  constexpr int kPulls = 2000, kPolls = 20000;
  std::vector<double> pull_us, poll_us;
  for (int i = 1; i <= kPulls; ++i) {
    if (rank == 0) {
      small.get("w").tensor().fill_(static_cast<float>(i));
      pub->publish(small);
    }
    if (rank <= 1) {
      std::vector<at::Tensor> t{at::zeros({1})};
      if (rank == 0) {
        dist::default_group()->send(t, 1, 78)->wait();
        dist::default_group()->recv(t, 1, 79)->wait();
      }
      if (rank == 1) {
        dist::default_group()->recv(t, 0, 78)->wait();
        const auto t0 = Clock::now();
        const auto got = sub->pull(small, {.timeout = 10s});
        const auto t1 = Clock::now();
        dist::default_group()->send(t, 0, 79)->wait();  // pulled: the next may be published
        if (got != i || !small.get("w").tensor().eq(static_cast<float>(i)).all().item<bool>()) {
          std::fprintf(stderr, "1 KB pull %d: got %lld, holding %f (%s)\n", i,
                       static_cast<long long>(got.value_or(-1)),
                       small.get("w").tensor()[0].item<float>(), sub->transport().c_str());
          std::exit(2);
        }
        if (i > 10) pull_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
    }
  }
  if (rank == 1) {
    for (int i = 0; i < kPolls; ++i) {
      const auto t0 = Clock::now();
      const auto got = sub->pull(small, {.timeout = 0ms});
      const auto t1 = Clock::now();
      if (got) std::exit(2);
      poll_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    std::printf("1 KB pull over shared memory (%s): p50 %.2f us (goal 20 us), of %d\n",
                sub->transport().c_str(), median(pull_us), static_cast<int>(pull_us.size()));
    std::printf("a poll that finds nothing new: p50 %.3f us (goal 2 us), of %d\n", median(poll_us),
                kPolls);
    std::fflush(stdout);
  }
  barrier();
  sub.reset();
  pub.reset();
  barrier();  // that publisher closed before the next one's subscribers ask
  torn_check(rank, seconds);
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 7;
  const double seconds = argc > 2 ? std::atof(argv[2]) : 10;
  dist::run([rounds, seconds](int rank, int world) { bench(rank, world, rounds, seconds); }, kWorld,
            {.timeout = std::chrono::minutes(8), .group_timeout = std::chrono::seconds(120)});
  return 0;
}
