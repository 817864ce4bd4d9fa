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
#include <c10/core/CPUAllocator.h>
#include <Python.h>
#if !(PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000)
#error "hazsan's native recorder reads CPython 3.11's frames; this Python is another version"
#endif
#define Py_BUILD_CORE
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#include <pthread.h>
#include <time.h>
#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr uint64_t NO_SITE = UINT64_MAX;
constexpr uint32_t FREED = 1;   // a free (else an allocation)
constexpr uint32_t QUIET = 2;   // freed on a thread inside a collective's wait

struct Record {        // 48 bytes
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
  n_pending.store(0);
  mu.unlock();
}

}  // namespace

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

// Every block alive: (addr, id, size, flags), for a forked child's trace.
py::list alive() {
  py::list out;
  for (const auto& kv : blocks) out.append(py::make_tuple(kv.first, kv.second.id, kv.second.size, kv.second.flags));
  return out;
}

// The pending records as trace events: (events, specials, dropped, passed through). `events` holds
// the plain ones as the binary layout's tuples, `[5, id, addr, size, "cpu", "default", nil, nil,
// nil, t, nil, site]` and `[6, id, t]`; `specials` the records Python must handle itself, each
// (the index in `events` it comes before, its fields): an allocation inside a scope
// (0, addr, size, site, t, scope, id), and a free (1, addr, size, thread, t, flags, id, block
// flags) when it was made inside a wait, its block is one Python holds or placed, or
// `all_frees` (Python has Work-held or stashed blocks to look at on every free).
py::tuple drain_events(bool all_frees) {
  std::vector<Record> out;
  std::vector<std::string> texts;
  uint64_t lost, passed;
  {
    std::lock_guard<std::mutex> lock(mu);
    out.swap(records);
    n_pending.store(0);
    texts.assign(site_texts.begin() + texts_handed, site_texts.end());
    texts_handed = site_texts.size();
    lost = dropped;
    passed = passed_through;
  }
  if (!s_cpu) {
    s_cpu = PyUnicode_InternFromString("cpu");
    s_default = PyUnicode_InternFromString("default");
  }
  for (const std::string& t : texts) {
    PyObject* o = PyUnicode_DecodeUTF8(t.data(), t.size(), "replace");
    if (!o) throw py::error_already_set();
    site_objs.push_back(o);
  }
  py::list events, specials;
  for (const Record& r : out) {
    if (r.flags & FREED) {
      auto it = blocks.find(r.addr);
      if (it == blocks.end()) continue;    // allocated before the recorder, of 0 bytes, or forgotten
      LiveBlock b = it->second;
      blocks.erase(it);
      if (all_frees || (r.flags & QUIET) || b.flags) {
        specials.append(py::make_tuple(events.size(), py::make_tuple(1, r.addr, b.size, r.thread, r.t, r.flags, b.id, b.flags)));
      } else {
        PyObject* ev = PyTuple_New(3);
        if (!ev) throw py::error_already_set();
        PyTuple_SET_ITEM(ev, 0, PyLong_FromLong(6));
        PyTuple_SET_ITEM(ev, 1, PyLong_FromUnsignedLongLong(b.id));
        PyTuple_SET_ITEM(ev, 2, PyLong_FromUnsignedLongLong(r.t));
        events.append(py::reinterpret_steal<py::object>(ev));
      }
      continue;
    }
    if (r.size == 0) continue;
    uint64_t id = next_block_id++;
    blocks[r.addr] = LiveBlock{id, r.size, r.scope ? MODELLED : 0u};
    if (r.scope) {
      specials.append(py::make_tuple(events.size(), py::make_tuple(0, r.addr, r.size,
          py::reinterpret_borrow<py::object>(site_obj(r.site)), r.t, r.scope, id)));
      continue;
    }
    PyObject* ev = PyTuple_New(12);
    if (!ev) throw py::error_already_set();
    PyTuple_SET_ITEM(ev, 0, PyLong_FromLong(5));
    PyTuple_SET_ITEM(ev, 1, PyLong_FromUnsignedLongLong(id));
    PyTuple_SET_ITEM(ev, 2, PyLong_FromUnsignedLongLong(r.addr));
    PyTuple_SET_ITEM(ev, 3, PyLong_FromUnsignedLongLong(r.size));
    Py_INCREF(s_cpu); PyTuple_SET_ITEM(ev, 4, s_cpu);
    Py_INCREF(s_default); PyTuple_SET_ITEM(ev, 5, s_default);
    for (int i : {6, 7, 8, 10}) { Py_INCREF(Py_None); PyTuple_SET_ITEM(ev, i, Py_None); }
    PyTuple_SET_ITEM(ev, 9, PyLong_FromUnsignedLongLong(r.t));
    PyObject* so = site_obj(r.site);
    Py_INCREF(so); PyTuple_SET_ITEM(ev, 11, so);
    events.append(py::reinterpret_steal<py::object>(ev));
  }
  return py::make_tuple(events, specials, lost, passed);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("installed", &installed);
  m.def("set_filters", &set_filters);
  m.def("set_scope", &set_scope);
  m.def("scope", &scope);
  m.def("quiet_add", &quiet_add);
  m.def("pending", &pending);
  m.def("drain_events", &drain_events);
  m.def("new_id", &new_id);
  m.def("claim", &claim);
  m.def("forget", &forget);
  m.def("alive", &alive);
}
