// The drop-ins' host path, compiled: one interpreter of launch recipes (harness/runtime/recipe.py)
// that names no op. An entry point is bound to one op's compiled form, a Python function of the
// call's arguments that answers a recipe (which kernels, grids and argument slots, which output and
// workspace) or None. The entry reads a call's signature (each tensor's dtype, device, sizes,
// pointer alignment class and gradient flag; each other argument's value, but a float's), asks the
// form once per signature, keeps the answer, and for every later call of that signature only
// allocates, fills the slots with this call's addresses and numbers, and launches. So every rule
// of every op is stated and checked in Python once; a call the form declines (None), a tensor that
// is not plain, dense and contiguous, or an argument of another kind returns None here and the
// op's Python path takes the call (and names what is wrong). host_launcher.py builds this file with
// torch.utils.cpp_extension; tests/test_call_rules.py holds both paths to the same launches.
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

constexpr int kMaxArgs = 32;       // an entry's arguments
constexpr int kMaxDims = 16;       // a tensor's or a sequence's
constexpr int kMaxKey = 256;       // words of a signature
constexpr int kMaxSlots = 32;      // a kernel's parameters
constexpr int kMaxString = 32;     // bytes of a string argument
constexpr size_t kMaxRecipes = 4096;  // signatures kept; past it the cache starts over

// A call's signature: tagged words, one group an argument (recipe.py's docstring says what counts).
enum Tag : int64_t { kNone, kTensor, kInt, kFloat, kString, kDtype, kSequence, kBool };
// Its hash is formed word by word as it is written.
struct Key {
  int n = 0;
  uint64_t h = 0;
  int64_t w[kMaxKey];
  bool push(int64_t v) {
    if (n == kMaxKey) return false;
    w[n++] = v;
    h = (h ^ static_cast<uint64_t>(v)) * 0x9e3779b97f4a7c15ull;
    return true;
  }
  uint64_t hash() const { return h ^ (h >> 29); }
};

// recipe.py's encoded form.
enum Kind { kU64, kI64, kI32, kF32 };
enum Source { kConst, kPtr, kOut, kWorkspace, kNumber };
struct Slot {
  int kind = kU64, source = kConst;
  uint64_t value = 0;  // a constant's bits, else an argument index
};
struct KernelLaunch {
  void* function = nullptr;
  unsigned grid[3] = {1, 1, 1}, threads = 1, shared = 0, cluster_y = 1;
  std::vector<Slot> slots;
};
struct Recipe {
  void* context = nullptr;
  int64_t device = -1;
  int out_arg = -1;  // -1: allocate
  std::vector<int64_t> out_sizes;
  at::ScalarType out_dtype = at::kFloat;
  int like = 0;
  int64_t workspace = 0;
  std::vector<KernelLaunch> launches;
  std::vector<std::pair<int, int>> numbers;  // (launch, slot) of every kNumber slot
};

// The kept recipes by signature: open addressing on the signature's hash, doubled at half full,
// started over past kMaxRecipes (a model's calls have a few dozen signatures).
class RecipeTable {
 public:
  // The kept answer for `key` (a null recipe: declined), or nullptr where none is kept.
  const std::shared_ptr<const Recipe>* find(const Key& key) const {
    if (slots_.empty()) return nullptr;
    const uint64_t hash = key.hash();
    for (size_t i = hash & mask();; i = (i + 1) & mask()) {
      const Entry& e = slots_[i];
      if (!e.used) return nullptr;
      if (e.hash == hash && e.words.size() == static_cast<size_t>(key.n) &&
          std::memcmp(e.words.data(), key.w, key.n * sizeof(int64_t)) == 0)
        return &e.recipe;
    }
  }
  void insert(const Key& key, std::shared_ptr<const Recipe> recipe) {
    if (find(key) != nullptr) return;  // another thread kept one first
    if (count_ >= kMaxRecipes) {
      slots_.clear();
      count_ = 0;
    }
    if (2 * (count_ + 1) > slots_.size()) grow();
    place(Entry{true, key.hash(), std::vector<int64_t>(key.w, key.w + key.n), std::move(recipe)});
    ++count_;
  }
  size_t size() const { return count_; }

