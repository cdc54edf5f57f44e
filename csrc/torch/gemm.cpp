// Fixed GEMM algorithms: each class of the layers' products runs one cuBLASLt algorithm, whatever its token count.
//
// ATen lets cuBLAS choose a kernel for each exact product, so a product with a token count not seen before may use a
// kernel not used before in the process. Loading a kernel waits until the GPU has finished all queued work, and a
// CUDA-graph step that captures a new bucket behind queued updates then drains the queue. With fixed algorithms on
// (gemm_fixed_enable), the first product of a class (its sizes except the token count, its layouts, dtype, bias,
// accumulation and device) takes cuBLASLt's first heuristic proposal for the class at the reference token count
// (--max-tokens), and every later product of the class runs that algorithm when cuBLASLt accepts it for the exact
// sizes (checked once per shape). So each class loads one kernel, in its first product. Whatever does not fit runs
// through the ATen call it replaces: fp32, strided or unaligned operands, sizes not multiples of 8, an algorithm
// cuBLASLt does not accept for a shape, or cuBLASLt missing.
//
// cuBLASLt is the one torch loaded: its functions are looked up in the process (no link-time dependency), and
// without its header at build time, or without the library at run time, every product takes ATen.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/cuda/Sleep.h>
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
  int8_t ta, tb, dtype, bias, add, token, device;
  int8_t reserved[1];  // no padding: every byte is a member
  Key() { std::memset(this, 0, sizeof(Key)); }
  bool operator==(const Key& o) const { return std::memcmp(this, &o, sizeof(Key)) == 0; }
  int64_t tokens() const { return token == 0 ? m : k; }
  Key with_tokens(int64_t t) const {
    Key c = *this;
    (token == 0 ? c.m : c.k) = t;
    return c;
  }
};
static_assert(sizeof(Key) == 32, "Key must have no padding");

struct KeyHash {
  size_t operator()(const Key& key) const {
    const auto* p = reinterpret_cast<const unsigned char*>(&key);
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < sizeof(Key); ++i) h = (h ^ p[i]) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

constexpr size_t kWorkspace = size_t(32) << 20;  // per stream

bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

// The operands and output of one product
struct Operands {
  Tensor a, b, out;
  OptTensor bias;
};

void run_aten(const Key& key, const Operands& o) {
  Tensor& out = const_cast<Tensor&>(o.out);
  if (key.add)
    out.addmm_(o.a, o.b);
  else if (key.bias)
    at::addmm_out(out, *o.bias, o.a, o.b);
  else
    at::mm_out(out, o.a, o.b);
}

#if LS_HAVE_CUBLASLT
struct LtApi {
  bool ok = false;
  decltype(&cublasLtCreate) create = nullptr;
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
    a.ok = all;
    return a;
  }();
  return api;
}

cudaDataType_t cuda_type(int8_t st) {
  return static_cast<at::ScalarType>(st) == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
}

// The bias pointer the heuristic and the check see: aligned to 16 bytes and no more, as a real bias may be (a null
// pointer would count as aligned to anything, and could let an algorithm through that refuses a real one).
const void* const kBiasPlaceholder = reinterpret_cast<const void*>(uintptr_t(16));

