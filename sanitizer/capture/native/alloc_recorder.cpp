// hazsan's native allocation recorder (HAZSAN_NATIVE, level alloc, CPU builds of torch).
//
// It wraps the CPU allocator that c10::GetCPUAllocator() returns (c10::SetCPUAllocator) and
// records per allocation its address, size, call site, the thread's symmetric scope, and per free
// its address, whether the freeing thread is inside a collective's wait, and that thread. Python
// (sanitizer/capture/native/__init__.py) drains the records into trace events in order with its
// own events. Nothing here makes a Python object or touches a reference count outside the calls
// Python makes (drain_events and the lookups, with the GIL):
// the allocator runs on threads that released the GIL (every torch op does) and on threads that
// never ran Python.
//
// The DataPtrs it hands out have the inner allocator's shape (context == data, one deleter: its
// own, which records the free and calls the inner one), so torch's raw_allocate / raw_deallocate
// and is_simple_data_ptr keep working and nothing is made per allocation. An allocation of another
// shape is handed out unrecorded and counted (the header says so).
//
// Call sites: the innermost Python frame whose file is not internal (the rules of
// sanitizer/capture/sites.py, given by set_filters), read from the allocating thread's own frame
// stack, which cannot change while that thread is inside this call. CPython 3.11's frame layout
// only (internal header); other versions are refused at build time and capture uses its Python
// path. A site is made into text the first time it is seen, while its frame is alive: a record
// keeps the site's index, never a code object.
#include <torch/extension.h>
#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/python_variable.h>
#include <Python.h>
#if !(PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000)
#error "hazsan's native recorder reads CPython 3.11's frames; this Python is another version"
#endif
#define Py_BUILD_CORE
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#include <pthread.h>
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

constexpr uint64_t NO_SITE = UINT64_MAX;
constexpr uint32_t FREED = 1;   // a free (else an allocation)
constexpr uint32_t QUIET = 2;   // freed on a thread inside a collective's wait
constexpr uint32_t LAUNCH = 4;  // an op's launch (addr: its index in `launches`)
constexpr uint32_t COLL = 8;    // a registered collective op returned (addr: its index in `colls`)
constexpr uint32_t COLL_DONE = 16;  // its completion (addr: its cid)

struct Record {        // 48 bytes (a launch: addr is its index in `launches`, size unused)
  uint64_t addr;
  uint64_t size;
  uint64_t site;       // index into site_texts, NO_SITE: none
  uint64_t thread;     // pthread_self() of the thread (threading.get_ident() on Linux)
  uint64_t t;          // CLOCK_REALTIME in ns (time.time_ns(), the trace's `t`)
  uint32_t flags;
  uint32_t scope;      // the thread's symmetric scope (an index Python gave), 0: none
};
static_assert(sizeof(Record) == 48, "Record layout");

std::mutex mu;
std::vector<Record> records;
std::atomic<uint64_t> n_pending{0};
uint64_t max_records = 0;
// Launches (level full): the ranges of each, and the tensors of storages the allocator did not
// make (Python adopts them at the drain, as the dispatch mode adopts a storage it never saw; held
// until then so that their storage is alive when it is adopted)
struct LaunchRange {
  uint64_t base;      // the storage's memory (the allocation's address)
  uint64_t ptr;       // the first element's address
  uint64_t size;      // bytes spanned
  uint32_t foreign;   // index in launch_tensors, or NONE
  uint32_t write;
};
struct LaunchRec { uint32_t op; uint32_t first; uint32_t n; };
constexpr uint32_t NONE = UINT32_MAX;
std::vector<LaunchRange> launch_ranges;
std::vector<LaunchRec> launches;
std::vector<at::Tensor> launch_tensors;
// Collectives of the ops serving engines register (record_coll): each one's ranges are in
// launch_ranges (`write`: the access, 0 read, 1 written, 2 both), its texts in coll_texts
struct CollRec { uint64_t cid; uint64_t seq; uint32_t comm; uint32_t op; uint32_t first; uint32_t n; };
std::vector<CollRec> colls;
std::vector<std::string> coll_texts;                      // comm names and op labels, by index
std::unordered_map<std::string, uint32_t> coll_text_index;
size_t coll_texts_handed = 0;
uint64_t dropped = 0;          // records lost (buffer at max_records): counted, never silent
uint64_t passed_through = 0;   // allocations of another shape, handed out unrecorded
bool sites_on = true;

thread_local uint32_t scope_now = 0;
thread_local int32_t quiet_depth = 0;

// ---- call sites
struct Filters {
  std::vector<std::string> internal, external, stdlib;
  std::string cwd;
};
Filters filters;

struct FileEntry {
  std::string file;       // the name it was made for (a reused str address is noticed)
  bool internal;
  std::string display;    // relative to cwd where it is under it
};
std::unordered_map<const void*, FileEntry> files;

bool starts_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}
bool ends_with(const std::string& s, const char* p) {
  size_t n = strlen(p);
  return s.size() >= n && s.compare(s.size() - n, n, p) == 0;
}

// sites.py, SiteFinder._entry: the same decision.
FileEntry classify(const std::string& fn) {
  FileEntry e{fn, false, fn};
  bool external = false;
  for (const auto& p : filters.external) if (starts_with(fn, p)) { external = true; break; }
  if (!external) {
    bool internal = starts_with(fn, "<frozen") || ends_with(fn, "contextlib.py") || ends_with(fn, "threading.py");
    for (const auto& p : filters.internal) if (!internal && starts_with(fn, p)) internal = true;
    if (!internal && fn.find("-packages/") == std::string::npos)
      for (const auto& p : filters.stdlib) if (starts_with(fn, p)) { internal = true; break; }
    e.internal = internal;
  }
  if (!filters.cwd.empty() && starts_with(fn, filters.cwd)) e.display = fn.substr(filters.cwd.size());
  return e;
}

// A str's text without the GIL: only a compact ASCII str's data can be read so (a non-ASCII one's
// UTF-8 form may have to be made); nullptr otherwise.
bool ascii(PyObject* s, std::string& out) {
  if (s && PyUnicode_Check(s) && PyUnicode_IS_COMPACT_ASCII(s)) {
    out.assign(static_cast<const char*>(PyUnicode_DATA(s)), PyUnicode_GET_LENGTH(s));
    return true;
  }
  return false;
}

const FileEntry* file_of(PyCodeObject* code) {
  PyObject* f = code->co_filename;
  if (!f || !PyUnicode_Check(f) || !PyUnicode_IS_COMPACT_ASCII(f)) return nullptr;
  const char* data = static_cast<const char*>(PyUnicode_DATA(f));
  size_t len = PyUnicode_GET_LENGTH(f);
  auto it = files.find(f);
  if (it != files.end() && it->second.file.size() == len && memcmp(it->second.file.data(), data, len) == 0)
    return &it->second;
  FileEntry e = classify(std::string(data, len));
  auto& slot = files[f];
  slot = std::move(e);
  return &slot;
}

struct SiteKey {
  const void* code; const void* name; int firstlineno; int lasti;
  bool operator==(const SiteKey& o) const {
    return code == o.code && name == o.name && firstlineno == o.firstlineno && lasti == o.lasti;
  }
};
struct SiteKeyHash {
  size_t operator()(const SiteKey& k) const {
    return std::hash<const void*>()(k.code) ^ (std::hash<int>()(k.lasti) << 1) ^ (std::hash<int>()(k.firstlineno) << 7);
  }
};
std::unordered_map<SiteKey, uint64_t, SiteKeyHash> site_index;
std::vector<std::string> site_texts;   // append-only: an index stays valid
size_t texts_handed = 0;               // handed to Python by the drains so far

// The site of the calling thread, NO_SITE where it has no Python frame outside internal files
// (`mu` held: the caches are shared).
uint64_t site_now() {
  if (!sites_on) return NO_SITE;
  PyThreadState* ts = PyGILState_GetThisThreadState();
  if (ts == nullptr || ts->cframe == nullptr) return NO_SITE;   // a thread that never ran Python
  for (_PyInterpreterFrame* f = ts->cframe->current_frame; f != nullptr; f = f->previous) {
    if (_PyFrame_IsIncomplete(f)) continue;
    PyCodeObject* code = f->f_code;
    const FileEntry* e = file_of(code);
    if (e == nullptr || e->internal) continue;
    int lasti = _PyInterpreterFrame_LASTI(f) * (int)sizeof(_Py_CODEUNIT);
    SiteKey key{code, code->co_name, code->co_firstlineno, lasti};
    auto it = site_index.find(key);
    if (it != site_index.end()) return it->second;
    std::string name;
    if (!ascii(code->co_name, name)) name = "?";
    int line = PyCode_Addr2Line(code, lasti);   // reads the line table, makes no object
    site_texts.push_back(e->display + ":" + std::to_string(line) + ":" + name);
    return site_index.emplace(key, site_texts.size() - 1).first->second;
  }
  return NO_SITE;
}

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

void push_locked(const Record& r) {
  if (records.size() >= max_records) { ++dropped; return; }
  records.push_back(r);
  n_pending.store(records.size(), std::memory_order_relaxed);
}

// ---- the allocator
c10::Allocator* inner = nullptr;
c10::DeleterFnPtr inner_deleter = nullptr;

void free_and_record(void* data) {
  Record r{reinterpret_cast<uint64_t>(data), 0, NO_SITE, static_cast<uint64_t>(pthread_self()), now_ns(),
           FREED | (quiet_depth > 0 ? QUIET : 0u), 0};
  {
    std::lock_guard<std::mutex> lock(mu);
    push_locked(r);
  }
  inner_deleter(data);
}

