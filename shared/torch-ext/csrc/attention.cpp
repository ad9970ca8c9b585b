// Attention kernels libtorch has and tch does not bind: flash attention over variable-length sequences packed
// end to end (`at::_ops::_flash_attention_forward` with cumulative sequence lengths), the kernel the padding-free
// training forward uses on CUDA. The op is differentiable (autograd's FlashAttentionBackward0); it exists for
// CUDA tensors in bf16 or fp16 only, and any other input comes back as an error, not an abort.

#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/ops/_flash_attention_forward.h>

#include "shim_util.hpp"

using jetrl_shim::fail;

extern "C" int jetrl_flash_attention_varlen(const jetrl_tensor* q, const jetrl_tensor* k, const jetrl_tensor* v,
                                            const jetrl_tensor* cu_seqlens, int64_t max_len, double scale,
                                            jetrl_tensor** out, char** err) {
  if (q == nullptr || k == nullptr || v == nullptr || cu_seqlens == nullptr || out == nullptr) {
    return fail(err, JETRL_ERR_INVALID_ARGUMENT, "jetrl_flash_attention_varlen: null argument");
  }
  return jetrl_shim::guarded(err, [&] {
    auto result = at::_ops::_flash_attention_forward::call(*q, *k, *v, *cu_seqlens, *cu_seqlens, max_len, max_len,
                                                           0.0, true, false, scale, std::nullopt, std::nullopt,
                                                           std::nullopt, std::nullopt);
    *out = new at::Tensor(std::get<0>(result));
  });
}
