// Which copy of the CPU kernels runs (csrc/cpu/isa.h). Compiled without ISA flags, like everything
// outside csrc/cpu/isa/, so it runs on any CPU and can tell what this one supports.
#include "isa.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

#if defined(FLASHOP_CPU_X86_ISAS)
#include <cpuid.h>

#include <cstdint>
#endif

namespace flashop::cpu {
namespace {

#if defined(FLASHOP_CPU_X86_ISAS)
// The register state the OS saves across context switches (XCR0): a CPU's AVX or AVX-512 registers are
// usable only where it saves them. libgcc's and compiler-rt's cpu_supports fold this in already; checked
// here as well, since a wrong answer is a crash rather than a slowdown.
uint64_t os_saved_state() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_OSXSAVE)) return 0;
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t{hi} << 32) | lo;
}
constexpr uint64_t kAvxState = 0x6;      // XMM and YMM registers
constexpr uint64_t kAvx512State = 0xe6;  // and the opmask registers and both halves of the ZMM registers

bool has_f16c() {  // read directly: "f16c" is no __builtin_cpu_supports name before GCC 11
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
}

// Every feature that a copy's flags let the compiler use: -mavx2 implies AVX, SSE4.2 and POPCNT; the
// AVX-512 copy also gets the AVX2 copy's (every AVX-512 CPU has them).
bool avx2_supported() {
  __builtin_cpu_init();
  return (os_saved_state() & kAvxState) == kAvxState && __builtin_cpu_supports("popcnt") &&
         __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("avx") && __builtin_cpu_supports("avx2") &&
         __builtin_cpu_supports("fma") && has_f16c();
}

bool avx512_supported() {
  return avx2_supported() && (os_saved_state() & kAvx512State) == kAvx512State &&
         __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#endif

bool any_cpu() { return true; }

struct Isa {
  const char* name;  // as FLASHOP_CPU_ISA spells it
  bool (*supported)();
  void (*forward)(const AttentionParams&, at::ScalarType);
  void (*backward)(const BackwardParams&, at::ScalarType);
};

// The copies in this build, generic first, best last.
const Isa kIsas[] = {
    {"default", any_cpu, isa_default::forward, isa_default::backward},
#if defined(FLASHOP_CPU_X86_ISAS)
    {"avx2", avx2_supported, isa_avx2::forward, isa_avx2::backward},
    {"avx512", avx512_supported, isa_avx512::forward, isa_avx512::backward},
#endif
};

std::string join(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& name : names) s += (s.empty() ? "" : ", ") + name;
  return s;
}

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

const Isa& chosen() {
  // A throw leaves it unset: every later call raises the same error.
  static const Isa* const isa = [] {
    const char* requested = std::getenv("FLASHOP_CPU_ISA");
    const std::string name = select_cpu_isa(requested ? requested : "", cpu_isas_supported());
    return &*std::find_if(std::begin(kIsas), std::end(kIsas), [&](const Isa& i) { return name == i.name; });
  }();
  return *isa;
}

}  // namespace

std::vector<std::string> cpu_isas() {
  std::vector<std::string> names;
  for (const Isa& isa : kIsas) names.emplace_back(isa.name);
  return names;
}

std::vector<std::string> cpu_isas_supported() {
  std::vector<std::string> names;
  for (const Isa& isa : kIsas) {
    if (isa.supported()) names.emplace_back(isa.name);
  }
  return names;
}

std::string select_cpu_isa(const std::string& requested, const std::vector<std::string>& supported) {
  TORCH_CHECK(!supported.empty(), "flashop: no CPU instruction set given as supported");
  if (requested.empty()) return supported.back();
  std::string name = requested;
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  const std::vector<std::string> built = cpu_isas();
  TORCH_CHECK(contains(built, name), "FLASHOP_CPU_ISA=", requested,
              ": unknown instruction set; flashop's CPU kernels are built for ", join(built),
              ", and this CPU supports ", join(supported));
  TORCH_CHECK(contains(supported, name), "FLASHOP_CPU_ISA=", requested, ": this CPU does not support ", name,
              "; it supports ", join(supported));
  return name;
}

std::string cpu_isa() { return chosen().name; }

void forward(const AttentionParams& p, at::ScalarType dtype) { chosen().forward(p, dtype); }

void backward(const BackwardParams& p, at::ScalarType dtype) { chosen().backward(p, dtype); }

}  // namespace flashop::cpu