// The descriptors of one exact product, and the algorithm it runs (ok: cuBLASLt takes it; else ATen)
struct Plan {
  bool ok = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

void release(const LtApi& api, Plan& p) {
  if (p.la) api.layout_destroy(p.la);
  if (p.lb) api.layout_destroy(p.lb);
  if (p.lc) api.layout_destroy(p.lc);
  if (p.desc) api.desc_destroy(p.desc);
  p = Plan{};
}

// cuBLASLt is column-major: C^T [n, m] = op(b)^T op(a)^T, so its first operand is b and its second a.
bool describe(const LtApi& api, const Key& key, Plan& p) {
  const int64_t M = key.m, N = key.n, K = key.k;
  if (api.desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return false;
  cublasOperation_t opa = key.tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = key.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  bool ok = api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)) == CUBLAS_STATUS_SUCCESS &&
            api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)) == CUBLAS_STATUS_SUCCESS;
  if (key.bias) {
    cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    cudaDataType_t bt = cuda_type(key.dtype);
    ok = ok && api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)) == CUBLAS_STATUS_SUCCESS &&
         api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)) == CUBLAS_STATUS_SUCCESS &&
         api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &kBiasPlaceholder, sizeof(kBiasPlaceholder)) ==
             CUBLAS_STATUS_SUCCESS;
  }
  const cudaDataType_t t = cuda_type(key.dtype);
  const int64_t ra = key.tb ? K : N, ca = key.tb ? N : K, rb = key.ta ? M : K, cb = key.ta ? K : M;
  ok = ok && api.layout_create(&p.la, t, ra, ca, ra) == CUBLAS_STATUS_SUCCESS &&
       api.layout_create(&p.lb, t, rb, cb, rb) == CUBLAS_STATUS_SUCCESS &&
       api.layout_create(&p.lc, t, N, M, N) == CUBLAS_STATUS_SUCCESS;
  return ok;
}
#endif  // LS_HAVE_CUBLASLT

struct ClassAlgo {
  bool ok = false;  // cuBLASLt proposed one
#if LS_HAVE_CUBLASLT
  cublasLtMatmulAlgo_t algo{};
#endif
};

struct Table {
  std::mutex mu;
  std::atomic<bool> on{false};
  int64_t ref = 0;                                          // the token count each class's algorithm is chosen at
  std::unordered_map<Key, ClassAlgo, KeyHash> classes;      // by class (token size 0)
#if LS_HAVE_CUBLASLT
  std::unordered_map<Key, Plan, KeyHash> plans;             // by exact product
  std::unordered_map<int, cublasLtHandle_t> handles;        // by device
#endif
  std::unordered_map<cudaStream_t, Tensor> workspaces;      // by stream (under a capture: from the graph's pool)
  int64_t refusals = 0;                                     // products cuBLASLt refused at run time (then ATen)
  int64_t pick = 0;            // 0: the heuristic's first proposal; k > 0: the fastest of its first k, timed at ref
  bool any_reduction = false;  // split sums reduced in any way cuBLASLt offers (else in fp32 only)
};

