// The drop-in dequantize_4bit's host path, compiled: checks, output allocation and the launch of
// a call whose tensors are already in the form the kernel reads (plain dense CUDA tensors on the
// GPU whose primary context is current, contiguous, the right dtypes and sizes). Anything else
// returns None, and the Python path (api.py), which owns every error message, takes the call: this
// file never raises for bad input. host_launcher.py builds it with torch.utils.cpp_extension and
// hands it every fact it needs: the operand rules (dequantize_kernel's tables, read through the
// interpreter below), quant types, output dtypes, block sizes, the tiling threshold and each
// plan's geometry. What is left here is parsing the call's arguments, computing its quantities
// (the same names as dequantize_kernel.quantities) and the grid formula of Geometry.grid_and_path;
// tests/test_call_rules.py holds both paths to the same decisions and launches.
//
// Why compiled: on an H100 host the same steps in Python cost ~16 us a call, of which ~4 us are
// tensor property reads, ~3 us PyTorch's Python allocation path and ~2 us the cuda-python
// binding around a ~2 us driver call (kernels/NOTES.md).

#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <climits>
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
// cuLaunchKernelEx's configuration with one attribute, laid out as cuda.h lays out CUlaunchConfig and
// CUlaunchAttribute (an id padded to 8 bytes, then a 64-byte value).
struct LaunchAttribute {
  int id = 0;
  char pad[4] = {};
  union {
    char bytes[64];
    struct {
      unsigned x, y, z;
    } cluster;
  } value = {};
};
struct LaunchConfig {
  unsigned grid[3] = {}, block[3] = {}, shared_bytes = 0;
  void* stream = nullptr;
  LaunchAttribute* attrs = nullptr;
  unsigned num_attrs = 0;
};
static_assert(sizeof(LaunchAttribute) == 72 && sizeof(LaunchConfig) == 56, "cuda.h's layout of the launch config");
constexpr int kClusterDimension = 4;  // CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
using LaunchKernelExFn = int (*)(const LaunchConfig* config, void* f, void** params, void** extra);

// The entry point's arguments, in order; an operand rule names its tensor by index into the first six.
constexpr const char* kArgs[] = {"A",     "absmax", "code2",     "absmax2",    "offset",    "out",
                                 "shape", "dtype",  "blocksize", "blocksize2", "quant_type"};
constexpr int kTensorArgs = 6;
// The quantities a call's sizes are written in (dequantize_kernel.QUANTITIES, checked at configure).
constexpr const char* kQuantities[] = {"one", "two", "codes8", "n", "nblocks", "blocksize2"};
constexpr int kNumQuantities = sizeof(kQuantities) / sizeof(kQuantities[0]);
constexpr int kParams = 11;  // dequantize_kernel.KernelArgs, one 8-byte slot each
constexpr int kMaxDims = 16;

// One operands.Operand, as operands.encoded() hands it over.
struct Rule {
  int arg = 0;
  enum Kind { kBytes, kFixed, kOut } kind = kFixed;
  at::ScalarType dtype = at::kByte;
  int num = 0, den = 0;
  bool at_least = false, same_shape = false;
  int64_t min_dims = 0;
};

struct Plan {
  std::atomic<bool> ready{false};
  void* function = nullptr;  // the loaded kernel (CUkernel handle)
  void* context = nullptr;   // the primary context it was loaded for
  int64_t threads = 0, tile_elems = 0, packed_align = 1, out_align = 1;
};

