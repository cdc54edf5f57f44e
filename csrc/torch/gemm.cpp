// GEMM tuning: the layers' products through the cuBLASLt algorithm measured fastest for their shape.
//
// For a product, cuBLASLt's heuristic proposes several algorithms (tile and cluster shapes, splits of the sum) and
// ATen runs the first. For the projections of a transformer the first is often not the fastest. With tuning on
// (gemm_tuning_enable), a product whose class (its sizes except the token count, its layouts, dtypes, bias and
// accumulation) has no decision yet is measured the first time it runs outside a CUDA-graph capture: at each token
// count of the grid, the ATen call and cuBLASLt's first candidates run on scratch operands (no random numbers are
// drawn), timed with CUDA events, and the fastest is kept. Every later product of the class runs the choice made at
// the grid's token count nearest its own: in cuBLASLt when that algorithm applies to its exact sizes (checked once
// per shape), else through ATen. Under capture a class without a decision takes ATen. The decisions can be exported
// (checkpoints keep them, so a resumed run computes with the same algorithms) and imported.
//
// cuBLASLt is the one torch loaded: its functions are looked up in the process (no link-time dependency), and
// without its header at build time, or without the library at run time, every product takes ATen.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "torch/ops.h"

#if __has_include(<cublasLt.h>)
#include <cublasLt.h>
#define LS_HAVE_CUBLASLT 1
#else
#define LS_HAVE_CUBLASLT 0
#endif

namespace ls_torch {
namespace {

// One product C[m, n] = op(a)[m, k] op(b)[k, n] (+ bias[n]) (+ C when add), a and b each row-major (t* = 0) or the
// transpose of a row-major tensor (t* = 1). token: which size counts tokens (0: m, 1: k). Compared and hashed as
// bytes: every instance starts zeroed.
struct Key {
  int64_t m, n, k;
  int8_t ta, tb, da, db, dc, bias, add, token, scaled;
  int8_t reserved[7];  // no padding: every byte is a member
  Key() { std::memset(this, 0, sizeof(Key)); }
  bool operator==(const Key& o) const { return std::memcmp(this, &o, sizeof(Key)) == 0; }
  int64_t tokens() const { return token == 0 ? m : k; }
  Key with_tokens(int64_t t) const {
    Key c = *this;
    (token == 0 ? c.m : c.k) = t;
    return c;
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    const auto* p = reinterpret_cast<const unsigned char*>(&key);
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof(Key); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

constexpr int kAlgoWords = 8;  // cublasLtMatmulAlgo_t: 8 64-bit words
constexpr size_t kWorkspace = size_t(32) << 20;

struct Choice {
  int64_t tokens = 0;
  bool lt = false;
  uint64_t algo[kAlgoWords] = {};
  double lt_ms = 0, aten_ms = 0;  // per product, at the grid point (0 when imported)
};

#if LS_HAVE_CUBLASLT
struct LtApi {
  bool ok = false;
  size_t version = 0;
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtGetVersion) get_version = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmulAlgoCheck) check = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  cublasLtHandle_t handle = nullptr;
};

const LtApi& lt_api() {
  static LtApi api = [] {
    LtApi a;
    void* lib = nullptr;
    for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);  // the copy torch loaded
      if (lib != nullptr) break;
    }
    if (lib == nullptr) return a;
    bool all = true;
    auto get = [&](auto& f, const char* sym) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(lib, sym));
      all = all && f != nullptr;
    };
    get(a.create, "cublasLtCreate");
    get(a.get_version, "cublasLtGetVersion");
    get(a.desc_create, "cublasLtMatmulDescCreate");
    get(a.desc_destroy, "cublasLtMatmulDescDestroy");
    get(a.desc_set, "cublasLtMatmulDescSetAttribute");
    get(a.layout_create, "cublasLtMatrixLayoutCreate");
    get(a.layout_destroy, "cublasLtMatrixLayoutDestroy");
    get(a.pref_create, "cublasLtMatmulPreferenceCreate");
    get(a.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    get(a.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    get(a.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    get(a.check, "cublasLtMatmulAlgoCheck");
    get(a.matmul, "cublasLtMatmul");
    if (!all || a.create(&a.handle) != CUBLAS_STATUS_SUCCESS) return LtApi{};
    a.version = a.get_version();
    a.ok = true;
    return a;
  }();
  return api;
}

cudaDataType_t cuda_type(int8_t st) {
  switch (static_cast<at::ScalarType>(st)) {
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2: return CUDA_R_8F_E5M2;
    default: return CUDA_R_32F;
  }
}

// The descriptors of one exact product, and the algorithm it runs (ok: cuBLASLt applies; else ATen)
struct Plan {
  bool ok = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// cuBLASLt is column-major: C^T [n, m] = op(b)^T op(a)^T, so its first operand is b and its second a.
bool describe(const LtApi& api, const Key& key, Plan& p) {
  const int64_t M = key.m, N = key.n, K = key.k;
  if (api.desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return false;
  cublasOperation_t opa = key.tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = key.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  bool ok = api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)) == CUBLAS_STATUS_SUCCESS &&
            api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)) == CUBLAS_STATUS_SUCCESS;
  if (key.bias) {
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    cudaDataType_t bt = cuda_type(key.dc);
    ok = ok && api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)) == CUBLAS_STATUS_SUCCESS &&
         api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)) == CUBLAS_STATUS_SUCCESS;
  }
  if (key.scaled) {
    int8_t fast = 1;
    ok = ok && api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)) == CUBLAS_STATUS_SUCCESS;
  }
  const int64_t ra = key.tb ? K : N, ca = key.tb ? N : K, rb = key.ta ? M : K, cb = key.ta ? K : M;
  ok = ok && api.layout_create(&p.la, cuda_type(key.db), ra, ca, ra) == CUBLAS_STATUS_SUCCESS &&
       api.layout_create(&p.lb, cuda_type(key.da), rb, cb, rb) == CUBLAS_STATUS_SUCCESS &&
       api.layout_create(&p.lc, cuda_type(key.dc), N, M, N) == CUBLAS_STATUS_SUCCESS;
  return ok;
}