struct RecordingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr real = inner->allocate(n);
    void* data = real.get();
    if (real.get_context() != data || real.get_deleter() != inner_deleter) {
      std::lock_guard<std::mutex> lock(mu);
      ++passed_through;
      return real;
    }
    c10::Device device = real.device();
    real.release_context();                      // ownership moves to the DataPtr returned
    Record r{reinterpret_cast<uint64_t>(data), static_cast<uint64_t>(n), NO_SITE,
             static_cast<uint64_t>(pthread_self()), now_ns(), 0, scope_now};
    {
      std::lock_guard<std::mutex> lock(mu);
      r.site = site_now();
      push_locked(r);
    }
    return c10::DataPtr(data, data, &free_and_record, device);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_and_record; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

RecordingAllocator recording;
bool fork_handlers = false;

void before_fork() { mu.lock(); }
void after_fork_parent() { mu.unlock(); }
// The child's records are its parent's (drained by the parent's trace): the child starts empty.
void after_fork_child() {
  records.clear();
  launches.clear();
  launch_ranges.clear();
  launch_tensors.clear();
  colls.clear();
  n_pending.store(0);
  mu.unlock();
}

// ---- launches (level full): a RecordFunction observer on every dispatched op
//
// The dispatch mode (sanitizer/capture/memory.py) sees an op after autograd, where composite
// ops have been decomposed, and not the ops its kernel calls: the mode is off inside
// __torch_dispatch__. A RecordFunction fires at every Dispatcher::call, nested ones included. So the
// observer keeps, per thread, whether it is inside an op the mode would have seen, and records
// only those outermost ops:
//   * TRANSPARENT: not an op the mode sees, its inner calls are (a CompositeImplicitAutograd op
//     without a kernel of its own for CPU, a string-named RecordFunction, an op with a tensor
//     subclass argument: the mode hands those back to the subclass, whose plain ops it sees, and
//     the ops capture marks so: vLLM's all_reduce, whose kernel issues the collectives);
//   * OPAQUE: seen, nothing launched, nothing inside seen (collectives: their `coll`; allocating
//     ops without a kernel; ops whose schema names no tensor to read or write);
//   * LAUNCH: seen and launched with its reads and writes (block_table._launch_plan's rules). A
//     maybe-alias op (`decide`: CompositeImplicitAutograd, seen whole where autograd is off:
//     `to.dtype`, `contiguous`, `reshape`, `type_as`) is a view or a copy by what it returned: a
//     result in a storage of its arguments is a view, any other a copy, which read the arguments
//     the result may alias (`Tensor(a) self`) and wrote the result (exit_op).
// On the threads the mode would be on only (launches_here: the importing thread and the Python
// threads started after it), never inside a collective's wait (quiet_depth), never for an op that
// raised.
enum OpKind : uint8_t { TRANSPARENT_OP = 0, OPAQUE_OP = 1, LAUNCH_OP = 2 };
struct OpPlan {
  std::string name, overload;
  OpKind kind;
  std::vector<uint32_t> reads, writes;
  bool fresh;
  uint32_t label;     // index in op_labels
  bool composite;     // done above the Python key where autograd runs (then TRANSPARENT)
  bool decide;        // a maybe-alias op: view or copy by the storages it returned
  std::vector<uint32_t> aliased;   // arguments its results may alias (read when it copied)
};
std::mutex plans_mu;
// by the schema's name pointer (stable while the op is registered; the strings are compared too)
std::unordered_map<const char*, std::vector<OpPlan*>> plans;   // plans are never freed
std::vector<std::string> op_labels;                             // "aten.add.Tensor" (str(OpOverload))
size_t labels_handed = 0;
std::atomic<uint64_t> plans_generation{0};
std::vector<std::string> opaque_namespaces, no_kernel_names;
std::unordered_map<std::string, OpKind> marked;                // "ns::name.overload" -> kind
uint64_t launch_kind = 9;                                      // binary.ORDER["launch"][0]
bool observer_on = false;

thread_local bool launches_here = false;
thread_local int32_t hidden_depth = 0;          // inside an op the mode would see
thread_local std::vector<uint8_t> open_ops;     // per open RecordFunction: whether it deepened
thread_local std::unordered_map<const char*, OpPlan*> plan_cache;
thread_local uint64_t plan_cache_generation = 0;

// Decomposed where autograd dispatches it (its CompositeImplicitAutograd kernel, no kernel of its
// own for CPU): above the Python key, unless autograd is off for the call (inference mode,
// inference tensors), where the dispatch mode sees the composite op itself.
bool composite_implicit(const c10::OperatorHandle& h) {
  using K = c10::DispatchKey;
  return h.hasKernelForDispatchKey(K::CompositeImplicitAutograd) && !h.hasKernelForDispatchKey(K::CPU) &&
         !h.hasKernelForDispatchKey(K::CompositeExplicitAutograd) &&
         !h.hasKernelForDispatchKey(K::CompositeExplicitAutogradNonFunctional);
}

bool names_tensor(const c10::TypePtr& t) { return t->str().find("Tensor") != std::string::npos; }

// plans_mu held
OpPlan* build_plan(const char* name, const char* overload, const c10::OperatorName& on) {
  auto* p = new OpPlan{name, overload, OPAQUE_OP, {}, {}, false, 0, false, false, {}};
  std::string ns = p->name.substr(0, p->name.find("::"));
  std::string base = p->name.find("::") == std::string::npos ? p->name : p->name.substr(p->name.find("::") + 2);
  std::string ov = p->overload.empty() ? "default" : p->overload;
  op_labels.push_back(ns + "." + base + "." + ov);
  p->label = static_cast<uint32_t>(op_labels.size() - 1);
  auto m = marked.find(p->name + "." + ov);
  if (m != marked.end()) { p->kind = m->second; return p; }
  for (const auto& n : opaque_namespaces) if (n == ns) return p;
  for (const auto& n : no_kernel_names) if (n == base) return p;
  auto h = c10::Dispatcher::singleton().findOp(on);
  if (!h || !h->hasSchema()) { p->kind = TRANSPARENT_OP; return p; }
  // detach_'s autograd kernel (VariableTypeManual.cpp) does its work without redispatching
  bool implicit = composite_implicit(*h);
  p->composite = implicit || p->name == "aten::detach_";
  const c10::FunctionSchema& schema = h->schema();
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (!names_tensor(args[i].type())) continue;
    const auto* alias = args[i].alias_info();
    if (alias != nullptr && alias->isWrite()) p->writes.push_back(static_cast<uint32_t>(i));
    else if (alias == nullptr) p->reads.push_back(static_cast<uint32_t>(i));
    else p->aliased.push_back(static_cast<uint32_t>(i));
  }
  const auto& rets = schema.returns();
  bool any_tensor = false, all_fresh = true;
  for (const auto& r : rets) {
    if (r.alias_info() != nullptr) all_fresh = false;
    if (names_tensor(r.type())) any_tensor = true;
  }
  p->fresh = !rets.empty() && all_fresh && any_tensor;
  // the schema's `Tensor(a)` of a composite op says only that the result MAY alias: `to.dtype`
  // returns self or a copy (_to_copy, inside it), native_functions.yaml; ops with a kernel of
  // their own are views (or fresh) as their schema says
  p->decide = implicit && any_tensor;
  if (!p->decide) p->aliased.clear();
  p->kind = (p->reads.empty() && p->writes.empty() && !p->fresh && p->aliased.empty()) ? OPAQUE_OP : LAUNCH_OP;
  return p;
}

// The plan of the op fn records, or nullptr for a RecordFunction that is not an op's.
const OpPlan* plan_of(const at::RecordFunction& fn) {
  const char* name = fn.name();
  const char* overload = fn.overload_name();
  uint64_t gen = plans_generation.load(std::memory_order_acquire);
  if (plan_cache_generation != gen) { plan_cache.clear(); plan_cache_generation = gen; }
  auto it = plan_cache.find(name);
  if (it != plan_cache.end() && it->second->name == name && it->second->overload == overload) return it->second;
  auto on = fn.operator_name();          // none for a string-named RecordFunction: not cached
  if (!on) return nullptr;
  OpPlan* found = nullptr;
  {
    std::lock_guard<std::mutex> lock(plans_mu);
    for (OpPlan* p : plans[name]) if (p->name == name && p->overload == overload) { found = p; break; }
    if (found == nullptr) {
      found = build_plan(name, overload, *on);
      plans[name].push_back(found);
    }
  }
  plan_cache[name] = found;
  return found;
}

// What a call's tensor arguments say: a subclass among them (the Python key), autograd on for any.
struct CallKeys { bool subclass = false; bool autograd = false; bool tensors = false; };
void look_at(const at::Tensor& t, CallKeys& k) {
  if (!t.defined()) return;
  c10::DispatchKeySet ks = t.key_set();
  k.tensors = true;
  if (ks.has(c10::DispatchKey::Python)) k.subclass = true;
  if (ks.has_any(c10::autograd_dispatch_keyset)) k.autograd = true;
}
void look_at(const c10::IValue& v, CallKeys& k) {
  if (v.isTensor()) {
    look_at(v.toTensor(), k);
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) look_at(t, k);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) if (e.isTensor()) look_at(e.toTensor(), k);
  }
}

void collect(const c10::IValue& v, std::vector<at::Tensor>& out) {
  if (v.isTensor()) { out.push_back(v.toTensor()); return; }
  if (v.isTensorList()) { for (const at::Tensor& t : v.toTensorList()) out.push_back(t); return; }
  if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) if (e.isTensor()) out.push_back(e.toTensor());
  } else if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) if (e.isTensor()) out.push_back(e.toTensor());
  }
}

struct LaunchCtx : at::ObserverContext {
  const OpPlan* plan = nullptr;
  int uncaught = 0;
  std::vector<at::Tensor> reads, writes, aliased;
};

