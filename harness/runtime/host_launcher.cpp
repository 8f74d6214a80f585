// The drop-in dequantize_4bit's host path, compiled: checks, output allocation and the launch of
// a call whose tensors are already in the form the kernel reads (plain dense CUDA tensors on the
// GPU whose primary context is current, contiguous, the right dtypes and sizes). Anything else
// returns None, and the Python path (api.py), which owns every error message, takes the call: this
// file never raises for bad input. host_launcher.py builds it with torch.utils.cpp_extension and
// hands it every fact it needs (quant types, output dtypes, block sizes, the tiling threshold, the
// plans); what is left here is the logic of api.dequantize_packed and dequantize_kernel.launch.
//
// Why compiled: on an H100 host the same steps in Python cost ~16 us a call, of which ~4 us are
// tensor property reads, ~3 us PyTorch's Python allocation path and ~2 us the cuda-python
// binding around a ~2 us driver call (kernels/NOTES.md).

#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace {

// The driver's entry points, resolved by cuda-python (cuGetProcAddress) and handed over as
// addresses: no CUDA header or library is needed to build this file.
using LaunchKernelFn = int (*)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                               unsigned shared_bytes, void* stream, void** params, void** extra);
using CtxGetCurrentFn = int (*)(void** ctx);

// The kernel's parameters (dequantize_kernel.KernelArgs, in order); each gets one 8-byte slot.
constexpr const char* kParamKinds[] = {"ptr", "ptr", "ptr", "ptr", "ptr", "f32", "ptr", "i64", "i32", "i32", "i32"};
constexpr int kParams = sizeof(kParamKinds) / sizeof(kParamKinds[0]);
constexpr int kMaxDims = 16;

struct Plan {
  std::atomic<bool> ready{false};
  void* function = nullptr;  // the loaded kernel (CUkernel handle)
  void* context = nullptr;   // the primary context it was loaded for
  int64_t threads = 0, tile_elems = 0, chunk = 0;
};

// Everything one configure() call bound: each returned entry point carries its own, so two copies
// of the harness in one process (the perf gate's base and candidate) never share plans.
struct Config {
  LaunchKernelFn launch = nullptr;
  CtxGetCurrentFn ctx_get_current = nullptr;
  PyObject* raw_stream = nullptr;    // torch._C._cuda_getCurrentRawStream
  PyObject* resolve_plan = nullptr;  // (quant, dtype, nested, tiling, device) -> (function, context, threads, tile, chunk)
  PyObject* subclass_ok = nullptr;   // (type) -> bool: may a Tensor subclass be read directly?
  std::vector<PyObject*> quant_types;  // str
  std::vector<PyObject*> out_dtypes;   // torch.dtype
  uint64_t blocksize_mask = 0;         // bit k: blocksize 2^k accepted
  int64_t large_min_elements = 0;      // tiling 1 from this many elements on
  int64_t max_grid = 0;
  int devices = 0;
  std::unique_ptr<Plan[]> plans;
  std::mutex mutex;  // guards plan publication and the subclass cache; never held across a Python call
  std::vector<std::pair<PyTypeObject*, bool>> subclass_cache;

  ~Config() {
    for (PyObject* o : {raw_stream, resolve_plan, subclass_ok}) Py_XDECREF(o);
    for (PyObject* o : quant_types) Py_DECREF(o);
    for (PyObject* o : out_dtypes) Py_DECREF(o);
    for (const auto& entry : subclass_cache) Py_DECREF(reinterpret_cast<PyObject*>(entry.first));
  }
};

constexpr const char* kCapsule = "nf4_harness_host.Config";

void free_config(PyObject* capsule) { delete static_cast<Config*>(PyCapsule_GetPointer(capsule, kCapsule)); }