 private:
  struct Entry {
    bool used = false;
    uint64_t hash = 0;
    std::vector<int64_t> words;
    std::shared_ptr<const Recipe> recipe;
  };
  size_t mask() const { return slots_.size() - 1; }
  void place(Entry e) {
    for (size_t i = e.hash & mask();; i = (i + 1) & mask()) {
      if (!slots_[i].used) {
        slots_[i] = std::move(e);
        return;
      }
    }
  }
  void grow() {
    std::vector<Entry> old = std::move(slots_);
    slots_ = std::vector<Entry>(std::max<size_t>(64, 2 * old.size()));
    for (Entry& e : old) {
      if (e.used) place(std::move(e));
    }
  }
  std::vector<Entry> slots_;  // a power of two of them
  size_t count_ = 0;
};

// The caches are read and written with the GIL held and never across a Python call, so with a GIL
// the GIL is their lock (a mutex cost a call about 25 ns); a free-threaded Python gets a mutex.
#ifdef Py_GIL_DISABLED
using CacheMutex = std::mutex;
#else
struct CacheMutex {
  void lock() {}
  void unlock() {}
};
#endif

// Everything one configure() call bound: each entry point has its own recipes, so two copies of the
// harness in one process (the perf gate's base and candidate) never share them.
struct Config {
  LaunchKernelFn launch = nullptr;
  LaunchKernelExFn launch_ex = nullptr;
  CtxGetCurrentFn ctx_get_current = nullptr;
  PyObject* raw_stream = nullptr;   // torch._C._cuda_getCurrentRawStream
  PyObject* form = nullptr;         // (*args) -> an encoded recipe, or None
  PyObject* subclass_ok = nullptr;  // (type) -> bool: may a Tensor subclass be read directly?
  c10::DispatchKey backend = c10::DispatchKey::CUDA;  // CPU only where tests bind it to host tensors
  int nargs = 0, key_align_log2 = 0;
  int64_t alloc_align = 1;
  CacheMutex mutex;  // guards the two caches; never held across a Python call
  RecipeTable recipes;
  std::vector<std::pair<PyTypeObject*, bool>> subclass_cache;

  ~Config() {
    for (PyObject* o : {raw_stream, form, subclass_ok}) Py_XDECREF(o);
    for (const auto& entry : subclass_cache) Py_DECREF(reinterpret_cast<PyObject*>(entry.first));
  }
};

constexpr const char* kCapsule = "nf4_harness_host.Config";

void free_config(PyObject* capsule) { delete static_cast<Config*>(PyCapsule_GetPointer(capsule, kCapsule)); }

Config* config_of(PyObject* capsule) { return static_cast<Config*>(PyCapsule_GetPointer(capsule, kCapsule)); }