std::atomic<uint64_t> observer_errors{0};   // exceptions caught in the callbacks (counted, never raised)
std::mutex observer_error_mu;
std::string last_observer_error;            // the latest one's message, for the hook error

void observer_failed(const char* where, const char* what) {
  observer_errors.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(observer_error_mu);
  last_observer_error = std::string(where) + ": " + what;
}

std::unique_ptr<at::ObserverContext> enter_op(const at::RecordFunction& fn) {
  // a call made with the Python key excluded never reaches a dispatch mode, nor do the calls
  // inside it (torch.tensor()'s own detach_, ...)
  const OpPlan* p = c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Python) ? nullptr : plan_of(fn);
  uint8_t deepened = 0;
  std::unique_ptr<LaunchCtx> ctx;
  if (p != nullptr && p->kind != TRANSPARENT_OP) {
    auto inputs = fn.inputs();
    CallKeys keys;
    for (const c10::IValue& v : inputs) look_at(v, keys);
    // (inference mode excludes autograd's functionality bit, no backend's: AutogradCPU would
    // never read as excluded, and a tensor made before it would be taken as decomposed)
    bool decomposed = p->composite && !c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::AutogradFunctionality) &&
                      (keys.autograd || !keys.tensors);
    if (!keys.subclass && !decomposed) {
      deepened = 1;
      if (hidden_depth == 0 && p->kind == LAUNCH_OP) {
        ctx = std::make_unique<LaunchCtx>();
        ctx->plan = p;
        ctx->uncaught = std::uncaught_exceptions();
        // the arguments' tensors now: the boxed inputs live only while the start callbacks run
        for (uint32_t i : p->reads) if (i < inputs.size()) collect(inputs[i], ctx->reads);
        for (uint32_t i : p->writes) if (i < inputs.size()) collect(inputs[i], ctx->writes);
        for (uint32_t i : p->aliased) if (i < inputs.size()) collect(inputs[i], ctx->aliased);
      }
    }
  }
  open_ops.push_back(deepened);     // (last: a failure before it leaves the nesting as it was)
  hidden_depth += deepened;
  return ctx;
}

// The span of t's elements in its storage's memory (`dp`, not null), appended to rs with `how` (a
// launch: written or not; a collective: its access code): a zero-element tensor spans 0 bytes. A
// storage the allocator did not make keeps its tensor, for Python to adopt.
void push_span(const at::Tensor& t, const c10::DataPtr& dp, uint32_t how, std::vector<LaunchRange>& rs,
               std::vector<at::Tensor>& foreign) {
  uint64_t base = reinterpret_cast<uint64_t>(dp.get());
  uint64_t item = static_cast<uint64_t>(t.itemsize());
  uint64_t ptr = base + static_cast<uint64_t>(t.storage_offset()) * item;
  int64_t n = t.numel();
  uint64_t size = 0;
  if (n > 0 && t.is_contiguous()) {
    size = static_cast<uint64_t>(n) * item;
  } else if (n > 0) {
    int64_t span = 1;
    auto sizes = t.sizes();
    auto strides = t.strides();
    for (size_t d = 0; d < sizes.size(); ++d) if (sizes[d] > 1) span += (sizes[d] - 1) * strides[d];
    size = static_cast<uint64_t>(span) * item;
  }
  uint32_t f = NONE;
  if (dp.get_deleter() != &free_and_record) {
    f = static_cast<uint32_t>(foreign.size());
    foreign.push_back(t);
  }
  rs.push_back(LaunchRange{base, ptr, size, f, how});
}

// A launch's range of t (BlockTable._ranges): none for a tensor whose memory is not its own or that
// has no elements.
void add_range(const at::Tensor& t, bool write, std::vector<LaunchRange>& rs, std::vector<at::Tensor>& foreign) {
  if (!t.defined() || t.layout() != c10::kStrided || !t.has_storage() || !t.device().is_cpu()) return;
  // a subclass's memory is not its own (a FakeTensor while torch.compile traces, with symbolic
  // sizes: the dispatch mode steps aside then), nor a symbolic shape's
  if (t.key_set().has(c10::DispatchKey::Python) || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return;
  // a Python number the binding made a tensor: a dispatch mode is handed the number back
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) return;
  int64_t n = t.numel();
  if (n == 0) return;
  const c10::DataPtr& dp = t.storage().data_ptr();
  if (dp.get() == nullptr) return;
  push_span(t, dp, write ? 1u : 0u, rs, foreign);
}

// rs and the tensors its foreign ranges name, kept until the drain (mu held): the index of its
// first range in launch_ranges.
uint32_t keep_ranges(std::vector<LaunchRange>& rs, std::vector<at::Tensor>& foreign) {
  uint32_t first = static_cast<uint32_t>(launch_ranges.size());
  uint32_t shift = static_cast<uint32_t>(launch_tensors.size());
  for (LaunchRange& x : rs) {
    if (x.foreign != NONE) x.foreign += shift;
    launch_ranges.push_back(x);
  }
  for (at::Tensor& t : foreign) launch_tensors.push_back(std::move(t));
  return first;
}

// Whether a result of a fresh-result op is a view of one of its arguments: memory the allocator did
// not give it (not this recorder's DataPtr) inside an argument's storage. sgl_kernel's
// weak_ref_tensor (`weak_ref_tensor(Tensor tensor) -> Tensor`, sgl-kernel/csrc/common_extension.cc)
// is at::from_blob over its argument's data_ptr (sgl-kernel/csrc/memory/weak_ref_tensor.cpp): its
// schema says fresh, yet it allocates and writes nothing (block_table.BlockTable.on_op_full).
//
// For a maybe-alias op (plan->decide) a result in an argument's own storage is a view too (the
// same StorageImpl: `to.dtype` returning self, `reshape` of a contiguous tensor).
bool views_an_argument(const at::Tensor& t, const LaunchCtx* ctx) {
  if (!t.defined() || t.layout() != c10::kStrided || !t.has_storage()) return false;
  if (ctx->plan->decide) {
    const c10::StorageImpl* own = t.storage().unsafeGetStorageImpl();
    for (const std::vector<at::Tensor>* args : {&ctx->aliased, &ctx->reads, &ctx->writes}) {
      for (const at::Tensor& a : *args) {
        if (a.defined() && a.has_storage() && a.storage().unsafeGetStorageImpl() == own) return true;
      }
    }
  }
  const c10::DataPtr& dp = t.storage().data_ptr();
  if (dp.get() == nullptr || dp.get_deleter() == &free_and_record) return false;
  uint64_t p = reinterpret_cast<uint64_t>(dp.get());
  for (const std::vector<at::Tensor>* args : {&ctx->aliased, &ctx->reads, &ctx->writes}) {
    for (const at::Tensor& a : *args) {
      if (!a.defined() || a.layout() != c10::kStrided || !a.has_storage()) continue;
      uint64_t base = reinterpret_cast<uint64_t>(a.storage().data_ptr().get());
      uint64_t n = static_cast<uint64_t>(a.storage().nbytes());
      if (base != 0 && base <= p && p < base + n) return true;
    }
  }
  return false;
}

void exit_op(const at::RecordFunction& fn, LaunchCtx* ctx) {
  if (std::uncaught_exceptions() > ctx->uncaught || quiet_depth > 0) return;
  std::vector<LaunchRange> rs;
  std::vector<at::Tensor> foreign;
  std::vector<at::Tensor> outs;
  size_t views = 0;
  if (ctx->plan->fresh || ctx->plan->decide) {
    for (const c10::IValue& v : fn.outputs()) collect(v, outs);
    for (const at::Tensor& t : outs) views += views_an_argument(t, ctx) ? 1 : 0;
    // every result a view of an argument and no argument written: a view op, which launches nothing
    if (views && views == outs.size() && ctx->writes.empty()) return;
  }
  for (const at::Tensor& t : ctx->reads) add_range(t, false, rs, foreign);
  // a maybe-alias op that made a result of its own copied the arguments it may alias
  if (views < outs.size()) for (const at::Tensor& t : ctx->aliased) add_range(t, false, rs, foreign);
  for (const at::Tensor& t : ctx->writes) add_range(t, true, rs, foreign);
  for (const at::Tensor& t : outs) {
    if (!views_an_argument(t, ctx)) add_range(t, true, rs, foreign);
  }
  if (rs.empty()) return;
  Record r{0, 0, NO_SITE, static_cast<uint64_t>(pthread_self()), now_ns(), LAUNCH, 0};
  std::lock_guard<std::mutex> lock(mu);
  if (records.size() >= max_records) { ++dropped; return; }
  r.addr = launches.size();
  launches.push_back(LaunchRec{ctx->plan->label, keep_ranges(rs, foreign), static_cast<uint32_t>(rs.size())});
  r.site = site_now();
  push_locked(r);
}

// ---- collectives of registered ops (collective_ops.CUSTOM: vLLM's shm_allreduce, custom
// all-reduce): their `coll` and `coll_done` as records, in order with the allocations around them,
// instead of Python events after a drain (a drain per call, a block object per fresh input, a
// Python site walk: ~25 us a call; benchmarks/custom_collective_cost.py)
std::vector<PyTypeObject*> plain_types;     // collective_ops.PLAIN_TYPES (references kept)

uint32_t coll_text(const std::string& s) {   // mu held
  auto it = coll_text_index.find(s);
  if (it != coll_text_index.end()) return it->second;
  coll_texts.push_back(s);
  return coll_text_index.emplace(s, static_cast<uint32_t>(coll_texts.size() - 1)).first->second;
}

