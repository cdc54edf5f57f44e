// ATen adapters of the FP8 linear layers (Hopper, Ada): the casts to FP8 codes under delayed per-tensor scaling,
// the weights' codes made ahead for a training forward, the fused casts (the FFN's activation, its gradient, the
// attention heads' merged gradient) and the layer's GEMMs through at::_scaled_mm (cuBLASLt) with the output in the
// input's dtype:
//
// Forward:   y  = [x]_e4m3 [W]_e4m3^T
// Backward:  dx = [dY]_g [W]_e4m3                          (g: the gradient format, e4m3 or e5m2)
//            dW = [dY]_g^T [x]_e4m3                         (the same codes of dY and x, transposed)
//
// The scaling state is a float32 tensor of [3 * linears, kFp8Width] owned by the model (ls_fairseq/ops/fp8.py:
// Fp8State); a linear takes rows 3 slot (input), 3 slot + 1 (weight), 3 slot + 2 (output gradient). mode: 0 off;
// 1 + the gradient format (0 e4m3, 1 e5m2), + 2 for current scaling (the first forward and backward of a state).
// The autograd nodes over these pieces are in fp8_nodes.cpp; the layouts, the fast accumulation and the padding of
// the transposed codes are described in docs/fp8.md ("Kernels and layouts").
#include <torch/extension.h>

#include <mutex>
#include <unordered_map>

#include "torch/fp8.h"

namespace ls_torch {

using namespace fp8_impl;

namespace fp8_impl {

ls::Fp8Format to_format(const char* op, int64_t f) {
  LS_CHECK(f == 0 || f == 1, op, ": FP8 format must be 0 (e4m3) or 1 (e5m2), got ", f);
  return f == 0 ? ls::Fp8Format::E4M3 : ls::Fp8Format::E5M2;
}

int64_t padded16(int64_t m) { return (m + 15) / 16 * 16; }

Tensor aligned(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();  // the kernels read 16-byte words
}

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

}  // namespace fp8_impl

namespace {

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

}  // namespace

namespace fp8_impl {

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

// The backward's GEMMs from the output gradient's codes: dx = dY W from gq [M, N] (undefined: no dx), dW = dY^T x
// from gq_t [N, Mp] (undefined: no dW)
// wkey: the weight's data pointer, whose gradient goes into its sink when the CUDA-graph step names one
// (weight_grads.cpp; dw is then undefined); nullptr: none. dw_out (defined): dW is written there instead.
std::pair<Tensor, Tensor> backward_gemms(const Tensor& gq, const Tensor& gq_t, const Tensor& sg, const Tensor& xq_t,
                                         const Tensor& wq_t, const Tensor& sx, const Tensor& sw,
                                         at::ScalarType dx_dtype, at::ScalarType w_dtype, const void* wkey,
                                         Tensor dw_out) {
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

// [dx2 (or undefined), dW (or undefined)] from the output gradient g2 [M, N]
std::pair<Tensor, Tensor> linear_backward(const Tensor& g2, const Tensor& xq_t, const Tensor& wq_t, const Tensor& sx,
                                          const Tensor& sw, const Use& u, bool need_dx, bool need_dw,
                                          at::ScalarType w_dtype, const void* wkey) {
  const char* op = "fp8_linear backward";
  auto [gq, gq_t] = quantize(op, g2, u.state, u.row(2), to_format(op, u.grad_format), u.current, need_dx, need_dw);
  return backward_gemms(gq, gq_t, scale_inv_of(u.state, u.row(2)), xq_t, wq_t, sx, sw, g2.scalar_type(), w_dtype,
                        wkey);
}

}  // namespace fp8_impl

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

// The bits of a > 0 in the dropout mask's layout (a's size a multiple of 8)
Tensor positive_bits_of(const Tensor& a) {
  Tensor weights = at::pow(2, at::arange(8, a.options().dtype(at::kInt))).to(at::kByte);
  return (a.reshape({-1, 8}) > 0).to(at::kByte).mul(weights).sum(1, false, at::kByte);
}

}  // namespace

namespace fp8_impl {

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

}  // namespace fp8_impl

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

void fp8_roll(const Tensor& state, int64_t grad_format) {
  const char* op = "fp8_roll";
  LS_CHECK(state.is_cuda(), op, ": FP8 state must be a CUDA tensor");
  check_state(op, state, 0, state);
  c10::cuda::CUDAGuard guard(state.device());
  launch(op, [&] { ls::fp8_roll(state.data_ptr<float>(), state.size(0), to_format(op, grad_format), stream()); });
}

}  // namespace ls_torch
