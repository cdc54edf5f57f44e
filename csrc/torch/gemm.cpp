// The layers' products through cuBLASLt, one algorithm per exact shape, with the kernels of the planned shapes
// loaded before the first update.
//
// The first product that uses a cuBLAS kernel not used before in the process waits until the GPU has finished all
// queued work, then loads the kernel. ATen gives no way to know which kernel a product will use, and cuBLAS picks
// among many across the token counts of one product, so a CUDA-graph step that captures a new bucket behind queued
// updates often drains the queue (benchmarks/RESULTS.md, section 'first epoch'). Here each exact product runs
// cuBLASLt's first heuristic proposal for its shape (chosen at the shape's first sight and kept), so the kernels a
// set of shapes needs are known before they run: gemm_preload runs, for the planned buckets' token counts and every
// class of product seen so far, one product per distinct algorithm on scratch operands while the GPU is idle anyway
// (beside the optimizer's setup, prewarm.py); the captures then meet no kernel not loaded before.
//
// Whatever does not fit runs through the ATen call it replaces: fp32, strided or unaligned operands, sizes not
// multiples of 8, a call cuBLASLt refuses, or cuBLASLt missing. cuBLASLt is the one torch loaded: its functions
// are looked up in the process (no link-time dependency).

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
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
    get(a.matmul, "cublasLtMatmul");
    a.ok = all;
    return a;
  }();
  return api;
}

cudaDataType_t cuda_type(int8_t st) {
  return static_cast<at::ScalarType>(st) == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
}

// The bias pointer the heuristic sees: aligned to 16 bytes and no more, as a real bias may be (a null
// pointer would count as aligned to anything, and could let an algorithm through that refuses a real one).
const void* const kBiasPlaceholder = reinterpret_cast<const void*>(uintptr_t(16));