// One tensor's range as BlockTable.buffer gives it (a zero-element tensor: its address, 0 bytes);
// false where Python must record the collective (a tensor off the CPU, or without storage).
bool coll_tensor(const at::Tensor& t, uint32_t code, std::vector<LaunchRange>& rs, std::vector<at::Tensor>& foreign) {
  if (!t.defined()) return false;
  if (t.layout() != c10::kStrided) return true;       // (buffer(): no range)
  if (!t.device().is_cpu() || !t.has_storage() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
  const c10::Storage& st = t.storage();
  if (st.data_ptr().get() == nullptr || st.nbytes() == 0) return true;   // no memory (BlockTable._new: no block)
  push_span(t, st.data_ptr(), code, rs, foreign);        // (a storage it did not make: adopted at the drain)
  return true;
}

// collective_ops.tensors_in: a plain tensor, or lists and tuples of them (nested); anything else
// names no buffer.
bool coll_value(PyObject* o, uint32_t code, std::vector<LaunchRange>& rs, std::vector<at::Tensor>& foreign, int depth) {
  if (o == Py_None) return true;
  PyTypeObject* tp = Py_TYPE(o);
  for (PyTypeObject* p : plain_types) {
    if (tp == p) return coll_tensor(THPVariable_Unpack(o), code, rs, foreign);
  }
  if (PyList_Check(o) || PyTuple_Check(o)) {
    if (depth > 32) return false;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!coll_value(items[i], code, rs, foreign, depth + 1)) return false;
    }
  }
  return true;
}

// Collectives only C++ waits for (DDP's verification and reducer): while Python has any, each op
// the mode would see first runs Python's poll, which writes the completions it finds, as the
// dispatch mode polled before each op; so a read after a wait in C++ comes after its `coll_done`.
std::atomic<bool> poll_wanted{false};
PyObject* poll_fn = nullptr;              // a strong reference, kept for the process's life
thread_local bool in_poll = false;

void poll_collectives() {
  if (in_poll || poll_fn == nullptr || !Py_IsInitialized() || _Py_IsFinalizing()) return;
  in_poll = true;
  PyGILState_STATE g = PyGILState_Ensure();
  PyObject* r = PyObject_CallNoArgs(poll_fn);
  if (r == nullptr) {
    PyErr_Clear();                          // (the poll counts its own failures)
  } else {
    Py_DECREF(r);
  }
  PyGILState_Release(g);
  in_poll = false;
}

// The callbacks: a failure is counted (the header's hook errors), never raised into the op, and
// the per-thread nesting stays paired whatever happened inside.
std::unique_ptr<at::ObserverContext> on_op_enter(const at::RecordFunction& fn) {
  if (!launches_here) return nullptr;
  if (poll_wanted.load(std::memory_order_relaxed) && hidden_depth == 0) poll_collectives();
  try {
    return enter_op(fn);
  } catch (const std::exception& e) {
    observer_failed(fn.name(), e.what());
  } catch (...) {
    observer_failed(fn.name(), "unknown exception");
  }
  open_ops.push_back(0);
  return nullptr;
}

void on_op_exit(const at::RecordFunction& fn, at::ObserverContext* c) {
  if (!launches_here || open_ops.empty()) return;
  if (open_ops.back()) --hidden_depth;
  open_ops.pop_back();
  if (c == nullptr) return;
  try {
    exit_op(fn, static_cast<LaunchCtx*>(c));
  } catch (const std::exception& e) {
    observer_failed(fn.name(), e.what());
  } catch (...) {
    observer_failed(fn.name(), "unknown exception");
  }
}

}  // namespace

// Level full: record launches from now on (the observer is registered once per process).
// `opaque_ns`: namespaces whose ops launch nothing (the collective ones); `no_kernel`: op names
// that launch nothing (empty, set_, ...); `kind`: the launch event's number in the binary layout.
void enable_launches(std::vector<std::string> opaque_ns, std::vector<std::string> no_kernel, int64_t kind) {
  {
    std::lock_guard<std::mutex> lock(plans_mu);
    opaque_namespaces = std::move(opaque_ns);
    no_kernel_names = std::move(no_kernel);
    launch_kind = static_cast<uint64_t>(kind);
    plans.clear();
    plans_generation.fetch_add(1, std::memory_order_release);
  }
  if (!observer_on) {
    at::addGlobalCallback(at::RecordFunctionCallback(&on_op_enter, &on_op_exit)
                              .needsInputs(true)
                              .needsOutputs(true)
                              .scopes({at::RecordScope::FUNCTION}));
    observer_on = true;
  }
}

// "ns::name.overload" is a collective capture handles (transparent: its inner ops are the
// program's, as the dispatch mode's `_transparent` handler sees them).
void mark_op(const std::string& qualified, bool transparent) {
  std::lock_guard<std::mutex> lock(plans_mu);
  marked[qualified] = transparent ? TRANSPARENT_OP : OPAQUE_OP;
  plans.clear();
  plans_generation.fetch_add(1, std::memory_order_release);
}

// Python's poll of the collectives only C++ waits for (called with the GIL), and whether it has any.
void set_poll(py::object fn) {
  PyObject* f = fn.ptr();
  Py_INCREF(f);
  poll_fn = f;                            // (an earlier one is kept: a thread may be calling it)
}
void want_poll(bool on) { poll_wanted.store(on, std::memory_order_relaxed); }

std::string observer_error() {
  std::lock_guard<std::mutex> lock(observer_error_mu);
  return last_observer_error;
}

// The calling thread's ops are launches (the dispatch mode's threads: capture calls it where it
// would push the mode), or, `on` false, are not: a thread that disables the dispatch mode for its
// own work (the testbed's comm thread, sanitizer/testbed/comm.py: the collective's own loads and
// stores, as an NCCL kernel's are out of the host's sight). Its allocations are recorded as ever.
void launches_on_this_thread(bool on) { launches_here = on; }

// A registered collective op returned: record its `coll` (cid, comm, seq and the op's label as
// Python names them, `values` its tensor arguments then its result, `codes` each one's access:
// 0 read, 1 written, 2 both) and, with `done`, its `coll_done`, under one lock: nothing another
// thread records comes between. Its call site is read here. Returns false, recording nothing,
// where Python must record it itself (a tensor off the CPU: its stream is the device's).
bool record_coll(int64_t cid, const std::string& comm, int64_t seq, const std::string& op, py::list values,
                 std::vector<int64_t> codes, bool done) {
  std::vector<LaunchRange> rs;
  std::vector<at::Tensor> foreign;
  size_t n = static_cast<size_t>(PyList_GET_SIZE(values.ptr()));
  if (codes.size() != n) throw std::invalid_argument("record_coll: one access code per value");
  for (size_t i = 0; i < n; ++i) {
    if (!coll_value(PyList_GET_ITEM(values.ptr(), i), static_cast<uint32_t>(codes[i]), rs, foreign, 0)) return false;
  }
  uint64_t thread = static_cast<uint64_t>(pthread_self());
  Record r{0, 0, NO_SITE, thread, now_ns(), COLL, 0};
  std::lock_guard<std::mutex> lock(mu);
  size_t need = done ? 2 : 1;
  if (records.size() + need > max_records) { dropped += need; return true; }
  r.addr = colls.size();
  colls.push_back(CollRec{static_cast<uint64_t>(cid), static_cast<uint64_t>(seq), coll_text(comm), coll_text(op),
                          keep_ranges(rs, foreign), static_cast<uint32_t>(rs.size())});
  r.site = site_now();
  push_locked(r);
  if (done) push_locked(Record{static_cast<uint64_t>(cid), 0, NO_SITE, thread, now_ns(), COLL_DONE, 0});
  return true;
}

// The types tensors_in takes as tensors (collective_ops.PLAIN_TYPES): a subclass's is not its own.
void set_plain_types(py::list types) {
  plain_types.clear();
  for (py::handle h : types) {
    if (!PyType_Check(h.ptr())) continue;
    Py_INCREF(h.ptr());                  // kept for the process's life
    plain_types.push_back(reinterpret_cast<PyTypeObject*>(h.ptr()));
  }
}

// Idempotent: a second call would take the recording allocator as its own inner one and recurse
// until the stack overflows (site.py reads a venv's .pth files twice). Returns whether it installed.
bool install(int64_t limit) {
  std::lock_guard<std::mutex> lock(mu);
  if (c10::GetCPUAllocator() == &recording) return false;
  max_records = static_cast<uint64_t>(limit);
  records.reserve(1 << 16);
  inner = c10::GetCPUAllocator();
  inner_deleter = inner->raw_deleter();
  TORCH_CHECK(inner_deleter != nullptr, "the CPU allocator has no raw deleter: it cannot be wrapped");
  if (!fork_handlers) {
    pthread_atfork(&before_fork, &after_fork_parent, &after_fork_child);
    fork_handlers = true;
  }
  c10::SetCPUAllocator(&recording, /*priority=*/100);
  return true;
}

bool installed() { return c10::GetCPUAllocator() == &recording; }

void set_filters(std::vector<std::string> internal, std::vector<std::string> external,
                 std::vector<std::string> stdlib, std::string cwd, bool with_sites) {
  std::lock_guard<std::mutex> lock(mu);
  filters = Filters{std::move(internal), std::move(external), std::move(stdlib), std::move(cwd)};
  files.clear();
  site_index.clear();   // texts stay (indexes handed out remain valid); new lookups remake them
  sites_on = with_sites;
}

void set_scope(int64_t scope) { scope_now = static_cast<uint32_t>(scope); }
int64_t scope() { return scope_now; }
void quiet_add(int64_t d) { quiet_depth += static_cast<int32_t>(d); }

int64_t pending() { return static_cast<int64_t>(n_pending.load(std::memory_order_relaxed)); }

