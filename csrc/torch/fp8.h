// What the FP8 adapters (fp8.cpp), their autograd nodes (fp8_nodes.cpp) and the FP8 cross-entropy
// (cross_entropy.cpp) share: the state's checks, the casts to FP8 codes and the projection's GEMMs. Internal to the
// adapters (not bound); the definitions and their fuller descriptions are in fp8.cpp.
#pragma once

#include <utility>
#include <vector>

#include "torch/adapter.h"
#include "torch/ops.h"

namespace ls_torch {
namespace fp8_impl {

ls::Fp8Format to_format(const char* op, int64_t f);  // 0 e4m3, 1 e5m2
int64_t padded16(int64_t m);                          // m rounded up to the FP8 GEMM's tile of 16
Tensor aligned(const Tensor& t);                      // t, or a copy of it where its data is not 16-byte aligned
Tensor scale_inv_of(const Tensor& state, int64_t row);
void check_state(const char* op, const Tensor& state, int64_t rows_needed, const Tensor& x);
// Uninitialised codes of a [M, K] tensor: [M, K] (rowwise) and [K, padded16(M)] (transposed), each or undefined
std::pair<Tensor, Tensor> empty_codes(const Tensor& like, int64_t M, int64_t K, ls::Fp8Format fmt, bool rowwise,
                                      bool transposed);
// [codes [M, K] or undefined, transposed codes [K, Mp] or undefined] of a 2-d tensor under state row `row`
std::pair<Tensor, Tensor> quantize(const char* op, const Tensor& x2_in, const Tensor& state, int64_t row,
                                   ls::Fp8Format fmt, bool current, bool rowwise, bool transposed);

// One projection's use of the state: its gradient format, current or delayed scaling, and its rows
struct Use {
  int64_t grad_format;
  bool current;
  Tensor state;
  int64_t slot;
  int64_t row(int role) const { return 3 * slot + role; }
};
Use use_of(const char* op, int64_t mode, const OptTensor& state, int64_t slot, const Tensor& x);
void check_projection(const char* op, const Tensor& x, const Tensor& weight, const OptTensor& bias);

// The forward's GEMM from the input's codes -> [y2, xq_t, W's transposed codes, 1/s of x, 1/s of W]
std::vector<Tensor> codes_forward(const Tensor& xq, const Tensor& xq_t, at::ScalarType dt, const Tensor& weight,
                                  const OptTensor& bias, const Use& u);
// The same from x2 itself (cast first; its transposed codes kept when keep_x)
std::vector<Tensor> linear_forward(const Tensor& x2, const Tensor& weight, const OptTensor& bias, const Use& u,
                                   bool keep_x);
// A pre-LN block's layer norm of x2 as the next projection's input codes -> [xq, xq_t (or undefined), mean, rstd]
std::vector<Tensor> pre_ln_codes(const char* op, const Tensor& x2_in, const Tensor& ln_w, const Tensor& ln_b,
                                 double eps, const Use& u, bool keep_x);
// The backward's GEMMs from the output gradient's codes -> [dx (or undefined), dW (or undefined)]
std::pair<Tensor, Tensor> backward_gemms(const Tensor& gq, const Tensor& gq_t, const Tensor& sg, const Tensor& xq_t,
                                         const Tensor& wq_t, const Tensor& sx, const Tensor& sw,
                                         at::ScalarType dx_dtype, at::ScalarType w_dtype, const void* wkey,
                                         Tensor dw_out = Tensor());
// [dx2 (or undefined), dW (or undefined)] from the output gradient g2 [M, N], cast first
std::pair<Tensor, Tensor> linear_backward(const Tensor& g2, const Tensor& xq_t, const Tensor& wq_t, const Tensor& sx,
                                          const Tensor& sw, const Use& u, bool need_dx, bool need_dw,
                                          at::ScalarType w_dtype, const void* wkey);
// The codes of the activation's input gradient, and the bias gradient -> [codes, transposed codes, dbias]
std::vector<Tensor> act_grad_codes(const char* op, const Tensor& dy2_in, const OptTensor& x2, const OptTensor& bias,
                                   const OptTensor& mask, double p, const std::string& activation, const Use& u,
                                   bool rowwise, bool transposed, bool need_db);
// The codes of the heads' gradients merged, and the bias gradient -> [codes, transposed codes, dbias]
std::vector<Tensor> merge_codes(const char* op, const std::vector<OptTensor>& parts, const Use& u, bool rowwise,
                                bool transposed, bool need_db);

}  // namespace fp8_impl
}  // namespace ls_torch
