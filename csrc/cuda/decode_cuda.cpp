// flashop._C's split-KV decode (csrc/cuda/decode/): the attention step of flashop::forward_kvcache when a
// sequence has few query rows per KV head. The arguments arrive checked by flashop/kvcache.py (the op's
// rules, index values included); this glue checks what the kernels themselves need (decode_supported),
// fills DecodeParams, picks the split count and launches on the current stream.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

#include "decode/decode.h"
#include "glue.h"

namespace flashop {
namespace glue {
namespace {

constexpr const char* kOp = "flashop.forward_kvcache";

bool aligned_rows(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0 || t.stride(3) != 1) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  }
  return true;
}

}  // namespace

// Whether the decode kernels run this call: CUDA fp16/bf16 on compute capability 8.0 or newer, a head
// dimension that is a multiple of 8 up to 256, at most decode::kMaxRows query rows per KV head, and rows
// that 16-byte loads can read in place.
bool decode_supported(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  if (!q.is_cuda() || (q.scalar_type() != at::kHalf && q.scalar_type() != at::kBFloat16)) return false;
  if (q.dim() != 4 || k_cache.dim() != 4 || v_cache.dim() != 4 || k_cache.size(2) < 1) return false;
  const int64_t headdim = q.size(3), ratio = q.size(2) / k_cache.size(2);
  if (headdim % 8 != 0 || headdim > decode::kMaxHeadDim || ratio * q.size(1) > decode::kMaxRows) return false;
  if (q.size(0) > 65535 || k_cache.size(2) > 65535 || q.numel() == 0) return false;
  if (device(q.get_device(), kOp).sm < 80) return false;
  return aligned_rows(q) && aligned_rows(k_cache) && aligned_rows(v_cache);
}