// ---- the records as trace events (called with the GIL, by one thread at a time: Python's drain
// lock). The blocks the recorder saw allocated and not yet freed, by address: their trace ids.
constexpr uint32_t NAMED = 1;      // Python holds a block object for it (a collective named it)
constexpr uint32_t MODELLED = 2;   // placed in a modelled window by Python (allocated in a scope)
struct LiveBlock { uint64_t id; uint64_t size; uint32_t flags; };
std::unordered_map<uint64_t, LiveBlock> blocks;
uint64_t next_block_id = 1;
// Python objects made once and kept for the process's life (never released: no destructor may
// run after the interpreter is gone)
std::vector<PyObject*> site_objs;
std::vector<PyObject*> label_objs;     // op labels, by plan label index
PyObject* s_cpu = nullptr;
PyObject* s_default = nullptr;

PyObject* site_obj(uint64_t site) {
  if (site == NO_SITE || site >= site_objs.size()) return Py_None;
  return site_objs[site];
}

// An id for a block Python records itself (a storage the recorder never saw): one sequence.
int64_t new_id() { return static_cast<int64_t>(next_block_id++); }

// Python took a block object for the block at `addr`: (id, size, flags before), or None.
py::object claim(uint64_t addr) {
  auto it = blocks.find(addr);
  if (it == blocks.end()) return py::none();
  py::tuple out = py::make_tuple(it->second.id, it->second.size, it->second.flags);
  it->second.flags |= NAMED;
  return out;
}

// The block at `addr` is no more the recorder's to free (released by Python: a resize).
void forget(uint64_t addr) { blocks.erase(addr); }

// The live block whose bytes hold `addr` (blocks.end(): none). A pointer at a block's start is
// one lookup; one inside a block (a slice's pointer, a storage made over another's bytes: from_blob,
// from_dlpack, frombuffer) a scan of the live blocks. Only raw pointers (NCCL's ctypes calls) and
// storages the allocator did not make ask, never an allocation or a free.
std::unordered_map<uint64_t, LiveBlock>::iterator block_holding(uint64_t addr) {
  auto it = blocks.find(addr);
  if (it != blocks.end() || addr == 0) return it;
  for (auto b = blocks.begin(); b != blocks.end(); ++b) {
    if (b->first <= addr && addr < b->first + b->second.size) return b;
  }
  return blocks.end();
}

// What the storage at `base` that the allocator did not make lies in, as the drain last found it
// (0: no live block): a program that reads such a storage in every op (numpy memory) scans once.
// A hit is checked against `blocks` at each use (its block may be gone); a miss holds until an
// allocation covers `base` (drain_events forgets those), the only way a miss can become a hit.
std::unordered_map<uint64_t, uint64_t> foreign_holder;
constexpr size_t FOREIGN_HOLDER_MAX = 4096;

std::unordered_map<uint64_t, LiveBlock>::iterator foreign_block(uint64_t base) {
  auto m = foreign_holder.find(base);
  if (m != foreign_holder.end()) {
    if (m->second == 0) return blocks.end();
    auto it = blocks.find(m->second);
    if (it != blocks.end() && base < it->first + it->second.size) return it;
    foreign_holder.erase(m);
  }
  auto it = block_holding(base);
  if (foreign_holder.size() >= FOREIGN_HOLDER_MAX) foreign_holder.clear();
  foreign_holder[base] = it == blocks.end() ? 0 : it->first;
  return it;
}

// Python's question for a raw pointer or a storage it did not see allocated (the GIL held, records
// drained): (the block's address, id, size, flags) of the live block holding `addr`, or None.
py::object containing(uint64_t addr) {
  auto it = block_holding(addr);
  if (it == blocks.end()) return py::none();
  return py::make_tuple(it->first, it->second.id, it->second.size, it->second.flags);
}

// Every block alive: (addr, id, size, flags), for a forked child's trace.
py::list alive() {
  py::list out;
  for (const auto& kv : blocks) out.append(py::make_tuple(kv.first, kv.second.id, kv.second.size, kv.second.flags));
  return out;
}

// The plain records as the binary layout's tuples (block_table.ALLOC_FIELDS and LAUNCH_FIELDS):
// `[5, id, addr, size, "cpu", "default", nil, nil, nil, t, nil, site]`, `[6, id, t]` and
// `[9, "cpu", reads, writes, t, nil, site, nil, op]`, reads and writes tuples of (ptr, size) or nil.
PyObject* alloc_tuple(uint64_t id, uint64_t addr, uint64_t size, uint64_t t, uint64_t site) {
  PyObject* ev = PyTuple_New(12);
  if (!ev) throw py::error_already_set();
  PyTuple_SET_ITEM(ev, 0, PyLong_FromLong(5));
  PyTuple_SET_ITEM(ev, 1, PyLong_FromUnsignedLongLong(id));
  PyTuple_SET_ITEM(ev, 2, PyLong_FromUnsignedLongLong(addr));
  PyTuple_SET_ITEM(ev, 3, PyLong_FromUnsignedLongLong(size));
  Py_INCREF(s_cpu); PyTuple_SET_ITEM(ev, 4, s_cpu);
  Py_INCREF(s_default); PyTuple_SET_ITEM(ev, 5, s_default);
  for (int i : {6, 7, 8, 10}) { Py_INCREF(Py_None); PyTuple_SET_ITEM(ev, i, Py_None); }
  PyTuple_SET_ITEM(ev, 9, PyLong_FromUnsignedLongLong(t));
  PyObject* so = site_obj(site);
  Py_INCREF(so); PyTuple_SET_ITEM(ev, 11, so);
  return ev;
}

PyObject* free_tuple(uint64_t id, uint64_t t) {
  PyObject* ev = PyTuple_New(3);
  if (!ev) throw py::error_already_set();
  PyTuple_SET_ITEM(ev, 0, PyLong_FromLong(6));
  PyTuple_SET_ITEM(ev, 1, PyLong_FromUnsignedLongLong(id));
  PyTuple_SET_ITEM(ev, 2, PyLong_FromUnsignedLongLong(t));
  return ev;
}

struct PlainRange { uint64_t ptr; uint64_t size; uint32_t write; };

PyObject* label_obj(uint32_t op) { return op < label_objs.size() ? label_objs[op] : Py_None; }

PyObject* launch_tuple(uint32_t op, uint64_t site, uint64_t t, const PlainRange* rs, uint32_t n) {
  uint32_t nr = 0, nw = 0;
  for (uint32_t i = 0; i < n; ++i) (rs[i].write ? nw : nr)++;
  PyObject* reads = nr ? PyTuple_New(nr) : nullptr;
  PyObject* writes = nw ? PyTuple_New(nw) : nullptr;
  uint32_t ir = 0, iw = 0;
  for (uint32_t i = 0; i < n; ++i) {
    PyObject* pair = PyTuple_New(2);
    PyTuple_SET_ITEM(pair, 0, PyLong_FromUnsignedLongLong(rs[i].ptr));
    PyTuple_SET_ITEM(pair, 1, PyLong_FromUnsignedLongLong(rs[i].size));
    if (rs[i].write) PyTuple_SET_ITEM(writes, iw++, pair);
    else PyTuple_SET_ITEM(reads, ir++, pair);
  }
  PyObject* ev = PyTuple_New(9);
  if (!ev) throw py::error_already_set();
  PyTuple_SET_ITEM(ev, 0, PyLong_FromUnsignedLongLong(launch_kind));
  Py_INCREF(s_cpu); PyTuple_SET_ITEM(ev, 1, s_cpu);
  if (!reads) { Py_INCREF(Py_None); reads = Py_None; }
  if (!writes) { Py_INCREF(Py_None); writes = Py_None; }
  PyTuple_SET_ITEM(ev, 2, reads);
  PyTuple_SET_ITEM(ev, 3, writes);
  PyTuple_SET_ITEM(ev, 4, PyLong_FromUnsignedLongLong(t));
  Py_INCREF(Py_None); PyTuple_SET_ITEM(ev, 5, Py_None);
  PyObject* so = site_obj(site);
  Py_INCREF(so); PyTuple_SET_ITEM(ev, 6, so);
  Py_INCREF(Py_None); PyTuple_SET_ITEM(ev, 7, Py_None);
  PyObject* label = label_obj(op);
  Py_INCREF(label); PyTuple_SET_ITEM(ev, 8, label);
  return ev;
}

// A registered op's collective (record_coll), as the binary layout's tuples (binary.layout:
// fixed by its version): `(10, cid, comm, seq, op, "cpu", [[addr, size, access], ...], t)`, with
// `nil, site` after t when it has a site, and `(11, cid, t)`.
constexpr uint64_t COLL_KIND = 10, COLL_DONE_KIND = 11;
std::vector<PyObject*> coll_text_objs;     // by coll_texts index
PyObject* s_access[3] = {nullptr, nullptr, nullptr};
const char* const ACCESS[3] = {"r", "w", "rw"};

std::vector<std::string> coll_text_strs;   // the same texts, for PackedRun::encode (the GIL held)

PyObject* coll_text_obj(uint32_t i) { return i < coll_text_objs.size() ? coll_text_objs[i] : Py_None; }
const std::string& coll_text_str(uint32_t i) {
  static const std::string none;
  return i < coll_text_strs.size() ? coll_text_strs[i] : none;
}

