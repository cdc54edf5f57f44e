// FP8 linear layers for Hopper (and Ada): y = x W^T (+ b) with every GEMM of the layer on the FP8 tensor cores,
// through torch's FP8 GEMM (at::_scaled_mm over cuBLASLt), output in the input's dtype.
//
// Forward:   y  = [x]_e4m3 [W]_e4m3^T
// Backward:  dx = [dY]_g [W]_e4m3                          (g: the gradient format, e4m3 or e5m2)
//            dW = [dY]_g^T [x]_e4m3                         (the same codes of dY and x, transposed)
//
// All three use cuBLASLt's fast accumulation (use_fast_accum): on one H200 the GEMMs of transformer-big's
// projections run 5-10% faster than with fp32 promotion, the error they add is about that of rounding the output
// to bf16 (far below the FP8 rounding of the operands), and the quality run of benchmarks/RESULTS.md ("FP8")
// ends at the same validation loss.
//
// Each quantisation is one pass (csrc/kernels/fp8.cu, delayed scaling from a per-tensor amax history) that writes
// the row-major codes and, where a GEMM needs them, the transposed codes: cuBLASLt's FP8 GEMM takes its first
// operand row-major and its second column-major, so the input-gradient GEMM reads W's codes transposed and the
// weight-gradient GEMM reads dY's and x's codes transposed. The backward keeps x's transposed e4m3 codes, not x.
// The weight-gradient GEMM adds over the tokens; the transposed codes are padded with zero tokens to a multiple
// of 16 (the FP8 GEMM's tile).
//
// The scaling state is a float32 tensor of [3 * linears, kFp8Width] owned by the model (ls_fairseq/ops/fp8.py:
// Fp8State); a linear takes rows 3 slot (input), 3 slot + 1 (weight), 3 slot + 2 (output gradient). mode: 0 off;
// 1 + the gradient format (0 e4m3, 1 e5m2), + 2 for current scaling (the first forward and backward of a state).
//
// A layer whose sizes are not multiples of 16 takes the plain linear node instead (ag_linear_mode), so any model
// size trains.
#include <torch/extension.h>

#include <mutex>
#include <unordered_map>

#include "torch/adapter.h"
#include "torch/ops.h"

