#!/usr/bin/env python3
"""Issue 30's question, measured: what would capture cost per tiny op with no Python dispatch mode
at all, its allocations taken from a native hook on torch's CPU allocator and (for `full`) its
launches from a native op observer?

A probe, not capture: a small C++ extension (built here with torch.utils.cpp_extension, cached
under --build-dir, compiled with -DNDEBUG as libtorch is: RecordFunction's inline accessors read
fields that exist only in debug builds otherwise).

- The allocation hook wraps the CPU allocator that `c10::GetCPUAllocator()` returns
  (`c10::SetCPUAllocator`) and records per allocation what capture's `alloc` needs that the
  allocator can know (address, size) plus the call site as capture finds it (the innermost Python
  frame whose file is not torch's or hazsan's, a flag cached per file name, the text
  `file:line:function` made the first time a code location is seen, while its frame is alive, and
  each record keeping only the site's index), and per
  free the address, into a preallocated buffer under a mutex. The DataPtrs it hands out have the
  inner allocator's shape (context == data, one deleter: its own, which records the free and calls
  the inner one), so torch's raw_allocate / raw_deallocate keep working and nothing is made per
  allocation.
- The op observer (`native-full`) is a RecordFunction global callback, as Kineto's: per outermost
  op (what the dispatch mode sees, not the ops it runs inside) its name, the ranges of its tensor
  inputs (reads) and outputs (writes), and its call site.

What it leaves out of capture: the dtype and shape (the allocator sees bytes), symmetric scopes
and pools, the trace writer; so its figures are floors for that design, not measurements of a
built recorder.

Each variant runs the tiny-op loop of op_instructions.py (a 16-element add, a new storage each)
under callgrind with 0 and --ops ops; the difference per op. Variants: bare, the no-op
TorchDispatchMode, HAZSAN=1 at alloc and at full (capture as it is), the probe with its records
read back into Python objects at the end (`native`), read back as one bytes object of packed
records with a list of the distinct sites (`native-packed`: what a native trace writer would hand
over; the check decodes them again, inside the count), the probe's hook alone (`native-hook`: the
records left in the buffer, only counted), and the hook with the op observer, both read back
packed (`native-full`). The native variants check that they recorded each op's output (64 bytes)
with the loop's own line as its site, a free per op, and (`native-full`) one `aten::add` launch
per op reading and writing its ranges at that line. The hook sees every allocation of the CPU
allocator, three per op here (the output, the 1.0 made a tensor, a 4-byte scratch), where the
dispatch mode sees one storage per op.

    .venv/bin/python benchmarks/native_alloc_probe.py                 # builds, then 16 callgrind runs
    .venv/bin/python benchmarks/native_alloc_probe.py --variants bare full native-full --ops 2000

Needs valgrind, a C++ compiler and ninja (the extension build).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from op_instructions import LOOP, VARIANTS, instructions  # noqa: E402

#: op_instructions.py's loop with what import left frozen out of the collector's reach: a full
#: collection walks every object of the process (about 170k after `import torch`, 50-60M
#: instructions), and whether one falls inside the 4,000 ops or not moved the per-op figures by
#: 10k either way between batches; frozen, a collection walks what the loop itself keeps.
FROZEN_LOOP = LOOP.replace("a = torch.ones(16)", "import gc; gc.collect(); gc.freeze()\na = torch.ones(16)")
assert FROZEN_LOOP != LOOP

SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <ATen/record_function.h>
#include <Python.h>
#include <frameobject.h>
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
// CPython 3.11's frame stack, read from the allocating thread itself (see site()).
#define Py_BUILD_CORE
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#define HAZSAN_FRAMES_311 1
#endif
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

constexpr uint64_t NO_SITE = UINT64_MAX;

struct Record {
  uint64_t addr;
  uint64_t size;
  uint64_t freed;     // 1: a free (an allocation may be of 0 bytes)
  uint64_t site;      // index into site_texts, NO_SITE: no Python frame outside torch and hazsan
};

std::mutex mu;
std::vector<Record> records;
// file name (the code object's co_filename str) -> is it torch's or hazsan's (skipped when
// finding the site)
std::unordered_map<PyObject*, bool> internal;

// Call sites are resolved to their text the first time they are seen, while the frame that shows
// them is alive: a record keeps only the site's index, never a code object, which may be freed
// before the records are read (SGLang's start-up frees code objects by the thousand; reading them
// at drain time crashed it). Key: what identifies a code location without a reference; a freed
// code object whose address comes back for another one with the same file, name, first line and
// instruction offset is the same location as far as a site says.
struct SiteKey {
  const void* code; const void* file; const void* name; int firstlineno; int lasti;
  bool operator==(const SiteKey& o) const {
    return code == o.code && file == o.file && name == o.name && firstlineno == o.firstlineno && lasti == o.lasti;
  }
};
struct SiteKeyHash {
  size_t operator()(const SiteKey& k) const {
    return std::hash<const void*>()(k.code) ^ (std::hash<int>()(k.lasti) << 1) ^ (std::hash<int>()(k.firstlineno) << 7);
  }
};
std::unordered_map<SiteKey, uint64_t, SiteKeyHash> site_index;
std::vector<std::string> site_texts;     // append-only: an index stays valid
size_t texts_handed = 0;                 // site_texts handed to Python by the drains so far

std::string ascii(PyObject* s) {
  if (s && PyUnicode_Check(s) && PyUnicode_IS_COMPACT_ASCII(s))
    return std::string(static_cast<const char*>(PyUnicode_DATA(s)), PyUnicode_GET_LENGTH(s));
  return "?";   // not read without the GIL (a non-ASCII str's UTF-8 form may have to be made)
}

// The site index of (code, lasti), its text made now if new (called under `mu`, the frame alive).
uint64_t site_of(PyCodeObject* code, int lasti) {
  SiteKey key{code, code->co_filename, code->co_name, code->co_firstlineno, lasti};
  auto it = site_index.find(key);
  if (it != site_index.end()) return it->second;
  int line = PyCode_Addr2Line(code, lasti);   // reads the code's line table, makes no object
  site_texts.push_back(ascii(code->co_filename) + ":" + std::to_string(line) + ":" + ascii(code->co_name));
  return site_index.emplace(key, site_texts.size() - 1).first->second;
}

// The sites made since the last drain (`mu` held); made into str objects after `mu` is let go:
// a Python object made may start a collection that frees a tensor, whose free takes `mu`.
std::vector<std::string> new_texts() {
  std::vector<std::string> out(site_texts.begin() + texts_handed, site_texts.end());
  texts_handed = site_texts.size();
  return out;
}

py::list as_list(const std::vector<std::string>& texts) {
  py::list out;
  for (const std::string& t : texts) out.append(py::str(t));
  return out;
}
c10::Allocator* inner = nullptr;
uint64_t dropped = 0;
size_t capacity = 0;

// Whether a code object is torch's or hazsan's, cached per code object. Called without the GIL
// (torch's bindings release it around every op), so nothing here may touch a reference count or
// allocate a Python object: the file name is read from the str's own ASCII data.
bool is_internal(PyCodeObject* code) {
  PyObject* file = code->co_filename;
  auto it = internal.find(file);
  if (it != internal.end()) return it->second;
  bool skip = false;
  if (file && PyUnicode_Check(file) && PyUnicode_IS_COMPACT_ASCII(file)) {
    const char* f = static_cast<const char*>(PyUnicode_DATA(file));
    skip = strstr(f, "/torch/") || strstr(f, "/sanitizer/");
  }
  // Kept without a reference (no GIL here): a str freed and its address reused by another file
  // name would keep this flag (one site misattributed; the probe accepts that).
  internal.emplace(file, skip);
  return skip;
}

// The call site: the innermost frame that is not torch's or hazsan's. The allocating thread's own
// frame stack cannot change while it is inside this call, so it is read as CPython 3.11 lays it
// out (PyGILState_GetThisThreadState: the thread's state even while it has released the GIL).
void site(Record& r) {
  r.site = NO_SITE;
#ifdef HAZSAN_FRAMES_311
  PyThreadState* ts = PyGILState_GetThisThreadState();
  if (ts == nullptr || ts->cframe == nullptr) return;   // a thread that never ran Python
  for (_PyInterpreterFrame* f = ts->cframe->current_frame; f != nullptr; f = f->previous) {
    if (_PyFrame_IsIncomplete(f)) continue;
    if (!is_internal(f->f_code)) {
      r.site = site_of(f->f_code, _PyInterpreterFrame_LASTI(f) * (int)sizeof(_Py_CODEUNIT));
      return;
    }
  }
#endif
}

void push(const Record& r) {
  std::lock_guard<std::mutex> lock(mu);
  if (records.size() >= capacity) { ++dropped; return; }
  records.push_back(r);
}

// The CPU allocator's own deleter (DefaultCPUAllocator: its raw_deleter). The recording allocator
// hands out DataPtrs shaped as the inner one does (context == data, one deleter for all), so that
// raw_allocate / raw_deallocate and is_simple_data_ptr keep working, and no object is made per
// allocation; its deleter records the free and calls the inner one.
c10::DeleterFnPtr inner_deleter = nullptr;
uint64_t passed_through = 0;   // allocations of another shape, handed out unrecorded (counted)

void free_and_record(void* data) {
  push(Record{reinterpret_cast<uint64_t>(data), 0, 1, NO_SITE});
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
    Record r{reinterpret_cast<uint64_t>(data), static_cast<uint64_t>(n), 0, NO_SITE};
    {
      std::lock_guard<std::mutex> lock(mu);
      site(r);
      if (records.size() >= capacity) ++dropped; else records.push_back(r);
    }
    return c10::DataPtr(data, data, &free_and_record, device);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_and_record; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

RecordingAllocator recording;

}  // namespace

// Idempotent: a second call (the .pth hook run again in a process that already has it) would take
// the recording allocator as its own inner one and recurse until the stack overflows (the SIGSEGV
// BSPROBE_FLOOR gave SGLang's Engine). Returns whether this call installed it.
bool install(int64_t n) {
  if (c10::GetCPUAllocator() == &recording) return false;
  capacity = static_cast<size_t>(n);
  records.reserve(capacity);
  inner = c10::GetCPUAllocator();
  inner_deleter = inner->raw_deleter();
  TORCH_CHECK(inner_deleter != nullptr, "the CPU allocator has no raw deleter: not wrapped");
  c10::SetCPUAllocator(&recording, /*priority=*/100);
  return true;
}

py::tuple drain() {
  std::vector<Record> out;
  std::vector<std::string> texts;
  {
    std::lock_guard<std::mutex> lock(mu);
    out.swap(records);
    records.reserve(capacity);
    texts = site_texts;
  }
  py::list allocs, frees;
  std::vector<py::object> text_of(texts.size());
  for (const Record& r : out) {
    if (r.freed) { frees.append(py::int_(r.addr)); continue; }
    py::object text = py::none();
    if (r.site != NO_SITE) {
      if (!text_of[r.site]) text_of[r.site] = py::str(texts[r.site]);
      text = text_of[r.site];
    }
    allocs.append(py::make_tuple(r.addr, r.size, text));
  }
  TORCH_CHECK(passed_through == 0, "allocations handed out unrecorded: ", passed_through);
  return py::make_tuple(allocs, frees, dropped);
}

// The records as one bytes object (what a native trace writer would hand to the file): 32 bytes a
// record (address, size, 1 for a free, site index), and the sites made since the last drain as
// "file:line:function" (the reader appends them to its table: indexes are into the whole table,
// as the binary trace's `V` frames are): no Python object per record.
py::tuple drain_packed() {
  std::vector<Record> out;
  std::vector<std::string> texts;
  {
    std::lock_guard<std::mutex> lock(mu);
    out.swap(records);
    records.reserve(capacity);
    texts = new_texts();
  }
  std::string packed(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(Record));
  return py::make_tuple(py::bytes(packed), as_list(texts), dropped);
}

// ---- the op observer (the `full` level's source: one `launch` per op with what it reads and writes)
// A RecordFunction global callback, as Kineto and the ExecutionTraceObserver use. Only the
// outermost op of each call is a launch (what the dispatch mode sees: aten::add, not the
// aten::to / empty_strided / copy_ it runs inside), with the ranges of its tensor inputs (reads,
// which RecordFunction hands only to the start callback) and outputs (writes, at the end), and
// its call site.
struct Launch {
  const char* name;   // the op's name, owned by the dispatcher (static)
  uint64_t site;
  uint32_t first_read, first_write;  // into `ranges`
  uint16_t n_reads, n_writes;
};
std::vector<Launch> launches;
std::vector<std::pair<uint64_t, uint64_t>> ranges;
uint64_t launches_dropped = 0;
thread_local int op_depth = 0;

struct LaunchContext final : at::ObserverContext {
  size_t index;
  explicit LaunchContext(size_t i) : index(i) {}
};

uint16_t add_ranges(const c10::IValue* values, size_t n) {
  uint16_t added = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!values[i].isTensor()) continue;
    const at::Tensor& t = values[i].toTensor();
    if (!t.defined() || !t.has_storage()) continue;
    ranges.emplace_back(reinterpret_cast<uint64_t>(t.storage().data()) + t.storage_offset() * t.itemsize(),
                        static_cast<uint64_t>(t.numel()) * t.itemsize());
    ++added;
  }
  return added;
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  if (op_depth++ > 0) return nullptr;            // inside an op already recorded
  std::lock_guard<std::mutex> lock(mu);
  if (launches.size() >= capacity) { ++launches_dropped; return nullptr; }
  Launch l{fn.name(), NO_SITE, static_cast<uint32_t>(ranges.size()), 0, 0, 0};
  Record r{0, 0, 0, NO_SITE};
  site(r);
  l.site = r.site;
  auto in = fn.inputs();
  l.n_reads = add_ranges(in.data(), in.size());
  launches.push_back(l);
  return std::make_unique<LaunchContext>(launches.size() - 1);
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  --op_depth;
  if (ctx == nullptr) return;
  std::lock_guard<std::mutex> lock(mu);
  size_t i = static_cast<LaunchContext*>(ctx)->index;
  if (i >= launches.size()) return;              // drained meanwhile
  const auto& out = fn.outputs();
  launches[i].first_write = static_cast<uint32_t>(ranges.size());
  launches[i].n_writes = add_ranges(out.data(), out.size());
}

void install_ops() {
  launches.reserve(capacity);
  ranges.reserve(capacity * 3);
  at::addGlobalCallback(at::RecordFunctionCallback(&on_op_start, &on_op_end)
                            .needsInputs(true).needsOutputs(true)
                            .scopes({at::RecordScope::FUNCTION}));
}

// The launches, packed as the records are: per launch 24 bytes (site index, reads << 32 | writes,
// name index), then its read and write ranges (16 bytes each); names and sites as lists of
// distinct strings.
py::tuple drain_launches() {
  std::vector<Launch> out;
  std::vector<std::pair<uint64_t, uint64_t>> rs;
  {
    std::lock_guard<std::mutex> lock(mu);
    out.swap(launches);
    rs.swap(ranges);
  }
  std::string packed;
  py::list names;
  std::vector<std::string> new_sites;
  {
    std::lock_guard<std::mutex> lock(mu);
    new_sites = new_texts();
  }
  py::list texts = as_list(new_sites);
  std::unordered_map<const char*, uint64_t> name_index;
  for (const Launch& l : out) {
    uint64_t at_site = l.site;
    auto nt = name_index.find(l.name);
    if (nt == name_index.end()) {
      names.append(py::str(l.name));
      nt = name_index.emplace(l.name, names.size() - 1).first;
    }
    uint64_t head[3] = {at_site, (uint64_t(l.n_reads) << 32) | l.n_writes, nt->second};
    packed.append(reinterpret_cast<const char*>(head), sizeof(head));
    if (l.n_reads) packed.append(reinterpret_cast<const char*>(&rs[l.first_read]), 16 * l.n_reads);
    if (l.n_writes) packed.append(reinterpret_cast<const char*>(&rs[l.first_write]), 16 * l.n_writes);
  }
  return py::make_tuple(py::bytes(packed), names, texts, launches_dropped);
}

int64_t pending() {
  std::lock_guard<std::mutex> lock(mu);
  return static_cast<int64_t>(records.size());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("pending", &pending);
  m.def("drain_packed", &drain_packed);
  m.def("install_ops", &install_ops);
  m.def("drain_launches", &drain_launches);
  m.def("drain", &drain);
}
"""