// Everything one configure() call bound: each returned entry point carries its own, so two copies
// of the harness in one process (the perf gate's base and candidate) never share plans.
struct Config {
  LaunchKernelFn launch = nullptr;
  CtxGetCurrentFn ctx_get_current = nullptr;
  PyObject* raw_stream = nullptr;    // torch._C._cuda_getCurrentRawStream
  PyObject* resolve_plan = nullptr;  // (quant, dtype, nested, tiling, device) -> (function, context, threads, tile,
                                     //  packed_align, out_align)
  PyObject* subclass_ok = nullptr;   // (type) -> bool: may a Tensor subclass be read directly?
  std::vector<PyObject*> quant_types;  // str
  std::vector<PyObject*> out_dtypes;   // torch.dtype
  std::vector<Rule> plain, nested;     // the operands of each scale kind
  Rule offset, out;
  c10::DispatchKey backend = c10::DispatchKey::CUDA;  // CPU only where tests bind it to host tensors
  uint64_t blocksize_mask = 0;                         // bit k: blocksize 2^k accepted
  int64_t large_min_elements = 0;                      // tiling 1 from this many elements on
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
// backed by dense strided memory of the bound backend with no view bits and no wrapper (vmap, grad
// transforms, functionalization, fake tensors) between it and its storage.
const at::Tensor* plain_tensor(Config* config, PyObject* obj) {
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
  if (!keys.has(config->backend) || !(keys & wrapped).empty()) return nullptr;
  return &t;
}

// operands.check, as a yes/no: the tensor of args[rule.arg] obeys the rule for this call.
const at::Tensor* obeys(Config* config, const Rule& rule, PyObject* const* args, const at::Device& device,
                        const int64_t* q, at::ScalarType dtype, const int64_t* sizes, int64_t ndim) {
  const at::Tensor* t = plain_tensor(config, args[rule.arg]);
  if (t == nullptr || t->device() != device || t->dim() < rule.min_dims || !t->is_contiguous()) return nullptr;
  if (rule.kind == Rule::kFixed && t->scalar_type() != rule.dtype) return nullptr;
  if (rule.kind == Rule::kOut && t->scalar_type() != dtype) return nullptr;
  if (rule.same_shape) {
    if (t->dim() != ndim) return nullptr;
    for (int64_t i = 0; i < ndim; ++i) {
      if (t->sizes()[i] != sizes[i]) return nullptr;
    }
    return t;
  }
  const int64_t need = q[rule.num] / q[rule.den] + (q[rule.num] % q[rule.den] != 0);
  const int64_t have = rule.kind == Rule::kBytes ? t->numel() * static_cast<int64_t>(t->element_size()) : t->numel();
  return (rule.at_least ? have >= need : have == need) ? t : nullptr;
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
  if (overflow || (*value == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

int log2_of(int64_t v) { return __builtin_ctzll(static_cast<unsigned long long>(v)); }

// The plan of one variant on one GPU, resolved through Python (which compiles and loads it) once.
const Plan* plan_for(Config* config, int quant, int dtype, int nested, int tiling, int64_t device) {
  const size_t slot = static_cast<size_t>(std::max<int64_t>(device, 0));
  const size_t index =
      (((slot * config->quant_types.size() + quant) * config->out_dtypes.size() + dtype) * 2 + nested) * 2 + tiling;
  Plan& plan = config->plans[index];
  if (plan.ready.load(std::memory_order_acquire)) return &plan;
  // Resolved without holding the mutex (Python may switch threads while it compiles); two threads
  // resolving the same plan get the same answer from dequantize_kernel's memo.
  PyObject* r = PyObject_CallFunction(config->resolve_plan, "iiiiL", quant, dtype, nested, tiling,
                                      static_cast<long long>(device));
  if (r == nullptr) throw python_error();
  unsigned long long function = 0, context = 0;
  long long threads = 0, tile = 0, packed_align = 0, out_align = 0;
  const bool parsed = PyArg_ParseTuple(r, "KKLLLL", &function, &context, &threads, &tile, &packed_align, &out_align);
  Py_DECREF(r);
  if (!parsed) throw python_error();
  if (threads <= 0 || tile <= 0 || packed_align <= 0 || out_align <= 0) {
    PyErr_SetString(PyExc_ValueError, "resolve_plan returned a non-positive size");
    throw python_error();
  }
  std::lock_guard<std::mutex> guard(config->mutex);
  if (!plan.ready.load(std::memory_order_relaxed)) {
    plan.function = reinterpret_cast<void*>(function);
    plan.context = reinterpret_cast<void*>(context);
    plan.threads = threads;
    plan.tile_elems = tile;
    plan.packed_align = packed_align;
    plan.out_align = out_align;
    plan.ready.store(true, std::memory_order_release);
  }
  return &plan;
}

// One call, checked and planned: what the launch needs once the output exists.
struct Launch {
  int quant = 0, dtype_index = 0, nested = 0, tiling = 0;
  int64_t device = -1, n = 0, blocksize = 0, blocksize2 = 1;
  at::ScalarType dtype = at::kFloat;
  int64_t sizes[kMaxDims] = {};
  int64_t ndim = 0;
  const at::Tensor* A = nullptr;
  const at::Tensor* out = nullptr;  // null: allocate
  uint64_t absmax_ptr = 0, code2_ptr = 0, absmax2_ptr = 0, offset_ptr = 0;
  float offset_value = 0.0f;
  const Plan* plan = nullptr;
  int64_t grid = 0;
  uint64_t slots[kParams] = {};
};

// Checks a call against the rules; false where the Python path must take it.
bool check_call(Config* config, PyObject* const* args, Py_ssize_t nargs, Launch* L) {
  if (nargs != static_cast<Py_ssize_t>(sizeof(kArgs) / sizeof(kArgs[0]))) return false;
  if (!exact_int(args[8], &L->blocksize) || !power_of_two(L->blocksize) ||
      !((config->blocksize_mask >> log2_of(L->blocksize)) & 1))
    return false;
  L->quant = index_of(config->quant_types, args[10]);
  L->dtype_index = THPDtype_Check(args[7]) ? index_of(config->out_dtypes, args[7]) : -1;
  if (L->quant < 0 || L->dtype_index < 0) return false;
  L->dtype = reinterpret_cast<THPDtype*>(args[7])->scalar_type;

  // A fixes the call's device; every operand rule then compares against it.
  L->A = plain_tensor(config, args[0]);
  if (L->A == nullptr) return false;
  const at::Device device = L->A->device();
  L->device = L->A->get_device();
  if (config->backend == c10::DispatchKey::CUDA && (L->device < 0 || L->device >= config->devices)) return false;

  // The shape: a tuple (torch.Size included) or list of non-negative ints whose product fits.
  PyObject* shape_obj = args[6];
  if (!PyTuple_Check(shape_obj) && !PyList_Check(shape_obj)) return false;
  L->ndim = PySequence_Fast_GET_SIZE(shape_obj);
  if (L->ndim > kMaxDims) return false;
  PyObject** dims = PySequence_Fast_ITEMS(shape_obj);
  L->n = 1;
  for (int64_t i = 0; i < L->ndim; ++i) {
    if (!exact_int(dims[i], &L->sizes[i]) || L->sizes[i] < 0 || __builtin_mul_overflow(L->n, L->sizes[i], &L->n))
      return false;
  }
  if (L->n == 0) return false;  // nothing to launch: Python allocates it

  L->nested = args[2] != Py_None;
  if (L->nested && (!exact_int(args[9], &L->blocksize2) || !power_of_two(L->blocksize2))) return false;
  // dequantize_kernel.quantities, in kQuantities' order.
  const int64_t q[kNumQuantities] = {1, 2, 256, L->n, L->n / L->blocksize + (L->n % L->blocksize != 0),
                                     L->blocksize2};
  const std::vector<Rule>& rules = L->nested ? config->nested : config->plain;
  const at::Tensor* operands[kTensorArgs] = {};
  for (const Rule& rule : rules) {
    operands[rule.arg] = obeys(config, rule, args, device, q, L->dtype, L->sizes, L->ndim);
    if (operands[rule.arg] == nullptr) return false;
  }
  if (L->nested) {
    // The offset as a Python number packed as float32, or a tensor the offset rule admits. Other
    // forms (host tensors, other dtypes) go through Python, which converts them.
    PyObject* offset_obj = args[config->offset.arg];
    if (PyFloat_CheckExact(offset_obj) || PyLong_CheckExact(offset_obj)) {
      const double value = PyFloat_CheckExact(offset_obj) ? PyFloat_AS_DOUBLE(offset_obj) : PyLong_AsDouble(offset_obj);
      if (value == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
      L->offset_value = static_cast<float>(value);
      if (std::isinf(L->offset_value) && !std::isinf(value)) return false;  // struct.pack refuses it
    } else {
      const at::Tensor* offset = obeys(config, config->offset, args, device, q, L->dtype, L->sizes, L->ndim);
      if (offset == nullptr) return false;
      L->offset_ptr = reinterpret_cast<uint64_t>(offset->const_data_ptr());
    }
    L->code2_ptr = reinterpret_cast<uint64_t>(operands[2]->const_data_ptr());
    L->absmax2_ptr = reinterpret_cast<uint64_t>(operands[3]->const_data_ptr());
  }
  L->absmax_ptr = reinterpret_cast<uint64_t>(operands[1]->const_data_ptr());
  if (args[config->out.arg] != Py_None) {
    L->out = obeys(config, config->out, args, device, q, L->dtype, L->sizes, L->ndim);
    if (L->out == nullptr) return false;
  }
  return true;
}

// Checks a call and resolves its plan; false where the Python path must take it.
bool prepare(Config* config, PyObject* const* args, Py_ssize_t nargs, Launch* L) {
  if (!check_call(config, args, nargs, L)) return false;
  L->tiling = L->n >= config->large_min_elements;
  L->plan = plan_for(config, L->quant, L->dtype_index, L->nested, L->tiling, L->device);
  return true;
}

// The grid and the kernel's arguments once the output exists (dequantize_kernel.kernel_args).
void finish(Launch* L, uint64_t out_ptr, int64_t max_grid) {
  const uint64_t A_ptr = reinterpret_cast<uint64_t>(L->A->const_data_ptr());
  const Plan* plan = L->plan;
  const bool vectorized = A_ptr % plan->packed_align == 0 && out_ptr % plan->out_align == 0;
  const int64_t per_block = vectorized ? plan->tile_elems : plan->threads;
  L->grid = std::max<int64_t>(1, std::min<int64_t>(L->n / per_block + (L->n % per_block != 0), max_grid));
  const int32_t small[3] = {log2_of(L->blocksize), log2_of(L->blocksize2), vectorized ? 1 : 0};
  L->slots[0] = A_ptr;
  L->slots[1] = L->absmax_ptr;
  L->slots[2] = L->code2_ptr;
  L->slots[3] = L->absmax2_ptr;
  L->slots[4] = L->offset_ptr;
  std::memcpy(&L->slots[5], &L->offset_value, sizeof(float));
  L->slots[6] = out_ptr;
  std::memcpy(&L->slots[7], &L->n, sizeof(int64_t));
  for (int i = 0; i < 3; ++i) std::memcpy(&L->slots[8 + i], &small[i], sizeof(int32_t));
}

at::Tensor allocate(const Launch& L) {
  return at::empty(c10::IntArrayRef(L.sizes, L.ndim), L.A->options().dtype(L.dtype));
}

// PyTorch's current stream on a GPU, as a raw handle.
unsigned long long current_stream(Config* config, int64_t device) {
  PyObject* device_obj = PyLong_FromLongLong(device);
  if (device_obj == nullptr) throw python_error();
  PyObject* stream_obj = PyObject_CallOneArg(config->raw_stream, device_obj);
  Py_DECREF(device_obj);
  if (stream_obj == nullptr) throw python_error();
  const unsigned long long stream = PyLong_AsUnsignedLongLong(stream_obj);
  Py_DECREF(stream_obj);
  if (PyErr_Occurred()) throw python_error();
  return stream;
}

Config* config_of(PyObject* capsule) { return static_cast<Config*>(PyCapsule_GetPointer(capsule, kCapsule)); }

// dequantize(A, absmax, code2, absmax2, offset, out, shape, dtype, blocksize, blocksize2, quant_type)
// -> the output tensor; None where the Python path must take the call; an int (the CUresult)
// where the driver refused the launch.
PyObject* dequantize(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  Config* config = config_of(capsule);
  if (config == nullptr) return nullptr;
  Launch L;
  if (!prepare(config, args, nargs, &L)) Py_RETURN_NONE;
  void* current = nullptr;
  if (config->ctx_get_current(&current) != 0 || current != L.plan->context) Py_RETURN_NONE;  // another GPU is current

  at::Tensor allocated;
  if (L.out == nullptr) {
    allocated = allocate(L);
    L.out = &allocated;
  }
  finish(&L, reinterpret_cast<uint64_t>(L.out->data_ptr()), config->max_grid);

  const unsigned long long stream = current_stream(config, L.device);
  void* params[kParams];
  for (int i = 0; i < kParams; ++i) params[i] = &L.slots[i];
  const int err = config->launch(L.plan->function, static_cast<unsigned>(L.grid), 1, 1,
                                 static_cast<unsigned>(L.plan->threads), 1, 1, 0, reinterpret_cast<void*>(stream), params,
                                 nullptr);
  if (err != 0) return PyLong_FromLong(err);
  if (args[config->out.arg] != Py_None) {
    Py_INCREF(args[config->out.arg]);
    return args[config->out.arg];
  }
  return THPVariable_Wrap(std::move(allocated));
  END_HANDLE_TH_ERRORS
}

// A launch's kernel parameter slots as a tuple of ints (for describe and describe_matmul).
PyObject* slots_tuple(const uint64_t* slots, int count) {
  PyObject* t = PyTuple_New(count);
  if (t == nullptr) return nullptr;
  for (int i = 0; i < count; ++i) PyTuple_SET_ITEM(t, i, PyLong_FromUnsignedLongLong(slots[i]));
  return t;
}

// describe(entry, *args): the launch dequantize would make, without the context check or the launch:
// ((quant, dtype, nested, tiling, device), grid, threads, slots), or None where it declines.
PyObject* describe(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs < 1 || !PyCFunction_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "describe: the first argument must be an entry point from configure()");
    return nullptr;
  }
  Config* config = config_of(PyCFunction_GET_SELF(args[0]));
  if (config == nullptr) return nullptr;
  Launch L;
  if (!prepare(config, args + 1, nargs - 1, &L)) Py_RETURN_NONE;
  at::Tensor allocated;
  if (L.out == nullptr) {
    allocated = allocate(L);
    L.out = &allocated;
  }
  finish(&L, reinterpret_cast<uint64_t>(L.out->data_ptr()), config->max_grid);
  PyObject* slots = slots_tuple(L.slots, kParams);
  if (slots == nullptr) return nullptr;
  return Py_BuildValue("(iiiiL)LLN", L.quant, L.dtype_index, L.nested, L.tiling, static_cast<long long>(L.device),
                       static_cast<long long>(L.grid), static_cast<long long>(L.plan->threads), slots);
  END_HANDLE_TH_ERRORS
}

PyMethodDef dequantize_def = {
    "dequantize", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(dequantize)), METH_FASTCALL,
    "dequantize(A, absmax, code2, absmax2, offset, out, shape, dtype, blocksize, blocksize2, quant_type): the output, "
    "None (the Python path takes the call) or a CUresult (the driver refused the launch)."};

// ---- The fused matmul (matmul_kernel.py): the same path for its calls ----
// A call is taken only where matmul.try_fused would run the fused kernel with these tensors as
// they are: the weight obeys the dequantization call's rules (check_call above, the same tables),
// the activations, bias and out are as the kernel reads them, no gradient is needed and the rows
// are within max_rows (None: the GPU's crossover for the weight's size). The token tile, plan and
// grid come from Python (matmul_kernel.host_plan and host_grid), so each rule about them is stated
// there once.

constexpr const char* kMatmulArgs[] = {"A",     "W",   "absmax", "code2",     "absmax2",    "offset",    "bias",
                                       "out",   "shape", "blocksize", "blocksize2", "quant_type", "max_rows"};
constexpr int kMatmulNargs = sizeof(kMatmulArgs) / sizeof(kMatmulArgs[0]);
constexpr int kMainParams = 16;   // matmul_kernel.MAIN_PARAMS
constexpr int kFinishParams = 6;  // matmul_kernel.FINISH_PARAMS

struct MatmulPlan {
  std::atomic<bool> ready{false};
  void* main = nullptr;
  void* finish = nullptr;
  void* context = nullptr;
  int64_t main_threads = 0, finish_threads = 0, blocks_per_sm = 0, sms = 0;
  unsigned main_shared = 0;  // dynamic shared memory bytes of each main launch
  PyObject* max_clusters = nullptr;  // handed back to grid_of as it came (matmul_kernel.Plan.max_clusters)

  ~MatmulPlan() { Py_XDECREF(max_clusters); }
};

// A GPU's crossover (matmul.crossover_table): (weight elements from which it holds, most rows), by
// increasing size, read once.
struct CrossoverTable {
  std::atomic<bool> ready{false};
  std::vector<std::pair<int64_t, int64_t>> steps;
};

struct MatmulConfig {
  PyObject* dequantize = nullptr;  // the dequantization entry point: owns the Config reused here
  Config* config = nullptr;
  PyObject* resolve_plan = nullptr;  // (dtype, quant, nested, tokens, device) -> (main, finish, context,
                                     //  main threads, main shared bytes, finish threads, blocks per SM,
                                     //  SMs, max clusters); indices but device
  PyObject* grid_of = nullptr;       // (M, N, K, tokens, blocks per SM, SMs, max clusters) -> (gx, gy, gz,
                                     //  steps per split, finish blocks (0: none), cluster blocks along y)
  LaunchKernelExFn launch_ex = nullptr;  // cuLaunchKernelEx: the main launch of a cluster grid
  PyObject* crossover = nullptr;     // (device) -> that GPU's CrossoverTable as ((elements, rows), ...)
  std::vector<PyObject*> dtypes;     // A's dtypes, in the variants' order
  std::vector<int64_t> token_tiles;
  int64_t k_multiple = 1, align = 1;
  std::unique_ptr<MatmulPlan[]> plans;
  std::unique_ptr<CrossoverTable[]> crossovers;  // per GPU

  ~MatmulConfig() {
    for (PyObject* o : {dequantize, resolve_plan, grid_of, crossover}) Py_XDECREF(o);
    for (PyObject* o : dtypes) Py_DECREF(o);
  }
};

constexpr const char* kMatmulCapsule = "nf4_harness_host.MatmulConfig";

void free_matmul_config(PyObject* capsule) {
  delete static_cast<MatmulConfig*>(PyCapsule_GetPointer(capsule, kMatmulCapsule));
}

MatmulConfig* matmul_config_of(PyObject* capsule) {
  return static_cast<MatmulConfig*>(PyCapsule_GetPointer(capsule, kMatmulCapsule));
}

uint64_t address(const at::Tensor* t) { return reinterpret_cast<uint64_t>(t->const_data_ptr()); }

const MatmulPlan* matmul_plan_for(MatmulConfig* mc, int dtype, int quant, int nested, int tokens, int64_t device) {
  const size_t slot = static_cast<size_t>(std::max<int64_t>(device, 0));
  const size_t index =
      (((slot * mc->dtypes.size() + dtype) * mc->config->quant_types.size() + quant) * 2 + nested) *
          mc->token_tiles.size() +
      tokens;
  MatmulPlan& plan = mc->plans[index];
  if (plan.ready.load(std::memory_order_acquire)) return &plan;
  PyObject* r = PyObject_CallFunction(mc->resolve_plan, "iiiiL", dtype, quant, nested, tokens,
                                      static_cast<long long>(device));
  if (r == nullptr) throw python_error();
  unsigned long long main = 0, finish = 0, context = 0;
  long long main_threads = 0, main_shared = 0, finish_threads = 0, blocks_per_sm = 0, sms = 0;
  PyObject* max_clusters = nullptr;  // borrowed from r
  const bool parsed = PyArg_ParseTuple(r, "KKKLLLLLO", &main, &finish, &context, &main_threads, &main_shared,
                                       &finish_threads, &blocks_per_sm, &sms, &max_clusters);
  if (parsed) Py_INCREF(max_clusters);
  Py_DECREF(r);
  if (!parsed) throw python_error();
  if (main_threads <= 0 || finish_threads <= 0 || blocks_per_sm <= 0 || sms <= 0 || main_shared < 0 ||
      main_shared > UINT_MAX) {
    Py_DECREF(max_clusters);
    PyErr_SetString(PyExc_ValueError, "matmul resolve_plan returned a non-positive size or a bad shared memory size");
    throw python_error();
  }
  std::lock_guard<std::mutex> guard(mc->config->mutex);
  if (!plan.ready.load(std::memory_order_relaxed)) {
    plan.main = reinterpret_cast<void*>(main);
    plan.finish = reinterpret_cast<void*>(finish);
    plan.context = reinterpret_cast<void*>(context);
    plan.main_threads = main_threads;
    plan.main_shared = static_cast<unsigned>(main_shared);
    plan.finish_threads = finish_threads;
    plan.blocks_per_sm = blocks_per_sm;
    plan.sms = sms;
    plan.max_clusters = max_clusters;
    plan.ready.store(true, std::memory_order_release);
  } else {
    Py_DECREF(max_clusters);  // another thread resolved it first
  }
  return &plan;
}

// The most rows fused on this GPU for a weight of `elements` elements: the rows of the table's last
// entry whose size is at most that (matmul.rows_within).
int64_t crossover_of(MatmulConfig* mc, int64_t device, int64_t elements) {
  CrossoverTable& table = mc->crossovers[static_cast<size_t>(std::max<int64_t>(device, 0))];
  if (!table.ready.load(std::memory_order_acquire)) {
    PyObject* r = PyObject_CallFunction(mc->crossover, "L", static_cast<long long>(device));
    if (r == nullptr) throw python_error();
    PyObject* seq = PySequence_Fast(r, "matmul crossover must return a sequence of (elements, rows) pairs");
    Py_DECREF(r);
    if (seq == nullptr) throw python_error();
    std::vector<std::pair<int64_t, int64_t>> steps;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
      long long size = 0, rows = 0;
      if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "LL", &size, &rows)) {
        Py_DECREF(seq);
        throw python_error();
      }
      steps.emplace_back(size, rows);
    }
    Py_DECREF(seq);
    std::lock_guard<std::mutex> guard(mc->config->mutex);
    if (!table.ready.load(std::memory_order_relaxed)) {
      table.steps = std::move(steps);
      table.ready.store(true, std::memory_order_release);
    }
  }
  int64_t rows = 0;
  for (const auto& [size, most] : table.steps) {
    if (size > elements) break;
    rows = most;
  }
  return rows;
}