// An int32 index tensor with unit stride in its last dimension (the kernels index rows of block_table by
// its row stride), or nothing.
namespace {

std::optional<at::Tensor> index_rows(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->stride(-1) == 1 ? *t : t->contiguous();
}

const int32_t* index_data(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<int32_t>() : nullptr;
}

// As many splits as fill one wave of resident CTAs without starting a second (a partial second wave costs a
// whole split's time), never a split shorter than 256 cache positions.
int default_splits(const Device& dev, int resident_per_sm, int64_t ctas, int64_t capacity) {
  const int64_t wave = int64_t(dev.sm_count) * resident_per_sm;
  return int(std::clamp<int64_t>(std::min(wave / ctas, capacity / 256), 1, decode::kMaxSplits));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_forward(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& key_begin_in, const std::optional<at::Tensor>& key_end_in, int64_t key_end_offset,
    const std::optional<at::Tensor>& cache_batch_idx_in, const std::optional<at::Tensor>& block_table_in,
    double softmax_scale, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks, int64_t num_splits,
    const std::optional<at::Tensor>& out_in) {
  TORCH_CHECK(decode_supported(q, k_cache, v_cache), kOp, " (CUDA decode): the decode kernels do not take these "
              "inputs (flashop/kvcache.py asks decode_supported first)");
  c10::cuda::CUDAGuard guard(q.device());
  const Device& dev = device(q.get_device(), kOp);
  const auto key_begin = index_rows(key_begin_in), key_end = index_rows(key_end_in);
  const auto cache_batch_idx = index_rows(cache_batch_idx_in), block_table = index_rows(block_table_in);
  const int64_t batch = q.size(0), seqlen_q = q.size(1), heads_q = q.size(2), headdim = q.size(3);
  const int64_t heads_k = k_cache.size(2);
  const bool paged = block_table.has_value();
  const int64_t capacity = paged ? block_table->size(1) * k_cache.size(1) : k_cache.size(1);

  // A given out (q's shape and dtype, checked by flashop/meta.py) is written in place, at its own strides.
  at::Tensor out = out_in.has_value() ? *out_in : at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({batch, heads_q, seqlen_q}, q.options().dtype(at::kFloat));
  const int splits = num_splits > 0 ? int(std::min<int64_t>(num_splits, decode::kMaxSplits))
                                    : default_splits(dev, decode::resident_ctas(int(headdim), q.scalar_type() == at::kBFloat16,
                                                                                q.get_device()),
                                                     batch * heads_k, capacity);
  at::Tensor partial_out, partial_lse;
  const int64_t rows_total = batch * heads_q * seqlen_q;
  if (splits > 1) {
    partial_out = at::empty({splits, rows_total, decode::tile_width(int(headdim))}, lse.options());
    partial_lse = at::empty({splits, rows_total}, lse.options());
  }

  DecodeParams p{};
  p.q = q.const_data_ptr();
  p.out = out.data_ptr();
  p.q_batch_stride = q.stride(0), p.q_row_stride = q.stride(1), p.q_head_stride = q.stride(2);
  p.o_batch_stride = out.stride(0), p.o_row_stride = out.stride(1), p.o_head_stride = out.stride(2);
  p.lse = lse.data_ptr<float>();
  p.k = k_cache.const_data_ptr();
  p.v = v_cache.const_data_ptr();
  p.k_batch_stride = k_cache.stride(0), p.k_row_stride = k_cache.stride(1), p.k_head_stride = k_cache.stride(2);
  p.v_batch_stride = v_cache.stride(0), p.v_row_stride = v_cache.stride(1), p.v_head_stride = v_cache.stride(2);
  p.cache_batch_idx = index_data(cache_batch_idx);
  p.block_table = index_data(block_table);
  p.block_table_stride = paged ? block_table->stride(0) : 0;
  p.page_size = int(k_cache.size(1));
  p.num_blocks = int(k_cache.size(0));
  p.capacity = int(capacity);
  p.key_begin = index_data(key_begin);
  p.key_end = index_data(key_end);
  p.key_end_offset = int(key_end_offset);
  p.batch = int(batch), p.seqlen_q = int(seqlen_q), p.heads_q = int(heads_q), p.heads_k = int(heads_k);
  p.head_ratio = int(heads_q / heads_k), p.headdim = int(headdim);
  p.scale = float(softmax_scale);
  p.variants.window_left = int(window_left);
  p.variants.window_right = int(window_right);
  p.variants.softcap = float(softcap);
  if (alibi_slopes.has_value()) {
    p.variants.alibi_slopes = alibi_slopes->const_data_ptr<float>();
    p.variants.alibi_batch_stride = alibi_slopes->dim() == 2 ? heads_q : 0;
  }
  p.variants.sinks = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  p.num_splits = splits;
  p.partial_out = splits > 1 ? partial_out.data_ptr<float>() : nullptr;
  p.partial_lse = splits > 1 ? partial_lse.data_ptr<float>() : nullptr;

  const cudaError_t err =
      decode::launch_decode(p, q.scalar_type() == at::kBFloat16, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, kOp, " (CUDA decode): kernel launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

void bind_decode(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("decode_supported", &decode_supported, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        "Whether the split-KV decode kernels run these inputs (CUDA fp16/bf16, sm80+, headdim a multiple of 8 up "
        "to 256, at most 8 query rows per KV head, 16-byte aligned rows).");
  m.def("decode_forward", &decode_forward, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("key_begin"), py::arg("key_end"), py::arg("key_end_offset"), py::arg("cache_batch_idx"), py::arg("block_table"),
        py::arg("softmax_scale"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
        py::arg("alibi_slopes"), py::arg("sinks"), py::arg("num_splits"), py::arg("out") = py::none(),
        "Split-KV decode over a contiguous or paged KV cache (checked arguments; csrc/cuda/decode/decode_params.h "
        "has their meaning). The window is normalised (causal is (-1, 0)). Writes `out` when given (q's shape and "
        "dtype). Returns (out (B, Sq, Hq, D), softmax_lse (B, Hq, Sq) float32).");
}

}  // namespace glue
}  // namespace flashop