void release(const LtApi& api, Plan& p) {
  if (p.la) api.layout_destroy(p.la);
  if (p.lb) api.layout_destroy(p.lb);
  if (p.lc) api.layout_destroy(p.lc);
  if (p.desc) api.desc_destroy(p.desc);
  p = Plan{};
}
#endif  // LS_HAVE_CUBLASLT

struct Tuner {
  std::mutex mu;
  std::atomic<bool> enabled{false};
  std::vector<int64_t> grid;  // token counts at which a class is measured
  int64_t candidates = 8;     // cuBLASLt candidates measured beside ATen
  std::unordered_map<Key, std::vector<Choice>, KeyHash> decisions;  // by class (token count 0)
#if LS_HAVE_CUBLASLT
  std::unordered_map<Key, Plan, KeyHash> plans;  // by exact product
#endif
  std::unordered_map<int, Tensor> workspace;  // by device
  double seconds = 0;                         // spent measuring
  int64_t measured = 0;                       // products measured (class x grid point)
};

Tuner& tuner() {
  static Tuner* t = new Tuner();  // never destroyed: products may run while the process exits
  return *t;
}

// 0: row-major and dense, 1: the transpose of a dense row-major tensor, -1: neither
int layout_of(const Tensor& t) {
  if (t.dim() != 2) return -1;
  if (t.stride(1) == 1 && t.stride(0) == t.size(1)) return 0;
  if (t.stride(0) == 1 && t.stride(1) == t.size(0)) return 1;
  return -1;
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The key of a product that tuning may take (else false: ATen, as before)
bool key_of(const Tensor& a, const Tensor& b, const OptTensor& bias, at::ScalarType out_dtype, bool add, int64_t token,
            bool scaled, Key* key) {
  if (!a.is_cuda() || !b.is_cuda() || a.dim() != 2 || b.dim() != 2) return false;
  const int la = layout_of(a), lb = layout_of(b);
  if (la < 0 || lb < 0 || !aligned16(a) || !aligned16(b)) return false;
  if (out_dtype != at::kBFloat16 && out_dtype != at::kHalf) return false;
  if (!scaled && (a.scalar_type() != out_dtype || b.scalar_type() != out_dtype)) return false;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const int64_t q = scaled ? 16 : 8;  // the leading sizes' alignment: 16 bytes
  if (m < 16 || n < 16 || k < 16 || m % q || n % q || k % q) return false;
  if (present(bias) && (bias->dim() != 1 || bias->size(0) != n || bias->scalar_type() != out_dtype ||
                        !bias->is_contiguous() || !aligned16(*bias)))
    return false;
  key->m = m, key->n = n, key->k = k;
  key->ta = static_cast<int8_t>(la), key->tb = static_cast<int8_t>(lb);
  key->da = static_cast<int8_t>(a.scalar_type()), key->db = static_cast<int8_t>(b.scalar_type());
  key->dc = static_cast<int8_t>(out_dtype);
  key->bias = present(bias), key->add = add, key->token = static_cast<int8_t>(token), key->scaled = scaled;
  return true;
}

int key_device() { return c10::cuda::current_device(); }

bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// The operands and output of one product, for the ATen or the cuBLASLt call
struct Operands {
  Tensor a, b, out, sa, sb;
  OptTensor bias;
};

void run_aten(const Key& key, const Operands& o) {
  if (key.scaled) {
    at::_scaled_mm_out(const_cast<Tensor&>(o.out), o.a, o.b, o.sa, o.sb, o.bias, std::nullopt,
                       static_cast<at::ScalarType>(key.dc), true);
  } else if (key.add) {
    const_cast<Tensor&>(o.out).addmm_(o.a, o.b);
  } else if (key.bias) {
    at::addmm_out(const_cast<Tensor&>(o.out), *o.bias, o.a, o.b);
  } else {
    at::mm_out(const_cast<Tensor&>(o.out), o.a, o.b);
  }
}

#if LS_HAVE_CUBLASLT
bool run_lt(const LtApi& api, const Key& key, Plan& p, const Operands& o, void* ws) {
  if (key.bias) {
    const void* bp = o.bias->data_ptr();
    if (api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)) != CUBLAS_STATUS_SUCCESS) return false;
  }
  if (key.scaled) {
    const void* pa = o.sb.data_ptr();  // cuBLASLt's first operand is b
    const void* pb = o.sa.data_ptr();
    if (api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof(pa)) != CUBLAS_STATUS_SUCCESS ||
        api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof(pb)) != CUBLAS_STATUS_SUCCESS)
      return false;
  }
  const float one = 1.f, beta = key.add ? 1.f : 0.f;
  return api.matmul(api.handle, p.desc, &one, o.b.data_ptr(), p.la, o.a.data_ptr(), p.lb, &beta, o.out.data_ptr(),
                    p.lc, o.out.data_ptr(), p.lc, &p.algo, ws, kWorkspace,
                    c10::cuda::getCurrentCUDAStream().stream()) == CUBLAS_STATUS_SUCCESS;
}