// A tensor the kernel may read directly: a Tensor, a Parameter, or a subclass Python vouched for,
// backed by dense strided CUDA memory with no view bits and no wrapper (vmap, grad transforms,
// functionalization, fake tensors) between it and its storage.
const at::Tensor* plain_cuda(Config* config, PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) {
    if (!THPVariable_Check(obj)) return nullptr;
    PyTypeObject* type = Py_TYPE(obj);
    int verdict = -1;  // unknown
    {
      std::lock_guard<std::mutex> guard(config->mutex);
      for (const auto& entry : config->subclass_cache) {
        if (entry.first == type) verdict = entry.second;
      }
    }
    if (verdict < 0) {
      // Asked without holding the mutex: Python may switch threads inside the call.
      PyObject* answer = PyObject_CallOneArg(config->subclass_ok, reinterpret_cast<PyObject*>(type));
      if (answer == nullptr) throw python_error();
      verdict = PyObject_IsTrue(answer) == 1;
      Py_DECREF(answer);
      std::lock_guard<std::mutex> guard(config->mutex);
      Py_INCREF(type);  // the cache keeps the type alive, so its address is never reused
      config->subclass_cache.emplace_back(type, verdict == 1);
    }
    if (verdict != 1) return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || !t.has_storage() || t.layout() != at::kStrided) return nullptr;
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::Functionalize,
                                            c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                            c10::DispatchKey::Conjugate, c10::DispatchKey::Negative,
                                            c10::DispatchKey::ZeroTensor});
  const c10::DispatchKeySet keys = t.key_set();
  if (!keys.has(c10::DispatchKey::CUDA) || !(keys & wrapped).empty()) return nullptr;
  return &t;
}

bool fits(const at::Tensor& t, int64_t device, at::ScalarType dtype, int64_t numel) {
  return t.get_device() == device && t.scalar_type() == dtype && t.is_contiguous() && (numel < 0 || t.numel() == numel);
}

// Index of obj in a registered list, compared by identity (dtype objects are singletons) or, for
// strings, by value.
int index_of(const std::vector<PyObject*>& items, PyObject* obj) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (items[i] == obj) return static_cast<int>(i);
  }
  if (PyUnicode_Check(obj)) {
    for (size_t i = 0; i < items.size(); ++i) {
      if (PyUnicode_Check(items[i]) && PyUnicode_Compare(items[i], obj) == 0) return static_cast<int>(i);
    }
  }
  return -1;
}

// A Python int of exactly type int, read into *value; false (no error set) otherwise.
bool exact_int(PyObject* obj, int64_t* value) {
  if (!PyLong_CheckExact(obj)) return false;
  int overflow = 0;
  *value = PyLong_AsLongLongAndOverflow(obj, &overflow);
  return !overflow && !(*value == -1 && PyErr_Occurred());
}

bool power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

int log2_of(int64_t v) { return __builtin_ctzll(static_cast<unsigned long long>(v)); }

// The plan of one variant on one GPU, resolved through Python (which compiles and loads it) once.
const Plan* plan_for(Config* config, int quant, int dtype, int nested, int tiling, int device) {
  const size_t index = (((static_cast<size_t>(device) * config->quant_types.size() + quant) * config->out_dtypes.size() +
                         dtype) * 2 + nested) * 2 + tiling;
  Plan& plan = config->plans[index];
  if (plan.ready.load(std::memory_order_acquire)) return &plan;
  // Resolved without holding the mutex (Python may switch threads while it compiles); two threads
  // resolving the same plan get the same answer from dequantize_kernel's memo.
  PyObject* r = PyObject_CallFunction(config->resolve_plan, "iiiii", quant, dtype, nested, tiling, device);
  if (r == nullptr) throw python_error();
  unsigned long long function = 0, context = 0;
  long long threads = 0, tile = 0, chunk = 0;
  const bool parsed = PyArg_ParseTuple(r, "KKLLL", &function, &context, &threads, &tile, &chunk);
  Py_DECREF(r);
  if (!parsed) throw python_error();
  std::lock_guard<std::mutex> guard(config->mutex);
  if (!plan.ready.load(std::memory_order_relaxed)) {
    plan.function = reinterpret_cast<void*>(function);
    plan.context = reinterpret_cast<void*>(context);
    plan.threads = threads;
    plan.tile_elems = tile;
    plan.chunk = chunk;
    plan.ready.store(true, std::memory_order_release);
  }
  return &plan;
}