PyObject* coll_tuple(uint64_t cid, uint32_t comm, uint64_t seq, uint32_t op, uint64_t site, uint64_t t,
                     const PlainRange* rs, uint32_t n) {
  PyObject* bufs = PyList_New(n);
  if (!bufs) throw py::error_already_set();
  for (uint32_t i = 0; i < n; ++i) {
    PyObject* b = PyList_New(3);
    PyList_SET_ITEM(b, 0, PyLong_FromUnsignedLongLong(rs[i].ptr));
    PyList_SET_ITEM(b, 1, PyLong_FromUnsignedLongLong(rs[i].size));
    PyObject* a = s_access[std::min<uint32_t>(rs[i].write, 2)];
    Py_INCREF(a); PyList_SET_ITEM(b, 2, a);
    PyList_SET_ITEM(bufs, i, b);
  }
  PyObject* so = site_obj(site);
  bool with_site = so != Py_None;
  PyObject* ev = PyTuple_New(with_site ? 10 : 8);
  if (!ev) throw py::error_already_set();
  PyTuple_SET_ITEM(ev, 0, PyLong_FromUnsignedLongLong(COLL_KIND));
  PyTuple_SET_ITEM(ev, 1, PyLong_FromUnsignedLongLong(cid));
  PyObject* c = coll_text_obj(comm);
  Py_INCREF(c); PyTuple_SET_ITEM(ev, 2, c);
  PyTuple_SET_ITEM(ev, 3, PyLong_FromUnsignedLongLong(seq));
  PyObject* o = coll_text_obj(op);
  Py_INCREF(o); PyTuple_SET_ITEM(ev, 4, o);
  Py_INCREF(s_cpu); PyTuple_SET_ITEM(ev, 5, s_cpu);
  PyTuple_SET_ITEM(ev, 6, bufs);
  PyTuple_SET_ITEM(ev, 7, PyLong_FromUnsignedLongLong(t));
  if (with_site) {
    Py_INCREF(Py_None); PyTuple_SET_ITEM(ev, 8, Py_None);
    Py_INCREF(so); PyTuple_SET_ITEM(ev, 9, so);
  }
  return ev;
}

PyObject* coll_done_tuple(uint64_t cid, uint64_t t) {
  PyObject* ev = PyTuple_New(3);
  if (!ev) throw py::error_already_set();
  PyTuple_SET_ITEM(ev, 0, PyLong_FromUnsignedLongLong(COLL_DONE_KIND));
  PyTuple_SET_ITEM(ev, 1, PyLong_FromUnsignedLongLong(cid));
  PyTuple_SET_ITEM(ev, 2, PyLong_FromUnsignedLongLong(t));
  return ev;
}

// ---- packed runs: the plain records of a drain kept here until the writer encodes them
//
// In a host-bound decode step (vLLM's, on this machine) the ~190 plain records a rank makes cost
// more as Python objects (a tuple each, then an item list, then msgspec) than everything else
// capture does per step. A run keeps them as structs; the writer asks it for their msgpack items
// at the flush, with the file's value tables as they are then (a call site or op label new to the
// file goes through the table's `ref`, so its `V` frame, rollback and rotation are the table's
// business as for any event). `events()` gives the tuples above, for JSON Lines and the tests
// that hold the two paths equal.
struct PlainEvent {
  uint64_t id;      // alloc, free: the block's id; launch, coll: its first range in `ranges`; coll_done: cid
  uint64_t addr;    // alloc; launch, coll: its number of ranges
  uint64_t size;    // alloc; coll: its index in `colls`
  uint64_t t;
  uint64_t site;    // NO_SITE: none
  uint32_t kind;    // 5 alloc, 6 free, 9 launch, 10 coll, 11 coll_done
  uint32_t op;      // launch: label index
};
struct RunData {
  std::vector<PlainEvent> evs;
  std::vector<PlainRange> ranges;
  std::vector<CollRec> colls;      // (first, n unused: the event's)
};

// msgpack, as msgspec writes it (the smallest form of each integer), so that a run's items are
// byte for byte what the Python path makes of the same tuples
struct Msgpack {
  // written through a pointer into `out`, whose size is its room while encoding (finish() cuts it
  // to what was written): a byte costs a store, not a std::string push_back
  std::string out;
  char* p = nullptr;
  char* end = nullptr;
  void room(size_t k) {
    if (static_cast<size_t>(end - p) >= k) return;
    size_t used = p ? static_cast<size_t>(p - &out[0]) : 0;
    out.resize(std::max(out.size() * 2, used + k + 4096));
    p = &out[0] + used;
    end = &out[0] + out.size();
  }
  void uint(uint64_t x) {
    room(9);
    if (x < 128) { *p++ = static_cast<char>(x); return; }
    int n;
    if (x <= 0xFF) { *p++ = '\xcc'; n = 1; }
    else if (x <= 0xFFFF) { *p++ = '\xcd'; n = 2; }
    else if (x <= 0xFFFFFFFFull) { *p++ = '\xce'; n = 4; }
    else { *p++ = '\xcf'; n = 8; }
    for (int i = n - 1; i >= 0; --i) *p++ = static_cast<char>(x >> (8 * i));
  }
  void nil() { room(1); *p++ = '\xc0'; }
  void array(size_t n) {
    room(5);
    if (n < 16) { *p++ = static_cast<char>(0x90 | n); return; }
    if (n <= 0xFFFF) {
      *p++ = '\xdc'; *p++ = static_cast<char>(n >> 8); *p++ = static_cast<char>(n);
      return;
    }
    *p++ = '\xdd';
    for (int i = 3; i >= 0; --i) *p++ = static_cast<char>(n >> (8 * i));
  }
  void raw(const char* s, size_t n) {
    room(n);
    std::memcpy(p, s, n);
    p += n;
  }
  void str(const std::string& s) {
    size_t n = s.size();
    room(5);
    if (n < 32) {
      *p++ = static_cast<char>(0xa0 | n);
    } else if (n <= 0xFF) {
      *p++ = '\xd9'; *p++ = static_cast<char>(n);
    } else if (n <= 0xFFFF) {
      *p++ = '\xda'; *p++ = static_cast<char>(n >> 8); *p++ = static_cast<char>(n);
    } else {
      *p++ = '\xdb';
      for (int i = 3; i >= 0; --i) *p++ = static_cast<char>(n >> (8 * i));
    }
    raw(s.data(), n);
  }
  const std::string& finish() {
    out.resize(p ? static_cast<size_t>(p - &out[0]) : 0);
    return out;
  }
};

class PackedRun {
 public:
  PackedRun(std::shared_ptr<RunData> d, size_t start, size_t stop) : d_(std::move(d)), start_(start), stop_(stop) {}
  size_t size() const { return stop_ - start_; }
  PackedRun part(int64_t start, int64_t stop) const {
    size_t n = size();
    size_t a = static_cast<size_t>(std::clamp<int64_t>(start, 0, static_cast<int64_t>(n)));
    size_t b = static_cast<size_t>(std::clamp<int64_t>(stop, static_cast<int64_t>(a), static_cast<int64_t>(n)));
    return PackedRun(d_, start_ + a, start_ + b);
  }
  py::list events() const {
    py::list out;
    for (size_t i = start_; i < stop_; ++i) out.append(py::reinterpret_steal<py::object>(tuple_of(d_->evs[i])));
    return out;
  }
  // The msgpack items of these events, one after another (no array around them), their call sites
  // and op labels as indices in the file's tables: `sites` and `ops` (value -> index), and
  // `ref(field, value)` for a value not yet in one. None if a value cannot be interned (the
  // caller then encodes events() its own way).
  py::object encode(py::dict sites, py::dict ops, py::object ref) const {
    std::unordered_map<uint64_t, int64_t> site_idx, op_idx;    // per call: the tables may change between
    auto index = [&](std::unordered_map<uint64_t, int64_t>& cache, PyObject* table, const char* field,
                     uint64_t key, PyObject* value) -> int64_t {
      auto it = cache.find(key);
      if (it != cache.end()) return it->second;
      int64_t found = -1;
      PyObject* got = PyDict_GetItemWithError(table, value);    // borrowed
      if (got == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        py::object r = ref(field, py::reinterpret_borrow<py::object>(value));
        if (!r.is_none()) found = r.cast<int64_t>();
      } else {
        found = PyLong_AsLongLong(got);
        if (found == -1 && PyErr_Occurred()) throw py::error_already_set();
      }
      cache.emplace(key, found);
      return found;
    };
    Msgpack m;
    m.room(size() * 40);
    for (size_t i = start_; i < stop_; ++i) {
      const PlainEvent& e = d_->evs[i];
      if (e.kind == 6 || e.kind == COLL_DONE_KIND) {
        m.array(3); m.uint(e.kind); m.uint(e.id); m.uint(e.t);
        continue;
      }
      int64_t site = -1;
      if (e.site != NO_SITE && e.site < site_objs.size()) {
        site = index(site_idx, sites.ptr(), "site", e.site, site_objs[e.site]);
        if (site < 0) return py::none();
      }
      if (e.kind == COLL_KIND) {        // as coll_tuple
        const CollRec& c = d_->colls[e.size];
        m.array(site < 0 ? 8 : 10); m.uint(COLL_KIND); m.uint(c.cid); m.str(coll_text_str(c.comm));
        m.uint(c.seq); m.str(coll_text_str(c.op)); m.raw("\xa3" "cpu", 4);
        const PlainRange* rs = d_->ranges.data() + e.id;
        m.array(e.addr);
        for (uint64_t k = 0; k < e.addr; ++k) {
          m.array(3); m.uint(rs[k].ptr); m.uint(rs[k].size); m.str(ACCESS[std::min<uint32_t>(rs[k].write, 2)]);
        }
        m.uint(e.t);
        if (site >= 0) { m.nil(); m.uint(static_cast<uint64_t>(site)); }
        continue;
      }
      if (e.kind == 5) {
        m.array(12); m.uint(5); m.uint(e.id); m.uint(e.addr); m.uint(e.size);
        m.raw("\xa3" "cpu", 4); m.raw("\xa7" "default", 8);
        m.nil(); m.nil(); m.nil(); m.uint(e.t); m.nil();
        if (site < 0) m.nil(); else m.uint(static_cast<uint64_t>(site));
        continue;
      }
      int64_t op = -1;
      if (e.op < label_objs.size()) {
        op = index(op_idx, ops.ptr(), "op", e.op, label_objs[e.op]);
        if (op < 0) return py::none();
      }
      const PlainRange* rs = d_->ranges.data() + e.id;
      uint32_t n = static_cast<uint32_t>(e.addr), nr = 0, nw = 0;
      for (uint32_t k = 0; k < n; ++k) (rs[k].write ? nw : nr)++;
      m.array(9); m.uint(launch_kind); m.raw("\xa3" "cpu", 4);
      for (uint32_t w = 0; w < 2; ++w) {
        uint32_t count = w ? nw : nr;
        if (!count) { m.nil(); continue; }
        m.array(count);
        for (uint32_t k = 0; k < n; ++k) {
          if ((rs[k].write != 0) != (w != 0)) continue;
          m.array(2); m.uint(rs[k].ptr); m.uint(rs[k].size);
        }
      }
      m.uint(e.t); m.nil();
      if (site < 0) m.nil(); else m.uint(static_cast<uint64_t>(site));
      m.nil();
      if (op < 0) m.nil(); else m.uint(static_cast<uint64_t>(op));
    }
    const std::string& bytes = m.finish();
    return py::bytes(bytes);
  }

