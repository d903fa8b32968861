// What every kernel family's config shares: the element type and its short name (the first field of
// every config string). Plain C++17: no torch, no CUDA headers.
#pragma once

namespace flashop {

enum class DType : int { kFp16 = 0, kBf16 = 1 };

inline const char* dtype_name(DType t) { return t == DType::kFp16 ? "fp16" : "bf16"; }

}  // namespace flashop