// A tensor the kernels may read directly: a Tensor, a Parameter, or a subclass Python vouched for,
// backed by dense strided memory of the bound backend with no view bits and no wrapper (vmap, grad
// transforms, functionalization, fake tensors) between it and its storage.
const at::Tensor* plain_tensor(Config* config, PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) {
    PyTypeObject* type = Py_TYPE(obj);
    int verdict = -1;  // unknown
    {
      std::lock_guard<CacheMutex> guard(config->mutex);
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
      std::lock_guard<CacheMutex> guard(config->mutex);
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

uint64_t address(const at::Tensor* t) { return reinterpret_cast<uint64_t>(t->const_data_ptr()); }

// A tensor argument's signature words into *key and the tensor into *tensor; false where it is not
// as the kernels read it.
bool tensor_signature(Config* config, PyObject* o, bool grad, Key* key, const at::Tensor** tensor) {
  const at::Tensor* t = plain_tensor(config, o);
  if (t == nullptr || !t->is_contiguous() || t->dim() > kMaxDims) return false;
  const uint64_t p = address(t);
  const int64_t align = p == 0 ? config->key_align_log2 : std::min<int64_t>(__builtin_ctzll(p), config->key_align_log2);
  // One word for the tag, dtype, device, alignment class, gradient flag and dims; then the sizes.
  const int64_t head = kTensor | static_cast<int64_t>(t->scalar_type()) << 8 | (t->get_device() + 1) << 16 |
                       align << 32 | static_cast<int64_t>(grad && t->requires_grad()) << 40 | t->dim() << 48;
  bool ok = key->push(head);
  const int64_t* sizes = t->sizes().data();
  for (int64_t d = 0; ok && d < t->dim(); ++d) ok = key->push(sizes[d]);
  *tensor = t;
  return ok;
}

// The call's signature into *key and its plain tensors into tensors[]; false where an argument is
// of a kind no recipe takes (the Python path's call).
bool signature(Config* config, PyObject* const* args, Py_ssize_t nargs, Key* key, const at::Tensor** tensors) {
  const bool grad = at::GradMode::is_enabled();
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    PyObject* o = args[i];
    tensors[i] = nullptr;
    bool ok = true;
    if (o == Py_None) {
      ok = key->push(kNone);
    } else if (THPVariable_CheckExact(o)) {
      ok = tensor_signature(config, o, grad, key, &tensors[i]);
    } else if (o == Py_True || o == Py_False) {
      ok = key->push(kBool) && key->push(o == Py_True);
    } else if (PyLong_CheckExact(o)) {
      int64_t v = 0;
      ok = exact_int(o, &v) && key->push(kInt) && key->push(v);
    } else if (PyFloat_CheckExact(o)) {
      ok = key->push(kFloat);  // its value is a kernel argument only (recipe.number)
    } else if (THPDtype_Check(o)) {
      ok = key->push(kDtype) && key->push(static_cast<int64_t>(reinterpret_cast<THPDtype*>(o)->scalar_type));
    } else if (PyUnicode_Check(o)) {
      Py_ssize_t length = 0;
      const char* s = PyUnicode_AsUTF8AndSize(o, &length);
      if (s == nullptr) {
        PyErr_Clear();
        return false;
      }
      if (length > kMaxString) return false;
      ok = key->push(kString) && key->push(length);
      for (Py_ssize_t at = 0; ok && at < length; at += 8) {
        int64_t word = 0;
        std::memcpy(&word, s + at, std::min<Py_ssize_t>(8, length - at));
        ok = key->push(word);
      }
    } else if (PyTuple_Check(o) || PyList_Check(o)) {  // torch.Size included
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
      if (n > kMaxDims) return false;
      ok = key->push(kSequence) && key->push(n);
      PyObject** items = PySequence_Fast_ITEMS(o);
      for (Py_ssize_t j = 0; ok && j < n; ++j) {
        int64_t v = 0;
        ok = exact_int(items[j], &v) && key->push(v);
      }
    } else if (THPVariable_Check(o)) {  // last: a subclass test may run Python (a metaclass's)
      ok = tensor_signature(config, o, grad, key, &tensors[i]);
    } else {
      return false;
    }
    if (!ok) return false;
  }
  return key->push(grad);
}

// A Python int read into *value, raising where it is not one.
int64_t int_of(PyObject* obj) {
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) throw python_error();
  return v;
}

void malformed(const char* what) {
  PyErr_Format(PyExc_ValueError, "host_launcher: the op's compiled form answered a malformed recipe (%s)", what);
  throw python_error();
}

