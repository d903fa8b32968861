// The flashop operators, defined once. Backends register kernels for them:
// csrc/cpu/ (CPU), csrc/cuda/ops_cuda.cpp (CUDA, through the config-dispatch policy),
// flashop/meta.py (fake tensors for tracing), csrc/autograd.cpp (autograd).
#include "cpu/isa.h"

#include <torch/extension.h>
#include <torch/library.h>

#ifdef FLASHOP_WITH_CUDA
namespace flashop {
namespace glue {
// csrc/cuda/forward_cuda.cpp, backward_cuda.cpp.
void bind_forward(pybind11::module_& m);
void bind_backward(pybind11::module_& m);
void bind_decode(pybind11::module_& m);  // csrc/cuda/decode_cuda.cpp
void bind_ops(pybind11::module_& m);     // csrc/cuda/ops_cuda.cpp
}  // namespace glue
}  // namespace flashop
#endif

TORCH_LIBRARY(flashop, m) {
  // The fake kernels live in Python; this tells the dispatcher where.
  // `deterministic` asks the backward for bit-identical gradients run to run; the forward takes it
  // only so autograd can carry it from the Python APIs to the backward.
  // The attention variants (csrc/attention_variants.h) are optional arguments after those, so today's
  // positional calls keep their meaning (not keyword-only: register_autograd takes no keyword-only
  // tensors). The backward takes no sinks: the forward's softmax_lse carries them, and their gradient is
  // formed by the autograd formula (flashop/ops.py). With cu_seqlens_q/k the batch is packed: q
  // (total_q, Hq, D), k and v (total_k, Hk, D), softmax_lse (Hq, total_q) (csrc/checks.h, VarlenArgs).
  m.set_python_module("flashop.meta");
  m.def(
      "forward(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool causal=False, "
      "str? config=None, bool deterministic=False, int window_size_left=-1, int window_size_right=-1, "
      "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? learnable_sink=None, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, Tensor? seqused_q=None, "
      "Tensor? seqused_k=None) -> (Tensor out, Tensor softmax_lse)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "float? softmax_scale=None, bool causal=False, str? config=None, bool deterministic=False, "
      "int window_size_left=-1, int window_size_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, "
      "Tensor? seqused_q=None, Tensor? seqused_k=None) -> (Tensor dq, Tensor dk, Tensor dv)",
      {at::Tag::pt2_compliant_tag});
  // The forward writing its output into a preallocated `out` (q's shape and dtype; vLLM's calling convention).
  m.def(
      "forward.with_out(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, bool causal=False, "
      "str? config=None, bool deterministic=False, int window_size_left=-1, int window_size_right=-1, "
      "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? learnable_sink=None, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, SymInt? max_seqlen_q=None, SymInt? max_seqlen_k=None, Tensor? seqused_q=None, "
      "Tensor? seqused_k=None, *, Tensor(a!) out) -> Tensor softmax_lse",
      {at::Tag::pt2_compliant_tag});
  // FlashAttention's flash_attn_with_kvcache: k and v are appended to the caches in place (hence its own op),
  // then q attends to each sequence's cache. Its kernels and rules are in flashop/kvcache.py.
  m.def(
      "forward_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k=None, Tensor? v=None, "
      "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? cache_seqlens=None, Tensor? cache_batch_idx=None, "
      "Tensor? cache_leftpad=None, Tensor? block_table=None, float? softmax_scale=None, bool causal=False, "
      "int window_size_left=-1, int window_size_right=-1, float softcap=0.0, bool rotary_interleaved=True, "
      "Tensor? alibi_slopes=None, Tensor? learnable_sink=None, int num_splits=0, str? config=None) "
      "-> (Tensor out, Tensor softmax_lse)",
      {at::Tag::pt2_compliant_tag});
  // The same, writing the output into a preallocated `out` (q's shape and dtype; vLLM's calling convention).
  m.def(
      "forward_kvcache.with_out(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k=None, Tensor? v=None, "
      "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? cache_seqlens=None, Tensor? cache_batch_idx=None, "
      "Tensor? cache_leftpad=None, Tensor? block_table=None, float? softmax_scale=None, bool causal=False, "
      "int window_size_left=-1, int window_size_right=-1, float softcap=0.0, bool rotary_interleaved=True, "
      "Tensor? alibi_slopes=None, Tensor? learnable_sink=None, int num_splits=0, str? config=None, *, "
      "Tensor(c!) out) -> Tensor softmax_lse",
      {at::Tag::pt2_compliant_tag});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flashop native extension: registers torch.ops.flashop.* and exposes the CUDA kernel registry";
  m.def("cpu_isa", &flashop::cpu::cpu_isa,
        "The instruction set of the CPU kernels that run: 'avx512', 'avx2' or 'default' (generic); the best this "
        "CPU supports unless the environment variable FLASHOP_CPU_ISA names one (read once, at the first use)");
  m.def("cpu_isas", &flashop::cpu::cpu_isas, "The instruction sets this build has CPU kernels for, generic first");
  m.def("cpu_isas_supported", &flashop::cpu::cpu_isas_supported,
        "The instruction sets of cpu_isas() that this CPU can run");
  m.def("_select_cpu_isa", &flashop::cpu::select_cpu_isa, pybind11::arg("requested"), pybind11::arg("supported"),
        "The instruction set FLASHOP_CPU_ISA=requested picks among `supported` (the rule cpu_isa() applies)");
#ifdef FLASHOP_WITH_CUDA
  m.attr("WITH_CUDA") = true;
  flashop::glue::bind_forward(m);
  flashop::glue::bind_backward(m);
  flashop::glue::bind_decode(m);
  flashop::glue::bind_ops(m);
#else
  m.attr("WITH_CUDA") = false;
#endif
}