namespace ls_torch {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

ls::Fp8Format to_format(const char* op, int64_t f) {
  LS_CHECK(f == 0 || f == 1, op, ": FP8 format must be 0 (e4m3) or 1 (e5m2), got ", f);
  return f == 0 ? ls::Fp8Format::E4M3 : ls::Fp8Format::E5M2;
}

int64_t padded16(int64_t m) { return (m + 15) / 16 * 16; }

Tensor aligned(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();  // the kernels read 16-byte words
}

OptTensor opt_of(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

Tensor scale_inv_of(const Tensor& state, int64_t row) { return state.select(0, row).select(0, ls::kFp8ScaleInv); }

void check_state(const char* op, const Tensor& state, int64_t rows_needed, const Tensor& x) {
  LS_CHECK(state.defined() && state.dim() == 2 && state.size(1) == ls::kFp8Width &&
               state.scalar_type() == at::kFloat && state.is_contiguous(),
           op, ": FP8 state must be a contiguous float32 [rows, ", ls::kFp8Width, "] tensor, got ",
           state.defined() ? state.sizes() : at::IntArrayRef{});
  LS_CHECK(state.device() == x.device(), op, ": FP8 state is on ", state.device().str(), ", the input on ",
           x.device().str());
  LS_CHECK(rows_needed >= 0 && rows_needed <= state.size(0), op, ": FP8 state has ", state.size(0),
           " rows, this layer needs ", rows_needed);
}

// Uninitialised codes of a [M, K] tensor in format fmt: [M, K] (rowwise) and [K, padded16(M)] (transposed), each
// or undefined
std::pair<Tensor, Tensor> empty_codes(const Tensor& like, int64_t M, int64_t K, ls::Fp8Format fmt, bool rowwise,
                                      bool transposed) {
  const auto qt = fmt == ls::Fp8Format::E4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2;
  return {rowwise ? at::empty({M, K}, like.options().dtype(qt)) : Tensor(),
          transposed ? at::empty({K, padded16(M)}, like.options().dtype(qt)) : Tensor()};
}

// [codes [M, K] or undefined, transposed codes [K, Mp] or undefined] of a 2-d tensor under state row `row`
std::pair<Tensor, Tensor> quantize(const char* op, const Tensor& x2_in, const Tensor& state, int64_t row,
                                   ls::Fp8Format fmt, bool current, bool rowwise, bool transposed) {
  Tensor x2 = aligned(contig(x2_in));
  const ls::DType dt = to_dtype(op, x2);
  const int64_t M = x2.size(0), K = x2.size(1), Mp = padded16(M);
  Tensor q, q_t;  // (not a structured binding: the launch lambda captures them)
  std::tie(q, q_t) = empty_codes(x2, M, K, fmt, rowwise, transposed);
  c10::cuda::CUDAGuard guard(x2.device());
  launch(op, [&] {
    ls::fp8_quantize(dt, x2.data_ptr(), M, K, state.data_ptr<float>() + row * ls::kFp8Width, fmt, current,
                     rowwise ? q.data_ptr() : nullptr, transposed ? q_t.data_ptr() : nullptr,
                     transposed ? Mp : M, stream());
  });
  return {q, q_t};
}

struct Use {
  int64_t grad_format;
  bool current;
  Tensor state;
  int64_t slot;
  int64_t row(int role) const { return 3 * slot + role; }
};

Use use_of(const char* op, int64_t mode, const OptTensor& state, int64_t slot, const Tensor& x) {
  LS_CHECK(mode >= 1 && mode <= 4, op, ": FP8 mode must be 1 to 4, got ", mode);
  LS_CHECK(present(state), op, ": FP8 needs its scaling state");
  LS_CHECK(slot >= 0, op, ": FP8 slot must be >= 0, got ", slot);
  check_state(op, *state, 3 * (slot + 1), x);
  return {(mode - 1) & 1, (mode - 1) >= 2, *state, slot};
}

// What an FP8 projection needs of its input, weight and bias (their shapes against each other checked before)
void check_projection(const char* op, const Tensor& x, const Tensor& weight, const OptTensor& bias) {
  LS_CHECK(x.is_cuda() && x.device() == weight.device(), op, ": input and weight must be on one CUDA device");
  LS_CHECK(x.scalar_type() == weight.scalar_type() &&
               (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
           op, ": input and weight must both be bfloat16 or float16, got ", x.scalar_type(), " and ",
           weight.scalar_type());
  LS_CHECK(fp8_linear_shapes_ok(weight), op, ": weight ", weight.sizes(),
           " has a size that is not a multiple of 16 (the FP8 GEMM's requirement)");
  if (present(bias))
    LS_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == x.scalar_type(), op,
             ": bias must be [", weight.size(0), "] of ", x.scalar_type(), ", got ", bias->sizes(), " of ",
             bias->scalar_type());
}

// The residual of a block whose projection maps x [..., K] to [..., n]: x's leading sizes, dtype and device
void check_residual(const char* op, const Tensor& residual, const Tensor& x, int64_t n) {
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  LS_CHECK(residual.sizes() == at::IntArrayRef(out_sizes) && residual.scalar_type() == x.scalar_type() &&
               residual.device() == x.device(),
           op, ": residual must be ", at::IntArrayRef(out_sizes), " of ", x.scalar_type(), " on ", x.device().str(),
           ", got ", residual.sizes(), " of ", residual.scalar_type());
}

// The weights' codes of one training forward, made ahead in one launch (fp8_cast_weights, at the forward's start)
// and taken by the projection that uses the weight, keyed by the weight's data. An entry is used at most once and
// only for the state row it was made for; what no projection took is dropped at the end of the model's body
// (fp8_forget_weights) and at the next forward's start.
struct WeightCodes {
  Tensor q, q_t;
  const void* state;
  int64_t row;
};
std::mutex weight_codes_mutex;
std::unordered_map<const void*, WeightCodes>& weight_codes() {
  static std::unordered_map<const void*, WeightCodes> codes;
  return codes;
}

// W's [codes, transposed codes] for projection u: made ahead when they were (delayed scaling only), else cast now
std::pair<Tensor, Tensor> weight_codes_of(const char* op, const Tensor& weight, const Use& u) {
  if (!u.current) {
    std::lock_guard<std::mutex> lock(weight_codes_mutex);
    auto& codes = weight_codes();
    auto it = codes.find(weight.data_ptr());
    if (it != codes.end()) {
      WeightCodes w = std::move(it->second);
      codes.erase(it);
      LS_CHECK(w.state == u.state.data_ptr() && w.row == u.row(1) && w.q.sizes() == weight.sizes(), op,
               ": the weight's codes made at the forward's start belong to state row ", w.row,
               ", this projection uses row ", u.row(1));
      return {w.q, w.q_t};
    }
  }
  return quantize(op, weight, u.state, u.row(1), ls::Fp8Format::E4M3, u.current, true, true);
}

// The forward's GEMM and what the backward keeps: [y2, x's transposed codes (or undefined), W's transposed codes,
// 1/s of x, 1/s of W]
// The same from the input's codes xq (and xq_t, kept for the backward, or undefined); dt: the output's dtype
std::vector<Tensor> codes_forward(const Tensor& xq, const Tensor& xq_t, at::ScalarType dt, const Tensor& weight,
                                  const OptTensor& bias, const Use& u) {
  const char* op = "fp8_linear";
  auto [wq, wq_t] = weight_codes_of(op, weight, u);
  Tensor sx = scale_inv_of(u.state, u.row(0)), sw = scale_inv_of(u.state, u.row(1));
  // mat2 = W^T as a column-major [K, N] view of the row-major [N, K] codes
  Tensor y2 = at::_scaled_mm(xq, wq.t(), sx, sw, bias, std::nullopt, dt, true);
  return {y2, xq_t, wq_t, sx, sw};
}

std::vector<Tensor> linear_forward(const Tensor& x2, const Tensor& weight, const OptTensor& bias, const Use& u,
                                   bool keep_x) {
  auto [xq, xq_t] = quantize("fp8_linear", x2, u.state, u.row(0), ls::Fp8Format::E4M3, u.current, true, keep_x);
  return codes_forward(xq, xq_t, x2.scalar_type(), weight, bias, u);
}

// A pre-LN block's layer norm of x2 [M, C] as the input codes of the FP8 projection after it (and the transposed
// codes when keep_x), with its mean and rstd for the backward: under delayed scaling one pass that never writes the
// layer norm's output (layer_norm_codes: the codes quantize() makes of layer_norm_fwd's output, bit for bit);
// under current scaling, or a hidden size that kernel does not take, layer_norm_fwd and then quantize().
// -> [xq, xq_t (or undefined), mean, rstd]
std::vector<Tensor> pre_ln_codes(const char* op, const Tensor& x2_in, const Tensor& ln_w, const Tensor& ln_b,
                                 double eps, const Use& u, bool keep_x) {
  Tensor x2 = aligned(contig(x2_in));
  const int64_t M = x2.size(0), C = x2.size(1);
  if (u.current || !ls::layer_norm_codes_supported((int)C)) {
    auto r = layer_norm_fwd(x2, std::nullopt, ln_w, ln_b, eps);
    auto [q, q_t] = quantize(op, r[0], u.state, u.row(0), ls::Fp8Format::E4M3, u.current, true, keep_x);
    return {q, q_t, r[2], r[3]};
  }
  Tensor g = aligned(*channel_param(op, "layer norm weight", ln_w, x2, C));
  Tensor b = aligned(*channel_param(op, "layer norm bias", ln_b, x2, C));
  Tensor q, q_t;
  std::tie(q, q_t) = empty_codes(x2, M, C, ls::Fp8Format::E4M3, true, keep_x);
  auto f32 = x2.options().dtype(at::kFloat);
  Tensor mean = at::empty({M}, f32), rstd = at::empty({M}, f32);
  c10::cuda::CUDAGuard guard(x2.device());
  launch(op, [&] {
    ls::layer_norm_codes(to_dtype(op, x2), x2.data_ptr(), g.data_ptr(), b.data_ptr(), mean.data_ptr<float>(),
                         rstd.data_ptr<float>(), M, (int)C, (float)eps,
                         u.state.data_ptr<float>() + u.row(0) * ls::kFp8Width, q.data_ptr(),
                         keep_x ? q_t.data_ptr() : nullptr, padded16(M), stream());
  });
  return {q, q_t, mean, rstd};
}

// A node's first projection from its input x2 [M, K]: linear_forward, or with ln_w (a pre-LN block) from the codes
// of layer_norm(x2) (pre_ln_codes). -> [y2, xq_t, wq_t, sx, sw] and, with ln_w, what input_grads reads of the layer
// norm (the node saves it after its own tensors): [x2, ln_w, ln_b, mean, rstd]
std::pair<std::vector<Tensor>, std::vector<Tensor>> first_forward(const char* op, const Tensor& x2,
                                                                  const OptTensor& ln_w, const OptTensor& ln_b,
                                                                  double eps, const Tensor& weight,
                                                                  const OptTensor& bias, const Use& u, bool keep_x) {
  if (!present(ln_w)) return {linear_forward(x2, weight, bias, u, keep_x), {}};
  auto c = pre_ln_codes(op, x2, *ln_w, *ln_b, eps, u, keep_x);  // [xq, xq_t, mean, rstd]
  return {codes_forward(c[0], c[1], x2.scalar_type(), weight, bias, u), {x2, *ln_w, *ln_b, c[2], c[3]}};
}

// Out[0], the gradient of a node's input x [..., C], from its first projection's input gradient dx2 [rows, C]: with
// the node's layer norm (ln; the saved tensors s[ln_saved ..]: first_forward's x2, ln_w, ln_b, mean, rstd), that
// layer norm's backward with the residual's gradient gsum (nullable) added into x's, and the layer norm's weight and
// bias gradients into out[ln_out], out[ln_out + 1] (in their dtypes); else dx2 in x's shape.
void input_grads(AutogradContext* ctx, variable_list& out, const Tensor& dx2, const Tensor& gsum, bool ln,
                 bool need_dx, const variable_list& s, size_t ln_saved, size_t ln_out) {
  const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
  if (!ln || !need_dx) {
    out[0] = need_dx ? at::_unsafe_view(dx2, x_sizes) : Tensor();
    return;
  }
  const Tensor &x2 = s[ln_saved], &ln_w = s[ln_saved + 1], &ln_b = s[ln_saved + 2];
  auto r = layer_norm_bwd(contig(dx2), gsum.defined() ? OptTensor(contig(gsum.reshape(dx2.sizes()))) : std::nullopt,
                          x2, ln_w, s[ln_saved + 3], s[ln_saved + 4]);
  out[0] = ctx->needs_input_grad(0) ? at::_unsafe_view(r[0], x_sizes) : Tensor();
  out[ln_out] = r[1].scalar_type() == ln_w.scalar_type() ? r[1] : r[1].to(ln_w.scalar_type());
  out[ln_out + 1] = r[2].scalar_type() == ln_b.scalar_type() ? r[2] : r[2].to(ln_b.scalar_type());
}

// The backward's GEMMs from the output gradient's codes: dx = dY W from gq [M, N] (undefined: no dx), dW = dY^T x
// from gq_t [N, Mp] (undefined: no dW)
// wkey: the weight's data pointer, whose gradient goes into its sink when the CUDA-graph step names one
// (weight_grads.cpp; dw is then undefined); nullptr: none. dw_out (defined): dW is written there instead.
std::pair<Tensor, Tensor> backward_gemms(const Tensor& gq, const Tensor& gq_t, const Tensor& sg, const Tensor& xq_t,
                                         const Tensor& wq_t, const Tensor& sx, const Tensor& sw,
                                         at::ScalarType dx_dtype, at::ScalarType w_dtype, const void* wkey,
                                         Tensor dw_out = Tensor()) {
  Tensor dx, dw;
  // dx = dY W: mat2 = W [N, K] column-major, i.e. the transposed codes viewed back
  if (gq.defined()) dx = at::_scaled_mm(gq, wq_t.t(), sg, sw, std::nullopt, std::nullopt, dx_dtype, true);
  // dW = dY^T x: mat1 = dY^T [N, Mp] row-major, mat2 = x [Mp, K] column-major (its transposed codes viewed back)
  if (gq_t.defined()) {
    Tensor sink =
        dw_out.defined() ? Tensor() : weight_grad_overwrite_sink(wkey, gq_t.size(0), xq_t.size(0), w_dtype);
    if (dw_out.defined())
      dw = at::_scaled_mm_out(dw_out, gq_t, xq_t.t(), sg, sx, std::nullopt, std::nullopt, w_dtype, true);
    else if (sink.defined())
      at::_scaled_mm_out(sink, gq_t, xq_t.t(), sg, sx, std::nullopt, std::nullopt, w_dtype, true);
    else
      dw = at::_scaled_mm(gq_t, xq_t.t(), sg, sx, std::nullopt, std::nullopt, w_dtype, true);
  }
  return {dx, dw};
}

inline const void* key_of(AutogradContext* ctx, const char* name) {
  return reinterpret_cast<const void*>(ctx->saved_data[name].toInt());
}
inline int64_t key_value(const Tensor& w) { return reinterpret_cast<int64_t>(w.data_ptr()); }

// [dx2 (or undefined), dW (or undefined)] from the output gradient g2 [M, N]
std::pair<Tensor, Tensor> linear_backward(const Tensor& g2, const Tensor& xq_t, const Tensor& wq_t, const Tensor& sx,
                                          const Tensor& sw, const Use& u, bool need_dx, bool need_dw,
                                          at::ScalarType w_dtype, const void* wkey) {
  const char* op = "fp8_linear backward";
  auto [gq, gq_t] = quantize(op, g2, u.state, u.row(2), to_format(op, u.grad_format), u.current, need_dx, need_dw);
  return backward_gemms(gq, gq_t, scale_inv_of(u.state, u.row(2)), xq_t, wq_t, sx, sw, g2.scalar_type(), w_dtype,
                        wkey);
}

struct Fp8LinearNode : public torch::autograd::Function<Fp8LinearNode> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                        int64_t mode, const Tensor& state, int64_t slot) {
    const Use u = use_of("fp8_linear", mode, state, slot, x);
    const int64_t K = x.size(-1);
    Tensor x2 = contig(x.reshape({-1, K}));
    auto f = linear_forward(x2, weight, bias, u, weight.requires_grad());
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({f[1], f[2], f[3], f[4], state});
    ctx->saved_data["hb"] = present(bias);
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["slot"] = slot;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["wkey"] = key_value(weight);
    return at::_unsafe_view(f[0], sizes);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Tensor& g = grads[0];
    if (!g.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    auto s = ctx->get_saved_variables();
    const Use u{(ctx->saved_data["mode"].toInt() - 1) & 1, ctx->saved_data["mode"].toInt() >= 3, s[4],
                ctx->saved_data["slot"].toInt()};
    const int64_t N = g.size(-1);
    Tensor g2 = contig(g.reshape({-1, N}));
    const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1) && s[0].defined();
    auto [dx2, dw] = linear_backward(g2, s[0], s[1], s[2], s[3], u, need_dx, need_dw,
                                     static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt()),
                                     key_of(ctx, "wkey"));
    Tensor dx = need_dx ? at::_unsafe_view(dx2, ctx->saved_data["x_sizes"].toIntVector()) : Tensor();
    Tensor db = ctx->saved_data["hb"].toBool() && ctx->needs_input_grad(2) ? g2.sum(0) : Tensor();
    return {dx, dw, db, Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

bool fp8_linear_shapes_ok(const Tensor& weight) { return weight.size(0) % 16 == 0 && weight.size(1) % 16 == 0; }

std::vector<Tensor> fp8_linear_forward_codes(const Tensor& x2, const Tensor& weight, int64_t mode,
                                             const Tensor& state, int64_t slot, bool keep_x) {
  const char* op = "fp8_linear_forward_codes";
  LS_CHECK(x2.dim() == 2 && weight.dim() == 2 && x2.size(1) == weight.size(1), op, ": input ", x2.sizes(),
           " does not match weight ", weight.sizes());
  check_projection(op, x2, weight, std::nullopt);
  const Use u = use_of(op, mode, state, slot, x2);
  c10::cuda::CUDAGuard guard(x2.device());
  return linear_forward(contig(x2), weight, std::nullopt, u, keep_x);
}

std::vector<Tensor> fp8_backward_gemms(const Tensor& gq, const OptTensor& gq_t, const Tensor& sg, const Tensor& xq_t,
                                       const Tensor& wq_t, const Tensor& sx, const Tensor& sw, at::ScalarType dtype,
                                       const OptTensor& dw_out) {
  const char* op = "fp8_backward_gemms";
  LS_CHECK(gq.is_cuda() && gq.dim() == 2 && wq_t.dim() == 2 && gq.size(1) == wq_t.size(1), op,
           ": gradient codes ", gq.sizes(), " do not match the weight's transposed codes ", wq_t.sizes());
  if (present(dw_out))
    LS_CHECK(dw_out->scalar_type() == dtype && dw_out->is_contiguous() && dw_out->dim() == 2 &&
                 dw_out->size(0) == wq_t.size(1) && dw_out->size(1) == wq_t.size(0),
             op, ": dw_out must be a contiguous [", wq_t.size(1), ", ", wq_t.size(0), "] tensor of ", dtype);
  c10::cuda::CUDAGuard guard(gq.device());
  auto [dx, dw] = backward_gemms(gq, present(gq_t) ? *gq_t : Tensor(), sg, xq_t, wq_t, sx, sw, dtype, dtype, nullptr,
                                 present(dw_out) ? *dw_out : Tensor());
  return {dx, dw};
}

namespace {

// The codes of a = dropout(act(x2 + bias)) under the input row's (delayed) scale, from one pass over x2: row-major
// codes (rowwise) and/or transposed codes; draw: the forward (the keep bits are drawn into mask, or with
// positive_bits mask gets the bits of a > 0 instead), else the replay (the keep bits are read from mask).
std::pair<Tensor, Tensor> act_codes(const char* op, const Tensor& x2_in, const OptTensor& bias_in, Tensor& mask,
                                    bool draw, bool positive_bits, const std::string& activation, double p,
                                    const Use& u, bool rowwise, bool transposed) {
  const ls::Act act = parse_act(op, activation);
  Tensor x2 = aligned(contig(x2_in));
  const int64_t M = x2.size(0), K = x2.size(1), Mp = padded16(M);
  OptTensor bias = channel_param(op, "bias", bias_in, x2, K);
  if (present(bias)) bias = aligned(contig(*bias));
  const bool drop = p > 0.0 && x2.numel() > 0;
  ls::PhiloxArgs rng{};
  if (draw) {
    mask = at::empty({drop || positive_bits ? ls::mask_bytes(x2.numel()) : 0}, x2.options().dtype(at::kByte));
    if (drop) rng = philox_args();
  }
  Tensor q, q_t;
  std::tie(q, q_t) = empty_codes(x2, M, K, ls::Fp8Format::E4M3, rowwise, transposed);
  uint8_t* keep = drop && !(draw && positive_bits) ? mask.data_ptr<uint8_t>() : nullptr;
  uint8_t* positive = draw && positive_bits && x2.numel() > 0 ? mask.data_ptr<uint8_t>() : nullptr;
  c10::cuda::CUDAGuard guard(x2.device());
  launch(op, [&] {
    ls::fp8_bias_act_dropout(to_dtype(op, x2), x2.data_ptr(), ptr_or_null(bias), keep, positive, draw, M, K,
                             drop ? (float)p : 0.f, act, rng, u.state.data_ptr<float>() + u.row(0) * ls::kFp8Width,
                             rowwise ? q.data_ptr() : nullptr, transposed ? q_t.data_ptr() : nullptr,
                             transposed ? Mp : M, stream());
  });
  return {q, q_t};
}

// What a cast that also sums columns writes: codes [M, K] (rowwise), transposed codes [K, Mp] (transposed), the bias
// gradient [K] (need_db; zero when M is 0) and the fp32 partial sums it is made from.
struct SummedCodes {
  Tensor q, q_t, db, ws;
  int64_t Mp;
  SummedCodes(const Tensor& like, int64_t M, int64_t K, ls::Fp8Format fmt, bool rowwise, bool transposed,
              bool need_db)
      : Mp(padded16(M)) {
    std::tie(q, q_t) = empty_codes(like, M, K, fmt, rowwise, transposed);
    if (need_db) {
      db = M == 0 ? at::zeros({K}, like.options()) : at::empty({K}, like.options());
      ws = at::empty({ls::fp8_grad_partial_floats(M, K, transposed ? Mp : M)}, like.options().dtype(at::kFloat));
    }
  }
  int64_t out_t_rows(int64_t M) const { return q_t.defined() ? Mp : M; }  // the kernels' Mp argument
  void* out() const { return q.defined() ? q.data_ptr() : nullptr; }
  void* out_t() const { return q_t.defined() ? q_t.data_ptr() : nullptr; }
  void* dbias() const { return db.defined() ? db.data_ptr() : nullptr; }
  float* partial() const { return ws.defined() ? ws.data_ptr<float>() : nullptr; }
};

// The codes of dh = the input gradient of a = dropout(act(x2 + bias)) for a's gradient dy2, as bias_act_dropout_bwd
// returns it, under the gradient row of u (rowwise and/or transposed), and the bias gradient (need_db), from one pass
// over dy2 under delayed scaling. x2 undefined (relu): mask holds the bits of a > 0; otherwise the keep bits
// (undefined: no dropout). -> [codes, transposed codes, dbias]
std::vector<Tensor> act_grad_codes(const char* op, const Tensor& dy2_in, const OptTensor& x2, const OptTensor& bias,
                                   const OptTensor& mask, double p, const std::string& activation, const Use& u,
                                   bool rowwise, bool transposed, bool need_db) {
  const ls::Fp8Format fmt = to_format(op, u.grad_format);
  if (u.current) {  // the scale needs dh's own maximum first: dh in the gradient's precision, then its codes
    auto r = bias_act_dropout_bwd(dy2_in, x2, bias, std::nullopt, mask, p, activation, need_db);
    auto [q, q_t] = quantize(op, r[0], u.state, u.row(2), fmt, true, rowwise, transposed);
    return {q, q_t, need_db ? r[1] : Tensor()};
  }
  const ls::Act act = parse_act(op, activation);
  Tensor dy2 = aligned(contig(dy2_in));
  const int64_t M = dy2.size(0), K = dy2.size(1);
  OptTensor x = present(x2) ? OptTensor(aligned(contig(*x2))) : std::nullopt;
  OptTensor b = channel_param(op, "bias", bias, dy2, K);
  if (present(b)) b = aligned(contig(*b));
  // the kernel reads the mask bits of 16 elements as one 2-byte word
  const OptTensor keep = present(mask) ? OptTensor(aligned(contig(*mask))) : std::nullopt;
  const SummedCodes c(dy2, M, K, fmt, rowwise, transposed, need_db);
  c10::cuda::CUDAGuard guard(dy2.device());
  launch(op, [&] {
    ls::fp8_act_dropout_grad(to_dtype(op, dy2), dy2.data_ptr(), ptr_or_null(x), ptr_or_null(b),
                             present(keep) ? keep->data_ptr<uint8_t>() : nullptr, M, K, (float)p, act,
                             u.state.data_ptr<float>() + u.row(2) * ls::kFp8Width, fmt, c.out(), c.out_t(),
                             c.out_t_rows(M), c.dbias(), c.partial(), stream());
  });
  return {c.q, c.q_t, c.db};
}

// The codes of the attention input projection's output gradient, merged from the head gradients parts (at least one
// given; a part not given: zeros) as split_heads_bwd merges them, under the gradient row of u, and the bias gradient
// (need_db); one pass over the head gradients under delayed scaling. -> [codes, transposed codes, dbias]
std::vector<Tensor> merge_codes(const char* op, const std::vector<OptTensor>& parts, const Use& u, bool rowwise,
                                bool transposed, bool need_db) {
  const ls::Fp8Format fmt = to_format(op, u.grad_format);
  const int64_t n = (int64_t)parts.size();
  const Tensor* ref = nullptr;
  for (const auto& p : parts)
    if (present(p)) { ref = &p.value(); break; }
  const int64_t B = ref->size(0), H = ref->size(1), T = ref->size(2), D = ref->size(3), M = B * T, K = n * H * D;
  if (u.current || D % 16 != 0 || n > ls::kMaxSplitParts) {  // merged in the gradient's precision, then quantised
    auto r = split_heads_bwd(parts, need_db);
    auto [q, q_t] = quantize(op, r[0].reshape({M, K}), u.state, u.row(2), fmt, u.current, rowwise, transposed);
    return {q, q_t, need_db ? r[1] : Tensor()};
  }
  const HeadGrads g = gather_head_grads(parts, true);  // the kernel reads 16-byte words
  const SummedCodes c(*ref, M, K, fmt, rowwise, transposed, need_db);
  c10::cuda::CUDAGuard guard(ref->device());
  launch(op, [&] {
    ls::fp8_merge_heads_grad(to_dtype(op, *ref), g.ptrs.data(), checked_int(op, "batch", B),
                             checked_int(op, "length", T), (int)n, checked_int(op, "heads", H),
                             checked_int(op, "head_dim", D), g.token_major,
                             u.state.data_ptr<float>() + u.row(2) * ls::kFp8Width, fmt, c.out(), c.out_t(),
                             c.out_t_rows(M), c.dbias(), c.partial(), stream());
  });
  return {c.q, c.q_t, c.db};
}

// The bits of a > 0 in the dropout mask's layout (a's size a multiple of 8)
Tensor positive_bits_of(const Tensor& a) {
  Tensor weights = at::pow(2, at::arange(8, a.options().dtype(at::kInt))).to(at::kByte);
  return (a.reshape({-1, 8}) > 0).to(at::kByte).mul(weights).sum(1, false, at::kByte);
}

}  // namespace

std::vector<Tensor> fp8_act_linear_forward(const Tensor& x2, const OptTensor& bias, const Tensor& weight,
                                           const std::string& activation, double p, int64_t mode,
                                           const OptTensor& state, int64_t slot, bool keep_codes,
                                           bool positive_bits) {
  const char* op = "fp8_bias_act_linear";
  const Use u = use_of(op, mode, state, slot, x2);
  LS_CHECK(!positive_bits || (keep_codes && activation == "relu"), op,
           ": the bits of a > 0 replace the dropout mask only for relu with the codes kept");
  if (u.current) {  // the scale needs a's own maximum first: a in the input's precision, then its codes
    auto r = bias_act_dropout_fwd(x2, bias, activation, p);
    auto f = linear_forward(r[0], weight, std::nullopt, u, keep_codes);
    return {f[0], positive_bits ? positive_bits_of(r[0]) : r[1], f[1], f[2], f[3], f[4]};
  }
  Tensor mask;
  auto [aq, aq_t] = act_codes(op, x2, bias, mask, true, positive_bits, activation, p, u, true, keep_codes);
  auto [wq, wq_t] = weight_codes_of(op, weight, u);  // delayed scaling here (current returned above)
  Tensor sa = scale_inv_of(u.state, u.row(0)), sw = scale_inv_of(u.state, u.row(1));
  Tensor y2 = at::_scaled_mm(aq, wq.t(), sa, sw, std::nullopt, std::nullopt, x2.scalar_type(), true);
  return {y2, mask, aq_t, wq_t, sa, sw};
}

Tensor fp8_act_codes_t(const Tensor& x2, const OptTensor& bias, const OptTensor& mask, const std::string& activation,
                       double p, int64_t mode, const OptTensor& state, int64_t slot) {
  const char* op = "fp8_bias_act_linear backward";
  const Use u = use_of(op, mode, state, slot, x2);
  if (u.current)  // as the forward: a in the input's precision, quantised under the scale the forward set
    return quantize(op, bias_act_dropout_replay(x2, bias, mask, activation, p), u.state, u.row(0),
                    ls::Fp8Format::E4M3, true, false, true).second;
  Tensor m = p > 0.0 && x2.numel() > 0 ? *mask : Tensor();
  return act_codes(op, x2, bias, m, false, false, activation, p, u, false, true).second;
}

std::vector<Tensor> fp8_linear_backward_codes(const Tensor& g2, const Tensor& xq_t, const Tensor& wq_t,
                                              const Tensor& sx, const Tensor& sw, int64_t mode,
                                              const OptTensor& state, int64_t slot, bool need_dw, const void* wkey) {
  const Use u = use_of("fp8_linear backward", mode, state, slot, g2);
  auto [dx, dw] = linear_backward(g2, xq_t, wq_t, sx, sw, u, true, need_dw && xq_t.defined(), g2.scalar_type(),
                                  wkey);
  return {dx, dw};
}

namespace {

// The FFN block's projections as one node: out = residual + dropout(dropout(act(x W1^T + b1)) W2^T + b2) with both
// projections in FP8, so that the gradients reaching each projection's output leave the kernel that computes them
// as codes: the residual dropout's backward writes the second projection's (with b2's gradient summed on the way),
// the activation's backward the first one's (with b1's); neither is stored in the model's precision nor quantised
// by a pass of its own. The forward is the chain ag_fp8_linear -> ag_bias_act_linear(keep_codes) ->
// ag_bias_dropout_residual would record, and every value but the bias gradients (the same sums in another order)
// equals that chain's bit for bit.
struct Fp8FfnNode : public torch::autograd::Function<Fp8FfnNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& w1, const OptTensor& b1,
                               const Tensor& w2, const OptTensor& b2, const Tensor& residual,
                               const std::string& activation, double p, double p_out, int64_t mode,
                               const Tensor& state, int64_t slot1, int64_t slot2, bool keep_codes,
                               const OptTensor& ln_w, const OptTensor& ln_b, double eps) {
    const char* op = "fp8_ffn";
    const Use u1 = use_of(op, mode, state, slot1, x);  // slot2: checked by ag_fp8_ffn and fp8_act_linear_forward
    Tensor x2 = contig(x.reshape({-1, x.size(-1)}));
    const bool ln = present(ln_w);  // pre-LN: the first projection's input is layer_norm(x), residual is x
    // f1: [h2, xq_t, w1q_t, sx, sw1]
    auto [f1, ln_keep] = first_forward(op, x2, ln_w, ln_b, eps, w1, std::nullopt, u1, w1.requires_grad());
    const bool relu_bits = keep_codes && activation == "relu";  // relu's backward needs only the bits of a > 0
    auto f2 = fp8_act_linear_forward(f1[0], b1, w2, activation, p, mode, state, slot2, keep_codes, relu_bits);
    const Tensor res2 = ln ? x2 : contig(residual.reshape({-1, w2.size(0)}));
    auto o = bias_dropout_residual_fwd(f2[0], b2, res2, p_out);  // [out, mask]
    auto sizes = x.sizes().vec();
    sizes.back() = w2.size(0);
    ctx->set_materialize_grads(false);
    // h2 f2[1]=mask  xq_t w1q_t sx sw1  aq_t w2q_t sa sw2  b1 state  mask_out  (ln: x2 ln_w ln_b mean rstd)
    std::vector<Tensor> keep = {relu_bits ? Tensor() : f1[0], f2[1], f1[1], f1[2], f1[3], f1[4], f2[2], f2[3], f2[4],
                                f2[5], present(b1) ? *b1 : Tensor(), state, o[1]};
    keep.insert(keep.end(), ln_keep.begin(), ln_keep.end());
    ctx->save_for_backward(keep);
    ctx->saved_data["ln"] = ln;
    ctx->mark_non_differentiable({f2[1], o[1]});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["act"] = activation;
    ctx->saved_data["p"] = p;
    ctx->saved_data["p_out"] = p_out;
    ctx->saved_data["hb2"] = present(b2);
    ctx->saved_data["relu_bits"] = relu_bits;
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["slot1"] = slot1;
    ctx->saved_data["slot2"] = slot2;
    ctx->saved_data["w1key"] = key_value(w1);
    ctx->saved_data["w2key"] = key_value(w2);
    return {at::_unsafe_view(o[0], sizes), f2[1], o[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const char* op = "fp8_ffn backward";
    const Tensor& g = grads[0];
    const variable_list none(17);
    if (!g.defined()) return none;
    const bool ln = ctx->saved_data["ln"].toBool();
    auto s = ctx->get_saved_variables();
    const Tensor &h2 = s[0], &mask_t = s[1], &xq_t = s[2], &w1q_t = s[3], &sx = s[4], &sw1 = s[5];
    const Tensor &sa = s[8], &sw2 = s[9], &mask_out = s[12];
    const OptTensor b1 = opt_of(s[10]);
    const Tensor& state = s[11];
    const std::string act = ctx->saved_data["act"].toStringRef();
    const double p = ctx->saved_data["p"].toDouble(), p_out = ctx->saved_data["p_out"].toDouble();
    const bool relu_bits = ctx->saved_data["relu_bits"].toBool();
    const int64_t mode = ctx->saved_data["mode"].toInt(), slot2 = ctx->saved_data["slot2"].toInt();
    const Use u1 = use_of(op, mode, state, ctx->saved_data["slot1"].toInt(), g);
    const Use u2 = use_of(op, mode, state, slot2, g);
    const OptTensor mask = p > 0 || relu_bits ? OptTensor(mask_t) : std::nullopt;
    // (needs_input_grad counts the tensor arguments: x w1 b1 w2 b2 residual state ln_w ln_b)
    const bool need_ln = ln && (ctx->needs_input_grad(7) || ctx->needs_input_grad(8));
    const bool need_dx = ctx->needs_input_grad(0) || need_ln, need_dw1 = ctx->needs_input_grad(1) && xq_t.defined();
    const bool need_db = present(b1) && ctx->needs_input_grad(2), need_dw2 = ctx->needs_input_grad(3);
    const bool need_db2 = ctx->saved_data["hb2"].toBool() && ctx->needs_input_grad(4);

    Tensor g2 = contig(g.reshape({-1, g.size(-1)}));
    Tensor aq_t = s[6];
    if (!aq_t.defined() && need_dw2) aq_t = fp8_act_codes_t(h2, b1, mask, act, p, mode, state, slot2);
    // the second projection's output gradient: the residual dropout's backward of g, as codes
    auto c2 = act_grad_codes(op, g2, std::nullopt, std::nullopt, p_out > 0 ? OptTensor(mask_out) : std::nullopt,
                             p_out, "none", u2, true, need_dw2 && aq_t.defined(), need_db2);
    auto [da2, dw2] = backward_gemms(c2[0], c2[1], scale_inv_of(state, u2.row(2)), aq_t, s[7], sa, sw2,
                                     g2.scalar_type(), g2.scalar_type(), key_of(ctx, "w2key"));
    auto c = act_grad_codes(op, da2, relu_bits ? std::nullopt : OptTensor(h2), b1, mask, p, act, u1, need_dx,
                            need_dw1, need_db);
    auto [dx2, dw1] = backward_gemms(c[0], c[1], scale_inv_of(state, u1.row(2)), xq_t, w1q_t, sx, sw1,
                                     g2.scalar_type(), g2.scalar_type(), key_of(ctx, "w1key"));
    variable_list out(17);
    input_grads(ctx, out, dx2, g, ln, need_dx, s, 13, 14);  // with ln, g (the residual's gradient) joins x's there
    out[1] = dw1;
    out[2] = need_db ? c[2] : Tensor();
    out[3] = need_dw2 ? dw2 : Tensor();
    out[4] = need_db2 ? c2[2] : Tensor();
    out[5] = !ln && ctx->needs_input_grad(5) ? g : Tensor();  // the residual's gradient: g itself
    return out;
  }
};

}  // namespace

namespace {
// What the FFN node needs of its arguments but the residual -> the first projection's use of the state
Use checked_ffn(const char* op, const Tensor& x, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
                const OptTensor& b2, const std::string& activation, double p, double p_out, int64_t mode,
                const OptTensor& state, int64_t slot1, int64_t slot2) {
  LS_CHECK(x.dim() >= 2 && w1.dim() == 2 && w2.dim() == 2 && x.size(-1) == w1.size(1) && w2.size(1) == w1.size(0),
           op, ": input ", x.sizes(), ", first weight ", w1.sizes(), " and second weight ", w2.sizes(),
           " do not chain");
  check_projection(op, x, w1, b1);
  check_projection(op, x, w2, b2);
  check_p(op, p);
  check_p(op, p_out);
  parse_act(op, activation);
  const Use u = use_of(op, mode, state, slot1, x);
  use_of(op, mode, state, slot2, x);
  return u;
}
}  // namespace

std::vector<Tensor> ag_fp8_ffn(const Tensor& x, const Tensor& w1, const OptTensor& b1, const Tensor& w2,
                               const OptTensor& b2, const Tensor& residual, const std::string& activation, double p,
                               double p_out, int64_t mode, const OptTensor& state, int64_t slot1, int64_t slot2,
                               bool keep_codes) {
  const char* op = "fp8_ffn";
  const Use u = checked_ffn(op, x, w1, b1, w2, b2, activation, p, p_out, mode, state, slot1, slot2);
  check_residual(op, residual, x, w2.size(0));
  if (x.numel() == 0) {
    auto r = ag_bias_act_dropout(ag_linear(x, w1, std::nullopt), b1, activation, p);
    auto o = ag_bias_dropout_residual(ag_linear(r[0], w2, std::nullopt), b2, residual, p_out);
    return {o[0], r[1], o[1]};
  }
  return Fp8FfnNode::apply(x, w1, b1, w2, b2, residual, activation, p, p_out, mode, u.state, slot1, slot2,
                           keep_codes, std::nullopt, std::nullopt, 0.0);
}

std::vector<Tensor> ag_fp8_ln_ffn(const Tensor& x, const Tensor& ln_w, const Tensor& ln_b, double eps,
                                  const Tensor& w1, const OptTensor& b1, const Tensor& w2, const OptTensor& b2,
                                  const std::string& activation, double p, double p_out, int64_t mode,
                                  const OptTensor& state, int64_t slot1, int64_t slot2, bool keep_codes) {
  const char* op = "fp8_ln_ffn";
  if (x.numel() == 0) {  // the chain
    auto r = ag_pre_layer_norm(x, ln_w, ln_b, eps, false);
    return ag_fp8_ffn(r[0], w1, b1, w2, b2, r[1], activation, p, p_out, mode, state, slot1, slot2, keep_codes);
  }
  const Use u = checked_ffn(op, x, w1, b1, w2, b2, activation, p, p_out, mode, state, slot1, slot2);
  check_residual(op, x, x, w2.size(0));  // x is the residual: the FFN maps it to its own size
  // x's gradient as the residual reaches x through the layer norm's backward, not as the residual input's
  return Fp8FfnNode::apply(x, w1, b1, w2, b2, x, activation, p, p_out, mode, u.state, slot1, slot2, keep_codes,
                           ln_w, ln_b, eps);
}

namespace {

// An attention block's output projection and the block's residual dropout as one FP8 node: out = residual +
// dropout(x W^T + b), so that the projection's output gradient leaves the dropout's backward as codes (with b's
// gradient summed on the way) and is neither stored in the model's precision nor quantised by a pass of its own,
// as the FFN node's second projection. The forward is the chain ag_fp8_linear -> ag_bias_dropout_residual would
// record, and every value but the bias gradient (the same sum in another order) equals that chain's bit for bit.
struct Fp8LinearResidualNode : public torch::autograd::Function<Fp8LinearResidualNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                               const Tensor& residual, double p, int64_t mode, const Tensor& state, int64_t slot) {
    const Use u = use_of("fp8_linear_residual", mode, state, slot, x);
    Tensor x2 = contig(x.reshape({-1, x.size(-1)}));
    auto f = linear_forward(x2, weight, std::nullopt, u, weight.requires_grad());  // [y2, xq_t, wq_t, sx, sw]
    auto o = bias_dropout_residual_fwd(f[0], bias, contig(residual.reshape({-1, weight.size(0)})), p);
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({f[1], f[2], f[3], f[4], state, o[1]});
    ctx->mark_non_differentiable({o[1]});
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["hb"] = present(bias);
    ctx->saved_data["p"] = p;
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["slot"] = slot;
    ctx->saved_data["wkey"] = key_value(weight);
    return {at::_unsafe_view(o[0], sizes), o[1]};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const char* op = "fp8_linear_residual backward";
    const Tensor& g = grads[0];
    if (!g.defined()) return variable_list(8);
    auto s = ctx->get_saved_variables();
    const Tensor &xq_t = s[0], &wq_t = s[1], &sx = s[2], &sw = s[3], &state = s[4], &mask = s[5];
    const Use u = use_of(op, ctx->saved_data["mode"].toInt(), state, ctx->saved_data["slot"].toInt(), g);
    const double p = ctx->saved_data["p"].toDouble();
    const bool need_dx = ctx->needs_input_grad(0), need_dw = ctx->needs_input_grad(1) && xq_t.defined();
    const bool need_db = ctx->saved_data["hb"].toBool() && ctx->needs_input_grad(2);
    Tensor g2 = contig(g.reshape({-1, g.size(-1)}));
    // the projection's output gradient: the residual dropout's backward of g, as codes (row-major codes also when
    // only the bias gradient is asked for: the kernel writes at least one layout)
    auto c = act_grad_codes(op, g2, std::nullopt, std::nullopt, p > 0 ? OptTensor(mask) : std::nullopt, p, "none", u,
                            need_dx || !need_dw, need_dw, need_db);
    auto [dx2, dw] = backward_gemms(need_dx ? c[0] : Tensor(), c[1], scale_inv_of(state, u.row(2)), xq_t, wq_t, sx,
                                    sw, g2.scalar_type(), g2.scalar_type(), key_of(ctx, "wkey"));
    variable_list out(8);
    out[0] = need_dx ? at::_unsafe_view(dx2, ctx->saved_data["x_sizes"].toIntVector()) : Tensor();
    out[1] = dw;
    out[2] = need_db ? c[2] : Tensor();
    out[3] = ctx->needs_input_grad(3) ? g : Tensor();  // the residual's gradient: g itself
    return out;
  }
};

}  // namespace

