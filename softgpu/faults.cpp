// Failures on request: SOFTGPU_FAIL=name:N[,name:N...] makes the N-th call (from 1, counted per
// process) of each named driver entry point fail; softgpu_fail_call(name, k) makes the k-th
// call of `name` from now fail (k = 1: the next one), for a test that wants a failure at a
// chosen moment. The entry points that honour it are listed in softgpu/README.md; they fail as
// the real driver does when it is out of memory or cannot map (CUDA_ERROR_OUT_OF_MEMORY), and
// take nothing.
#include "instrument.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <mutex>
#include <string>

#define SOFTGPU_EXPORT extern "C" __attribute__((visibility("default")))

namespace softgpu {
namespace {

struct Plan {
  uint64_t calls = 0;            // calls of the entry point so far
  std::multiset<uint64_t> fail;  // call numbers that fail
};

std::mutex g_m;
std::map<std::string, Plan> *g_plans = nullptr;

std::map<std::string, Plan> &plans() {
  // Under g_m. SOFTGPU_FAIL is read at the first use.
  if (!g_plans) {
    g_plans = new std::map<std::string, Plan>();
    const char *spec = getenv("SOFTGPU_FAIL");
    std::string s = spec ? spec : "";
    size_t at = 0;
    while (at < s.size()) {
      size_t end = s.find(',', at);
      if (end == std::string::npos) end = s.size();
      std::string item = s.substr(at, end - at);
      size_t colon = item.rfind(':');
      if (colon != std::string::npos) {
        long n = strtol(item.c_str() + colon + 1, nullptr, 10);
        if (n > 0) (*g_plans)[item.substr(0, colon)].fail.insert((uint64_t)n);
      }
      at = end + 1;
    }
  }
  return *g_plans;
}

} // namespace

bool fail_now(const char *name) {
  std::lock_guard<std::mutex> l(g_m);
  auto &all = plans();
  auto it = all.find(name);
  if (it == all.end()) return false;
  Plan &p = it->second;
  uint64_t n = ++p.calls;
  auto f = p.fail.find(n);
  if (f == p.fail.end()) return false;
  p.fail.erase(f);
  return true;
}

} // namespace softgpu

// Makes the k-th call of the driver entry point `name` from now fail (k >= 1). Returns 0, or
// -1 for a bad argument.
SOFTGPU_EXPORT int softgpu_fail_call(const char *name, long k) {
  using namespace softgpu;
  if (!name || k < 1) return -1;
  std::lock_guard<std::mutex> l(g_m);
  Plan &p = plans()[name];
  p.fail.insert(p.calls + (uint64_t)k);
  return 0;
}