// One matmul call, checked and planned: what its launches need once the output exists.
struct MatmulLaunch {
  Launch weight;  // the weight's checks and scale pointers (its A is the packed weight)
  const at::Tensor* A = nullptr;
  const at::Tensor* bias = nullptr;
  const at::Tensor* out = nullptr;  // null: allocate
  int dtype = 0, tokens = 0;
  int64_t M = 0, N = 0, K = 0;
  int64_t out_sizes[kMaxDims] = {};
  int64_t out_ndim = 0;
  const MatmulPlan* plan = nullptr;
  int64_t grid[3] = {}, steps_per_split = 0, finish_blocks = 0, cluster_y = 1;
  uint64_t main[kMainParams] = {}, finish[kFinishParams] = {};
};

// A tensor matmul.try_fused reads as it is: plain, dense, on A's device, of A's dtype, 16-byte aligned.
const at::Tensor* kernel_reads(MatmulConfig* mc, PyObject* obj, const at::Tensor& A) {
  const at::Tensor* t = plain_tensor(mc->config, obj);
  if (t == nullptr || t->device() != A.device() || t->scalar_type() != A.scalar_type() || !t->is_contiguous())
    return nullptr;
  return address(t) % mc->align == 0 ? t : nullptr;
}

bool prepare_matmul(MatmulConfig* mc, PyObject* const* args, Py_ssize_t nargs, MatmulLaunch* ML) {
  if (nargs != kMatmulNargs) return false;
  Config* config = mc->config;
  ML->A = plain_tensor(config, args[0]);
  if (ML->A == nullptr) return false;
  const at::Tensor& A = *ML->A;
  ML->dtype = -1;
  for (size_t i = 0; i < mc->dtypes.size(); ++i) {
    if (reinterpret_cast<THPDtype*>(mc->dtypes[i])->scalar_type == A.scalar_type()) ML->dtype = static_cast<int>(i);
  }
  if (ML->dtype < 0 || A.dim() < 1 || A.numel() == 0 || !A.is_contiguous() || address(ML->A) % mc->align != 0)
    return false;
  const bool grad = at::GradMode::is_enabled();
  if (grad && A.requires_grad()) return false;

  // The weight: the dequantization call's rules, its output dtype A's.
  PyObject* const weight_args[] = {args[1], args[2], args[3], args[4], args[5], Py_None,
                                   args[8], mc->dtypes[ML->dtype], args[9], args[10], args[11]};
  Launch& W = ML->weight;
  if (!check_call(config, weight_args, sizeof(weight_args) / sizeof(weight_args[0]), &W)) return false;
  if (W.ndim != 2 || W.A->device() != A.device() || address(W.A) % mc->align != 0) return false;
  ML->N = W.sizes[0];
  ML->K = W.sizes[1];
  if (A.size(-1) != ML->K || ML->K % mc->k_multiple != 0 || W.blocksize < mc->k_multiple) return false;
  ML->M = A.numel() / ML->K;
  int64_t max_rows = 0;
  if (args[12] == Py_None) {
    max_rows = crossover_of(mc, W.device, ML->N * ML->K);
  } else if (!exact_int(args[12], &max_rows)) {
    return false;
  }
  if (ML->M > max_rows) return false;

  if (args[6] != Py_None) {
    ML->bias = kernel_reads(mc, args[6], A);
    if (ML->bias == nullptr || ML->bias->numel() != ML->N || (grad && ML->bias->requires_grad())) return false;
  }
  ML->out_ndim = A.dim();
  for (int64_t i = 0; i + 1 < A.dim(); ++i) ML->out_sizes[i] = A.size(i);
  ML->out_sizes[A.dim() - 1] = ML->N;
  if (args[7] != Py_None) {  // written directly only where it is the result's own form
    const at::Tensor* out = plain_tensor(config, args[7]);
    if (out == nullptr || out->device() != A.device() || out->scalar_type() != A.scalar_type() ||
        !out->is_contiguous() || out->dim() != ML->out_ndim)
      return false;
    for (int64_t i = 0; i < ML->out_ndim; ++i) {
      if (out->size(i) != ML->out_sizes[i]) return false;
    }
    ML->out = out;
  }

  ML->tokens = static_cast<int>(mc->token_tiles.size()) - 1;  // the largest for more: the grid covers the rest
  for (size_t i = 0; i < mc->token_tiles.size(); ++i) {
    if (ML->M <= mc->token_tiles[i]) {
      ML->tokens = static_cast<int>(i);
      break;
    }
  }
  ML->plan = matmul_plan_for(mc, ML->dtype, W.quant, W.nested, ML->tokens, W.device);
  PyObject* g = PyObject_CallFunction(
      mc->grid_of, "LLLLLLO", static_cast<long long>(ML->M), static_cast<long long>(ML->N),
      static_cast<long long>(ML->K), static_cast<long long>(mc->token_tiles[ML->tokens]),
      static_cast<long long>(ML->plan->blocks_per_sm), static_cast<long long>(ML->plan->sms),
      ML->plan->max_clusters);
  if (g == nullptr) throw python_error();
  long long gx = 0, gy = 0, gz = 0, steps = 0, finish_blocks = 0, cluster_y = 1;
  const bool parsed = PyArg_ParseTuple(g, "LLLLLL", &gx, &gy, &gz, &steps, &finish_blocks, &cluster_y);
  Py_DECREF(g);
  if (!parsed) throw python_error();
  ML->grid[0] = gx;
  ML->grid[1] = gy;
  ML->grid[2] = gz;
  ML->steps_per_split = steps;
  ML->finish_blocks = finish_blocks;
  ML->cluster_y = cluster_y;
  return true;
}

