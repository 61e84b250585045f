// Our TensorDictPipe between two processes, for benchmarks/pipe_bench.py, which runs it beside
// ucx_perftest, the reference's pipe and a raw Gloo send on the same transports (UCX_TLS as the
// caller sets it). The process forks: the parent listens, the child connects.
//
//   pipe_bench lat BYTES ROUNDS   round trips of a consolidated TensorDict of BYTES bytes: the
//                                 child sends, the parent receives and sends it back.
//   pipe_bench bw BYTES ROUNDS    the child streams ROUNDS such TensorDicts, the parent
//                                 receives them and answers with one byte after the last.
//
// Prints one JSON line: {"mode", "bytes", "rounds", "median_us" (lat: one round trip; bw: one
// message, total time / rounds), "samples"}. Every received value is checked against what was
// sent; a mismatch exits 1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/testing.h"
#include "tensordict/consolidate.h"
#include "tensordict/pipe/pipe.h"

using tensordict::TensorDict;
using tensordict::TestKey;
using tensordict::pipe::Pipe;
using tensordict::pipe::PipeOptions;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kWarmup = 20;

TensorDict message(int64_t bytes) {
  return tensordict::consolidate(TensorDict({{"x", at::zeros({bytes}, at::kByte)}}));
}

uint8_t stamp(const TensorDict& td) { return td.get("x").tensor().data_ptr<uint8_t>()[0]; }

void set_stamp(TensorDict& td, int round) {
  at::Tensor x = td.get("x").tensor();
  x.data_ptr<uint8_t>()[0] = static_cast<uint8_t>(round);
  x.data_ptr<uint8_t>()[x.numel() - 1] = static_cast<uint8_t>(round);
}

bool intact(const TensorDict& td, int round) {
  const at::Tensor x = td.get("x").tensor();
  return x.data_ptr<uint8_t>()[0] == static_cast<uint8_t>(round) &&
         x.data_ptr<uint8_t>()[x.numel() - 1] == static_cast<uint8_t>(round);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The listening side: echoes (lat) or receives and acks (bw).
int serve(Pipe& pipe, const std::string& mode, int rounds) {
  const int total = kWarmup + rounds;
  for (int r = 0; r < total; ++r) {
    TensorDict td = pipe.recv();
    if (!intact(td, r)) {
      std::fprintf(stderr, "pipe_bench: message %d holds %d\n", r, stamp(td));
      return 1;
    }
    if (mode == "lat") pipe.send(td);
    if (mode == "bw" && (r == kWarmup - 1 || r == total - 1)) pipe.send_raw(TestKey{}, "k", 1);
  }
  return 0;
}

int drive(Pipe& pipe, const std::string& mode, int64_t bytes, int rounds) {
  TensorDict td = message(bytes);
  std::vector<double> samples;
  if (mode == "lat") {
    for (int r = 0; r < kWarmup + rounds; ++r) {
      set_stamp(td, r);
      const auto t0 = Clock::now();
      pipe.send(td);
      TensorDict echo = pipe.recv();
      const auto t1 = Clock::now();
      if (!intact(echo, r)) return 1;
      if (r >= kWarmup)
        samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
  } else {
    for (int r = 0; r < kWarmup; ++r) {
      set_stamp(td, r);
      pipe.send(td);
    }
    pipe.recv_raw(TestKey{}, 1);
    const auto t0 = Clock::now();
    for (int r = kWarmup; r < kWarmup + rounds; ++r) {
      set_stamp(td, r);
      pipe.send(td);
    }
    pipe.recv_raw(TestKey{}, 1);
    samples.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() /
                      rounds);
  }
  std::string list;
  for (double s : samples) list += (list.empty() ? "" : ",") + std::to_string(s);
  std::printf(
      "{\"mode\": \"%s\", \"bytes\": %lld, \"rounds\": %d, \"median_us\": %.3f, "
      "\"transports\": \"%s\", \"samples\": [%s]}\n",
      mode.c_str(), static_cast<long long>(bytes), rounds, median(samples),
      pipe.transports().c_str(), list.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 || (std::string(argv[1]) != "lat" && std::string(argv[1]) != "bw")) {
    std::fprintf(stderr, "usage: pipe_bench lat|bw BYTES ROUNDS\n");
    return 2;
  }
  const std::string mode = argv[1];
  const int64_t bytes = std::stoll(argv[2]);
  const int rounds = std::stoi(argv[3]);
  PipeOptions options;
  options.timeout = std::chrono::seconds(120);
  // The port goes to the child through a pipe(2): the listener exists before the fork, its UCX
  // worker after it (UCX state must not cross a fork), so the parent binds first and writes.
  int fds[2];
  if (::pipe(fds) != 0) return 2;
  const pid_t child = ::fork();
  at::set_num_threads(1);
  if (child == 0) {
    ::close(fds[1]);
    int port = 0;
    if (::read(fds[0], &port, sizeof(port)) != sizeof(port)) ::_exit(2);
    Pipe pipe = Pipe::connect("127.0.0.1", port, options);
    const int rc = drive(pipe, mode, bytes, rounds);
    pipe.close();
    std::fflush(stdout);
    ::_exit(rc);
  }
  ::close(fds[0]);
  Pipe pipe = Pipe::listen(0, "127.0.0.1", options);
  const int port = pipe.port();
  if (::write(fds[1], &port, sizeof(port)) != sizeof(port)) return 2;
  int rc = 1;
  try {
    rc = serve(pipe, mode, rounds);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipe_bench: %s\n", e.what());
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  pipe.close();
  return rc != 0 ? rc : (WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}