// Deterministic scratch values in [-1, 1) (no random numbers drawn), in dtype
Tensor scratch(at::IntArrayRef sizes, at::ScalarType dtype, int device) {
  int64_t n = 1;
  for (auto s : sizes) n *= s;
  auto opts = at::TensorOptions().device(at::kCUDA, device).dtype(at::kFloat);
  return at::arange(n, opts).mul_(0.6180339887).frac_().mul_(2).sub_(1).view(sizes).to(dtype);
}

Operands scratch_operands(const Key& key) {
  Operands o;
  const int dev = c10::cuda::current_device();
  const auto da = static_cast<at::ScalarType>(key.da), db = static_cast<at::ScalarType>(key.db),
             dc = static_cast<at::ScalarType>(key.dc);
  o.a = key.ta ? scratch({key.k, key.m}, da, dev).t() : scratch({key.m, key.k}, da, dev);
  o.b = key.tb ? scratch({key.n, key.k}, db, dev).t() : scratch({key.k, key.n}, db, dev);
  o.out = at::zeros({key.m, key.n}, at::TensorOptions().device(at::kCUDA, dev).dtype(dc));
  if (key.bias) o.bias = scratch({key.n}, dc, dev);
  if (key.scaled) {
    o.sa = at::ones({}, at::TensorOptions().device(at::kCUDA, dev).dtype(at::kFloat));
    o.sb = o.sa.clone();
  }
  return o;
}

