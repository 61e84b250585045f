#pragma once
// The passkey of the test hooks in the public headers (TensorDict::set_consolidated_state,
// pipe::Pipe::send_raw / recv_raw): they take a TestKey, which only code that includes this
// header can make. It is never installed, so the hooks are out of users' reach; the project's
// tests, benchmarks and the Python module's test hooks include it. The library only passes the
// key along and never needs the type complete.

namespace tensordict {

class TestKey {
 public:
  TestKey() = default;
};

}  // namespace tensordict