#: The probe's variant: the loop of op_instructions.py with the recorder installed first, then
#: the records read back and checked (one alloc and one free per op, the loop's line as site).
NATIVE_LOOP = """
import importlib.util, os, sys, torch
spec = importlib.util.spec_from_file_location("hazsan_native_probe", os.environ["HAZSAN_PROBE_SO"])
probe = importlib.util.module_from_spec(spec); spec.loader.exec_module(probe)
n = int(sys.argv[1])
probe.install(8 * n + 4096)  # 3 allocations and 3 frees per op
if os.environ.get("HAZSAN_PROBE_FULL"):
    probe.install_ops()
import gc; gc.collect(); gc.freeze()
a = torch.ones(16)
b = None
loop_line = sys._getframe().f_lineno + 2    # the line of `b = a + 1.0`: every record's expected site
for _ in range(n):
    b = a + 1.0
del b
if os.environ.get("HAZSAN_PROBE_HOOK_ONLY"):     # the hook alone: the records are not read back
    assert probe.pending() >= 2 * n, probe.pending()
    sys.exit(0)
if os.environ.get("HAZSAN_PROBE_FULL"):         # and the launches: their ranges and sites, packed
    import array, struct
    packed, texts, dropped = probe.drain_packed()
    lpacked, names, ltexts, ldropped = probe.drain_launches()
    ltexts = texts + ltexts                # one table of sites: the later drain adds to it
    assert dropped == 0 and ldropped == 0, (dropped, ldropped)
    fields = array.array("Q", packed)
    assert fields[1::4].count(64) == n + 1, fields[1::4].count(64)
    adds, at, size = 0, 0, len(lpacked)
    add = names.index("aten::add") if "aten::add" in names else -1
    while at < size:                       # walked only to check: n adds, one read of 64 bytes, one write
        site, rw, name = struct.unpack_from("<QQQ", lpacked, at)
        reads, writes = rw >> 32, rw & 0xFFFFFFFF
        if name == add and reads >= 1 and writes == 1 and ltexts[site].endswith(f":{loop_line}:<module>"):
            adds += 1
        at += 24 + 16 * (reads + writes)
    assert adds == n, (adds, names, ltexts)
    sys.exit(0)
if os.environ.get("HAZSAN_PROBE_PACKED"):       # read back as one bytes object, no object per record
    import array
    packed, texts, dropped = probe.drain_packed()
    assert dropped == 0, dropped
    # checked without an object per record (small ints only): the outputs (64 bytes: n, and
    # torch.ones' one), the loop line's allocations (3 per op), a free per op
    fields = array.array("Q", packed)
    sizes, freed, sites = fields[1::4], fields[2::4], fields[3::4]
    loop = [i for i, t in enumerate(texts) if t.endswith(f":{loop_line}:<module>")]
    assert sizes.count(64) == n + 1 and freed.count(1) >= n, (sizes.count(64), freed.count(1), texts)
    assert n == 0 or (len(loop) == 1 and sites.count(loop[0]) == 3 * n), (texts, loop)
    sys.exit(0)
allocs, frees, dropped = probe.drain()
assert dropped == 0, dropped
outputs = [x for x in allocs if x[1] == 64 and x[2] and x[2].endswith(f":{loop_line}:<module>")]  # b, 16 floats
assert len(outputs) == n and len(frees) >= n, (len(allocs), len(outputs), len(frees), allocs[:4])
if os.environ.get("HAZSAN_PROBE_SHOW"):
    print(len(allocs), "allocations,", len(frees), "frees; sites:", sorted({x[2] for x in allocs}, key=str))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=4000)
    p.add_argument("--variants", nargs="+", choices=[*VARIANTS, "native", "native-packed", "native-hook", "native-full"],
                   default=["bare", "noop", "alloc", "full", "native", "native-packed", "native-hook", "native-full"])
    p.add_argument("--build-dir", default=os.path.join(tempfile.gettempdir(), "hazsan-native-probe"))
    args = p.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    from torch.utils.cpp_extension import load_inline

    os.makedirs(args.build_dir, exist_ok=True)
    so = load_inline("hazsan_native_probe", cpp_sources=[SOURCE], extra_cflags=["-O2", "-DNDEBUG"],
                     build_directory=args.build_dir).__file__
    print(f"probe built: {so}")
    tmp = tempfile.mkdtemp(prefix="hazsan-probe-")
    scripts = {}
    for name, text in (("ops.py", FROZEN_LOOP), ("native.py", NATIVE_LOOP)):
        scripts[name] = os.path.join(tmp, name)
        with open(scripts[name], "w") as f:
            f.write(text)
    per = {}
    for v in args.variants:
        native = v.startswith("native")
        script = scripts["native.py" if native else "ops.py"]
        extra = VARIANTS.get(v, {})
        if native:
            extra = {"HAZSAN_PROBE_SO": so, **({"HAZSAN_PROBE_HOOK_ONLY": "1"} if v == "native-hook" else {}),
                     **({"HAZSAN_PROBE_PACKED": "1"} if v == "native-packed" else {}),
                     **({"HAZSAN_PROBE_FULL": "1"} if v == "native-full" else {})}
        n0 = instructions(script, 0, extra, tmp)
        n1 = instructions(script, args.ops, extra, tmp)
        per[v] = (n1 - n0) / args.ops
        print(f"{v:>6}: {per[v] / 1000:8.1f}k instructions per op", flush=True)
    if "bare" in per:
        for v in per:
            if v != "bare":
                print(f"{v} / bare: {per[v] / per['bare']:.2f}x")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