std::vector<Tensor> ag_fp8_linear_residual(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                           const Tensor& residual, double p, int64_t mode, const OptTensor& state,
                                           int64_t slot) {
  const char* op = "fp8_linear_residual";
  LS_CHECK(x.dim() >= 2 && weight.dim() == 2 && x.size(-1) == weight.size(1), op, ": input ", x.sizes(),
           " does not match weight ", weight.sizes());
  check_residual(op, residual, x, weight.size(0));
  check_projection(op, x, weight, bias);
  check_p(op, p);
  const Use u = use_of(op, mode, state, slot, x);
  if (x.numel() == 0) return ag_bias_dropout_residual(ag_linear(x, weight, std::nullopt), bias, residual, p);
  return Fp8LinearResidualNode::apply(x, weight, bias, residual, p, mode, u.state, slot);
}

namespace {

// The attention's input projection and its head split as one FP8 node: x W^T (+ bias) -> n parts [B, H, T, D], views
// of the GEMM's output (the bias added in its epilogue), so that nothing is copied in the forward and the output
// gradient leaves the heads' gradients as codes (with the bias gradient summed on the way), never merged in the
// model's precision nor quantised by a pass of its own. Every value but the bias gradient (the same sum in another
// order) equals bit for bit that of the chain ag_fp8_linear (with the bias) -> the heads as views of its output.
// With ln_w (a pre-LN block): x is the block's input and the projection's input is layer_norm(x) (ln_w, ln_b, eps),
// made by pre_ln_codes as codes only; the node then also returns x (the block's residual), whose gradient the layer
// norm's backward adds into x's, as PreLayerNormNode does.
struct Fp8LinearSplitNode : public torch::autograd::Function<Fp8LinearSplitNode> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                               int64_t n, int64_t num_heads, int64_t mode, const Tensor& state, int64_t slot,
                               const OptTensor& ln_w, const OptTensor& ln_b, double eps) {
    const char* op = "fp8_linear_split";
    const Use u = use_of(op, mode, state, slot, x);
    Tensor x2 = contig(x.reshape({-1, x.size(-1)}));
    const bool ln = present(ln_w);
    // the bias in the GEMM's epilogue; the parts are views of its output (as ag_linear_split's, autograd.cpp)
    // f: [y2, xq_t, wq_t, sx, sw]
    auto [f, ln_keep] = first_forward(op, x2, ln_w, ln_b, eps, weight, bias, u, weight.requires_grad());
    ctx->set_materialize_grads(false);
    std::vector<Tensor> keep = {f[1], f[2], f[3], f[4], state};
    keep.insert(keep.end(), ln_keep.begin(), ln_keep.end());
    ctx->save_for_backward(keep);
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["hb"] = present(bias);
    ctx->saved_data["n"] = n;
    ctx->saved_data["ln"] = ln;
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["slot"] = slot;
    ctx->saved_data["dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["wkey"] = key_value(weight);
    auto out = head_views(f[0], x.size(0), x.size(1), n, num_heads);
    if (ln) out.push_back(x.view_as(x));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const char* op = "fp8_linear_split backward";
    const int64_t n = ctx->saved_data["n"].toInt();
    const bool ln = ctx->saved_data["ln"].toBool();
    const Tensor gx = ln && (int64_t)grads.size() > n ? grads[n] : Tensor();  // the residual's gradient
    const auto d = part_grads(grads, n);
    variable_list out(11);
    if (d.empty()) {
      out[0] = gx;
      return out;
    }
    auto s = ctx->get_saved_variables();
    const Tensor &xq_t = s[0], &wq_t = s[1], &sx = s[2], &sw = s[3], &state = s[4];
    const Use u = use_of(op, ctx->saved_data["mode"].toInt(), state, ctx->saved_data["slot"].toInt(), state);
    // (needs_input_grad counts the tensor arguments: x, weight, bias, state, ln_w, ln_b)
    const bool need_ln = ln && (ctx->needs_input_grad(4) || ctx->needs_input_grad(5));
    const bool need_dx = ctx->needs_input_grad(0) || need_ln;
    const bool need_dw = ctx->needs_input_grad(1) && xq_t.defined();
    const bool need_db = ctx->saved_data["hb"].toBool() && ctx->needs_input_grad(2);
    auto c = merge_codes(op, d, u, need_dx, need_dw, need_db);
    const auto dt = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    auto [dx2, dw] = backward_gemms(c[0], c[1], scale_inv_of(state, u.row(2)), xq_t, wq_t, sx, sw, dt, dt,
                                    key_of(ctx, "wkey"));
    input_grads(ctx, out, dx2, gx, ln, need_dx, s, 5, 8);
    out[1] = dw;
    out[2] = need_db ? c[2] : Tensor();
    return out;
  }
};

}  // namespace

