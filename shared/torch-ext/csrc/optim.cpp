// ATen's fused AdamW (`at::_ops::_fused_adamw_`, what `torch.optim.AdamW(fused=True)` calls): one kernel pass over
// each parameter that reads the gradient and both moments and writes the moments and the parameter, where the
// same update written with separate tensor ops reads and writes the whole state several times. CPU and CUDA
// kernels exist; the step count is a float32 scalar tensor on the parameter's device, read by the kernel.

#include <optional>

#include <ATen/ATen.h>
#include <ATen/ops/_fused_adamw.h>

#include "shim_util.hpp"

using jetrl_shim::fail;

extern "C" int jetrl_fused_adamw(jetrl_tensor* param, const jetrl_tensor* grad, jetrl_tensor* exp_avg,
                                 jetrl_tensor* exp_avg_sq, const jetrl_tensor* step, double lr, double beta1,
                                 double beta2, double weight_decay, double eps, char** err) {
  if (param == nullptr || grad == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr || step == nullptr) {
    return fail(err, JETRL_ERR_INVALID_ARGUMENT, "jetrl_fused_adamw: null argument");
  }
  return jetrl_shim::guarded(err, [&] {
    at::Tensor params[] = {*param};
    at::Tensor grads[] = {*grad};
    at::Tensor avgs[] = {*exp_avg};
    at::Tensor avg_sqs[] = {*exp_avg_sq};
    at::Tensor steps[] = {*step};
    at::_ops::_fused_adamw_::call(params, grads, avgs, avg_sqs, {}, steps, lr, beta1, beta2, weight_decay, eps,
                                  false, false, std::nullopt, std::nullopt);
  });
}
