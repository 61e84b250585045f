// libFuzzer's setup hook, one for every target (and for replay_main.cpp, which calls it too):
// see fuzz::init in fuzz_util.h.
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tensordict::fuzz::init();
  return 0;
}