// The output, the workspace (one fp32 [M, N] slice per split of K the finish adds) and both kernels'
// arguments (matmul_kernel.launch_args' order).
void finish_matmul(MatmulLaunch* ML, at::Tensor* allocated, at::Tensor* workspace) {
  const at::Tensor& A = *ML->A;
  if (ML->out == nullptr) {
    *allocated = at::empty(c10::IntArrayRef(ML->out_sizes, ML->out_ndim), A.options());
    ML->out = allocated;
  }
  const int64_t splits = ML->grid[1];
  uint64_t partial = 0;
  if (ML->finish_blocks > 0) {
    *workspace = at::empty({splits * ML->M * ML->N}, A.options().dtype(at::kFloat));
    partial = reinterpret_cast<uint64_t>(workspace->data_ptr());
  }
  const Launch& W = ML->weight;
  const uint64_t out = reinterpret_cast<uint64_t>(ML->out->data_ptr());
  const uint64_t bias = ML->bias ? address(ML->bias) : 0;
  uint64_t* m = ML->main;
  m[0] = address(ML->A);
  m[1] = address(W.A);
  m[2] = W.absmax_ptr;
  m[3] = W.code2_ptr;
  m[4] = W.absmax2_ptr;
  m[5] = W.offset_ptr;
  std::memcpy(&m[6], &W.offset_value, sizeof(float));
  m[7] = partial;
  m[8] = bias;
  m[9] = out;
  std::memcpy(&m[10], &ML->M, sizeof(int64_t));
  const int32_t small[6] = {static_cast<int32_t>(ML->N), static_cast<int32_t>(ML->K), log2_of(W.blocksize),
                            log2_of(W.blocksize2), static_cast<int32_t>(ML->steps_per_split),
                            static_cast<int32_t>(splits)};
  for (int i = 0; i < 5; ++i) std::memcpy(&m[11 + i], &small[i], sizeof(int32_t));
  uint64_t* f = ML->finish;
  f[0] = partial;
  f[1] = bias;
  f[2] = out;
  std::memcpy(&f[3], &ML->M, sizeof(int64_t));
  std::memcpy(&f[4], &small[0], sizeof(int32_t));
  std::memcpy(&f[5], &small[5], sizeof(int32_t));
}