 private:
  PyObject* tuple_of(const PlainEvent& e) const {
    if (e.kind == 5) return alloc_tuple(e.id, e.addr, e.size, e.t, e.site);
    if (e.kind == 6) return free_tuple(e.id, e.t);
    if (e.kind == COLL_DONE_KIND) return coll_done_tuple(e.id, e.t);
    if (e.kind == COLL_KIND) {
      const CollRec& c = d_->colls[e.size];
      return coll_tuple(c.cid, c.comm, c.seq, c.op, e.site, e.t, d_->ranges.data() + e.id, static_cast<uint32_t>(e.addr));
    }
    return launch_tuple(e.op, e.site, e.t, d_->ranges.data() + e.id, static_cast<uint32_t>(e.addr));
  }
  std::shared_ptr<RunData> d_;
  size_t start_, stop_;
};

// The pending records as trace events: (events, specials, dropped, passed through, launches,
// observer errors). `events` holds the plain ones: as tuples (alloc_tuple, free_tuple,
// launch_tuple), or with `packed` as one PackedRun; `specials` the records Python must handle
// itself, each (the index in `events` it comes before, its fields): an allocation inside a scope
// (0, addr, size, site, t, scope, id), a free (1, addr, size, thread, t, flags, id, block flags)
// when it was made inside a wait, its block is one Python holds or placed, or `all_frees` (Python
// has Work-held or stashed blocks to look at on every free), and a launch with a range Python must
// translate (2, op, site, t, ranges), and a registered op's collective with such a range
// (3, cid, comm, seq, op, site, t, ranges), its ranges' first element the access ("r", "w", "rw").
// Host threads: before the first record and wherever the records' thread changes, a special
// (4, thread), its pthread_self() (threading.get_ident()): the events after it are that thread's.
// A launch of a thread other than `main_thread` is a special too (Python puts it on that thread's
// lane, `cpu@<thread>`), and only the main thread's count in the launches returned (the lazy
// `cpu` sync is the main thread's alone). `main_thread` 0: no threads told apart (neither).
py::tuple drain_events(bool all_frees, bool packed, uint64_t main_thread) {
  std::vector<Record> out;
  std::vector<std::string> texts, labels, ctexts;
  std::vector<CollRec> crecs;
  std::vector<LaunchRec> lrecs;
  std::vector<LaunchRange> lranges;
  std::vector<at::Tensor> ltensors;
  uint64_t lost, passed;
  {
    std::lock_guard<std::mutex> lock(plans_mu);
    labels.assign(op_labels.begin() + labels_handed, op_labels.end());
    labels_handed = op_labels.size();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    out.swap(records);
    lrecs.swap(launches);
    lranges.swap(launch_ranges);
    ltensors.swap(launch_tensors);
    crecs.swap(colls);
    ctexts.assign(coll_texts.begin() + coll_texts_handed, coll_texts.end());
    coll_texts_handed = coll_texts.size();
    n_pending.store(0);
    texts.assign(site_texts.begin() + texts_handed, site_texts.end());
    texts_handed = site_texts.size();
    lost = dropped;
    passed = passed_through;
  }
  if (!s_cpu) {
    s_cpu = PyUnicode_InternFromString("cpu");
    s_default = PyUnicode_InternFromString("default");
    for (int i = 0; i < 3; ++i) s_access[i] = PyUnicode_InternFromString(ACCESS[i]);
  }
  for (const std::string& t : ctexts) {
    PyObject* o = PyUnicode_DecodeUTF8(t.data(), t.size(), "replace");
    if (!o) throw py::error_already_set();
    coll_text_objs.push_back(o);
    coll_text_strs.push_back(t);
  }
  for (const std::string& t : texts) {
    PyObject* o = PyUnicode_DecodeUTF8(t.data(), t.size(), "replace");
    if (!o) throw py::error_already_set();
    site_objs.push_back(o);
  }
  for (const std::string& t : labels) {
    PyObject* o = PyUnicode_InternFromString(t.c_str());
    if (!o) throw py::error_already_set();
    label_objs.push_back(o);
  }
  py::list events, specials;
  auto run = packed ? std::make_shared<RunData>() : nullptr;
  if (run) run->evs.reserve(out.size());
  size_t n_events = 0;      // plain events so far: a special's place among them
  auto plain = [&](PyObject* ev) {
    events.append(py::reinterpret_steal<py::object>(ev));
    ++n_events;
  };
  int64_t n_launches = 0;
  std::vector<PlainRange> rs;
  // plain: every range in a block the recorder made and Python did not place
  auto plain_ranges = [&](uint32_t first, uint32_t n) {
    for (uint32_t i = first; i < first + n; ++i) {
      const LaunchRange& x = lranges[i];
      if (x.foreign != NONE) return false;
      auto it = blocks.find(x.base);
      if (it == blocks.end() || (it->second.flags & MODELLED)) return false;
    }
    return true;
  };
  // the ranges of a launch or collective that is not plain, for Python: (write or access, base,
  // ptr, size, the tensor of a storage the recorder did not make, resolved)
  auto ranges_for_python = [&](uint32_t first, uint32_t n, bool coll) {
    py::list ranges;
    for (uint32_t i = first; i < first + n; ++i) {
      const LaunchRange& x = lranges[i];
      py::object t = py::none();
      if (x.foreign != NONE) t = py::reinterpret_steal<py::object>(THPVariable_Wrap(ltensors[x.foreign]));
      // resolved here, where `blocks` is as it was at the record (Python handles the specials
      // after every record of the batch went through it: a later free is gone from it)
      bool resolved = false;
      if (x.foreign == NONE) {
        auto it = blocks.find(x.base);
        resolved = it != blocks.end() && !(it->second.flags & MODELLED);
      }
      py::object how = coll ? py::reinterpret_borrow<py::object>(s_access[std::min<uint32_t>(x.write, 2)])
                            : py::reinterpret_borrow<py::object>(x.write ? Py_True : Py_False);
      ranges.append(py::make_tuple(how, x.base, x.ptr, x.size, t, resolved));
    }
    return ranges;
  };
  // A range in a storage the allocator did not make over bytes of a block it did (an alias:
  // from_blob, from_dlpack, frombuffer over a tensor's memory) is that block's range: resolved
  // here, where `blocks` is as it was at the record, so Python neither adopts the alias as an
  // allocation nor misses its block freed later in the batch. A storage over no live block keeps
  // its tensor (Python records its bytes where they are: block_table.BlockTable._new).
  auto own_aliases = [&](uint32_t first, uint32_t n) {
    for (uint32_t i = first; i < first + n; ++i) {
      LaunchRange& x = lranges[i];
      if (x.foreign == NONE) continue;
      auto it = foreign_block(x.base);
      if (it == blocks.end()) continue;
      x.base = it->first;
      x.foreign = NONE;
    }
  };
  uint64_t current_thread = 0;
  bool thread_known = false;
  for (const Record& r : out) {
    if (main_thread != 0 && (!thread_known || r.thread != current_thread)) {
      specials.append(py::make_tuple(n_events, py::make_tuple(4, r.thread)));
      current_thread = r.thread;
      thread_known = true;
    }
    if (r.flags & COLL_DONE) {
      if (run) {
        run->evs.push_back(PlainEvent{r.addr, 0, 0, r.t, NO_SITE, static_cast<uint32_t>(COLL_DONE_KIND), 0});
        ++n_events;
      } else {
        plain(coll_done_tuple(r.addr, r.t));
      }
      continue;
    }
    if (r.flags & COLL) {
      const CollRec& c = crecs[r.addr];
      own_aliases(c.first, c.n);
      if (!plain_ranges(c.first, c.n)) {
        specials.append(py::make_tuple(n_events, py::make_tuple(3, c.cid,
            py::reinterpret_borrow<py::object>(coll_text_obj(c.comm)), c.seq,
            py::reinterpret_borrow<py::object>(coll_text_obj(c.op)),
            py::reinterpret_borrow<py::object>(site_obj(r.site)), r.t, ranges_for_python(c.first, c.n, true))));
        continue;
      }
      rs.clear();
      for (uint32_t i = c.first; i < c.first + c.n; ++i)
        rs.push_back(PlainRange{lranges[i].ptr, lranges[i].size, lranges[i].write});
      if (run) {
        run->evs.push_back(PlainEvent{run->ranges.size(), c.n, run->colls.size(), r.t, r.site,
                                      static_cast<uint32_t>(COLL_KIND), 0});
        run->colls.push_back(c);
        run->ranges.insert(run->ranges.end(), rs.begin(), rs.end());
        ++n_events;
      } else {
        plain(coll_tuple(c.cid, c.comm, c.seq, c.op, r.site, r.t, rs.data(), c.n));
      }
      continue;
    }
    if (r.flags & LAUNCH) {
      const LaunchRec& l = lrecs[r.addr];
      bool main = main_thread == 0 || r.thread == main_thread;
      if (main) ++n_launches;
      own_aliases(l.first, l.n);
      if (!main || !plain_ranges(l.first, l.n)) {
        specials.append(py::make_tuple(n_events, py::make_tuple(2, py::reinterpret_borrow<py::object>(label_obj(l.op)),
            py::reinterpret_borrow<py::object>(site_obj(r.site)), r.t, ranges_for_python(l.first, l.n, false))));
        continue;
      }
      if (run) {
        run->evs.push_back(PlainEvent{run->ranges.size(), l.n, 0, r.t, r.site, 9, l.op});
        for (uint32_t i = l.first; i < l.first + l.n; ++i)
          run->ranges.push_back(PlainRange{lranges[i].ptr, lranges[i].size, lranges[i].write});
        ++n_events;
        continue;
      }
      rs.clear();
      for (uint32_t i = l.first; i < l.first + l.n; ++i)
        rs.push_back(PlainRange{lranges[i].ptr, lranges[i].size, lranges[i].write});
      plain(launch_tuple(l.op, r.site, r.t, rs.data(), l.n));
      continue;
    }
    if (r.flags & FREED) {
      auto it = blocks.find(r.addr);
      if (it == blocks.end()) continue;    // allocated before the recorder, of 0 bytes, or forgotten
      LiveBlock b = it->second;
      blocks.erase(it);
      if (all_frees || (r.flags & QUIET) || b.flags) {
        specials.append(py::make_tuple(n_events, py::make_tuple(1, r.addr, b.size, r.thread, r.t, r.flags, b.id, b.flags)));
      } else if (run) {
        run->evs.push_back(PlainEvent{b.id, 0, 0, r.t, NO_SITE, 6, 0});
        ++n_events;
      } else {
        plain(free_tuple(b.id, r.t));
      }
      continue;
    }
    if (r.size == 0) continue;
    if (!foreign_holder.empty()) {       // a miss this block now covers is a miss no more
      for (auto m = foreign_holder.begin(); m != foreign_holder.end();) {
        if (m->second == 0 && r.addr <= m->first && m->first < r.addr + r.size) m = foreign_holder.erase(m);
        else ++m;
      }
    }
    uint64_t id = next_block_id++;
    blocks[r.addr] = LiveBlock{id, r.size, r.scope ? MODELLED : 0u};
    if (r.scope) {
      specials.append(py::make_tuple(n_events, py::make_tuple(0, r.addr, r.size,
          py::reinterpret_borrow<py::object>(site_obj(r.site)), r.t, r.scope, id)));
      continue;
    }
    if (run) {
      run->evs.push_back(PlainEvent{id, r.addr, r.size, r.t, r.site, 5, 0});
      ++n_events;
      continue;
    }
    plain(alloc_tuple(id, r.addr, r.size, r.t, r.site));
  }
  py::object evs = events;
  if (run) {
    size_t n = run->evs.size();
    evs = py::cast(PackedRun(std::move(run), 0, n));
  }
  return py::make_tuple(evs, specials, lost, passed, n_launches,
                        static_cast<int64_t>(observer_errors.load(std::memory_order_relaxed)));
}