// recipe.encoded()'s tuple into a Recipe, checked against the entry's arguments.
std::shared_ptr<const Recipe> parse_recipe(Config* config, PyObject* r) {
  if (r == Py_None) return nullptr;
  PyObject *sizes, *dtype, *launches;
  unsigned long long context = 0;
  long long device = 0, workspace = 0;
  int out_arg = 0, like = 0;
  if (!PyArg_ParseTuple(r, "KLiO!OiLO!", &context, &device, &out_arg, &PyTuple_Type, &sizes, &dtype, &like,
                        &workspace, &PyTuple_Type, &launches))
    throw python_error();
  auto recipe = std::make_shared<Recipe>();
  recipe->context = reinterpret_cast<void*>(context);
  recipe->device = device;
  recipe->out_arg = out_arg;
  recipe->like = like;
  recipe->workspace = workspace;
  if (out_arg >= config->nargs || like < 0 || like >= config->nargs || workspace < 0) malformed("an argument index");
  if (out_arg < 0) {
    if (!THPDtype_Check(dtype) || PyTuple_GET_SIZE(sizes) > kMaxDims) malformed("the output");
    recipe->out_dtype = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(sizes); ++i) recipe->out_sizes.push_back(int_of(PyTuple_GET_ITEM(sizes, i)));
  }
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(launches); ++i) {
    KernelLaunch k;
    unsigned long long function = 0;
    PyObject* slots;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(launches, i), "KIIIIIIO!", &function, &k.grid[0], &k.grid[1], &k.grid[2],
                          &k.threads, &k.shared, &k.cluster_y, &PyTuple_Type, &slots))
      throw python_error();
    k.function = reinterpret_cast<void*>(function);
    if (PyTuple_GET_SIZE(slots) > kMaxSlots || k.cluster_y == 0) malformed("a launch");
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(slots); ++j) {
      Slot s;
      unsigned long long value = 0;
      if (!PyArg_ParseTuple(PyTuple_GET_ITEM(slots, j), "iiK", &s.kind, &s.source, &value)) throw python_error();
      s.value = value;
      const bool address_slot = s.kind == kU64 || s.kind == kI64;
      const bool ok = s.kind >= kU64 && s.kind <= kF32 &&
                      (s.source == kConst || ((s.source == kOut || s.source == kWorkspace) && address_slot) ||
                       (s.source == kPtr && address_slot && value < static_cast<uint64_t>(config->nargs)) ||
                       (s.source == kNumber && s.kind == kF32 && value < static_cast<uint64_t>(config->nargs)));
      if (!ok) malformed("a slot");
      if (s.source == kNumber) recipe->numbers.emplace_back(static_cast<int>(i), static_cast<int>(j));
      k.slots.push_back(s);
    }
    recipe->launches.push_back(std::move(k));
  }
  return recipe;
}

// The recipe of a call's signature: kept, or asked of the op's form (null: declined).
std::shared_ptr<const Recipe> recipe_of(Config* config, const Key& key, PyObject* const* args, Py_ssize_t nargs) {
  {
    std::lock_guard<CacheMutex> guard(config->mutex);
    if (const auto* kept = config->recipes.find(key)) return *kept;
  }
  // Asked without holding the mutex (Python may switch threads while it compiles); two threads
  // asking for one signature get the same answer. An error the form raises (a bad call named by
  // the op's own checks) reaches the caller, and nothing is kept.
  PyObject* r = PyObject_Vectorcall(config->form, args, nargs, nullptr);
  if (r == nullptr) throw python_error();
  std::shared_ptr<const Recipe> recipe;
  try {
    recipe = parse_recipe(config, r);
  } catch (...) {
    Py_DECREF(r);
    throw;
  }
  Py_DECREF(r);
  std::lock_guard<CacheMutex> guard(config->mutex);
  config->recipes.insert(key, recipe);
  return recipe;
}

// One call's launches, filled: the output (allocated or the caller's), the workspace, every slot.
struct Filled {
  at::Tensor allocated, workspace;
  const at::Tensor* out = nullptr;
  uint64_t slots[4][kMaxSlots];  // written slot by slot before any is read
};
constexpr size_t kMaxLaunches = sizeof(Filled::slots) / sizeof(Filled::slots[0]);

