// Argument checks with clear messages (LS_CHECK) and the tensor aliases every adapter and autograd node
// shares. Nothing here needs CUDA headers: autograd.cpp builds against this alone (and so does its CPU
// wiring test, tests/test_cpp_nodes.py).
#pragma once

#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <ATen/ATen.h>

namespace ls_torch {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// ---- Argument checks -----------------------------------------------------------------------------
// LS_CHECK(cond, parts...) throws std::invalid_argument with the parts concatenated. The message is
// built with std::string / std::to_string / snprintf only: no iostreams, no c10 formatting machinery
// (TORCH_CHECK formats through std::ostringstream; see the note in ls_fairseq/_build_flags.py).
// bindings.cpp turns every std::exception into a Python RuntimeError.
namespace detail {

inline void append(std::string& s, const char* v) { s += (v ? v : "(null)"); }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, char v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                           !std::is_same_v<T, char>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);  // same digits as an ostream's default formatting
  s += buf;
}
inline void append(std::string& s, float v) { append(s, static_cast<double>(v)); }
inline void append(std::string& s, at::ScalarType t) { s += c10::toString(t); }
inline void append(std::string& s, const c10::Device& d) {
  s += c10::DeviceTypeName(d.type(), /*lower_case=*/true);
  if (d.has_index()) s += ":" + std::to_string(static_cast<int>(d.index()));
}
inline void append(std::string& s, at::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}

template <typename... A>
inline std::string concat(const A&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}

template <typename... A>
[[noreturn]] inline void fail(const A&... parts) {
  throw std::invalid_argument(concat(parts...));
}

}  // namespace detail

// "[a, b, c]" for a shape.
inline std::string sizes_str(at::IntArrayRef v) { return detail::concat(v); }

#define LS_CHECK(cond, ...)                                  \
  do {                                                       \
    if (!(cond)) ::ls_torch::detail::fail(__VA_ARGS__);      \
  } while (0)

#define LS_CHECK_CUDA(op, t) LS_CHECK((t).is_cuda(), op, ": ", #t, " must be a CUDA tensor, got ", (t).device())
#define LS_CHECK_CONTIG(op, t) LS_CHECK((t).is_contiguous(), op, ": ", #t, " must be contiguous")
#define LS_CHECK_INPUT(op, t) \
  LS_CHECK_CUDA(op, t);       \
  LS_CHECK_CONTIG(op, t)
#define LS_CHECK_SAME_DEVICE(op, a, b) \
  LS_CHECK((a).device() == (b).device(), op, ": ", #a, " and ", #b, " are on different devices")
#define LS_CHECK_DTYPE(op, t, dt) \
  LS_CHECK((t).scalar_type() == (dt), op, ": ", #t, " must be ", (dt), ", got ", (t).scalar_type())

inline bool present(const OptTensor& t) { return t.has_value() && t->defined(); }
// t itself when contiguous (no dispatcher call), else a contiguous copy
inline Tensor contig(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

}  // namespace ls_torch
