// Publication's contract (publication_contract.h) over a pipe's PipeLink (src/pipe/pipe_link.h):
// one TensorDictServer in this process, each connection a Pipe connected to it and the pipe the
// server accepted for it. A pipe has a clean close of its own (its close marker), used for real.

#include <chrono>
#include <memory>
#include <optional>
#include <utility>

#include "pipe/pipe_link.h"
#include "pipe_test_util.h"
#include "publication_contract.h"
#include "tensordict/pipe/pipe.h"
#include "tensordict/pipe/server.h"

namespace publication_contract {
namespace {

namespace tdp = tensordict::pipe;

tdp::PipeOptions options() {
  tdp::PipeOptions o;
  o.timeout = std::chrono::seconds(20);
  return o;
}

// Kept for the life of the process, as the pipes' leftover operations may be.
tdp::TensorDictServer& server() {
  static auto* s = new tdp::TensorDictServer(0, "127.0.0.1", options());
  return *s;
}

struct PipeTransport {
  static constexpr const char* kName = "pipe";
  Connection connect() {
    struct Pipes {
      tdp::Pipe client, accepted;
    };
    tdp::Pipe client = tdp::Pipe::connect("127.0.0.1", server().port(), options());
    std::optional<tdp::Pipe> accepted = server().accept(std::chrono::seconds(20));
    TORCH_CHECK(accepted.has_value(), "the server accepted no client");
    auto pipes = std::make_shared<Pipes>(Pipes{std::move(client), std::move(*accepted)});
    Connection c;
    c.publisher = tdp::detail::pipe_link(pipes->accepted, "Publisher");
    tdp::detail::carry_publication(pipes->accepted);
    c.subscriber = tdp::detail::pipe_link(pipes->client, "Subscriber");
    tdp::detail::carry_publication(pipes->client);
    c.close = [pipes](Side side) {
      (side == Side::kSubscriber ? pipes->client : pipes->accepted).close();
    };
    c.resources = pipes;
    return c;
  }
};

}  // namespace

INSTANTIATE_PUBLICATION_CONTRACT(Pipe, PipeTransport);

}  // namespace publication_contract