// matmul(A, W, absmax, code2, absmax2, offset, bias, out, shape, blocksize, blocksize2, quant_type,
// max_rows) -> the output; None where the Python path must take the call; (kernel, CUresult) where
// the driver refused a launch (kernel 0: the main one, 1: the finish).
PyObject* matmul(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  MatmulConfig* mc = matmul_config_of(capsule);
  if (mc == nullptr) return nullptr;
  MatmulLaunch ML;
  if (!prepare_matmul(mc, args, nargs, &ML)) Py_RETURN_NONE;
  Config* config = mc->config;
  void* current = nullptr;
  // Another GPU's context is current, or none (a thread that never used CUDA): the Python path.
  if (config->ctx_get_current(&current) != 0 || current != ML.plan->context) Py_RETURN_NONE;
  at::Tensor allocated, workspace;
  finish_matmul(&ML, &allocated, &workspace);
  void* stream = reinterpret_cast<void*>(current_stream(config, ML.weight.device));
  void* params[kMainParams];
  for (int i = 0; i < kMainParams; ++i) params[i] = &ML.main[i];
  int err = 0;
  if (ML.cluster_y == 1) {
    err = config->launch(ML.plan->main, static_cast<unsigned>(ML.grid[0]), static_cast<unsigned>(ML.grid[1]),
                         static_cast<unsigned>(ML.grid[2]), static_cast<unsigned>(ML.plan->main_threads), 1, 1,
                         ML.plan->main_shared, stream, params, nullptr);
  } else {
    LaunchAttribute cluster;
    cluster.id = kClusterDimension;
    cluster.value.cluster = {1, static_cast<unsigned>(ML.cluster_y), 1};
    LaunchConfig launch;
    for (int i = 0; i < 3; ++i) launch.grid[i] = static_cast<unsigned>(ML.grid[i]);
    launch.block[0] = static_cast<unsigned>(ML.plan->main_threads);
    launch.block[1] = launch.block[2] = 1;
    launch.shared_bytes = ML.plan->main_shared;
    launch.stream = stream;
    launch.attrs = &cluster;
    launch.num_attrs = 1;
    err = mc->launch_ex(&launch, ML.plan->main, params, nullptr);
  }
  if (err != 0) return Py_BuildValue("ii", 0, err);
  if (ML.finish_blocks > 0) {
    for (int i = 0; i < kFinishParams; ++i) params[i] = &ML.finish[i];
    err = config->launch(ML.plan->finish, static_cast<unsigned>(ML.finish_blocks), 1, 1,
                         static_cast<unsigned>(ML.plan->finish_threads), 1, 1, 0, stream, params, nullptr);
    if (err != 0) return Py_BuildValue("ii", 1, err);
  }
  if (args[7] != Py_None) {
    Py_INCREF(args[7]);
    return args[7];
  }
  return THPVariable_Wrap(std::move(allocated));
  END_HANDLE_TH_ERRORS
}