namespace {
// What the projection + head split node needs of its arguments -> the projection's use of the state
Use checked_split(const char* op, const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t n,
                  int64_t num_heads, int64_t mode, const OptTensor& state, int64_t slot) {
  LS_CHECK(n >= 1, op, ": n must be >= 1, got ", n);
  LS_CHECK(num_heads >= 1 && weight.dim() == 2 && weight.size(0) % (n * num_heads) == 0, op, ": weight ",
           weight.sizes(), " does not split into ", n, " parts of ", num_heads, " heads");
  LS_CHECK(x.dim() == 3 && x.size(-1) == weight.size(1), op, ": input ", x.sizes(), " does not match weight ",
           weight.sizes(), " (expected [batch, length, ", weight.size(1), "])");
  check_projection(op, x, weight, bias);
  return use_of(op, mode, state, slot, x);
}
}  // namespace

std::vector<Tensor> ag_fp8_linear_split(const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t n,
                                        int64_t num_heads, int64_t mode, const OptTensor& state, int64_t slot) {
  const Use u = checked_split("fp8_linear_split", x, weight, bias, n, num_heads, mode, state, slot);
  if (x.numel() == 0) return ag_split_heads(ag_linear(x, weight, std::nullopt), bias, n, num_heads);
  return Fp8LinearSplitNode::apply(x, weight, bias, n, num_heads, mode, u.state, slot, std::nullopt, std::nullopt,
                                   0.0);
}