void* workspace(Tuner& t, int device) {
  auto it = t.workspace.find(device);
  if (it != t.workspace.end()) return it->second.data_ptr();
  if (capturing()) return nullptr;  // allocated outside captures only
  Tensor w = at::empty({static_cast<int64_t>(kWorkspace)},
                       at::TensorOptions().device(at::kCUDA, device).dtype(at::kByte));
  t.workspace[device] = w;
  return w.data_ptr();
}

// Measures one class at every grid point (the caller holds the lock, outside any capture)
void measure(Tuner& t, const LtApi& api, const Key& cls) {
  const auto start = std::chrono::steady_clock::now();
  void* ws = workspace(t, c10::cuda::current_device());
  std::vector<Choice> choices;
  constexpr int kReps = 3, kRounds = 2;
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  for (int64_t tokens : t.grid) {
    const Key key = cls.with_tokens(tokens);
    Operands o = scratch_operands(key);
    Plan base;
    std::vector<cublasLtMatmulHeuristicResult_t> found(std::max<int64_t>(t.candidates, 1));
    int got = 0;
    if (describe(api, key, base)) {
      cublasLtMatmulPreference_t pref = nullptr;
      if (api.pref_create(&pref) == CUBLAS_STATUS_SUCCESS) {
        uint64_t ws_bytes = kWorkspace;
        uint32_t align = 16, reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
        api.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes));
        for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
          api.pref_set(pref, attr, &align, sizeof(align));
        api.pref_set(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction, sizeof(reduction));
        if (api.heuristic(api.handle, base.desc, base.la, base.lb, base.lc, base.lc, pref,
                          static_cast<int>(found.size()), found.data(), &got) != CUBLAS_STATUS_SUCCESS)
          got = 0;
        api.pref_destroy(pref);
      }
    }
    // candidate -1: ATen; 0..got-1: cuBLASLt's. Each runs once (loading its kernel), then kRounds x kReps timed.
    std::vector<int> usable = {-1};
    for (int i = 0; i < got && ws != nullptr; ++i) {
      if (found[i].state != CUBLAS_STATUS_SUCCESS) continue;
      base.algo = found[i].algo;
      if (run_lt(api, key, base, o, ws)) usable.push_back(i);
    }
    run_aten(key, o);
    std::vector<cudaEvent_t> ev(2 * usable.size() * kRounds);
    for (auto& e : ev) cudaEventCreate(&e);
    for (int r = 0; r < kRounds; ++r) {
      for (size_t c = 0; c < usable.size(); ++c) {
        cudaEvent_t* pair = &ev[2 * (r * usable.size() + c)];
        cudaEventRecord(pair[0], stream);
        for (int rep = 0; rep < kReps; ++rep) {
          if (usable[c] < 0) {
            run_aten(key, o);
          } else {
            base.algo = found[usable[c]].algo;
            run_lt(api, key, base, o, ws);
          }
        }
        cudaEventRecord(pair[1], stream);
      }
    }
    cudaEventSynchronize(ev.back());
    std::vector<double> best(usable.size(), 1e30);
    for (int r = 0; r < kRounds; ++r)
      for (size_t c = 0; c < usable.size(); ++c) {
        float ms = 0;
        cudaEventElapsedTime(&ms, ev[2 * (r * usable.size() + c)], ev[2 * (r * usable.size() + c) + 1]);
        best[c] = std::min(best[c], static_cast<double>(ms) / kReps);
      }
    for (auto& e : ev) cudaEventDestroy(e);
    Choice ch;
    ch.tokens = tokens;
    ch.aten_ms = best[0];
    size_t win = 0;
    for (size_t c = 1; c < usable.size(); ++c)
      if (best[c] < best[win]) win = c;
    // cuBLASLt only where it is clearly faster (2%): within that the two are the same speed, and ATen stays
    if (win > 0 && best[win] < 0.98 * best[0]) {
      ch.lt = true;
      ch.lt_ms = best[win];
      std::memcpy(ch.algo, &found[usable[win]].algo, sizeof(ch.algo));
    } else {
      ch.lt_ms = best[0];
    }
    choices.push_back(ch);
    release(api, base);
    ++t.measured;
  }
  t.decisions[cls] = std::move(choices);
  t.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The plan of an exact product: its class's choice at the nearest grid point, checked against its sizes