// Fills *f for a call of `recipe`; false where the Python path must take it (a number that does not
// fit fp32, an allocation off the alignment the recipe assumed).
bool fill(Config* config, const Recipe& recipe, PyObject* const* args, const at::Tensor* const* tensors, Filled* f) {
  if (recipe.launches.size() > kMaxLaunches) return false;
  // Numbers first: nothing is allocated for a call that then declines.
  for (const auto& [k, j] : recipe.numbers) {
    PyObject* o = args[recipe.launches[k].slots[j].value];
    if (!PyFloat_CheckExact(o) && !PyLong_CheckExact(o)) return false;
    const double v = PyFloat_CheckExact(o) ? PyFloat_AS_DOUBLE(o) : PyLong_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    const float x = static_cast<float>(v);
    if (std::isinf(x) && !std::isinf(v)) return false;  // struct.pack refuses it
    f->slots[k][j] = 0;
    std::memcpy(&f->slots[k][j], &x, sizeof(float));
  }
  if (recipe.out_arg >= 0) {
    f->out = tensors[recipe.out_arg];
    if (f->out == nullptr) return false;
  } else {
    const at::Tensor* like = tensors[recipe.like];
    if (like == nullptr) return false;
    f->allocated = at::empty(c10::IntArrayRef(recipe.out_sizes), like->options().dtype(recipe.out_dtype));
    if (address(&f->allocated) % config->alloc_align != 0) return false;
    f->out = &f->allocated;
  }
  uint64_t workspace = 0;
  if (recipe.workspace > 0) {
    f->workspace = at::empty({recipe.workspace}, tensors[recipe.like]->options().dtype(at::kFloat));
    workspace = reinterpret_cast<uint64_t>(f->workspace.data_ptr());
    if (workspace % config->alloc_align != 0) return false;
  }
  const uint64_t out = reinterpret_cast<uint64_t>(f->out->data_ptr());
  for (size_t k = 0; k < recipe.launches.size(); ++k) {
    const auto& slots = recipe.launches[k].slots;
    for (size_t j = 0; j < slots.size(); ++j) {
      const Slot& s = slots[j];
      uint64_t& slot = f->slots[k][j];
      switch (s.source) {
        case kConst: slot = s.value; break;
        case kPtr: slot = tensors[s.value] ? address(tensors[s.value]) : 0; break;
        case kOut: slot = out; break;
        case kWorkspace: slot = workspace; break;
        default: break;  // kNumber: filled above
      }
      if (s.source == kPtr && tensors[s.value] == nullptr && args[s.value] != Py_None) return false;
    }
  }
  return true;
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

// The launch of recipe launch k with its filled slots; the driver's CUresult.
int launch_one(Config* config, const KernelLaunch& k, uint64_t* slots, void* stream) {
  void* params[kMaxSlots];
  for (size_t j = 0; j < k.slots.size(); ++j) params[j] = &slots[j];
  if (k.cluster_y == 1)
    return config->launch(k.function, k.grid[0], k.grid[1], k.grid[2], k.threads, 1, 1, k.shared, stream, params,
                          nullptr);
  LaunchAttribute cluster;
  cluster.id = kClusterDimension;
  cluster.value.cluster = {1, k.cluster_y, 1};
  LaunchConfig launch;
  for (int i = 0; i < 3; ++i) launch.grid[i] = k.grid[i];
  launch.block[0] = k.threads;
  launch.block[1] = launch.block[2] = 1;
  launch.shared_bytes = k.shared;
  launch.stream = stream;
  launch.attrs = &cluster;
  launch.num_attrs = 1;
  return config->launch_ex(&launch, k.function, params, nullptr);
}

// A call's recipe and its plain tensors (what entry and describe share); a null recipe where the
// Python path must take the call.
std::shared_ptr<const Recipe> recipe_for(Config* config, PyObject* const* args, Py_ssize_t nargs,
                                         const at::Tensor** tensors) {
  Key key;
  if (nargs != config->nargs || !signature(config, args, nargs, &key, tensors)) return nullptr;
  return recipe_of(config, key, args, nargs);
}

// entry(*args) -> the output; None where the Python path must take the call; (launch index,
// CUresult) where the driver refused a launch.
PyObject* entry(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  Config* config = config_of(capsule);
  if (config == nullptr) return nullptr;
  const at::Tensor* tensors[kMaxArgs];
  const std::shared_ptr<const Recipe> recipe = recipe_for(config, args, nargs, tensors);
  if (!recipe) Py_RETURN_NONE;
  if (!recipe->launches.empty()) {
    void* current = nullptr;
    // Another GPU's context is current, or none (a thread that never used CUDA): the Python path.
    if (config->ctx_get_current(&current) != 0 || current != recipe->context) Py_RETURN_NONE;
  }
  Filled f;
  if (!fill(config, *recipe, args, tensors, &f)) Py_RETURN_NONE;
  if (!recipe->launches.empty()) {
    void* stream = reinterpret_cast<void*>(current_stream(config, recipe->device));
    for (size_t k = 0; k < recipe->launches.size(); ++k) {
      const int err = launch_one(config, recipe->launches[k], f.slots[k], stream);
      if (err != 0) return Py_BuildValue("ni", static_cast<Py_ssize_t>(k), err);
    }
  }
  if (recipe->out_arg >= 0) {
    Py_INCREF(args[recipe->out_arg]);
    return args[recipe->out_arg];
  }
  return THPVariable_Wrap(std::move(f.allocated));
  END_HANDLE_TH_ERRORS
}

PyMethodDef entry_def = {
    "entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(entry)), METH_FASTCALL,
    "entry(*args): the output, None (the op's Python path takes the call) or (launch index, CUresult) (the driver "
    "refused that launch)."};

Config* entry_config(PyObject* const* args, Py_ssize_t nargs, const char* who) {
  if (nargs < 1 || !PyCFunction_Check(args[0]) || PyCFunction_GET_SELF(args[0]) == nullptr ||
      !PyCapsule_IsValid(PyCFunction_GET_SELF(args[0]), kCapsule)) {
    PyErr_Format(PyExc_TypeError, "%s: the first argument must be an entry point from configure()", who);
    return nullptr;
  }
  return config_of(PyCFunction_GET_SELF(args[0]));
}

// describe(entry, *args): what the entry would launch for these arguments, without the context
// check or the launches: (output address, workspace address, ((kernel, (gx, gy, gz), threads, shared
// bytes, cluster y, slots), ...)), or None where it declines. The output and workspace it allocates
// are freed on return.
PyObject* describe(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  Config* config = entry_config(args, nargs, "describe");
  if (config == nullptr) return nullptr;
  ++args;  // past the entry: the call's own arguments
  --nargs;
  const at::Tensor* tensors[kMaxArgs];
  const std::shared_ptr<const Recipe> recipe = recipe_for(config, args, nargs, tensors);
  if (!recipe) Py_RETURN_NONE;
  Filled f;
  if (!fill(config, *recipe, args, tensors, &f)) Py_RETURN_NONE;
  PyObject* launches = PyTuple_New(static_cast<Py_ssize_t>(recipe->launches.size()));
  if (launches == nullptr) return nullptr;
  for (size_t k = 0; k < recipe->launches.size(); ++k) {
    const KernelLaunch& l = recipe->launches[k];
    PyObject* slots = PyTuple_New(static_cast<Py_ssize_t>(l.slots.size()));
    if (slots == nullptr) {
      Py_DECREF(launches);
      return nullptr;
    }
    for (size_t j = 0; j < l.slots.size(); ++j) PyTuple_SET_ITEM(slots, j, PyLong_FromUnsignedLongLong(f.slots[k][j]));
    PyObject* item = Py_BuildValue("K(III)IIIN", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(l.function)),
                                   l.grid[0], l.grid[1], l.grid[2], l.threads, l.shared, l.cluster_y, slots);
    if (item == nullptr) {
      Py_DECREF(launches);
      return nullptr;
    }
    PyTuple_SET_ITEM(launches, k, item);
  }
  const uint64_t workspace = recipe->workspace > 0 ? reinterpret_cast<uint64_t>(f.workspace.data_ptr()) : 0;
  return Py_BuildValue("KKN", static_cast<unsigned long long>(address(f.out)),
                       static_cast<unsigned long long>(workspace), launches);
  END_HANDLE_TH_ERRORS
}