// dequantize(A, absmax, code2, absmax2, offset, out, shape, dtype, blocksize, blocksize2, quant_type)
// -> the output tensor; None where the Python path must take the call; an int (the CUresult)
// where the driver refused the launch.
PyObject* dequantize(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  auto* config = static_cast<Config*>(PyCapsule_GetPointer(capsule, kCapsule));
  if (config == nullptr) return nullptr;
  if (nargs != 11) Py_RETURN_NONE;
  PyObject *A_obj = args[0], *absmax_obj = args[1], *code2_obj = args[2], *absmax2_obj = args[3];
  PyObject *offset_obj = args[4], *out_obj = args[5], *shape_obj = args[6];

  int64_t blocksize = 0;
  if (!exact_int(args[8], &blocksize) || !power_of_two(blocksize) || !((config->blocksize_mask >> log2_of(blocksize)) & 1)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  const int quant = index_of(config->quant_types, args[10]);
  const int dtype_index = THPDtype_Check(args[7]) ? index_of(config->out_dtypes, args[7]) : -1;
  if (quant < 0 || dtype_index < 0) Py_RETURN_NONE;
  const at::ScalarType dtype = reinterpret_cast<THPDtype*>(args[7])->scalar_type;

  const at::Tensor* A = plain_cuda(config, A_obj);
  if (A == nullptr || A->scalar_type() != at::kByte || A->dim() == 0 || !A->is_contiguous()) Py_RETURN_NONE;
  const int64_t device = A->get_device();
  if (device < 0 || device >= config->devices) Py_RETURN_NONE;

  // The shape: a tuple (torch.Size included) or list of non-negative ints whose product fits.
  if (!PyTuple_Check(shape_obj) && !PyList_Check(shape_obj)) Py_RETURN_NONE;
  const Py_ssize_t ndim = PySequence_Fast_GET_SIZE(shape_obj);
  if (ndim > kMaxDims) Py_RETURN_NONE;
  PyObject** dims = PySequence_Fast_ITEMS(shape_obj);
  int64_t sizes[kMaxDims];
  int64_t n = 1;
  for (Py_ssize_t i = 0; i < ndim; ++i) {
    if (!exact_int(dims[i], &sizes[i]) || sizes[i] < 0 || __builtin_mul_overflow(n, sizes[i], &n)) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
  }
  if (n == 0 || A->numel() < n / 2 + n % 2) Py_RETURN_NONE;  // nothing to launch: Python allocates it
  const int64_t nblocks = n / blocksize + (n % blocksize != 0);

  const bool nested = code2_obj != Py_None;
  uint64_t absmax_ptr = 0, code2_ptr = 0, absmax2_ptr = 0, offset_ptr = 0;
  float offset_value = 0.0f;
  int64_t blocksize2 = 1;
  const at::Tensor* absmax = plain_cuda(config, absmax_obj);
  if (absmax == nullptr) Py_RETURN_NONE;
  if (nested) {
    const at::Tensor* code2 = plain_cuda(config, code2_obj);
    const at::Tensor* absmax2 = absmax2_obj == Py_None ? nullptr : plain_cuda(config, absmax2_obj);
    if (!exact_int(args[9], &blocksize2) || !power_of_two(blocksize2)) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    if (code2 == nullptr || absmax2 == nullptr || !fits(*absmax, device, at::kByte, nblocks) ||
        !fits(*code2, device, at::kFloat, 256) ||
        !fits(*absmax2, device, at::kFloat, nblocks / blocksize2 + (nblocks % blocksize2 != 0)))
      Py_RETURN_NONE;
    // The offset as the Python path takes it: a float32 one-element tensor on this GPU (read by the
    // kernel) or a Python number packed as float32. Other forms (host tensors, other dtypes) go
    // through Python, which converts them.
    if (PyFloat_CheckExact(offset_obj) || PyLong_CheckExact(offset_obj)) {
      const double value = PyFloat_CheckExact(offset_obj) ? PyFloat_AS_DOUBLE(offset_obj) : PyLong_AsDouble(offset_obj);
      if (value == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
      }
      offset_value = static_cast<float>(value);
      if (std::isinf(offset_value) && !std::isinf(value)) Py_RETURN_NONE;  // struct.pack refuses it
    } else {
      const at::Tensor* offset = plain_cuda(config, offset_obj);
      if (offset == nullptr || !fits(*offset, device, at::kFloat, 1)) Py_RETURN_NONE;
      offset_ptr = reinterpret_cast<uint64_t>(offset->const_data_ptr());
    }
    code2_ptr = reinterpret_cast<uint64_t>(code2->const_data_ptr());
    absmax2_ptr = reinterpret_cast<uint64_t>(absmax2->const_data_ptr());
  } else if (!fits(*absmax, device, at::kFloat, nblocks)) {
    Py_RETURN_NONE;
  }
  absmax_ptr = reinterpret_cast<uint64_t>(absmax->const_data_ptr());

  const at::Tensor* out = nullptr;
  if (out_obj != Py_None) {
    out = plain_cuda(config, out_obj);
    if (out == nullptr || !fits(*out, device, dtype, -1) || out->dim() != ndim) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < ndim; ++i) {
      if (out->sizes()[i] != sizes[i]) Py_RETURN_NONE;
    }
  }

  const Plan* plan = plan_for(config, quant, dtype_index, nested, n >= config->large_min_elements, static_cast<int>(device));
  void* current = nullptr;
  if (config->ctx_get_current(&current) != 0 || current != plan->context) Py_RETURN_NONE;  // another GPU is current

  at::Tensor allocated;
  if (out == nullptr) {
    allocated = at::empty(c10::IntArrayRef(sizes, ndim), A->options().dtype(dtype));
    out = &allocated;
  }
  const uint64_t A_ptr = reinterpret_cast<uint64_t>(A->const_data_ptr());
  const uint64_t out_ptr = reinterpret_cast<uint64_t>(out->data_ptr());
  // 16-byte stores need a 16-byte aligned output and chunk/2-byte aligned packed loads; else the
  // scalar path, one element per thread (dequantize_kernel.Plan.grid_and_path).
  const bool vectorized = A_ptr % (plan->chunk / 2) == 0 && out_ptr % 16 == 0;
  const int64_t per_block = vectorized ? plan->tile_elems : plan->threads;
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(n / per_block + (n % per_block != 0), config->max_grid));

  PyObject* device_obj = PyLong_FromLongLong(device);
  if (device_obj == nullptr) throw python_error();
  PyObject* stream_obj = PyObject_CallOneArg(config->raw_stream, device_obj);
  Py_DECREF(device_obj);
  if (stream_obj == nullptr) throw python_error();
  const unsigned long long stream = PyLong_AsUnsignedLongLong(stream_obj);
  Py_DECREF(stream_obj);
  if (PyErr_Occurred()) throw python_error();

  uint64_t slots[kParams] = {};
  const int32_t small[3] = {log2_of(blocksize), log2_of(blocksize2), vectorized ? 1 : 0};
  slots[0] = A_ptr;
  slots[1] = absmax_ptr;
  slots[2] = code2_ptr;
  slots[3] = absmax2_ptr;
  slots[4] = offset_ptr;
  std::memcpy(&slots[5], &offset_value, sizeof(float));
  slots[6] = out_ptr;
  std::memcpy(&slots[7], &n, sizeof(int64_t));
  for (int i = 0; i < 3; ++i) std::memcpy(&slots[8 + i], &small[i], sizeof(int32_t));
  void* params[kParams];
  for (int i = 0; i < kParams; ++i) params[i] = &slots[i];

  const int err = config->launch(plan->function, static_cast<unsigned>(grid), 1, 1, static_cast<unsigned>(plan->threads),
                                 1, 1, 0, reinterpret_cast<void*>(stream), params, nullptr);
  if (err != 0) return PyLong_FromLong(err);
  if (out_obj != Py_None) {
    Py_INCREF(out_obj);
    return out_obj;
  }
  return THPVariable_Wrap(std::move(allocated));
  END_HANDLE_TH_ERRORS
}