Table& table() {
  static Table* t = new Table();  // never destroyed: products may run while the process exits
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

// The key of a product that may run a fixed algorithm (else false: ATen)
bool key_of(const Tensor& a, const Tensor& b, const OptTensor& bias, bool add, int64_t token, Key* key) {
  if (!a.is_cuda() || !b.is_cuda() || a.dim() != 2 || b.dim() != 2 || a.device() != b.device()) return false;
  const auto dt = a.scalar_type();
  if ((dt != at::kBFloat16 && dt != at::kHalf) || b.scalar_type() != dt) return false;
  const int la = layout_of(a), lb = layout_of(b);
  if (la < 0 || lb < 0 || !aligned16(a) || !aligned16(b)) return false;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (b.size(0) != k || m < 16 || n < 16 || k < 16 || m % 8 || n % 8 || k % 8) return false;
  if (present(bias) && (bias->dim() != 1 || bias->size(0) != n || bias->scalar_type() != dt ||
                        bias->device() != a.device() || !bias->is_contiguous() || !aligned16(*bias)))
    return false;
  key->m = m, key->n = n, key->k = k;
  key->ta = static_cast<int8_t>(la), key->tb = static_cast<int8_t>(lb);
  key->dtype = static_cast<int8_t>(dt);
  key->bias = present(bias), key->add = add, key->token = static_cast<int8_t>(token);
  key->device = static_cast<int8_t>(a.get_device());
  return true;
}

#if LS_HAVE_CUBLASLT
cublasLtHandle_t handle_for(const LtApi& api, Table& t, int device) {
  auto it = t.handles.find(device);
  if (it != t.handles.end()) return it->second;
  cublasLtHandle_t h = nullptr;
  if (api.create(&h) != CUBLAS_STATUS_SUCCESS) h = nullptr;
  t.handles[device] = h;
  return h;
}

void* workspace(Table& t, const c10::cuda::CUDAStream& stream);

// Deterministic scratch values in [-1, 1) (no random numbers drawn)
Tensor scratch(at::IntArrayRef sizes, at::ScalarType dtype, int device) {
  int64_t n = 1;
  for (auto s : sizes) n *= s;
  auto opts = at::TensorOptions().device(at::kCUDA, device).dtype(at::kFloat);
  return at::arange(n, opts).mul_(0.6180339887).frac_().mul_(2).sub_(1).view(sizes).to(dtype);
}

// The fastest of the proposals for the class, by their GPU time summed over products at half, three quarters and
// all of the reference token count, timed on scratch operands behind a GPU sleep (so that the host's launches do not
// count) outside captures. A proposal cuBLASLt refuses at one of these sizes is not taken.
cublasLtMatmulAlgo_t fastest(const LtApi& api, Table& t, cublasLtHandle_t h, const Key& cls, int64_t ref,
                             const cublasLtMatmulHeuristicResult_t* found, int got) {
  const auto dt = static_cast<at::ScalarType>(cls.dtype);
  const auto stream = c10::cuda::getCurrentCUDAStream(cls.device);
  void* ws = workspace(t, stream);
  std::vector<double> total(got, 0.0);
  std::vector<bool> usable(got, true);
  for (int i = 0; i < got; ++i) usable[i] = found[i].state == CUBLAS_STATUS_SUCCESS;
  constexpr int kReps = 5;
  for (int64_t tokens : {ref / 2, ref * 3 / 4, ref}) {
    const Key key = cls.with_tokens(std::max<int64_t>(16, (tokens + 15) / 16 * 16));
    Plan q;
    if (!describe(api, key, q)) {
      release(api, q);
      return found[0].algo;
    }
    Tensor a = key.ta ? scratch({key.k, key.m}, dt, key.device) : scratch({key.m, key.k}, dt, key.device);
    Tensor b = key.tb ? scratch({key.n, key.k}, dt, key.device) : scratch({key.k, key.n}, dt, key.device);
    Tensor out = at::zeros({key.m, key.n}, a.options());
    Tensor bias = scratch({key.n}, dt, key.device);
    if (key.bias) {
      const void* bp = bias.data_ptr();
      api.desc_set(q.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp));
    }
    const float one = 1.f, beta = key.add ? 1.f : 0.f;
    auto run = [&](int i) {
      return api.matmul(h, q.desc, &one, b.data_ptr(), q.la, a.data_ptr(), q.lb, &beta, out.data_ptr(), q.lc,
                        out.data_ptr(), q.lc, &found[i].algo, ws, kWorkspace, stream.stream()) ==
             CUBLAS_STATUS_SUCCESS;
    };
    std::vector<cudaEvent_t> ev(2 * got, nullptr);
    for (int i = 0; i < got; ++i) {
      cublasLtMatmulHeuristicResult_t r{};
      if (!usable[i] ||
          api.check(h, q.desc, q.la, q.lb, q.lc, q.lc, &found[i].algo, &r) != CUBLAS_STATUS_SUCCESS ||
          r.workspaceSize > kWorkspace || !run(i)) {  // the first run loads the kernel
        usable[i] = false;
        continue;
      }
      cudaEventCreate(&ev[2 * i]);
      cudaEventCreate(&ev[2 * i + 1]);
      at::cuda::sleep(200000);  // the launches below queue up before the GPU reaches them
      cudaEventRecord(ev[2 * i], stream.stream());
      for (int rep = 0; rep < kReps; ++rep) run(i);
      cudaEventRecord(ev[2 * i + 1], stream.stream());
    }
    for (int i = 0; i < got; ++i) {
      if (ev[2 * i] == nullptr) continue;
      cudaEventSynchronize(ev[2 * i + 1]);
      float ms = 0;
      cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]);
      total[i] += ms;
      cudaEventDestroy(ev[2 * i]);
      cudaEventDestroy(ev[2 * i + 1]);
    }
    release(api, q);
  }
  int best = -1;
  for (int i = 0; i < got; ++i)
    if (usable[i] && (best < 0 || total[i] < total[best])) best = i;
  return found[best < 0 ? 0 : best].algo;
}