std::vector<Tensor> ag_fp8_ln_linear_split(const Tensor& x, const Tensor& ln_w, const Tensor& ln_b, double eps,
                                           const Tensor& weight, const OptTensor& bias, int64_t n, int64_t num_heads,
                                           int64_t mode, const OptTensor& state, int64_t slot) {
  if (x.numel() == 0) {  // the chain
    auto r = ag_pre_layer_norm(x, ln_w, ln_b, eps, false);
    auto parts = ag_fp8_linear_split(r[0], weight, bias, n, num_heads, mode, state, slot);
    parts.push_back(r[1]);
    return parts;
  }
  const Use u = checked_split("fp8_ln_linear_split", x, weight, bias, n, num_heads, mode, state, slot);
  return Fp8LinearSplitNode::apply(x, weight, bias, n, num_heads, mode, u.state, slot, ln_w, ln_b, eps);
}

std::vector<Tensor> fp8_quantize(const Tensor& x, const Tensor& state, int64_t row, int64_t format, bool current,
                                 bool rowwise, bool transposed) {
  const char* op = "fp8_quantize";
  LS_CHECK_INPUT(op, x);
  to_dtype(op, x);
  LS_CHECK(x.dim() == 2 && x.size(1) % 16 == 0, op, ": expected a 2-d tensor whose rows are a multiple of 16 long, got ",
           x.sizes());
  LS_CHECK(row >= 0, op, ": row must be >= 0, got ", row);
  check_state(op, state, row + 1, x);
  auto [q, q_t] = quantize(op, x, state, row, to_format(op, format), current, rowwise, transposed);
  return {q, q_t};
}