// ---- the idle watch: when the writer's time flush has something to do, said without the GIL
//
// The time flush (sanitizer/trace/flush_timer.py) must notice soon (HAZSAN_IDLE_SECONDS) that a
// program which marks step ends is idle after its last one, and that records made here wait
// while the file says it holds everything. A Python thread looking every idle/2 s takes the GIL
// from the step's thread 40 times a second, which cost a vLLM TP=2 batch about 9% on a 2-core
// machine (benchmarks/README.md). This thread looks instead, holding nothing of Python's, and
// writes one byte to the time flush's pipe only when there is something for it to do:
//   * a program that marks step ends: its last step ended idle_s ago, none started since, and
//     the time flush was not yet told of that end, or records are pending;
//   * any other program: records are pending.
// It never takes the GIL or touches a Python object, and is joined before its pipe is closed.
namespace {
struct WatchSync { std::mutex mu; std::condition_variable cv; };
WatchSync* watch_sync = new WatchSync();   // never destroyed: the process may exit while it waits
std::thread* watch_thread = nullptr;       // the running one, joined by watch_stop (heap: never
                                           // destroyed joinable, which would std::terminate)
std::mutex watch_control;                  // one start or stop at a time
std::atomic<uint64_t> watch_gen{0};
std::atomic<bool> w_step_ends{false};
std::atomic<bool> w_in_step{false};
std::atomic<int64_t> w_last_end{0};        // CLOCK_MONOTONIC ns of the last step end, 0: none
bool watch_fork_handler = false;

int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

void watch_loop(uint64_t gen, int fd, int64_t look_ns, int64_t idle_ns) {
  int64_t told = 0;
  std::unique_lock<std::mutex> lock(watch_sync->mu);
  while (true) {
    watch_sync->cv.wait_for(lock, std::chrono::nanoseconds(look_ns), [&] { return watch_gen.load() != gen; });
    if (watch_gen.load() != gen) return;
    bool pending_now = n_pending.load(std::memory_order_relaxed) > 0;
    bool wake = false;
    if (!w_step_ends.load(std::memory_order_relaxed)) {
      wake = pending_now;
    } else if (!w_in_step.load(std::memory_order_relaxed)) {
      int64_t end = w_last_end.load(std::memory_order_relaxed);
      if (end != 0 && monotonic_ns() - end >= idle_ns) {
        wake = pending_now || end != told;
        told = end;
      }
    }
    if (wake) {
      char b = 'w';
      ssize_t r = write(fd, &b, 1);   // non-blocking: a full pipe already wakes the reader
      (void)r;
    }
  }
}

// In a forked child the thread does not exist (and the lock may have been held): start afresh.
void watch_after_fork_child() {
  watch_sync = new WatchSync();
  watch_thread = nullptr;                  // the parent's: not ours to join or destroy
  new (&watch_control) std::mutex();
  w_step_ends.store(false);
  w_in_step.store(false);
  w_last_end.store(0);
}

void watch_stop_locked() {
  if (watch_thread == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(watch_sync->mu);
    ++watch_gen;
  }
  watch_sync->cv.notify_all();
  watch_thread->join();
  delete watch_thread;
  watch_thread = nullptr;
}
}  // namespace

// Start the watch (stopping one running): it writes to `fd` (the time flush's pipe, non-blocking)
// every `look_s` at most, when the time flush has something to do (above).
// The GIL stays held in both (the watch thread never takes it, and a join is at most one wake-up
// of it): the time flush calls them, a daemon thread, and one that took the GIL back inside a C++
// frame while the interpreter finalizes is ended by pthread_exit, whose unwinding through the
// release guard's noexcept destructor aborts the program ("terminate called without an active
// exception", pytorch#38228; seen at exit under load, tests/capture/test_capture_nothing_lost.py).
bool watch_start(int64_t fd, double look_s, double idle_s) {
  std::lock_guard<std::mutex> control(watch_control);
  watch_stop_locked();
  if (!watch_fork_handler) {
    pthread_atfork(nullptr, nullptr, &watch_after_fork_child);
    watch_fork_handler = true;
  }
  uint64_t gen = ++watch_gen;
  int64_t look_ns = static_cast<int64_t>(std::max(look_s, 0.001) * 1e9);
  int64_t idle_ns = static_cast<int64_t>(std::max(idle_s, 0.0) * 1e9);
  watch_thread = new std::thread(watch_loop, gen, static_cast<int>(fd), look_ns, idle_ns);
  return true;
}

// Stop the watch and wait for its thread (then its pipe may be closed).
void watch_stop() {
  std::lock_guard<std::mutex> control(watch_control);
  watch_stop_locked();
}

// The program's step hook: a step starts (`ended` false) or ended.
void watch_step(bool ended) {
  if (ended) {
    w_last_end.store(monotonic_ns());
    w_in_step.store(false);
    w_step_ends.store(true);
  } else {
    w_in_step.store(true);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("installed", &installed);
  m.def("set_filters", &set_filters);
  m.def("set_scope", &set_scope);
  m.def("scope", &scope);
  m.def("quiet_add", &quiet_add);
  m.def("pending", &pending);
  m.def("drain_events", &drain_events, py::arg("all_frees"), py::arg("packed") = false,
        py::arg("main_thread") = static_cast<uint64_t>(0));
  m.def("record_coll", &record_coll);
  m.def("set_plain_types", &set_plain_types);
  py::class_<PackedRun>(m, "PackedRun")
      .def("__len__", &PackedRun::size)
      .def("part", &PackedRun::part)
      .def("events", &PackedRun::events)
      .def("encode", &PackedRun::encode);
  m.def("new_id", &new_id);
  m.def("claim", &claim);
  m.def("forget", &forget);
  m.def("containing", &containing);
  m.def("alive", &alive);
  m.def("enable_launches", &enable_launches);
  m.def("mark_op", &mark_op);
  m.def("launches_on_this_thread", &launches_on_this_thread, py::arg("on") = true);
  m.def("observer_error", &observer_error);
  m.def("set_poll", &set_poll);
  m.def("want_poll", &want_poll);
  m.def("watch_start", &watch_start);
  m.def("watch_stop", &watch_stop);
  m.def("watch_step", &watch_step);
}