// cuBLASLt's first proposal for the class at the reference token count (the caller holds the lock)
ClassAlgo choose(const LtApi& api, Table& t, const Key& cls) {
  ClassAlgo c;
  cublasLtHandle_t h = handle_for(api, t, cls.device);
  if (h == nullptr) return c;
  // the reference token count, rounded up to a multiple of 16 (the product's other sizes are the class's)
  const Key key = cls.with_tokens((std::max<int64_t>(t.ref, 16) + 15) / 16 * 16);
  Plan p;
  if (describe(api, key, p)) {
    cublasLtMatmulPreference_t pref = nullptr;
    if (api.pref_create(&pref) == CUBLAS_STATUS_SUCCESS) {
      uint64_t ws_bytes = kWorkspace;
      uint32_t align = 16, reduction = t.any_reduction ? CUBLASLT_REDUCTION_SCHEME_MASK
                                                        : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
      bool ok = api.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)) ==
                CUBLAS_STATUS_SUCCESS;
      for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
        ok = ok && api.pref_set(pref, attr, &align, sizeof(align)) == CUBLAS_STATUS_SUCCESS;
      // split sums reduced in fp32, never in the output's 16-bit type
      ok = ok && api.pref_set(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction, sizeof(reduction)) ==
                     CUBLAS_STATUS_SUCCESS;
      std::vector<cublasLtMatmulHeuristicResult_t> found(std::max<int64_t>(t.pick, 1));
      int got = 0;
      if (ok && api.heuristic(h, p.desc, p.la, p.lb, p.lc, p.lc, pref, static_cast<int>(found.size()), found.data(),
                              &got) == CUBLAS_STATUS_SUCCESS &&
          got > 0 && found[0].state == CUBLAS_STATUS_SUCCESS) {
        c.ok = true;
        c.algo = found[0].algo;
        if (got > 1 && !capturing()) c.algo = fastest(api, t, h, cls, key.tokens(), found.data(), got);
      }
      api.pref_destroy(pref);
    }
  }
  release(api, p);
  return c;
}

// The plan of an exact product: its class's algorithm, checked against its sizes (the caller holds the lock)
Plan* plan_for(const LtApi& api, Table& t, const Key& key) {
  auto pit = t.plans.find(key);
  if (pit != t.plans.end()) return pit->second.ok ? &pit->second : nullptr;
  const Key cls = key.with_tokens(0);
  auto cit = t.classes.find(cls);
  if (cit == t.classes.end()) cit = t.classes.emplace(cls, choose(api, t, cls)).first;
  Plan p;
  cublasLtHandle_t h = handle_for(api, t, key.device);
  if (cit->second.ok && h != nullptr && describe(api, key, p)) {
    p.algo = cit->second.algo;
    cublasLtMatmulHeuristicResult_t r{};
    p.ok = api.check(h, p.desc, p.la, p.lb, p.lc, p.lc, &p.algo, &r) == CUBLAS_STATUS_SUCCESS &&
           r.workspaceSize <= kWorkspace;
  }
  if (!p.ok) release(api, p);
  Plan& slot = t.plans[key];
  slot = p;
  return slot.ok ? &slot : nullptr;
}

// This stream's workspace (the caller holds the lock). Made under a capture it comes from the graph's memory pool
// and is kept, as every workspace is, for the life of the process.
void* workspace(Table& t, const c10::cuda::CUDAStream& stream) {
  auto it = t.workspaces.find(stream.stream());
  if (it != t.workspaces.end()) return it->second.data_ptr();
  Tensor w = at::empty({static_cast<int64_t>(kWorkspace)},
                       at::TensorOptions().device(at::kCUDA, stream.device_index()).dtype(at::kByte));
  t.workspaces[stream.stream()] = w;
  return w.data_ptr();
}
#endif  // LS_HAVE_CUBLASLT

