// The CUDA kernels of flashop::forward and flashop::backward, registered with the dispatcher: the argument
// rules of every backend (csrc/checks.cpp), the kernel config the policy picks, then the split-KV decode,
// mma.sync or Hopper kernels. The policy lives in flashop/dispatch.py (config_for_call); it is asked once per
// problem and its answer kept here, keyed by everything it reads, so a call of a problem seen before runs no
// Python. flashop.dispatch.clear_caches() forgets the answers (a new tuned cache, tests).

#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>

#include "../checks.h"
#include "glue.h"
#include "kernel_entry.h"

namespace flashop {
namespace glue {
namespace {

namespace py = pybind11;

// What the policy's answer depends on: the device, the problem (flashop/dispatch.py Problem) and the rules
// check_config applies to a named config.
struct PickKey {
  int device;
  bool backward;
  at::ScalarType dtype;
  int64_t headdim, seqlen_q, seqlen_k, batch_heads;
  int64_t sequences;  // of a packed batch
  bool causal, variants, requested, packed, deterministic;
  std::string config;  // empty: none named

  auto fields() const {
    return std::tie(device, backward, dtype, headdim, seqlen_q, seqlen_k, batch_heads, sequences, causal, variants,
                    requested, packed, deterministic, config);
  }
  bool operator==(const PickKey& other) const { return fields() == other.fields(); }
};

struct PickKeyHash {
  size_t operator()(const PickKey& key) const {
    size_t h = std::hash<std::string>()(key.config);
    for (int64_t x : {int64_t(key.device), int64_t(key.dtype), key.headdim, key.seqlen_q, key.seqlen_k,
                      key.batch_heads}) {
      h = h * 1000003u ^ std::hash<int64_t>()(x);
    }
    const int flags = key.backward | key.causal << 1 | key.variants << 2 | key.requested << 3 | key.packed << 4 |
                      key.deterministic << 5;
    return h * 1000003u ^ size_t(flags);
  }
};

// Bounded like the Python policy's own cache: many distinct packed lengths must not grow it forever.
constexpr size_t kMaxPicks = 4096;
std::mutex picks_mutex;
std::unordered_map<PickKey, std::string, PickKeyHash> picks;

void clear_picks() {
  std::lock_guard<std::mutex> lock(picks_mutex);
  picks.clear();
}

// The config a call runs. A miss asks flashop.dispatch.config_for_call under the GIL (never while holding the
// lock); a Python error becomes the op's error with its message.
std::string pick_config(const PickKey& key, const at::Tensor& q, const at::Tensor& k) {
  {
    std::lock_guard<std::mutex> lock(picks_mutex);
    const auto it = picks.find(key);
    if (it != picks.end()) return it->second;
  }
  std::string name;
  {
    py::gil_scoped_acquire gil;
    try {
      const py::object packed_shape =
          key.packed ? py::object(py::make_tuple(key.sequences, key.seqlen_q, key.seqlen_k)) : py::object(py::none());
      const py::object config = key.config.empty() ? py::object(py::none()) : py::object(py::str(key.config));
      name = py::module_::import("flashop.dispatch")
                 .attr("config_for_call")(key.backward ? "backward" : "forward", q, k, key.causal, key.variants,
                                          key.requested, packed_shape, key.deterministic, config)
                 .cast<std::string>();
    } catch (py::error_already_set& err) {
      const std::string message = py::str(err.value());
      TORCH_CHECK(false, message);
    }
  }
  std::lock_guard<std::mutex> lock(picks_mutex);
  if (picks.size() >= kMaxPicks) picks.clear();
  picks.emplace(key, name);
  return name;
}

// The Hopper module's entry points, from its capsule (imported on the first Hopper call).
std::atomic<const KernelEntries*> hopper_entries{nullptr};

const KernelEntries& hopper() {
  const KernelEntries* entries = hopper_entries.load(std::memory_order_acquire);
  if (entries == nullptr) {
    py::gil_scoped_acquire gil;
    try {
      const py::capsule capsule = py::module_::import("flashop._C_sm90").attr("entry_points");
      entries = capsule.get_pointer<KernelEntries>();
    } catch (py::error_already_set& err) {
      const std::string message = py::str(err.value());
      TORCH_CHECK(false, "flashop: the Hopper kernels (flashop._C_sm90) could not be loaded: ", message);
    }
    hopper_entries.store(entries, std::memory_order_release);
  }
  return *entries;
}

bool is_hopper(const std::string& config) { return config.rfind("sm90.", 0) == 0; }

// meta.variants_requested: whether the arguments, as given, ask for more than dense or causal attention
// (before the window is normalised, so eager and traced calls judge a named config alike).
bool variants_requested(bool causal, int64_t window_left, int64_t window_right, double softcap,
                        const OptTensor& alibi_slopes, const OptTensor& sinks) {
  return window_left >= 0 || (window_right > 0 && !causal) || softcap > 0 || alibi_slopes.has_value() ||
         sinks.has_value();
}

bool variants_on(const AttentionVariants& v) {
  return v.window_left >= 0 || v.window_right > 0 || v.softcap > 0 || v.alibi_slopes != nullptr ||
         v.sinks != nullptr;
}

// The CUDA kernels read 16-byte rows: a head dimension that is not a multiple of 8 gets zero columns up to the
// next one (zeros add nothing to q.k, and give zero output columns). dispatch.kernel_headdim is the same rule.
at::Tensor pad_headdim(const at::Tensor& t) {
  const int64_t pad = (8 - t.size(-1) % 8) % 8;
  return pad == 0 ? t : at::constant_pad_nd(t, {0, pad});
}

at::Tensor unpad_headdim(const at::Tensor& t, int64_t headdim) {
  return t.size(-1) == headdim ? t : t.slice(-1, 0, headdim).contiguous();
}

// The dims and the policy's view of a dense or packed batch: (sequences, longest query, longest key sequence),
// the token counts standing in for lengths not given.
AttentionDims checked_dims(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& cu_seqlens_q,
                           const OptTensor& cu_seqlens_k, std::optional<int64_t> max_seqlen_q,
                           std::optional<int64_t> max_seqlen_k, const OptTensor& seqused_q,
                           const OptTensor& seqused_k, PickKey& key) {
  TORCH_CHECK(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
              "flashop: cu_seqlens_q and cu_seqlens_k must be given together");
  TORCH_CHECK(cu_seqlens_q.has_value() || (!max_seqlen_q && !max_seqlen_k && !seqused_q && !seqused_k),
              "flashop: max_seqlen_q/k and seqused_q/k need cu_seqlens_q and cu_seqlens_k");
  key.packed = cu_seqlens_q.has_value();
  if (!key.packed) {
    const AttentionDims dims = check_forward_inputs(q, k, v);
    key.seqlen_q = dims.seqlen_q;
    key.seqlen_k = dims.seqlen_k;
    key.batch_heads = dims.batch * dims.heads_q;
    return dims;
  }
  const AttentionDims dims = check_varlen_inputs(q, k, v, VarlenArgs{*cu_seqlens_q, *cu_seqlens_k, seqused_q, seqused_k});
  key.seqlen_q = max_seqlen_q.value_or(dims.seqlen_q);
  key.seqlen_k = max_seqlen_k.value_or(dims.seqlen_k);
  key.batch_heads = dims.batch * dims.heads_q;
  key.sequences = dims.batch;
  return dims;
}

PickKey key_of(const at::Tensor& q, bool backward, bool deterministic, const std::optional<c10::string_view>& config) {
  PickKey key{};
  key.device = q.is_cuda() ? q.get_device() : -1;
  key.backward = backward;
  key.dtype = q.scalar_type();
  key.headdim = q.size(-1);
  key.deterministic = deterministic;
  if (config.has_value()) key.config = std::string(config->data(), config->size());
  return key;
}

// The Hopper kernels take a packed batch's longest lengths as given: the value checks run here (eager).
void hopper_packed_lengths(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& cu_seqlens_q,
                           const OptTensor& cu_seqlens_k, std::optional<int64_t>& max_seqlen_q,
                           std::optional<int64_t>& max_seqlen_k, const OptTensor& seqused_q,
                           const OptTensor& seqused_k) {
  if (!cu_seqlens_q.has_value()) return;
  PackedBatch packed;
  check_packed_inputs(q, k, v, *cu_seqlens_q, *cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, packed);
  max_seqlen_q = packed.max_seqlen_q;
  max_seqlen_k = packed.max_seqlen_k;
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, std::optional<double> softmax_scale,
    bool causal, std::optional<c10::string_view> config, bool deterministic, int64_t window_left, int64_t window_right,
    double softcap, const OptTensor& alibi_slopes, const OptTensor& learnable_sink, const OptTensor& cu_seqlens_q,
    const OptTensor& cu_seqlens_k, std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k,
    const OptTensor& seqused_q, const OptTensor& seqused_k) {
  PickKey key = key_of(q_in, /*backward=*/false, deterministic, config);
  const AttentionDims dims = checked_dims(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          seqused_q, seqused_k, key);
  key.requested = variants_requested(causal, window_left, window_right, softcap, alibi_slopes, learnable_sink);
  key.causal = causal;  // check_variants normalises it: causal is exactly the (-1, 0) window
  const AttentionVariants variants = check_variants(dims, q_in, key.causal, window_left, window_right, softcap,
                                                    alibi_slopes, learnable_sink);
  key.variants = variants_on(variants);
  const double scale = resolve_softmax_scale(softmax_scale, dims.headdim);

  if (!config.has_value() && !key.packed && dims.seqlen_k > 0 && decode_supported(q_in, k_in, v_in)) {
    // At most 8 query rows per KV head (decoding through flash_attn_func): the split-KV decode kernels, with k
    // and v as a cache every sequence fills.
    return decode_forward(q_in, k_in, v_in, std::nullopt, std::nullopt, 0, std::nullopt, std::nullopt, scale,
                          variants.window_left, variants.window_right, softcap, alibi_slopes, learnable_sink, 0,
                          std::nullopt);
  }
  const std::string name = pick_config(key, q_in, k_in);
  const at::Tensor q = pad_headdim(q_in), k = pad_headdim(k_in), v = pad_headdim(v_in);
  at::Tensor out, lse;
  if (is_hopper(name)) {
    hopper_packed_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k);
    std::tie(out, lse) = hopper().forward(q, k, v, scale, key.causal, name, variants.window_left,
                                          variants.window_right, softcap, alibi_slopes, learnable_sink, cu_seqlens_q,
                                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k);
  } else {
    std::tie(out, lse) = mma_sync_forward(q, k, v, scale, key.causal, name, variants.window_left,
                                          variants.window_right, softcap, alibi_slopes, learnable_sink, cu_seqlens_q,
                                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k);
  }
  return {unpad_headdim(out, dims.headdim), lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& softmax_lse, std::optional<double> softmax_scale, bool causal,
    std::optional<c10::string_view> config, bool deterministic, int64_t window_left, int64_t window_right,
    double softcap, const OptTensor& alibi_slopes, const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k,
    std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k, const OptTensor& seqused_q,
    const OptTensor& seqused_k) {
  PickKey key = key_of(q_in, /*backward=*/true, deterministic, config);
  const AttentionDims dims = checked_dims(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          seqused_q, seqused_k, key);
  check_backward_inputs(dout_in, q_in, out_in, softmax_lse, dims, key.packed);
  key.requested = variants_requested(causal, window_left, window_right, softcap, alibi_slopes, std::nullopt);
  key.causal = causal;
  // Sinks need nothing here: softmax_lse carries them.
  const AttentionVariants variants =
      check_variants(dims, q_in, key.causal, window_left, window_right, softcap, alibi_slopes, std::nullopt);
  key.variants = variants_on(variants);
  const double scale = resolve_softmax_scale(softmax_scale, dims.headdim);

  const std::string name = pick_config(key, q_in, k_in);
  const at::Tensor dout = pad_headdim(dout_in), q = pad_headdim(q_in), k = pad_headdim(k_in),
                   v = pad_headdim(v_in), out = pad_headdim(out_in);
  at::Tensor dq, dk, dv;
  if (is_hopper(name)) {
    hopper_packed_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k);
    std::tie(dq, dk, dv) = hopper().backward(dout, q, k, v, out, softmax_lse, scale, key.causal, deterministic, name,
                                             variants.window_left, variants.window_right, softcap, alibi_slopes,
                                             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                             seqused_k);
  } else {
    std::tie(dq, dk, dv) = mma_sync_backward(dout, q, k, v, out, softmax_lse, scale, key.causal, deterministic, name,
                                             variants.window_left, variants.window_right, softcap, alibi_slopes,
                                             cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                             seqused_k);
  }
  return {unpad_headdim(dq, dims.headdim), unpad_headdim(dk, dims.headdim), unpad_headdim(dv, dims.headdim)};
}

}  // namespace

void bind_ops(py::module_& m) {
  m.def("_clear_config_picks", &clear_picks,
        "Forget the kernel configs the CUDA ops keep per problem (flashop.dispatch.clear_caches calls it)");
}

}  // namespace glue
}  // namespace flashop

TORCH_LIBRARY_IMPL(flashop, CUDA, m) {
  m.impl("forward", &flashop::glue::forward_cuda);
  m.impl("backward", &flashop::glue::backward_cuda);
}