// signatures(entry) -> how many call signatures the entry keeps a recipe (or a decline) for.
PyObject* signatures(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  Config* config = entry_config(args, nargs, "signatures");
  if (config == nullptr) return nullptr;
  std::lock_guard<CacheMutex> guard(config->mutex);
  return PyLong_FromSize_t(config->recipes.size());
}

// configure(launch_kernel, launch_kernel_ex, ctx_get_current, raw_stream, subclass_ok, form, nargs,
//           backend, key_align, alloc_align) -> an entry point bound to one op's compiled form
PyObject* configure(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  unsigned long long launch = 0, launch_ex = 0, ctx_get_current = 0;
  PyObject *raw_stream, *subclass_ok, *form;
  const char* backend = nullptr;
  int nargs = 0;
  long long key_align = 0, alloc_align = 0;
  if (!PyArg_ParseTuple(args, "KKKOOOisLL", &launch, &launch_ex, &ctx_get_current, &raw_stream, &subclass_ok, &form,
                        &nargs, &backend, &key_align, &alloc_align))
    return nullptr;
  const auto power_of_two = [](long long v) { return v > 0 && (v & (v - 1)) == 0; };
  if (launch == 0 || launch_ex == 0 || ctx_get_current == 0 || nargs < 0 || nargs > kMaxArgs ||
      !power_of_two(key_align) || !power_of_two(alloc_align) || alloc_align > key_align) {
    PyErr_SetString(PyExc_ValueError,
                    "configure: a null driver entry point, an argument count past 32 or an alignment that is not a "
                    "power of two (the allocation's at most the signature's)");
    return nullptr;
  }
  if (!PyCallable_Check(form) || !PyCallable_Check(subclass_ok) || !PyCallable_Check(raw_stream)) {
    PyErr_SetString(PyExc_TypeError, "configure: the stream lookup, subclass test and compiled form must be callable");
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
  next->launch = reinterpret_cast<LaunchKernelFn>(launch);
  next->launch_ex = reinterpret_cast<LaunchKernelExFn>(launch_ex);
  next->ctx_get_current = reinterpret_cast<CtxGetCurrentFn>(ctx_get_current);
  for (PyObject* f : {raw_stream, subclass_ok, form}) Py_INCREF(f);
  next->raw_stream = raw_stream;
  next->subclass_ok = subclass_ok;
  next->form = form;
  next->nargs = nargs;
  next->key_align_log2 = __builtin_ctzll(static_cast<unsigned long long>(key_align));
  next->alloc_align = alloc_align;
  PyObject* capsule = PyCapsule_New(next.get(), kCapsule, free_config);
  if (capsule == nullptr) return nullptr;
  next.release();  // the capsule owns it now
  PyObject* e = PyCFunction_New(&entry_def, capsule);  // called with the capsule as its first argument
  Py_DECREF(capsule);
  return e;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "Bind the driver, PyTorch's stream lookup and one op's compiled form; returns the entry point."},
    {"describe", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(describe)), METH_FASTCALL,
     "describe(entry, *args): the launches the entry point would make for these arguments, or None."},
    {"signatures", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(signatures)), METH_FASTCALL,
     "signatures(entry): how many call signatures the entry point keeps an answer for."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

#define NF4_CONCAT_(a, b) a##b
#define NF4_CONCAT(a, b) NF4_CONCAT_(a, b)
#define NF4_STR_(a) #a
#define NF4_STR(a) NF4_STR_(a)

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, NF4_STR(TORCH_EXTENSION_NAME),
                                 "Compiled host path of nf4-harness' drop-ins: an interpreter of launch recipes.", -1,
                                 methods};

PyMODINIT_FUNC NF4_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