// Runs the product through its class's fixed algorithm; false: the caller runs ATen.
bool fixed(const Key& key, const Operands& o) {
#if LS_HAVE_CUBLASLT
  const LtApi& api = lt_api();
  if (!api.ok) return false;
  // ATen's cuBLAS handle of this thread and device, made outside any capture as the ATen product this one replaces
  // would have made it (a later capture that falls back to ATen on this thread could not create one)
  thread_local std::vector<int> warmed;
  if (std::find(warmed.begin(), warmed.end(), key.device) == warmed.end() && !capturing()) {
    auto opts = at::TensorOptions().device(at::kCUDA, key.device).dtype(static_cast<at::ScalarType>(key.dtype));
    Tensor x = at::zeros({16, 16}, opts);
    at::mm(x, x);
    warmed.push_back(key.device);
  }
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  if (!t.on) return false;
  Plan* p = plan_for(api, t, key);
  if (p == nullptr) return false;
  const auto stream = c10::cuda::getCurrentCUDAStream(key.device);
  void* ws = workspace(t, stream);
  cublasLtHandle_t h = handle_for(api, t, key.device);
  bool ok = true;
  if (key.bias) {
    const void* bp = o.bias->data_ptr();
    ok = api.desc_set(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)) == CUBLAS_STATUS_SUCCESS;
  }
  const float one = 1.f, beta = key.add ? 1.f : 0.f;
  ok = ok && api.matmul(h, p->desc, &one, o.b.data_ptr(), p->la, o.a.data_ptr(), p->lb, &beta, o.out.data_ptr(),
                        p->lc, o.out.data_ptr(), p->lc, &p->algo, ws, kWorkspace, stream.stream()) ==
                 CUBLAS_STATUS_SUCCESS;
  if (!ok) {  // this shape goes through ATen from now on
    ++t.refusals;
    release(api, *p);
  }
  return ok;
#else
  (void)key;
  (void)o;
  return false;
#endif
}

bool maybe_on() { return table().on.load(std::memory_order_relaxed); }  // no lock while off

}  // namespace

Tensor gemm_mm(const Tensor& a, const Tensor& b, const OptTensor& bias, int64_t token) {
  Key key;
  if (maybe_on() && key_of(a, b, bias, false, token, &key)) {
    c10::cuda::CUDAGuard guard(a.device());
    Operands o{a, b, at::empty({a.size(0), b.size(1)}, a.options()), bias};
    if (fixed(key, o)) return o.out;
  }
  return present(bias) ? at::addmm(*bias, a, b) : at::mm(a, b);
}

void gemm_mm_into(const Tensor& out, const Tensor& a, const Tensor& b, bool add, int64_t token) {
  Key key;
  if (maybe_on() && out.scalar_type() == a.scalar_type() && layout_of(out) == 0 && aligned16(out) &&
      out.device() == a.device() && out.size(0) == a.size(0) && out.size(1) == b.size(1) &&
      key_of(a, b, std::nullopt, add, token, &key)) {
    c10::cuda::CUDAGuard guard(a.device());
    if (fixed(key, Operands{a, b, out, std::nullopt})) return;
  }
  if (add)
    const_cast<Tensor&>(out).addmm_(a, b);
  else
    at::mm_out(const_cast<Tensor&>(out), a, b);
}