void fp8_cast_weights(const std::vector<Tensor>& weights, const Tensor& state, const std::vector<int64_t>& rows) {
  const char* op = "fp8_cast_weights";
  LS_CHECK(weights.size() == rows.size(), op, ": ", weights.size(), " weights but ", rows.size(), " state rows");
  std::lock_guard<std::mutex> lock(weight_codes_mutex);
  auto& codes = weight_codes();
  codes.clear();
  if (weights.empty()) return;
  LS_CHECK(state.is_cuda(), op, ": FP8 state must be a CUDA tensor");
  const ls::DType dt = to_dtype(op, weights[0]);
  std::vector<ls::Fp8CastJob> jobs;
  for (size_t k = 0; k < weights.size(); ++k) {
    const Tensor& w = weights[k];
    LS_CHECK(w.is_cuda() && w.dim() == 2 && w.scalar_type() == weights[0].scalar_type(), op, ": weight ", k,
             " must be a 2-d CUDA tensor of ", weights[0].scalar_type());
    LS_CHECK(fp8_linear_shapes_ok(w), op, ": weight ", k, " ", w.sizes(), " must have sizes that are multiples of 16");
    LS_CHECK(rows[k] >= 0, op, ": state row ", rows[k], " of weight ", k);
    check_state(op, state, rows[k] + 1, w);
    // a weight the kernel cannot read as it is (a view, unaligned) is cast by its projection instead
    if (!w.is_contiguous() || reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 != 0 || w.numel() == 0) continue;
    auto [q, q_t] = empty_codes(w, w.size(0), w.size(1), ls::Fp8Format::E4M3, true, true);
    jobs.push_back({w.data_ptr(), q.data_ptr(), q_t.data_ptr(), state.data_ptr<float>() + rows[k] * ls::kFp8Width,
                    w.size(0), w.size(1), padded16(w.size(0))});
    LS_CHECK(codes.emplace(w.data_ptr(), WeightCodes{q, q_t, state.data_ptr(), rows[k]}).second, op, ": weight ", k,
             " is listed twice");
  }
  c10::cuda::CUDAGuard guard(state.device());
  launch(op, [&] { ls::fp8_quantize_many(dt, jobs.data(), (int)jobs.size(), ls::Fp8Format::E4M3, stream()); });
}