Plan* plan_for(Tuner& t, const LtApi& api, const Key& key) {
  auto pit = t.plans.find(key);
  if (pit != t.plans.end()) return pit->second.ok ? &pit->second : nullptr;
  const auto dit = t.decisions.find(key.with_tokens(0));
  if (dit == t.decisions.end() || dit->second.empty()) return nullptr;  // no decision yet: not cached
  const int64_t tokens = key.tokens();
  const Choice* near = &dit->second.front();
  for (const Choice& c : dit->second)
    if (std::llabs(c.tokens - tokens) < std::llabs(near->tokens - tokens)) near = &c;
  Plan p;
  if (near->lt && describe(api, key, p)) {
    std::memcpy(&p.algo, near->algo, sizeof(p.algo));
    cublasLtMatmulHeuristicResult_t r{};
    p.ok = api.check(api.handle, p.desc, p.la, p.lb, p.lc, p.lc, &p.algo, &r) == CUBLAS_STATUS_SUCCESS &&
           r.workspaceSize <= kWorkspace;
  }
  if (!p.ok) release(api, p);
  auto& slot = t.plans[key];
  slot = p;
  return slot.ok ? &slot : nullptr;
}
#endif  // LS_HAVE_CUBLASLT

// Runs the product through its tuned cuBLASLt algorithm when it has one; false: the caller runs ATen.
bool tuned(const Key& key, const Operands& o) {
#if LS_HAVE_CUBLASLT
  Tuner& t = tuner();
  const LtApi& api = lt_api();
  if (!api.ok) return false;
  // ATen's cuBLAS handles of this thread, made outside any capture as the ATen product this one replaces would have
  // made them (a later capture that runs an ATen product on this thread could not create one): the same ATen call
  // once per thread, form and device on 16 x 16 scratch operands
  thread_local std::vector<int> warmed;
  const int form = (key_device() * 2 + key.scaled) * 2 + key.bias;
  if (std::find(warmed.begin(), warmed.end(), form) == warmed.end() && !capturing()) {
    Key tiny = key;
    tiny.m = tiny.n = tiny.k = 16;
    run_aten(tiny, scratch_operands(tiny));
    warmed.push_back(form);
  }
  std::lock_guard<std::mutex> lock(t.mu);
  if (!t.enabled) return false;
  const Key cls = key.with_tokens(0);
  if (t.decisions.find(cls) == t.decisions.end()) {
    if (capturing() || t.grid.empty()) return false;
    measure(t, api, cls);
  }
  Plan* p = plan_for(t, api, key);
  if (p == nullptr) return false;
  void* ws = workspace(t, c10::cuda::current_device());
  return ws != nullptr && run_lt(api, key, *p, o, ws);
#else
  (void)key;
  (void)o;
  return false;
#endif
}

bool maybe_enabled() { return tuner().enabled.load(std::memory_order_relaxed); }  // no lock while off

}  // namespace