// PROBE (scaffolding): ms per product of the i-th proposal at ref tokens, run at a, b's exact sizes (-1: none)
double gemm_lt_candidate_ms(const Tensor& a, const Tensor& b, const OptTensor& bias, const Tensor& out, bool add,
                            int64_t token, int64_t ref, int64_t i, bool any_reduction, int64_t reps) {
#if LS_HAVE_CUBLASLT
  Key key;
  if (!key_of(a, b, bias, add, token, &key)) return -2;
  const LtApi& api = lt_api();
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  cublasLtHandle_t h = handle_for(api, t, key.device);
  const Key rk = key.with_tokens(ref);
  Plan p, q;
  double result = -1;
  if (describe(api, rk, p) && describe(api, key, q)) {
    cublasLtMatmulPreference_t pref = nullptr;
    api.pref_create(&pref);
    uint64_t ws_bytes = kWorkspace;
    uint32_t align = 16, reduction = any_reduction ? CUBLASLT_REDUCTION_SCHEME_MASK : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    api.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes));
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      api.pref_set(pref, attr, &align, sizeof(align));
    api.pref_set(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction, sizeof(reduction));
    std::vector<cublasLtMatmulHeuristicResult_t> found(i + 1);
    int got = 0;
    api.heuristic(h, p.desc, p.la, p.lb, p.lc, p.lc, pref, static_cast<int>(found.size()), found.data(), &got);
    api.pref_destroy(pref);
    cublasLtMatmulHeuristicResult_t r{};
    if (got > i && found[i].state == CUBLAS_STATUS_SUCCESS &&
        api.check(h, q.desc, q.la, q.lb, q.lc, q.lc, &found[i].algo, &r) == CUBLAS_STATUS_SUCCESS) {
      const auto stream = c10::cuda::getCurrentCUDAStream(key.device);
      void* ws = workspace(t, stream);
      if (key.bias) {
        const void* bp = bias->data_ptr();
        api.desc_set(q.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp));
      }
      const float one = 1.f, beta = add ? 1.f : 0.f;
      auto run = [&] {
        api.matmul(h, q.desc, &one, b.data_ptr(), q.la, a.data_ptr(), q.lb, &beta, out.data_ptr(), q.lc,
                   out.data_ptr(), q.lc, &found[i].algo, ws, kWorkspace, stream.stream());
      };
      run();
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      float best = 1e30f;
      for (int round = 0; round < 3; ++round) {
        cudaEventRecord(e0, stream.stream());
        for (int64_t k = 0; k < reps; ++k) run();
        cudaEventRecord(e1, stream.stream());
        cudaEventSynchronize(e1);
        float ms = 0;
        cudaEventElapsedTime(&ms, e0, e1);
        best = std::min(best, ms / reps);
      }
      cudaEventDestroy(e0);
      cudaEventDestroy(e1);
      result = best;
    }
  }
  release(api, p);
  release(api, q);
  return result;
#else
  return -3;
#endif
}

// ----------------------------------------------------------------------------- control (bindings.cpp)

bool gemm_fixed_available() {
#if LS_HAVE_CUBLASLT
  return lt_api().ok;
#else
  return false;
#endif
}

void gemm_fixed_enable(int64_t ref_tokens, int64_t pick, bool any_reduction) {
  LS_CHECK(ref_tokens >= 1, "gemm_fixed_enable: the reference token count must be positive, got ", ref_tokens);
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  // a fresh table: the classes choose again at the new reference
#if LS_HAVE_CUBLASLT
  if (gemm_fixed_available())
    for (auto& kv : t.plans) release(lt_api(), kv.second);
  t.plans.clear();
#endif
  t.classes.clear();
  t.refusals = 0;
  t.ref = ref_tokens;
  t.pick = pick;
  t.any_reduction = any_reduction;
  t.on = gemm_fixed_available();
}

void gemm_fixed_disable() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  t.on = false;
}

bool gemm_fixed_on() { return table().on.load(); }

// [on, reference token count, classes seen, classes with a cuBLASLt algorithm, exact shapes through cuBLASLt,
//  exact shapes through ATen (the algorithm not accepted), products refused at run time]
std::vector<int64_t> gemm_fixed_report() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  int64_t lt_classes = 0, lt_shapes = 0, aten_shapes = 0;
  for (const auto& kv : t.classes) lt_classes += kv.second.ok;
#if LS_HAVE_CUBLASLT
  for (const auto& kv : t.plans) (kv.second.ok ? lt_shapes : aten_shapes) += 1;
#endif
  return {static_cast<int64_t>(t.on.load()), t.ref, static_cast<int64_t>(t.classes.size()), lt_classes, lt_shapes,
          aten_shapes, t.refusals};
}

}  // namespace ls_torch