PyMethodDef dequantize_def = {
    "dequantize", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(dequantize)), METH_FASTCALL,
    "dequantize(A, absmax, code2, absmax2, offset, out, shape, dtype, blocksize, blocksize2, quant_type): the output, "
    "None (the Python path takes the call) or a CUresult (the driver refused the launch)."};

// configure(launch_kernel, ctx_get_current, raw_stream, resolve_plan, subclass_ok, quant_types,
//           out_dtypes, blocksizes, large_min_elements, max_grid, devices) -> a dequantize entry
//           point bound to these facts
PyObject* configure(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  unsigned long long launch = 0, ctx_get_current = 0;
  PyObject *raw_stream, *resolve_plan, *subclass_ok, *quant_types, *out_dtypes, *blocksizes;
  long long large_min = 0, max_grid = 0;
  int devices = 0;
  if (!PyArg_ParseTuple(args, "KKOOOO!O!O!LLi", &launch, &ctx_get_current, &raw_stream, &resolve_plan, &subclass_ok,
                        &PyTuple_Type, &quant_types, &PyTuple_Type, &out_dtypes, &PyTuple_Type, &blocksizes,
                        &large_min, &max_grid, &devices))
    return nullptr;
  if (launch == 0 || ctx_get_current == 0 || devices < 0) {
    PyErr_SetString(PyExc_ValueError, "configure: null driver entry point or negative device count");
    return nullptr;
  }
  auto next = std::make_unique<Config>();
  next->launch = reinterpret_cast<LaunchKernelFn>(launch);
  next->ctx_get_current = reinterpret_cast<CtxGetCurrentFn>(ctx_get_current);
  for (PyObject* f : {raw_stream, resolve_plan, subclass_ok}) Py_INCREF(f);
  next->raw_stream = raw_stream;
  next->resolve_plan = resolve_plan;
  next->subclass_ok = subclass_ok;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(quant_types); ++i) {
    PyObject* item = PyTuple_GET_ITEM(quant_types, i);
    Py_INCREF(item);
    next->quant_types.push_back(item);
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(out_dtypes); ++i) {
    PyObject* item = PyTuple_GET_ITEM(out_dtypes, i);
    if (!THPDtype_Check(item)) {
      PyErr_SetString(PyExc_TypeError, "configure: out_dtypes must be torch.dtype objects");
      return nullptr;
    }
    Py_INCREF(item);
    next->out_dtypes.push_back(item);
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(blocksizes); ++i) {
    const long long b = PyLong_AsLongLong(PyTuple_GET_ITEM(blocksizes, i));
    if (!power_of_two(b)) {
      PyErr_SetString(PyExc_ValueError, "configure: block sizes must be powers of two");
      return nullptr;
    }
    next->blocksize_mask |= 1ull << log2_of(b);
  }
  next->large_min_elements = large_min;
  next->max_grid = max_grid;
  next->devices = devices;
  next->plans.reset(new Plan[static_cast<size_t>(devices) * next->quant_types.size() * next->out_dtypes.size() * 4]);
  PyObject* capsule = PyCapsule_New(next.get(), kCapsule, free_config);
  if (capsule == nullptr) return nullptr;
  next.release();  // the capsule owns it now
  PyObject* entry = PyCFunction_New(&dequantize_def, capsule);  // called with the capsule as its first argument
  Py_DECREF(capsule);
  return entry;
  END_HANDLE_TH_ERRORS
}

PyObject* param_kinds(PyObject* /*module*/, PyObject* /*unused*/) {
  PyObject* kinds = PyTuple_New(kParams);
  if (kinds == nullptr) return nullptr;
  for (int i = 0; i < kParams; ++i) PyTuple_SET_ITEM(kinds, i, PyUnicode_FromString(kParamKinds[i]));
  return kinds;
}

PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "Bind the driver, PyTorch's stream lookup and the kernel's facts; returns the dequantize entry point."},
    {"param_kinds", param_kinds, METH_NOARGS, "The kernel parameter kinds this file packs, in order."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

#define NF4_CONCAT_(a, b) a##b
#define NF4_CONCAT(a, b) NF4_CONCAT_(a, b)
#define NF4_STR_(a) #a
#define NF4_STR(a) NF4_STR_(a)

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, NF4_STR(TORCH_EXTENSION_NAME),
                                 "Compiled host path of nf4-harness' dequantize_4bit.", -1, methods};

PyMODINIT_FUNC NF4_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