Tensor gemm_mm(const Tensor& a, const Tensor& b, const OptTensor& bias, int64_t token) {
  Key key;
  if (maybe_enabled() && key_of(a, b, bias, a.scalar_type(), false, token, false, &key)) {
    c10::cuda::CUDAGuard guard(a.device());
    Operands o{a, b, at::empty({a.size(0), b.size(1)}, a.options()), Tensor(), Tensor(), bias};
    if (tuned(key, o)) return o.out;
  }
  return present(bias) ? at::addmm(*bias, a, b) : at::mm(a, b);
}

void gemm_mm_into(const Tensor& out, const Tensor& a, const Tensor& b, bool add, int64_t token) {
  Key key;
  if (maybe_enabled() && out.scalar_type() == a.scalar_type() && layout_of(out) == 0 && aligned16(out) &&
      out.size(0) == a.size(0) && out.size(1) == b.size(1) &&
      key_of(a, b, std::nullopt, out.scalar_type(), add, token, false, &key)) {
    c10::cuda::CUDAGuard guard(a.device());
    if (tuned(key, Operands{a, b, out, Tensor(), Tensor(), std::nullopt})) return;
  }
  if (add)
    const_cast<Tensor&>(out).addmm_(a, b);
  else
    at::mm_out(const_cast<Tensor&>(out), a, b);
}

Tensor gemm_scaled(const Tensor& a, const Tensor& b, const Tensor& sa, const Tensor& sb, const OptTensor& bias,
                   at::ScalarType out_dtype, int64_t token) {
  Key key;
  if (maybe_enabled() && key_of(a, b, bias, out_dtype, false, token, true, &key)) {
    c10::cuda::CUDAGuard guard(a.device());
    Operands o{a, b, at::empty({a.size(0), b.size(1)}, a.options().dtype(out_dtype)), sa, sb, bias};
    if (tuned(key, o)) return o.out;
  }
  return at::_scaled_mm(a, b, sa, sb, bias, std::nullopt, out_dtype, true);
}

void gemm_scaled_into(const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& sa, const Tensor& sb,
                      at::ScalarType out_dtype, int64_t token) {
  Key key;
  if (maybe_enabled() && out.scalar_type() == out_dtype && layout_of(out) == 0 && aligned16(out) &&
      out.size(0) == a.size(0) && out.size(1) == b.size(1) &&
      key_of(a, b, std::nullopt, out_dtype, false, token, true, &key)) {
    c10::cuda::CUDAGuard guard(a.device());
    if (tuned(key, Operands{a, b, out, sa, sb, std::nullopt})) return;
  }
  at::_scaled_mm_out(const_cast<Tensor&>(out), a, b, sa, sb, std::nullopt, std::nullopt, out_dtype, true);
}

// ----------------------------------------------------------------------------- control (bindings.cpp)

bool gemm_tuning_available() {
#if LS_HAVE_CUBLASLT
  return lt_api().ok;
#else
  return false;
#endif
}

int64_t gemm_tuning_version() {
#if LS_HAVE_CUBLASLT
  return static_cast<int64_t>(lt_api().version);
#else
  return 0;
#endif
}

void gemm_tuning_enable(const std::vector<int64_t>& grid, int64_t candidates) {
  Tuner& t = tuner();
  std::lock_guard<std::mutex> lock(t.mu);
  for (int64_t g : grid)
    LS_CHECK(g >= 16 && g % 16 == 0, "gemm_tuning_enable: token counts must be multiples of 16 (>= 16), got ", g);
  LS_CHECK(candidates >= 1 && candidates <= 64, "gemm_tuning_enable: candidates must be 1 to 64, got ", candidates);
  t.grid = grid;
  std::sort(t.grid.begin(), t.grid.end());
  t.grid.erase(std::unique(t.grid.begin(), t.grid.end()), t.grid.end());
  t.candidates = candidates;
  t.enabled = gemm_tuning_available();
}