int64_t fp8_forget_weights() {
  std::lock_guard<std::mutex> lock(weight_codes_mutex);
  const int64_t left = (int64_t)weight_codes().size();
  weight_codes().clear();
  return left;
}

// The loss and nll sums of the head as ls_cross_entropy_fwd_bwd computes them, and the gradient of
// grad_scale * loss sum only as FP8 codes in `format`: exactly the codes fp8_quantize would make of the gradient
// that ls_cross_entropy_fwd_bwd writes, under the delayed scale of state row `row` (whose amax records the
// gradient's maximum). A pass per row makes the loss's statistics and a tile pass over the logits the codes: the
// row-major codes [N, V] and, when `transposed`, the transposed codes [V, padded16(N)] (what the weight-gradient
// GEMM reads). The logits are left as they are: the gradient is never stored in their precision. V a multiple of
// 16.
std::vector<Tensor> ls_cross_entropy_fwd_bwd_fp8(const Tensor& logits, const Tensor& target, double epsilon,
                                                 int64_t ignore_index, const OptTensor& grad_scale,
                                                 const Tensor& state, int64_t row, int64_t format, bool transposed) {
  const char* op = "ls_cross_entropy_fwd_bwd_fp8";
  check_ce(op, logits, target);
  LS_CHECK(epsilon >= 0.0 && epsilon < 1.0, op, ": label smoothing must be in [0, 1), got ", epsilon);
  LS_CHECK(logits.size(1) % 16 == 0, op, ": the vocabulary (", logits.size(1),
           ") must be a multiple of 16 for FP8 codes");
  LS_CHECK(row >= 0, op, ": row must be >= 0, got ", row);
  check_state(op, state, row + 1, logits);
  check_grad_scale(op, grad_scale, logits);
  const ls::Fp8Format fmt = to_format(op, format);
  const ls::DType dt = to_dtype(op, logits);
  Tensor x = aligned(logits);
  const int64_t N = x.size(0), V = x.size(1), Mp = padded16(N);
  Tensor q, q_t;
  std::tie(q, q_t) = empty_codes(x, N, V, fmt, true, transposed);
  Tensor losses = at::empty({2, N}, x.options().dtype(at::kFloat));
  Tensor lse = at::empty({N}, x.options().dtype(at::kFloat));
  float* fp8_row = state.data_ptr<float>() + row * ls::kFp8Width;
  c10::cuda::CUDAGuard guard(x.device());
  launch(op, [&] {
    ls::ls_cross_entropy_fwd_bwd_fp8(dt, x.data_ptr(), target.data_ptr<int64_t>(), losses.data_ptr<float>(),
                                     present(grad_scale) ? grad_scale->data_ptr<float>() : nullptr, N,
                                     checked_int(op, "vocab", V), (float)epsilon, ignore_index,
                                     lse.data_ptr<float>(), fp8_row, fmt, q.data_ptr(),
                                     transposed ? q_t.data_ptr() : nullptr, Mp, stream());
  });
  Tensor sums = N > 0 ? losses.sum(1) : at::zeros({2}, losses.options());
  return {sums[0].clone(), sums[1].clone(), q, q_t};
}