// describe_matmul(entry, *args): the launches matmul would make, without the context check or the
// launches: ((dtype, quant, nested, tokens, device), (gx, gy, gz), main threads, main shared bytes,
// main slots, cluster blocks along y, finish blocks (0: no finish), finish threads, finish slots), or
// None where it declines.
PyObject* describe_matmul(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs < 1 || !PyCFunction_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError,
                    "describe_matmul: the first argument must be an entry point from configure_matmul()");
    return nullptr;
  }
  MatmulConfig* mc = matmul_config_of(PyCFunction_GET_SELF(args[0]));
  if (mc == nullptr) return nullptr;
  MatmulLaunch ML;
  if (!prepare_matmul(mc, args + 1, nargs - 1, &ML)) Py_RETURN_NONE;
  at::Tensor allocated, workspace;
  finish_matmul(&ML, &allocated, &workspace);
  const Launch& W = ML.weight;
  return Py_BuildValue("(iiiiL)(LLL)LLNLLLN", ML.dtype, W.quant, W.nested, ML.tokens,
                       static_cast<long long>(W.device), static_cast<long long>(ML.grid[0]),
                       static_cast<long long>(ML.grid[1]), static_cast<long long>(ML.grid[2]),
                       static_cast<long long>(ML.plan->main_threads), static_cast<long long>(ML.plan->main_shared),
                       slots_tuple(ML.main, kMainParams),
                       static_cast<long long>(ML.cluster_y), static_cast<long long>(ML.finish_blocks),
                       static_cast<long long>(ML.plan->finish_threads), slots_tuple(ML.finish, kFinishParams));
  END_HANDLE_TH_ERRORS
}