// The descriptors of one exact product, and the algorithm it runs (ok: cuBLASLt takes it; else ATen)
struct Plan {
  bool ok = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ran = false;  // run at least once (its kernel counted in Table::ran)
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


struct Table {
  std::mutex mu;
  std::atomic<bool> on{false};
#if LS_HAVE_CUBLASLT
  std::unordered_map<Key, Plan, KeyHash> plans;       // by exact product
  std::unordered_map<int, cublasLtHandle_t> handles;  // by device
  std::unordered_set<std::string> ran;                // algorithms run at least once (their kernels loaded), by class
#endif
  std::unordered_set<Key, KeyHash> classes;             // classes seen (token size 0)
  std::unordered_map<cudaStream_t, Tensor> workspaces;  // by stream (under a capture: from the graph's pool)
  int64_t refusals = 0;                                 // products cuBLASLt refused at run time (then ATen)
  int64_t preload_runs = 0;                             // products gemm_preload ran
  double preload_seconds = 0;
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

bool sizes_fit(int64_t m, int64_t n, int64_t k) {
  return m >= 16 && n >= 16 && k >= 16 && m % 8 == 0 && n % 8 == 0 && k % 8 == 0;
}

// The key of a product cuBLASLt may run here (else false: ATen)
bool key_of(const Tensor& a, const Tensor& b, const OptTensor& bias, bool add, int64_t token, Key* key) {
  if (!a.is_cuda() || !b.is_cuda() || a.dim() != 2 || b.dim() != 2 || a.device() != b.device()) return false;
  const auto dt = a.scalar_type();
  if ((dt != at::kBFloat16 && dt != at::kHalf) || b.scalar_type() != dt) return false;
  const int la = layout_of(a), lb = layout_of(b);
  if (la < 0 || lb < 0 || !aligned16(a) || !aligned16(b)) return false;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (b.size(0) != k || !sizes_fit(m, n, k)) return false;
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

// The plan of an exact product: cuBLASLt's first proposal for its shape (the caller holds the lock)
Plan* plan_for(const LtApi& api, Table& t, const Key& key) {
  auto pit = t.plans.find(key);
  if (pit != t.plans.end()) return pit->second.ok ? &pit->second : nullptr;
  t.classes.insert(key.with_tokens(0));
  Plan p;
  cublasLtHandle_t h = handle_for(api, t, key.device);
  cublasLtMatmulPreference_t pref = nullptr;
  if (h != nullptr && describe(api, key, p) && api.pref_create(&pref) == CUBLAS_STATUS_SUCCESS) {
    uint64_t ws_bytes = kWorkspace;
    uint32_t align = 16, reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    bool ok = api.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)) ==
              CUBLAS_STATUS_SUCCESS;
    for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      ok = ok && api.pref_set(pref, attr, &align, sizeof(align)) == CUBLAS_STATUS_SUCCESS;
    // split sums reduced in fp32, never in the output's 16-bit type
    ok = ok && api.pref_set(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction, sizeof(reduction)) ==
                   CUBLAS_STATUS_SUCCESS;
    cublasLtMatmulHeuristicResult_t found{};
    int got = 0;
    if (ok && api.heuristic(h, p.desc, p.la, p.lb, p.lc, p.lc, pref, 1, &found, &got) == CUBLAS_STATUS_SUCCESS &&
        got > 0 && found.state == CUBLAS_STATUS_SUCCESS && found.workspaceSize <= kWorkspace) {
      p.ok = true;
      p.algo = found.algo;
    }
    api.pref_destroy(pref);
  }
  if (!p.ok) release(api, p);
  Plan& slot = t.plans[key];
  slot = p;
  return slot.ok ? &slot : nullptr;
}

// The identity of a plan's kernel: its class and its algorithm's bytes
std::string kernel_of(const Key& key, const Plan& p) {
  const Key cls = key.with_tokens(0);
  std::string id(reinterpret_cast<const char*>(&cls), sizeof(Key));
  id.append(reinterpret_cast<const char*>(&p.algo), sizeof(p.algo));
  return id;
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

// One product through its plan on the current stream (the caller holds the lock); false: cuBLASLt refused it
bool launch(const LtApi& api, Table& t, const Key& key, Plan& p, const void* a, const void* b, const void* bias,
            void* out) {
  const auto stream = c10::cuda::getCurrentCUDAStream(key.device);
  void* ws = workspace(t, stream);
  cublasLtHandle_t h = handle_for(api, t, key.device);
  bool ok = true;
  if (key.bias)
    ok = api.desc_set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)) == CUBLAS_STATUS_SUCCESS;
  const float one = 1.f, beta = key.add ? 1.f : 0.f;
  ok = ok && api.matmul(h, p.desc, &one, b, p.la, a, p.lb, &beta, out, p.lc, out, p.lc, &p.algo, ws, kWorkspace,
                        stream.stream()) == CUBLAS_STATUS_SUCCESS;
  if (ok && !p.ran) {
    t.ran.insert(kernel_of(key, p));
    p.ran = true;
  } else if (!ok) {  // this shape goes through ATen from now on
    ++t.refusals;
    release(api, p);
  }
  return ok;
}
#endif  // LS_HAVE_CUBLASLT

// Runs the product through cuBLASLt; false: the caller runs ATen.
bool run_lt(const Key& key, const Operands& o) {
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
  return p != nullptr && launch(api, t, key, *p, o.a.data_ptr(), o.b.data_ptr(),
                                key.bias ? o.bias->data_ptr() : nullptr, o.out.data_ptr());
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
    if (run_lt(key, o)) return o.out;
  }
  return present(bias) ? at::addmm(*bias, a, b) : at::mm(a, b);
}

void gemm_mm_into(const Tensor& out, const Tensor& a, const Tensor& b, bool add, int64_t token) {
  Key key;
  if (maybe_on() && out.scalar_type() == a.scalar_type() && layout_of(out) == 0 && aligned16(out) &&
      out.device() == a.device() && out.size(0) == a.size(0) && out.size(1) == b.size(1) &&
      key_of(a, b, std::nullopt, add, token, &key)) {
    c10::cuda::CUDAGuard guard(a.device());
    if (run_lt(key, Operands{a, b, out, std::nullopt})) return;
  }
  if (add)
    const_cast<Tensor&>(out).addmm_(a, b);
  else
    at::mm_out(const_cast<Tensor&>(out), a, b);
}