void fp8_roll(const Tensor& state, int64_t grad_format) {
  const char* op = "fp8_roll";
  LS_CHECK(state.is_cuda(), op, ": FP8 state must be a CUDA tensor");
  check_state(op, state, 0, state);
  c10::cuda::CUDAGuard guard(state.device());
  launch(op, [&] { ls::fp8_roll(state.data_ptr<float>(), state.size(0), to_format(op, grad_format), stream()); });
}

Tensor ag_fp8_linear(const Tensor& x, const Tensor& weight, const OptTensor& bias, int64_t mode,
                     const OptTensor& state, int64_t slot) {
  const char* op = "fp8_linear";
  LS_CHECK(x.dim() >= 2 && weight.dim() == 2 && x.size(-1) == weight.size(1), op, ": input ", x.sizes(),
           " does not match weight ", weight.sizes());
  check_projection(op, x, weight, bias);
  const Use u = use_of(op, mode, state, slot, x);
  if (x.numel() == 0) return ag_linear(x, weight, bias);
  return Fp8LinearNode::apply(x, weight, bias, mode, u.state, slot);
}

Tensor ag_linear_mode(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Fp8Args& fp8) {
  if (fp8.mode > 0 && fp8_linear_shapes_ok(weight) && x.dim() >= 2)
    return ag_fp8_linear(x, weight, bias, fp8.mode, fp8.state, fp8.slot);
  return ag_linear(x, weight, bias);
}

}  // namespace ls_torch