PyMethodDef matmul_def = {
    "matmul", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(matmul)), METH_FASTCALL,
    "matmul(A, W, absmax, code2, absmax2, offset, bias, out, shape, blocksize, blocksize2, quant_type, max_rows): the "
    "output, None (the Python path takes the call) or (kernel, CUresult) (the driver refused a launch)."};

// configure_matmul(dequantize_entry, resolve_plan, grid_of, crossover, dtypes, token_tiles, k_multiple, align,
// launch_kernel_ex) -> a matmul entry point sharing the dequantization entry's driver, stream lookup and
// weight rules
PyObject* configure_matmul(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *dequantize, *resolve_plan, *grid_of, *crossover, *dtypes, *token_tiles;
  long long k_multiple = 0, align = 0;
  unsigned long long launch_ex = 0;
  if (!PyArg_ParseTuple(args, "OOOOO!O!LLK", &dequantize, &resolve_plan, &grid_of, &crossover, &PyTuple_Type,
                        &dtypes, &PyTuple_Type, &token_tiles, &k_multiple, &align, &launch_ex))
    return nullptr;
  if (!PyCFunction_Check(dequantize) || PyCFunction_GET_SELF(dequantize) == nullptr ||
      !PyCapsule_IsValid(PyCFunction_GET_SELF(dequantize), kCapsule)) {
    PyErr_SetString(PyExc_TypeError, "configure_matmul: the first argument must be an entry point from configure()");
    return nullptr;
  }
  if (k_multiple <= 0 || align <= 0 || PyTuple_GET_SIZE(dtypes) == 0 || PyTuple_GET_SIZE(token_tiles) == 0) {
    PyErr_SetString(PyExc_ValueError, "configure_matmul: empty dtypes or token tiles, or a non-positive size");
    return nullptr;
  }
  auto next = std::make_unique<MatmulConfig>();
  next->config = config_of(PyCFunction_GET_SELF(dequantize));
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(dtypes); ++i) {
    PyObject* item = PyTuple_GET_ITEM(dtypes, i);
    if (!THPDtype_Check(item) || index_of(next->config->out_dtypes, item) < 0) {
      PyErr_SetString(PyExc_TypeError,
                      "configure_matmul: every dtype must be one of the dequantization's output dtypes");
      return nullptr;
    }
    Py_INCREF(item);
    next->dtypes.push_back(item);
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(token_tiles); ++i) {
    const long long t = PyLong_AsLongLong(PyTuple_GET_ITEM(token_tiles, i));
    if (t <= 0 || (!next->token_tiles.empty() && t <= next->token_tiles.back())) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "configure_matmul: token tiles must be increasing");
      return nullptr;
    }
    next->token_tiles.push_back(t);
  }
  for (PyObject* f : {dequantize, resolve_plan, grid_of, crossover}) Py_INCREF(f);
  next->dequantize = dequantize;
  next->resolve_plan = resolve_plan;
  next->grid_of = grid_of;
  next->crossover = crossover;
  next->k_multiple = k_multiple;
  next->align = align;
  next->launch_ex = reinterpret_cast<LaunchKernelExFn>(launch_ex);
  const size_t slots = static_cast<size_t>(std::max(next->config->devices, 1));
  next->plans.reset(new MatmulPlan[slots * next->dtypes.size() * next->config->quant_types.size() * 2 *
                                   next->token_tiles.size()]);
  next->crossovers.reset(new CrossoverTable[slots]);
  PyObject* capsule = PyCapsule_New(next.get(), kMatmulCapsule, free_matmul_config);
  if (capsule == nullptr) return nullptr;
  next.release();
  PyObject* entry = PyCFunction_New(&matmul_def, capsule);
  Py_DECREF(capsule);
  return entry;
  END_HANDLE_TH_ERRORS
}

// One row of operands.encoded() into a Rule; false (a Python error set) where it is malformed.
bool parse_rule(PyObject* row, Rule* rule) {
  PyObject* dtype = nullptr;
  int at_least = 0, same_shape = 0;
  long long min_dims = 0;
  if (!PyArg_ParseTuple(row, "iOiipLp", &rule->arg, &dtype, &rule->num, &rule->den, &at_least, &min_dims,
                        &same_shape))
    return false;
  if (rule->arg < 0 || rule->arg >= kTensorArgs || rule->num < 0 || rule->num >= kNumQuantities || rule->den < 0 ||
      rule->den >= kNumQuantities) {
    PyErr_SetString(PyExc_ValueError, "configure: an operand rule names an unknown argument or quantity");
    return false;
  }
  if (dtype == Py_None) {
    rule->kind = Rule::kBytes;
  } else if (THPDtype_Check(dtype)) {
    rule->kind = Rule::kFixed;
    rule->dtype = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  } else if (PyUnicode_Check(dtype) && PyUnicode_CompareWithASCIIString(dtype, "out") == 0) {
    rule->kind = Rule::kOut;
  } else {
    PyErr_SetString(PyExc_TypeError, "configure: an operand's dtype must be a torch.dtype, None or 'out'");
    return false;
  }
  rule->at_least = at_least;
  rule->same_shape = same_shape;
  rule->min_dims = min_dims;
  return true;
}