// For every class seen so far and every token count: the shape's plan, and one product on scratch operands for
// each algorithm not run before (on the current device and stream, outside captures); a weight gradient's class
// also in its other form (added to, or written). Classes with a size equal to
// skip_size (the vocabulary: the head, whose products the graph step runs through ATen) are left out. Returns
// [shapes planned, products run, classes].
std::vector<int64_t> gemm_preload(const std::vector<int64_t>& token_counts, int64_t skip_size) {
  LS_CHECK(!capturing(), "gemm_preload: not under a CUDA-graph capture");
  int64_t shapes = 0, runs = 0, classes = 0;
#if LS_HAVE_CUBLASLT
  const LtApi& api = lt_api();
  Table& t = table();
  if (!api.ok || !t.on) return {0, 0, 0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<Key> seen;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    seen.assign(t.classes.begin(), t.classes.end());
  }
  // a weight gradient written is also added to (several micro-batches, or a weight used twice), and the reverse
  for (size_t i = 0, n = seen.size(); i < n; ++i) {
    if (seen[i].token != 1) continue;
    Key other = seen[i];
    other.add = !other.add;
    if (std::find(seen.begin(), seen.end(), other) == seen.end()) seen.push_back(other);
  }
  const int device = c10::cuda::current_device();
  for (const Key& cls : seen) {
    if (cls.device != device || (skip_size > 0 && (cls.m == skip_size || cls.n == skip_size || cls.k == skip_size)))
      continue;
    ++classes;
    const auto opts = at::TensorOptions().device(at::kCUDA, device).dtype(static_cast<at::ScalarType>(cls.dtype));
    for (int64_t tokens : token_counts) {
      const Key key = cls.with_tokens(tokens);
      if (!sizes_fit(key.m, key.n, key.k)) continue;
      std::lock_guard<std::mutex> lock(t.mu);  // per shape: products on other threads go on between them
      if (!t.on) break;
      Plan* p = plan_for(api, t, key);
      if (p == nullptr) continue;
      ++shapes;
      if (t.ran.count(kernel_of(key, *p))) continue;
      // scratch operands, never read back: only the kernel's loading matters
      Tensor a = at::zeros({key.m * key.k}, opts), b = at::zeros({key.k * key.n}, opts);
      Tensor out = at::zeros({key.m * key.n}, opts), bias = at::zeros({key.n}, opts);
      if (launch(api, t, key, *p, a.data_ptr(), b.data_ptr(), bias.data_ptr(), out.data_ptr())) ++runs;
    }
  }
  std::lock_guard<std::mutex> lock(t.mu);
  t.preload_runs += runs;
  t.preload_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
#else
  (void)token_counts;
  (void)skip_size;
#endif
  return {shapes, runs, classes};
}

// ----------------------------------------------------------------------------- control (bindings.cpp)

bool gemm_lt_available() {
#if LS_HAVE_CUBLASLT
  return lt_api().ok;
#else
  return false;
#endif
}

void gemm_lt_enable() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  t.on = gemm_lt_available();
}

void gemm_lt_disable() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  t.on = false;
}

bool gemm_lt_on() { return table().on.load(); }

// [on, classes seen, exact shapes through cuBLASLt, exact shapes through ATen (no proposal), distinct kernels run,
//  products refused at run time, products gemm_preload ran, milliseconds gemm_preload took]
std::vector<int64_t> gemm_lt_report() {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  int64_t lt_shapes = 0, aten_shapes = 0, kernels = 0;
#if LS_HAVE_CUBLASLT
  for (const auto& kv : t.plans) (kv.second.ok ? lt_shapes : aten_shapes) += 1;
  kernels = static_cast<int64_t>(t.ran.size());
#endif
  return {static_cast<int64_t>(t.on.load()), static_cast<int64_t>(t.classes.size()), lt_shapes, aten_shapes, kernels,
          t.refusals, t.preload_runs, static_cast<int64_t>(t.preload_seconds * 1000)};
}

}  // namespace ls_torch