void gemm_tuning_disable() {
  Tuner& t = tuner();
  std::lock_guard<std::mutex> lock(t.mu);
  t.enabled = false;
}

void gemm_tuning_clear() {
  Tuner& t = tuner();
  std::lock_guard<std::mutex> lock(t.mu);
  t.decisions.clear();
#if LS_HAVE_CUBLASLT
  if (gemm_tuning_available())
    for (auto& kv : t.plans) release(lt_api(), kv.second);
  t.plans.clear();
#endif
  t.seconds = 0;
  t.measured = 0;
}

// One row per decision: [m, n, k, ta, tb, da, db, dc, bias, add, token, scaled, tokens, lt, algo x 8]
// (the class's token size 0)
std::vector<std::vector<int64_t>> gemm_tuning_state() {
  Tuner& t = tuner();
  std::lock_guard<std::mutex> lock(t.mu);
  std::vector<std::vector<int64_t>> rows;
  for (const auto& kv : t.decisions) {
    const Key& c = kv.first;
    for (const Choice& ch : kv.second) {
      std::vector<int64_t> r = {c.m, c.n, c.k, c.ta, c.tb, c.da, c.db, c.dc, c.bias, c.add, c.token, c.scaled,
                                ch.tokens, static_cast<int64_t>(ch.lt)};
      for (int i = 0; i < kAlgoWords; ++i) r.push_back(static_cast<int64_t>(ch.algo[i]));
      rows.push_back(std::move(r));
    }
  }
  return rows;
}

void gemm_tuning_load(const std::vector<std::vector<int64_t>>& rows) {
  Tuner& t = tuner();
  std::unordered_map<Key, std::vector<Choice>, KeyHash> loaded;
  for (const auto& r : rows) {
    LS_CHECK(r.size() == 14 + kAlgoWords, "gemm_tuning_load: a decision has ", r.size(), " values, expected ",
             14 + kAlgoWords);
    Key c;
    c.m = r[0], c.n = r[1], c.k = r[2];
    int8_t* small[] = {&c.ta, &c.tb, &c.da, &c.db, &c.dc, &c.bias, &c.add, &c.token, &c.scaled};
    for (int i = 0; i < 9; ++i) {
      LS_CHECK(r[3 + i] >= -128 && r[3 + i] <= 127, "gemm_tuning_load: value ", r[3 + i], " out of range");
      *small[i] = static_cast<int8_t>(r[3 + i]);
    }
    LS_CHECK(c.token == 0 || c.token == 1, "gemm_tuning_load: token must be 0 or 1, got ", r[10]);
    LS_CHECK(c.tokens() == 0, "gemm_tuning_load: a class has its token size set");
    Choice ch;
    ch.tokens = r[12];
    ch.lt = r[13] != 0;
    for (int i = 0; i < kAlgoWords; ++i) ch.algo[i] = static_cast<uint64_t>(r[14 + i]);
    loaded[c].push_back(ch);
  }
  std::lock_guard<std::mutex> lock(t.mu);
#if LS_HAVE_CUBLASLT
  if (gemm_tuning_available())
    for (auto& kv : t.plans) release(lt_api(), kv.second);
  t.plans.clear();
#endif
  t.decisions = std::move(loaded);
}

// [classes measured or loaded, decisions, of them cuBLASLt, seconds measuring, grid points measured,
//  summed ATen ms, summed chosen ms (over the measured points: one product of each)]
std::vector<double> gemm_tuning_report() {
  Tuner& t = tuner();
  std::lock_guard<std::mutex> lock(t.mu);
  double n = 0, lt = 0, aten = 0, chosen = 0;
  for (const auto& kv : t.decisions)
    for (const Choice& ch : kv.second) {
      n += 1;
      lt += ch.lt;
      aten += ch.aten_ms;
      chosen += ch.lt ? ch.lt_ms : ch.aten_ms;
    }
  return {static_cast<double>(t.decisions.size()), n, lt, t.seconds, static_cast<double>(t.measured), aten, chosen};
}

}  // namespace ls_torch