bool parse_rules(PyObject* rows, std::vector<Rule>* rules) {
  if (!PyTuple_Check(rows)) {
    PyErr_SetString(PyExc_TypeError, "configure: operand rules must be a tuple");
    return false;
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(rows); ++i) {
    Rule rule;
    if (!parse_rule(PyTuple_GET_ITEM(rows, i), &rule)) return false;
    rules->push_back(rule);
  }
  return true;
}

// configure(launch_kernel, ctx_get_current, raw_stream, resolve_plan, subclass_ok, quant_types,
//           out_dtypes, blocksizes, large_min_elements, max_grid, devices, quantities, plain, nested,
//           offset, out, backend) -> a dequantize entry point bound to these facts
PyObject* configure(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  unsigned long long launch = 0, ctx_get_current = 0;
  PyObject *raw_stream, *resolve_plan, *subclass_ok, *quant_types, *out_dtypes, *blocksizes, *quantities;
  PyObject *plain, *nested, *offset, *out;
  const char* backend = nullptr;
  long long large_min = 0, max_grid = 0;
  int devices = 0;
  if (!PyArg_ParseTuple(args, "KKOOOO!O!O!LLiO!OOOOs", &launch, &ctx_get_current, &raw_stream, &resolve_plan,
                        &subclass_ok, &PyTuple_Type, &quant_types, &PyTuple_Type, &out_dtypes, &PyTuple_Type,
                        &blocksizes, &large_min, &max_grid, &devices, &PyTuple_Type, &quantities, &plain, &nested,
                        &offset, &out, &backend))
    return nullptr;
  if (launch == 0 || ctx_get_current == 0 || devices < 0) {
    PyErr_SetString(PyExc_ValueError, "configure: null driver entry point or negative device count");
    return nullptr;
  }
  bool same = PyTuple_GET_SIZE(quantities) == kNumQuantities;
  for (int i = 0; same && i < kNumQuantities; ++i) {
    PyObject* name = PyTuple_GET_ITEM(quantities, i);
    same = PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, kQuantities[i]) == 0;
  }
  if (!same) {
    PyErr_SetString(PyExc_ValueError, "configure: the quantities differ from the ones this file computes");
    return nullptr;
  }
  auto next = std::make_unique<Config>();
  if (std::strcmp(backend, "cuda") == 0) {
    next->backend = c10::DispatchKey::CUDA;
  } else if (std::strcmp(backend, "cpu") == 0) {
    next->backend = c10::DispatchKey::CPU;
  } else {
    PyErr_SetString(PyExc_ValueError, "configure: backend must be 'cuda' or 'cpu'");
    return nullptr;
  }
  if (!parse_rules(plain, &next->plain) || !parse_rules(nested, &next->nested) || !parse_rule(offset, &next->offset) ||
      !parse_rule(out, &next->out))
    return nullptr;
  // prepare() reads A's device first and the pointers of these arguments after the checks.
  const std::pair<const std::vector<Rule>*, unsigned> coverage[] = {{&next->plain, 0b0011u}, {&next->nested, 0b1111u}};
  for (const auto& [rules, needed] : coverage) {
    unsigned covered = 0;
    for (const Rule& rule : *rules) covered |= 1u << rule.arg;
    if (rules->empty() || (*rules)[0].arg != 0 || (covered & needed) != needed) {
      PyErr_SetString(PyExc_ValueError, "configure: an operand table must start with A and cover its scale tensors");
      return nullptr;
    }
  }
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
  const size_t slots = static_cast<size_t>(std::max(devices, 1));
  next->plans.reset(new Plan[slots * next->quant_types.size() * next->out_dtypes.size() * 4]);
  PyObject* capsule = PyCapsule_New(next.get(), kCapsule, free_config);
  if (capsule == nullptr) return nullptr;
  next.release();  // the capsule owns it now
  PyObject* entry = PyCFunction_New(&dequantize_def, capsule);  // called with the capsule as its first argument
  Py_DECREF(capsule);
  return entry;
  END_HANDLE_TH_ERRORS
}

PyObject* entry_args(PyObject* /*module*/, PyObject* /*unused*/) {
  constexpr int count = sizeof(kArgs) / sizeof(kArgs[0]);
  PyObject* names = PyTuple_New(count);
  if (names == nullptr) return nullptr;
  for (int i = 0; i < count; ++i) PyTuple_SET_ITEM(names, i, PyUnicode_FromString(kArgs[i]));
  return names;
}

PyObject* matmul_args(PyObject* /*module*/, PyObject* /*unused*/) {
  PyObject* names = PyTuple_New(kMatmulNargs);
  if (names == nullptr) return nullptr;
  for (int i = 0; i < kMatmulNargs; ++i) PyTuple_SET_ITEM(names, i, PyUnicode_FromString(kMatmulArgs[i]));
  return names;
}

PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "Bind the driver, PyTorch's stream lookup, the operand rules and the kernel's facts; returns the entry point."},
    {"describe", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(describe)), METH_FASTCALL,
     "describe(entry, *args): the launch the entry point would make for these arguments, or None."},
    {"entry_args", entry_args, METH_NOARGS, "The entry point's argument names, in order."},
    {"configure_matmul", configure_matmul, METH_VARARGS,
     "Bind the fused matmul's plan, grid and crossover beside a dequantize entry point; returns the matmul entry."},
    {"describe_matmul", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(describe_matmul)), METH_FASTCALL,
     "describe_matmul(entry, *args): the launches the matmul entry point would make, or None."},
    {"matmul_args", matmul_args, METH_NOARGS, "The matmul entry point's argument names, in order."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

#define NF4_CONCAT_(a, b) a##b
#define NF4_CONCAT(a, b) NF4_CONCAT_(a, b)
#define NF4_STR_(a) #a
#define NF4_STR(a) NF4_STR_(a)

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, NF4_STR(TORCH_EXTENSION_NAME),
                                 "Compiled host path of nf4-harness' dequantize_4bit.", -1, methods};

PyMODINIT_FUNC NF4_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
