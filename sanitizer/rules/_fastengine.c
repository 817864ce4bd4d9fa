/*
 * _fastengine: the per-rank engine of sanitizer/rules/engine.py (RankAnalyzer), in C.
 *
 * engine.py is the statement of the algorithm (DESIGN.md sections 3 and 4) and the fallback; this
 * file runs the same algorithm, step for step, on the same parsed events (orjson dicts, batched),
 * and must give identical findings, problems and counters. Every handler below mirrors the Python
 * handler of the same name, including the order in which it looks fields up, hashes values and
 * fails, so that a malformed line gets the same message. When engine.py changes, change this too.
 *
 * What is different is only the representation:
 *   - streams are interned to small ints; vector clocks are int64 arrays indexed by them;
 *   - in-flight ops sit per stream in epoch-ordered arrays (bisect on the epochs);
 *   - ops, blocks, windows and graphs are small C objects (Python-visible, so that the Python
 *     side can call describe() and read .line/.site for findings and the CollectiveMatcher);
 *   - an event dict is scanned once (PyDict_Next); its keys are mapped to field numbers through
 *     a pointer cache (orjson hands out the same key objects again and again), which gives both
 *     the field values and the unknown-field check in one pass;
 *   - raw lines (feed_lines) are mostly not parsed into dicts at all: scan_line reads the common
 *     compact form straight into the field table and leaves every other line to orjson (see
 *     "the line scanner" below);
 *   - integers are held as __int128, which holds every integer orjson produces (it turns anything
 *     outside [-2**63, 2**64) into a float) and any sum of two of them.
 * Findings are rare: they are made by calling back into Python (self._report, self._transient,
 * the matcher), so Finding and FindingSink stay what they are.
 *
 * Handlers return 0 (done), -1 (a Python exception is set) or MALFORMED (a->malformed holds the
 * message). feed_batch turns MALFORMED, KeyError, TypeError and ValueError into problems exactly as
 * RankAnalyzer.feed_batch does; anything else propagates.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#if !defined(__SIZEOF_INT128__)
#error "_fastengine needs a compiler with __int128 (GCC or Clang on a 64-bit target)"
#endif

typedef __int128 i128;
typedef unsigned __int128 u128;

#define READ 1
#define WRITE 2
#define MALFORMED (-2)

/* ------------------------------------------------------------------------------ fields, kinds */

enum {
    F_EV, F_T, F_STEP, F_SITE, F_STACK, F_OP, F_SHAPE, F_DTYPE,
    F_ADDR, F_SIZE, F_POOL, F_COMM, F_ID, F_STREAM, F_READS, F_WRITES,
    F_CID, F_SEQ, F_BUFS, F_EVENT, F_GRAPH, F_NAME, F_ENTER, F_N, F_COUNT,
    N_HANDLER_FIELDS
};
#define MAX_FIELDS 64

static const char *HANDLER_FIELD_NAMES[N_HANDLER_FIELDS] = {
    "ev", "t", "step", "site", "stack", "op", "shape", "dtype",
    "addr", "size", "pool", "comm", "id", "stream", "reads", "writes",
    "cid", "seq", "bufs", "event", "graph", "name", "enter", "n", "count",
};

enum {
    K_SEGMENT, K_SEGMENT_FREE, K_WINDOW, K_WINDOW_FREE, K_ALLOC, K_FREE, K_FREE_DONE,
    K_RECORD_STREAM, K_LAUNCH, K_COLL, K_COLL_DONE, K_RECORD, K_WAIT, K_SYNC,
    K_GRAPH_BEGIN, K_GRAPH_END, K_GRAPH_REPLAY, K_GRAPH_FREE, K_SCOPE, K_STEP,
    K_DROPPED, K_HOOK_ERROR, N_KINDS
};

static const char *KIND_NAMES[N_KINDS] = {
    "segment", "segment_free", "window", "window_free", "alloc", "free", "free_done",
    "record_stream", "launch", "coll", "coll_done", "record", "wait", "sync",
    "graph_begin", "graph_end", "graph_replay", "graph_free", "scope", "step",
    "dropped", "hook_error",
};

/* Module state, set by setup(): field numbering from the schema tables, allowed masks per kind. */
static int configured = 0;
static PyObject *field_ids = NULL;      /* name -> int */
static PyObject *field_names[MAX_FIELDS];
static int n_fields = 0;
static uint64_t kind_allowed[N_KINDS];
static PyObject *kind_ids = NULL;       /* name -> int (slow path of kind lookup) */
static PyObject *kind_strs[N_KINDS];
static PyObject *TraceErrorType = NULL;

/* kind lookup by (length, first, last, middle char) */
#define KT_SIZE 128
static int8_t kind_table[KT_SIZE];
static Py_ssize_t kind_len[N_KINDS];

static inline unsigned kind_hash(const char *s, Py_ssize_t n)
{
    return (unsigned)(n * 31 + (unsigned char)s[0] * 7 + (unsigned char)s[n - 1] * 3 + (unsigned char)s[n / 2]) & (KT_SIZE - 1);
}

/* Key objects -> field number (or -1: not a field any kind allows). Holds a reference to each
 * cached key so that its address cannot be reused by another object while cached. */
#define KC_SIZE 1024
static struct { PyObject *key; int fid; } key_cache[KC_SIZE];

static int key_field_slow(PyObject *k, size_t h)
{
    int fid = -1;
    PyObject *id = PyDict_GetItemWithError(field_ids, k);
    if (id != NULL)
        fid = (int)PyLong_AsLong(id);
    else if (PyErr_Occurred())
        PyErr_Clear();  /* an odd key; it is simply unknown */
    Py_INCREF(k);
    Py_XSETREF(key_cache[h].key, k);
    key_cache[h].fid = fid;
    return fid;
}

static inline int key_field(PyObject *k)
{
    uintptr_t p = (uintptr_t)k;
    size_t h = ((p >> 4) ^ (p >> 14)) & (KC_SIZE - 1);
    if (key_cache[h].key == k)
        return key_cache[h].fid;
    return key_field_slow(k, h);
}

static PyObject *s_report, *s_transient, *s_submit, *s_enabled, *s_addr, *s_size, *s_access;
static PyObject *s_r, *s_w, *s_rw;
static PyObject *RULE_REUSE, *RULE_FREE, *RULE_UNORDERED, *RULE_GRAPH;
static PyObject *DETAIL_GRAPH_ALLOC, *DETAIL_GRAPH_FREE;
static PyObject *KIND_LAUNCH_STR, *KIND_COLL_STR;
static PyObject *k_kind, *k_op, *k_stream, *k_line, *k_step, *k_site, *k_stack, *k_cid, *k_comm,
    *k_seq, *k_replay_of_line, *k_id, *k_addr, *k_size, *k_pool, *k_window, *k_window_offset;

/* ------------------------------------------------------------------------------ integers */

/* 0: ok; 1: outside what an __int128 holds; -1: error set. Accepts int and bool. */
static int to_i128(PyObject *o, i128 *out)
{
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (!overflow) {
        if (v == -1 && PyErr_Occurred())
            return -1;
        *out = v;
        return 0;
    }
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(o);
        if (!(u == (unsigned long long)-1 && PyErr_Occurred())) {
            *out = (i128)u;
            return 0;
        }
        PyErr_Clear();
    }
    PyObject *sixty_four = PyLong_FromLong(64);
    if (sixty_four == NULL)
        return -1;
    PyObject *hi = PyNumber_Rshift(o, sixty_four);
    Py_DECREF(sixty_four);
    if (hi == NULL)
        return -1;
    long long h = PyLong_AsLongLongAndOverflow(hi, &overflow);
    Py_DECREF(hi);
    if (overflow)
        return 1;
    if (h == -1 && PyErr_Occurred())
        return -1;
    unsigned long long l = PyLong_AsUnsignedLongLongMask(o);
    if (l == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (i128)(((u128)(unsigned long long)h << 64) | (u128)l);
    return 0;
}

static PyObject *i128_to_py(i128 v)
{
    if (v >= INT64_MIN && v <= INT64_MAX)
        return PyLong_FromLongLong((long long)v);
    if (v > 0 && v <= (i128)UINT64_MAX)
        return PyLong_FromUnsignedLongLong((unsigned long long)v);
    PyObject *h = PyLong_FromLongLong((long long)(v >> 64));
    PyObject *l = PyLong_FromUnsignedLongLong((unsigned long long)(u128)v);
    PyObject *sh = PyLong_FromLong(64);
    PyObject *out = NULL;
    if (h && l && sh) {
        PyObject *t = PyNumber_Lshift(h, sh);
        if (t) {
            out = PyNumber_Or(t, l);
            Py_DECREF(t);
        }
    }
    Py_XDECREF(h);
    Py_XDECREF(l);
    Py_XDECREF(sh);
    return out;
}

/* ------------------------------------------------------------------------------ clocks */

typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} Clock;

static inline int64_t clk_get(const Clock *c, Py_ssize_t i)
{
    return i < c->n ? c->v[i] : 0;
}

static int clk_grow(Clock *c, Py_ssize_t n)
{
    if (n <= c->n)
        return 0;
    if (n > c->cap) {
        Py_ssize_t cap = c->cap ? c->cap : 4;
        while (cap < n)
            cap *= 2;
        int64_t *v = PyMem_Realloc(c->v, (size_t)cap * sizeof(int64_t));
        if (v == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        c->v = v;
        c->cap = cap;
    }
    memset(c->v + c->n, 0, (size_t)(n - c->n) * sizeof(int64_t));
    c->n = n;
    return 0;
}

/* t = max(t, o); *changed set when t grew. */
static int clk_merge(Clock *t, const Clock *o, int *changed)
{
    for (Py_ssize_t i = 0; i < o->n; i++) {
        int64_t x = o->v[i];
        if (x > clk_get(t, i)) {
            if (i >= t->n && clk_grow(t, i + 1) < 0)
                return -1;
            t->v[i] = x;
            *changed = 1;
        }
    }
    return 0;
}

static int clk_copy(Clock *dst, const Clock *src)
{
    dst->n = 0;
    if (clk_grow(dst, src->n) < 0)
        return -1;
    if (src->n)
        memcpy(dst->v, src->v, (size_t)src->n * sizeof(int64_t));
    return 0;
}

static void clk_free(Clock *c)
{
    PyMem_Free(c->v);
    c->v = NULL;
    c->n = c->cap = 0;
}

/* A clock as a Python object: recorded events' clocks, pending frees' snapshots. */
typedef struct {
    PyObject_HEAD
    Clock c;
} ClockObj;

static void ClockObj_dealloc(ClockObj *self)
{
    clk_free(&self->c);
    PyObject_Free(self);
}

static PyTypeObject ClockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sanitizer.rules._fastengine.Clock",
    .tp_basicsize = sizeof(ClockObj),
    .tp_dealloc = (destructor)ClockObj_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A vector clock (internal).",
};

static ClockObj *clockobj_new(void)
{
    ClockObj *c = PyObject_New(ClockObj, &ClockType);
    if (c != NULL)
        memset(&c->c, 0, sizeof(Clock));
    return c;
}

/* ------------------------------------------------------------------------------ ops */

typedef struct {
    i128 lo, hi;
    int acc;
} Buf;

typedef struct Op {
    PyObject_VAR_HEAD
    char kind;            /* 0 launch, 1 coll */
    char has_clock;       /* collectives enqueued directly: clock at enqueue (for coll_done) */
    int32_t sidx;         /* interned stream, -1 until enqueued */
    int64_t epoch;
    Py_ssize_t nbufs;     /* bufs[0:nbufs]: accesses */
    Py_ssize_t nwbufs;    /* bufs[nbufs:nbufs+nwbufs]: successor mode, own-window buffers */
    Buf *bufs;            /* into inline_bufs, or the captured op's */
    long long line;
    PyObject *stream, *step, *name, *site, *stack, *cid, *comm, *seq_obj;
    i128 seq;
    Clock clock;
    struct Op *captured;  /* replays: the captured op they re-run */
    uint64_t hit_gen;
    Py_ssize_t hit_idx;
    Buf inline_bufs[];
} Op;

static PyTypeObject OpType;

static Op *op_new(Py_ssize_t n)
{
    Op *op = PyObject_NewVar(Op, &OpType, n);
    if (op == NULL)
        return NULL;
    op->kind = 0;
    op->has_clock = 0;
    op->sidx = -1;
    op->epoch = 0;
    op->nbufs = op->nwbufs = 0;
    op->bufs = op->inline_bufs;
    op->line = 0;
    op->stream = op->step = op->name = op->site = op->stack = NULL;
    op->cid = op->comm = op->seq_obj = NULL;
    op->seq = 0;
    memset(&op->clock, 0, sizeof(Clock));
    op->captured = NULL;
    op->hit_gen = 0;
    op->hit_idx = 0;
    return op;
}

static void Op_dealloc(Op *op)
{
    Py_XDECREF(op->stream);
    Py_XDECREF(op->step);
    Py_XDECREF(op->name);
    Py_XDECREF(op->site);
    Py_XDECREF(op->stack);
    Py_XDECREF(op->cid);
    Py_XDECREF(op->comm);
    Py_XDECREF(op->seq_obj);
    Py_XDECREF((PyObject *)op->captured);
    clk_free(&op->clock);
    PyObject_Free(op);
}

static inline PyObject *or_none(PyObject *o)
{
    return o ? o : Py_None;
}

static int dict_set(PyObject *d, PyObject *k, PyObject *v)
{
    return PyDict_SetItem(d, k, or_none(v));
}

static int dict_set_new(PyObject *d, PyObject *k, PyObject *v)
{
    if (v == NULL)
        return -1;
    int r = PyDict_SetItem(d, k, v);
    Py_DECREF(v);
    return r;
}

static PyObject *Op_describe(Op *op, PyObject *unused)
{
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    if (dict_set(d, k_kind, op->kind ? KIND_COLL_STR : KIND_LAUNCH_STR) < 0 ||
        dict_set(d, k_op, op->name) < 0 ||
        dict_set(d, k_stream, op->stream) < 0 ||
        dict_set_new(d, k_line, PyLong_FromLongLong(op->line)) < 0 ||
        dict_set(d, k_step, op->step) < 0 ||
        dict_set(d, k_site, op->site) < 0 ||
        dict_set(d, k_stack, op->stack) < 0)
        goto fail;
    if (op->kind == 1) {
        if (dict_set(d, k_cid, op->cid) < 0 || dict_set(d, k_comm, op->comm) < 0 ||
            dict_set(d, k_seq, op->seq_obj) < 0)
            goto fail;
    }
    if (op->captured != NULL &&
        dict_set_new(d, k_replay_of_line, PyLong_FromLongLong(op->captured->line)) < 0)
        goto fail;
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

static PyObject *get_or_none(PyObject *o)
{
    return Py_NewRef(or_none(o));
}

static PyObject *Op_get_kind(Op *op, void *c) { return Py_NewRef(op->kind ? KIND_COLL_STR : KIND_LAUNCH_STR); }
static PyObject *Op_get_name(Op *op, void *c) { return get_or_none(op->name); }
static PyObject *Op_get_stream(Op *op, void *c) { return get_or_none(op->stream); }
static PyObject *Op_get_line(Op *op, void *c) { return PyLong_FromLongLong(op->line); }
static PyObject *Op_get_step(Op *op, void *c) { return get_or_none(op->step); }
static PyObject *Op_get_site(Op *op, void *c) { return get_or_none(op->site); }
static PyObject *Op_get_stack(Op *op, void *c) { return get_or_none(op->stack); }
static PyObject *Op_get_cid(Op *op, void *c) { return get_or_none(op->cid); }
static PyObject *Op_get_comm(Op *op, void *c) { return get_or_none(op->comm); }
static PyObject *Op_get_seq(Op *op, void *c) { return get_or_none(op->seq_obj); }
static PyObject *Op_get_epoch(Op *op, void *c) { return PyLong_FromLongLong(op->epoch); }
static PyObject *Op_get_captured(Op *op, void *c) { return get_or_none((PyObject *)op->captured); }

static PyObject *bufs_list(const Buf *b, Py_ssize_t n)
{
    PyObject *l = PyList_New(n);
    if (l == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *lo = i128_to_py(b[i].lo), *hi = i128_to_py(b[i].hi);
        PyObject *t = (lo && hi) ? Py_BuildValue("(OOi)", lo, hi, b[i].acc) : NULL;
        Py_XDECREF(lo);
        Py_XDECREF(hi);
        if (t == NULL) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, i, t);
    }
    return l;
}

static PyObject *Op_get_bufs(Op *op, void *c) { return bufs_list(op->bufs, op->nbufs); }
static PyObject *Op_get_window_bufs(Op *op, void *c) { return bufs_list(op->bufs + op->nbufs, op->nwbufs); }

static PyGetSetDef Op_getset[] = {
    {"kind", (getter)Op_get_kind, NULL, NULL, NULL},
    {"name", (getter)Op_get_name, NULL, NULL, NULL},
    {"stream", (getter)Op_get_stream, NULL, NULL, NULL},
    {"line", (getter)Op_get_line, NULL, NULL, NULL},
    {"step", (getter)Op_get_step, NULL, NULL, NULL},
    {"site", (getter)Op_get_site, NULL, NULL, NULL},
    {"stack", (getter)Op_get_stack, NULL, NULL, NULL},
    {"cid", (getter)Op_get_cid, NULL, NULL, NULL},
    {"comm", (getter)Op_get_comm, NULL, NULL, NULL},
    {"seq", (getter)Op_get_seq, NULL, NULL, NULL},
    {"epoch", (getter)Op_get_epoch, NULL, NULL, NULL},
    {"captured", (getter)Op_get_captured, NULL, NULL, NULL},
    {"bufs", (getter)Op_get_bufs, NULL, "(lo, hi, access) triples", NULL},
    {"window_bufs", (getter)Op_get_window_bufs, NULL, "successor mode: own-window buffers", NULL},
    {NULL}
};

static PyMethodDef Op_methods[] = {
    {"describe", (PyCFunction)Op_describe, METH_NOARGS, "The op as a finding shows it (engine.Op.describe)."},
    {NULL}
};

static PyTypeObject OpType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sanitizer.rules._fastengine.Op",
    .tp_basicsize = sizeof(Op),
    .tp_itemsize = sizeof(Buf),
    .tp_dealloc = (destructor)Op_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Device work with declared buffers (engine.Op).",
    .tp_methods = Op_methods,
    .tp_getset = Op_getset,
};

/* A replay of a captured op: shares its buffers (a successor-mode op's window buffers become plain
 * accesses: a replay carries no new seq). */
static Op *op_replay(Op *c, PyObject *stream, long long line, PyObject *step)
{
    Op *r = op_new(0);
    if (r == NULL)
        return NULL;
    r->kind = c->kind;
    r->stream = Py_NewRef(stream);
    r->bufs = c->bufs;
    r->nbufs = c->nbufs + c->nwbufs;
    r->nwbufs = 0;
    r->line = line;
    r->step = Py_XNewRef(step);
    r->name = Py_XNewRef(c->name);
    r->site = Py_XNewRef(c->site);
    r->stack = Py_XNewRef(c->stack);
    r->cid = Py_XNewRef(c->cid);
    r->comm = Py_XNewRef(c->comm);
    r->seq_obj = Py_XNewRef(c->seq_obj);
    r->seq = c->seq;
    r->captured = (Op *)Py_NewRef((PyObject *)c);
    return r;
}

/* ------------------------------------------------------------------------------ windows */

typedef struct {
    PyObject_HEAD
    i128 addr, end;
    PyObject *comm;
    long long ordinal;
} Window;

static void Window_dealloc(Window *w)
{
    Py_XDECREF(w->comm);
    PyObject_Free(w);
}

static PyObject *Window_get_addr(Window *w, void *c) { return i128_to_py(w->addr); }
static PyObject *Window_get_end(Window *w, void *c) { return i128_to_py(w->end); }
static PyObject *Window_get_comm(Window *w, void *c) { return get_or_none(w->comm); }
static PyObject *Window_get_ordinal(Window *w, void *c) { return PyLong_FromLongLong(w->ordinal); }

static PyGetSetDef Window_getset[] = {
    {"addr", (getter)Window_get_addr, NULL, NULL, NULL},
    {"end", (getter)Window_get_end, NULL, NULL, NULL},
    {"comm", (getter)Window_get_comm, NULL, NULL, NULL},
    {"ordinal", (getter)Window_get_ordinal, NULL, NULL, NULL},
    {NULL}
};

static PyTypeObject WindowType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sanitizer.rules._fastengine.Window",
    .tp_basicsize = sizeof(Window),
    .tp_dealloc = (destructor)Window_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A symmetric window (engine.Window).",
    .tp_getset = Window_getset,
};

/* ------------------------------------------------------------------------------ blocks */

typedef struct {
    PyObject_HEAD
    PyObject *id, *stream, *pool, *step, *site, *stack, *op;
    Window *window;
    i128 addr, end;
    long long line;
    int32_t sidx;
    int32_t nrec, caprec;
    int32_t *rec;         /* record_stream streams (interned, distinct), as engine's set */
    char coll_touched;
} Block;

static PyTypeObject BlockType;

static void Block_dealloc(Block *b)
{
    Py_XDECREF(b->id);
    Py_XDECREF(b->stream);
    Py_XDECREF(b->pool);
    Py_XDECREF(b->step);
    Py_XDECREF(b->site);
    Py_XDECREF(b->stack);
    Py_XDECREF(b->op);
    Py_XDECREF((PyObject *)b->window);
    PyMem_Free(b->rec);
    PyObject_Free(b);
}

static PyObject *Block_describe(Block *b, PyObject *unused)
{
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    Window *w = b->window;
    if (dict_set(d, k_id, b->id) < 0 ||
        dict_set_new(d, k_addr, i128_to_py(b->addr)) < 0 ||
        dict_set_new(d, k_size, i128_to_py(b->end - b->addr)) < 0 ||
        dict_set(d, k_stream, b->stream) < 0 ||
        dict_set(d, k_pool, b->pool) < 0 ||
        dict_set(d, k_window, w ? w->comm : NULL) < 0 ||
        (w ? dict_set_new(d, k_window_offset, i128_to_py(b->addr - w->addr))
           : dict_set(d, k_window_offset, NULL)) < 0 ||
        dict_set(d, k_site, b->site) < 0 ||
        dict_set(d, k_stack, b->stack) < 0 ||
        dict_set(d, k_op, b->op) < 0 ||
        dict_set_new(d, k_line, PyLong_FromLongLong(b->line)) < 0 ||
        dict_set(d, k_step, b->step) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *Block_get_id(Block *b, void *c) { return get_or_none(b->id); }
static PyObject *Block_get_addr(Block *b, void *c) { return i128_to_py(b->addr); }
static PyObject *Block_get_end(Block *b, void *c) { return i128_to_py(b->end); }
static PyObject *Block_get_stream(Block *b, void *c) { return get_or_none(b->stream); }
static PyObject *Block_get_pool(Block *b, void *c) { return get_or_none(b->pool); }
static PyObject *Block_get_line(Block *b, void *c) { return PyLong_FromLongLong(b->line); }
static PyObject *Block_get_step(Block *b, void *c) { return get_or_none(b->step); }
static PyObject *Block_get_site(Block *b, void *c) { return get_or_none(b->site); }
static PyObject *Block_get_stack(Block *b, void *c) { return get_or_none(b->stack); }
static PyObject *Block_get_op(Block *b, void *c) { return get_or_none(b->op); }
static PyObject *Block_get_window(Block *b, void *c) { return get_or_none((PyObject *)b->window); }
static PyObject *Block_get_coll_touched(Block *b, void *c) { return PyBool_FromLong(b->coll_touched); }

static PyGetSetDef Block_getset[] = {
    {"id", (getter)Block_get_id, NULL, NULL, NULL},
    {"addr", (getter)Block_get_addr, NULL, NULL, NULL},
    {"end", (getter)Block_get_end, NULL, NULL, NULL},
    {"stream", (getter)Block_get_stream, NULL, NULL, NULL},
    {"pool", (getter)Block_get_pool, NULL, NULL, NULL},
    {"line", (getter)Block_get_line, NULL, NULL, NULL},
    {"step", (getter)Block_get_step, NULL, NULL, NULL},
    {"site", (getter)Block_get_site, NULL, NULL, NULL},
    {"stack", (getter)Block_get_stack, NULL, NULL, NULL},
    {"op", (getter)Block_get_op, NULL, NULL, NULL},
    {"window", (getter)Block_get_window, NULL, NULL, NULL},
    {"coll_touched", (getter)Block_get_coll_touched, NULL, NULL, NULL},
    {NULL}
};

static PyMethodDef Block_methods[] = {
    {"describe", (PyCFunction)Block_describe, METH_NOARGS, "The block as a finding shows it (engine.Block.describe)."},
    {NULL}
};

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sanitizer.rules._fastengine.Block",
    .tp_basicsize = sizeof(Block),
    .tp_dealloc = (destructor)Block_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A live allocation (engine.Block).",
    .tp_methods = Block_methods,
    .tp_getset = Block_getset,
};

/* ------------------------------------------------------------------------------ range index */

/* engine.RangeIndex: items sorted by lo (ties in insertion order); overlap queries by bisect on
 * lo - max_len, then a bounded scan. Holds a reference to each item. */
typedef struct {
    i128 lo, hi;
    PyObject *item;
} RItem;

typedef struct {
    RItem *items;
    Py_ssize_t n, cap;
    i128 max_len;
} RangeIndex;

static Py_ssize_t ri_bisect_right(const RangeIndex *ri, i128 x)
{
    Py_ssize_t lo = 0, hi = ri->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < ri->items[mid].lo)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

static int ri_add(RangeIndex *ri, i128 lo, i128 hi, PyObject *item)
{
    if (ri->n == ri->cap) {
        Py_ssize_t cap = ri->cap ? ri->cap * 2 : 16;
        RItem *items = PyMem_Realloc(ri->items, (size_t)cap * sizeof(RItem));
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        ri->items = items;
        ri->cap = cap;
    }
    Py_ssize_t i = ri_bisect_right(ri, lo);
    memmove(ri->items + i + 1, ri->items + i, (size_t)(ri->n - i) * sizeof(RItem));
    ri->items[i].lo = lo;
    ri->items[i].hi = hi;
    ri->items[i].item = Py_NewRef(item);
    ri->n++;
    if (hi - lo > ri->max_len)
        ri->max_len = hi - lo;
    return 0;
}

static void ri_remove(RangeIndex *ri, i128 lo, PyObject *item)
{
    Py_ssize_t i = ri_bisect_right(ri, lo) - 1;
    while (i >= 0 && ri->items[i].lo == lo) {
        if (ri->items[i].item == item) {
            PyObject *it = ri->items[i].item;
            memmove(ri->items + i, ri->items + i + 1, (size_t)(ri->n - i - 1) * sizeof(RItem));
            ri->n--;
            Py_DECREF(it);
            return;
        }
        i--;
    }
}

/* [*first, *end) are the candidates; the caller keeps those with hi > lo. */
static inline void ri_range(const RangeIndex *ri, i128 lo, i128 hi, Py_ssize_t *first, Py_ssize_t *end)
{
    *first = ri_bisect_right(ri, lo - ri->max_len);
    *end = ri_bisect_right(ri, hi - 1);
}

static void ri_clear(RangeIndex *ri)
{
    RItem *items = ri->items;
    Py_ssize_t n = ri->n;
    ri->items = NULL;
    ri->n = ri->cap = 0;
    ri->max_len = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(items[i].item);
    PyMem_Free(items);
}

/* ------------------------------------------------------------------------------ graphs */

typedef struct {
    PyObject_HEAD
    PyObject *id, *stream;
    long long line;
    char live;
    Op **ops;
    Py_ssize_t nops, capops;
    RangeIndex reserved;
} Graph;

static void Graph_dealloc(Graph *g)
{
    Py_XDECREF(g->id);
    Py_XDECREF(g->stream);
    ri_clear(&g->reserved);
    for (Py_ssize_t i = 0; i < g->nops; i++)
        Py_DECREF((PyObject *)g->ops[i]);
    PyMem_Free(g->ops);
    PyObject_Free(g);
}

static PyObject *Graph_get_id(Graph *g, void *c) { return get_or_none(g->id); }
static PyObject *Graph_get_stream(Graph *g, void *c) { return get_or_none(g->stream); }
static PyObject *Graph_get_line(Graph *g, void *c) { return PyLong_FromLongLong(g->line); }
static PyObject *Graph_get_live(Graph *g, void *c) { return PyBool_FromLong(g->live); }
static PyObject *Graph_get_ops(Graph *g, void *c)
{
    PyObject *l = PyList_New(g->nops);
    if (l == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < g->nops; i++)
        PyList_SET_ITEM(l, i, Py_NewRef((PyObject *)g->ops[i]));
    return l;
}

static PyGetSetDef Graph_getset[] = {
    {"id", (getter)Graph_get_id, NULL, NULL, NULL},
    {"stream", (getter)Graph_get_stream, NULL, NULL, NULL},
    {"line", (getter)Graph_get_line, NULL, NULL, NULL},
    {"live", (getter)Graph_get_live, NULL, NULL, NULL},
    {"ops", (getter)Graph_get_ops, NULL, NULL, NULL},
    {NULL}
};

static PyTypeObject GraphType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sanitizer.rules._fastengine.Graph",
    .tp_basicsize = sizeof(Graph),
    .tp_dealloc = (destructor)Graph_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A captured CUDA graph (engine.Graph).",
    .tp_getset = Graph_getset,
};

/* ------------------------------------------------------------------------------ the analyzer */

typedef struct {
    Clock clock;
    int64_t merged_version;
    /* in-flight ops on this stream, epoch order; ops[start:n] are not yet done for the host */
    Op **ops;
    int64_t *epochs;
    Py_ssize_t start, n, cap;
    char in_order;
} Stream;

typedef struct {
    Op **colls;
    Py_ssize_t n, cap;
    char monotone;
} StrictComm;

typedef struct {
    Op *op;
    i128 lo, hi;
} Hit;

/* {op: [lo, hi]} in insertion order, as engine's hits dicts; ops carry (gen, index) marks. */
typedef struct {
    Hit *h;
    Py_ssize_t n, cap;
    uint64_t gen;
} HitSet;

#define SMALL_STREAMS 256

typedef struct {
    PyObject_HEAD
    PyObject *file, *rank, *sink, *matcher;
    int strict;
    /* clocks (StreamClocks) */
    Stream *streams;
    Py_ssize_t nstreams, capstreams;
    PyObject *stream_ids;
    int32_t small_streams[SMALL_STREAMS];
    Clock host;
    int64_t host_version;
    PyObject *event_clocks;       /* event -> ClockObj */
    /* in-flight work */
    int32_t *inflight_order;      /* streams in the order they first got an op (engine's dict) */
    Py_ssize_t ninflight, capinflight;
    PyObject *strict_ids;         /* comm -> int */
    StrictComm *strict_comms;
    Py_ssize_t nstrict, capstrict;
    /* memory */
    PyObject *live;               /* id -> Block */
    RangeIndex window_blocks;     /* every live block by range (engine.live_ranges) */
    Window **windows;
    Py_ssize_t nwindows, capwindows;
    PyObject *window_ordinals;
    PyObject *pending_free;       /* id -> tuple of ClockObj */
    PyObject *colls_in_flight;    /* cid -> Op */
    /* SeenIds */
    char cids_has_range;
    i128 cids_lo, cids_hi;
    PyObject *cids_other;
    /* graphs */
    PyObject *graphs, *capturing, *live_graphs;
    PyObject *transients;
    PyObject *step;
    PyObject *steps_seen;         /* set of step numbers */
    long long line, events, unrecorded_waits;
    PyObject *unknown_kinds, *unknown_fields, *counted_drops, *hook_errors;
    PyObject *malformed;
    HitSet hs_graph, hs_hits;
    uint64_t gen;
    char busy;
} Analyzer;

static PyTypeObject AnalyzerType;

/* ---------------------------------------------------------------- hit sets */

static inline void hits_begin(Analyzer *a, HitSet *hs)
{
    hs->gen = ++a->gen;
}

static void hits_reset(HitSet *hs)
{
    Py_ssize_t n = hs->n;
    hs->n = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF((PyObject *)hs->h[i].op);
    hs->gen = 0;
}

static int hits_add(HitSet *hs, Op *op, i128 lo, i128 hi)
{
    if (op->hit_gen == hs->gen && op->hit_idx < hs->n && hs->h[op->hit_idx].op == op) {
        Hit *h = &hs->h[op->hit_idx];
        if (lo < h->lo)
            h->lo = lo;
        if (hi > h->hi)
            h->hi = hi;
        return 0;
    }
    if (hs->n == hs->cap) {
        Py_ssize_t cap = hs->cap ? hs->cap * 2 : 8;
        Hit *h = PyMem_Realloc(hs->h, (size_t)cap * sizeof(Hit));
        if (h == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        hs->h = h;
        hs->cap = cap;
    }
    op->hit_gen = hs->gen;
    op->hit_idx = hs->n;
    hs->h[hs->n].op = (Op *)Py_NewRef((PyObject *)op);
    hs->h[hs->n].lo = lo;
    hs->h[hs->n].hi = hi;
    hs->n++;
    return 0;
}

static inline int hits_contains(const HitSet *hs, const Op *op)
{
    return op != NULL && hs->n && op->hit_gen == hs->gen && op->hit_idx < hs->n && hs->h[op->hit_idx].op == op;
}

/* ---------------------------------------------------------------- malformed lines */

static int set_malformed(Analyzer *a, PyObject *msg)
{
    if (msg == NULL)
        return -1;
    Py_XSETREF(a->malformed, msg);
    return MALFORMED;
}

#define MAL(...) set_malformed(a, PyUnicode_FromFormat(__VA_ARGS__))

#define PAIR_MAX 16

typedef struct {
    PyObject *v[MAX_FIELDS];
    uint64_t present;
    PyObject *dict;
    long long line;
    int kid;
    /* a launch's reads and writes as the line scanner read them, [addr, size, addr, size, ...]:
     * when pairs_fast is set, every one of the two present is here (and not in v) */
    char pairs_fast;
    Py_ssize_t npairs[2];
    long long pairs[2][2 * PAIR_MAX];
} Ev;

static inline PyObject *ev_get(const Ev *e, int f)
{
    return ((e->present >> f) & 1) ? e->v[f] : NULL;
}

static int missing(Analyzer *a, const Ev *e, int f)
{
    return MAL("%s: missing field '%s'", KIND_NAMES[e->kid], HANDLER_FIELD_NAMES[f]);
}

static int not_int(Analyzer *a, int f, PyObject *v)
{
    return MAL("field '%s' must be an integer, got %R", HANDLER_FIELD_NAMES[f], v);
}

static int out_of_range(Analyzer *a, const char *what, PyObject *v)
{
    return MAL("%s %R is outside the integer range the native engine handles (-2**127, 2**127)", what, v);
}

#define REQ(var, f) \
    PyObject *var = ev_get(e, f); \
    if (var == NULL) return missing(a, e, f);
#define REQINT(var, f) \
    REQ(var, f) \
    if (!PyLong_CheckExact(var)) return not_int(a, f, var);

/* ---------------------------------------------------------------- streams and clocks */

static int32_t intern_slow(Analyzer *a, PyObject *obj)
{
    PyObject *idx = PyDict_GetItemWithError(a->stream_ids, obj);
    if (idx != NULL)
        return (int32_t)PyLong_AsLong(idx);
    if (PyErr_Occurred())
        return -1;
    if (a->nstreams >= INT32_MAX - 1) {
        PyErr_SetString(PyExc_OverflowError, "too many distinct streams");
        return -1;
    }
    if (a->nstreams == a->capstreams) {
        Py_ssize_t cap = a->capstreams ? a->capstreams * 2 : 8;
        Stream *s = PyMem_Realloc(a->streams, (size_t)cap * sizeof(Stream));
        if (s == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        a->streams = s;
        a->capstreams = cap;
    }
    int32_t i = (int32_t)a->nstreams;
    PyObject *pi = PyLong_FromLong(i);
    if (pi == NULL)
        return -1;
    int r = PyDict_SetItem(a->stream_ids, obj, pi);
    Py_DECREF(pi);
    if (r < 0)
        return -1;
    Stream *st = &a->streams[i];
    memset(st, 0, sizeof(Stream));
    st->merged_version = -1;
    a->nstreams++;
    return i;
}

/* The stream's index; hashes `obj` (TypeError for an unhashable one, as a dict would). */
static inline int32_t intern(Analyzer *a, PyObject *obj)
{
    if (PyLong_CheckExact(obj)) {
        int overflow;
        long v = PyLong_AsLongAndOverflow(obj, &overflow);
        if (!overflow && v >= 0 && v < SMALL_STREAMS) {
            int32_t i = a->small_streams[v];
            if (i >= 0)
                return i;
            i = intern_slow(a, obj);
            if (i >= 0)
                a->small_streams[v] = i;
            return i;
        }
    }
    return intern_slow(a, obj);
}

static int host_learns(Analyzer *a, const Clock *c)
{
    int changed = 0;
    if (clk_merge(&a->host, c, &changed) < 0)
        return -1;
    if (changed)
        a->host_version++;
    return 0;
}

/* Enqueue on stream s: VC_S = max(VC_S, VC_H); VC_S[S] += 1; returns the epoch. */
static int64_t enqueue_clock(Analyzer *a, int32_t s)
{
    Stream *st = &a->streams[s];
    if (st->merged_version != a->host_version) {
        int changed = 0;
        if (clk_merge(&st->clock, &a->host, &changed) < 0)
            return -1;
        st->merged_version = a->host_version;
    }
    if (clk_grow(&st->clock, (Py_ssize_t)s + 1) < 0)
        return -1;
    return ++st->clock.v[s];
}

/* A copy of what stream s knows now (max(VC_S, VC_H)). */
static int snapshot(Analyzer *a, int32_t s, Clock *out)
{
    int changed = 0;
    if (clk_copy(out, &a->streams[s].clock) < 0)
        return -1;
    return clk_merge(out, &a->host, &changed);
}

static inline int64_t knows(const Analyzer *a, int32_t x, int32_t of)
{
    int64_t h = clk_get(&a->host, of);
    int64_t v = clk_get(&a->streams[x].clock, of);
    return v > h ? v : h;
}

static inline int in_set(const int32_t *set, int32_t n, int32_t x)
{
    for (int32_t i = 0; i < n; i++)
        if (set[i] == x)
            return 1;
    return 0;
}

static inline Py_ssize_t bisect_epochs(const int64_t *e, int64_t x, Py_ssize_t lo, Py_ssize_t hi)
{
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < e[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* ---------------------------------------------------------------- queries (engine._not_done) */

/* Ops with a buffer overlapping [lo, hi) that conflicts with `access` and is not done for
 * stream x (DESIGN 3.1), added to hs with the overlapping range. */
static int not_done(Analyzer *a, int32_t x, i128 lo, i128 hi, int access,
                    const int32_t *prot, int32_t nprot, HitSet *hs)
{
    const Clock *vh = &a->host;
    const Clock *vx = &a->streams[x].clock;
    for (Py_ssize_t k = 0; k < a->ninflight; k++) {
        int32_t s = a->inflight_order[k];
        Stream *st = &a->streams[s];
        if (st->start == st->n)
            continue;
        int64_t known = clk_get(vx, s), h = clk_get(vh, s);
        if (h > known)
            known = h;
        if (st->epochs[st->n - 1] <= known || (nprot && in_set(prot, nprot, s)))
            continue;
        for (Py_ssize_t i = bisect_epochs(st->epochs, known, st->start, st->n); i < st->n; i++) {
            Op *op = st->ops[i];
            const Buf *b = op->bufs;
            for (Py_ssize_t j = 0; j < op->nbufs; j++) {
                if (b[j].lo < hi && lo < b[j].hi && ((b[j].acc | access) & WRITE)) {
                    if (hits_add(hs, op, lo > b[j].lo ? lo : b[j].lo, hi < b[j].hi ? hi : b[j].hi) < 0)
                        return -1;
                }
            }
        }
    }
    if (a->nstrict) {
        /* Successor mode: reuse and writes wait for a later collective (peers may still read my
         * window); a read needs the collective locally complete only (engine._not_done). */
        int write = access & WRITE;
        for (Py_ssize_t c = 0; c < a->nstrict; c++) {
            StrictComm *sc = &a->strict_comms[c];
            int have_done = 0;
            i128 done_seq = 0;
            for (Py_ssize_t i = sc->n - 1; i >= 0; i--) {
                Op *op = sc->colls[i];
                int local = knows(a, x, op->sidx) >= op->epoch;
                /* done for a write: locally complete AND a later collective done (DESIGN 3.1) */
                int not_done = write ? !(local && have_done && done_seq > op->seq) : !local;
                if (op->nwbufs && not_done && !(nprot && in_set(prot, nprot, op->sidx))) {
                    const Buf *b = op->bufs + op->nbufs;
                    for (Py_ssize_t j = 0; j < op->nwbufs; j++) {
                        if (b[j].lo < hi && lo < b[j].hi && ((b[j].acc | access) & WRITE)) {
                            if (hits_add(hs, op, lo > b[j].lo ? lo : b[j].lo, hi < b[j].hi ? hi : b[j].hi) < 0)
                                return -1;
                        }
                    }
                }
                if (local) {
                    if (!have_done || op->seq > done_seq) {
                        done_seq = op->seq;
                        have_done = 1;
                    }
                }
            }
        }
    }
    return 0;
}

/* engine._mark_coll_touched: live window blocks overlapping any of `bufs`. */
static void mark_coll_touched(Analyzer *a, const Buf *bufs, Py_ssize_t n)
{
    if (a->window_blocks.n == 0)
        return;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t q, end;
        ri_range(&a->window_blocks, bufs[i].lo, bufs[i].hi, &q, &end);
        for (; q < end; q++)
            if (a->window_blocks.items[q].hi > bufs[i].lo)
                ((Block *)a->window_blocks.items[q].item)->coll_touched = 1;
    }
}

/* Captured ops of live graphs whose buffers overlap [lo, hi) (engine._graph_hits). */
static int graph_hits(Analyzer *a, i128 lo, i128 hi, HitSet *hs)
{
    Py_ssize_t ng = PyList_GET_SIZE(a->live_graphs);
    for (Py_ssize_t gi = 0; gi < ng; gi++) {
        Graph *g = (Graph *)PyList_GET_ITEM(a->live_graphs, gi);
        Py_ssize_t i, end;
        ri_range(&g->reserved, lo, hi, &i, &end);
        for (; i < end; i++) {
            RItem *it = &g->reserved.items[i];
            if (it->hi > lo) {
                if (hits_add(hs, (Op *)it->item, lo > it->lo ? lo : it->lo, hi < it->hi ? hi : it->hi) < 0)
                    return -1;
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- reporting */

static int report(Analyzer *a, PyObject *rule, long long line, PyObject *block, Op *op,
                  i128 lo, i128 hi, PyObject *detail, Op *access_op)
{
    PyObject *pline = PyLong_FromLongLong(line);
    PyObject *plo = i128_to_py(lo), *phi = i128_to_py(hi);
    PyObject *overlap = (plo && phi) ? PyTuple_Pack(2, plo, phi) : NULL;
    PyObject *r = NULL;
    if (pline && overlap)
        r = PyObject_CallMethodObjArgs((PyObject *)a, s_report, rule, pline, or_none(block), (PyObject *)op,
                                       overlap, or_none(detail), or_none((PyObject *)access_op), NULL);
    Py_XDECREF(pline);
    Py_XDECREF(plo);
    Py_XDECREF(phi);
    Py_XDECREF(overlap);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* ---------------------------------------------------------------- retiring (engine._retire) */

static int pop_coll_in_flight(Analyzer *a, PyObject *cid)
{
    PyObject *v = PyDict_GetItemWithError(a->colls_in_flight, cid);
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return PyDict_DelItem(a->colls_in_flight, cid);
}

static int retire(Analyzer *a)
{
    const Clock *vh = &a->host;
    for (Py_ssize_t k = 0; k < a->ninflight; k++) {
        int32_t s = a->inflight_order[k];
        int64_t known = clk_get(vh, s);
        if (!known)
            continue;
        Stream *st = &a->streams[s];
        if (st->start == st->n || st->epochs[st->start] > known)
            continue;
        Py_ssize_t stop = bisect_epochs(st->epochs, known, st->start, st->n);
        Py_ssize_t first = st->start;
        st->start = stop;
        int err = 0;
        for (Py_ssize_t i = first; i < stop; i++) {
            Op *op = st->ops[i];
            st->ops[i] = NULL;
            if (!err && op->has_clock && pop_coll_in_flight(a, op->cid) < 0)
                err = 1;
            Py_DECREF((PyObject *)op);
        }
        st = &a->streams[s];
        if (st->start > 64 && st->start * 2 > st->n) {  /* compact now and then */
            Py_ssize_t keep = st->n - st->start;
            memmove(st->ops, st->ops + st->start, (size_t)keep * sizeof(Op *));
            memmove(st->epochs, st->epochs + st->start, (size_t)keep * sizeof(int64_t));
            st->n = keep;
            st->start = 0;
        }
        if (err)
            return -1;
    }
    for (Py_ssize_t c = 0; c < a->nstrict; c++) {
        StrictComm *sc = &a->strict_comms[c];
        /* engine._retire: a collective leaves once it is done for the host itself (locally
         * complete and a later one done); the others stay, in order. */
        int have_done = 0;
        i128 done_seq = 0;
        char *gone = sc->n ? PyMem_Calloc((size_t)sc->n, 1) : NULL;
        if (sc->n && gone == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        Py_ssize_t ngone = 0;
        for (Py_ssize_t i = sc->n - 1; i >= 0; i--) {
            Op *op = sc->colls[i];
            int local = clk_get(vh, op->sidx) >= op->epoch;
            if (local && have_done && done_seq > op->seq) {
                gone[i] = 1;
                ngone++;
            }
            if (local && (!have_done || op->seq > done_seq)) {
                done_seq = op->seq;
                have_done = 1;
            }
        }
        if (ngone) {
            Op **dead = PyMem_Malloc((size_t)ngone * sizeof(Op *));
            if (dead == NULL) {
                PyMem_Free(gone);
                PyErr_NoMemory();
                return -1;
            }
            Py_ssize_t w = 0, d = 0;
            for (Py_ssize_t i = 0; i < sc->n; i++) {
                if (gone[i])
                    dead[d++] = sc->colls[i];
                else
                    sc->colls[w++] = sc->colls[i];
            }
            sc->n = w;
            for (Py_ssize_t i = 0; i < d; i++)
                Py_DECREF((PyObject *)dead[i]);
            PyMem_Free(dead);
        }
        PyMem_Free(gone);
    }
    return 0;
}

/* ---------------------------------------------------------------- enqueue (engine._enqueue) */

static int inflight_append(Analyzer *a, int32_t s, Op *op)
{
    Stream *st = &a->streams[s];
    if (!st->in_order) {
        if (a->ninflight == a->capinflight) {
            Py_ssize_t cap = a->capinflight ? a->capinflight * 2 : 8;
            int32_t *o = PyMem_Realloc(a->inflight_order, (size_t)cap * sizeof(int32_t));
            if (o == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            a->inflight_order = o;
            a->capinflight = cap;
        }
        a->inflight_order[a->ninflight++] = s;
        st->in_order = 1;
    }
    if (st->n == st->cap) {
        Py_ssize_t cap = st->cap ? st->cap * 2 : 16;
        Op **ops = PyMem_Realloc(st->ops, (size_t)cap * sizeof(Op *));
        if (ops == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        st->ops = ops;
        int64_t *ep = PyMem_Realloc(st->epochs, (size_t)cap * sizeof(int64_t));
        if (ep == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        st->epochs = ep;
        st->cap = cap;
    }
    st->ops[st->n] = (Op *)Py_NewRef((PyObject *)op);
    st->epochs[st->n] = op->epoch;
    st->n++;
    return 0;
}

static int strict_append(Analyzer *a, Op *op)
{
    PyObject *idx = PyDict_GetItemWithError(a->strict_ids, op->comm);
    Py_ssize_t c;
    if (idx != NULL) {
        c = PyLong_AsSsize_t(idx);
    } else {
        if (PyErr_Occurred())
            return -1;
        if (a->nstrict == a->capstrict) {
            Py_ssize_t cap = a->capstrict ? a->capstrict * 2 : 4;
            StrictComm *s = PyMem_Realloc(a->strict_comms, (size_t)cap * sizeof(StrictComm));
            if (s == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            a->strict_comms = s;
            a->capstrict = cap;
        }
        c = a->nstrict;
        PyObject *pc = PyLong_FromSsize_t(c);
        if (pc == NULL)
            return -1;
        int r = PyDict_SetItem(a->strict_ids, op->comm, pc);
        Py_DECREF(pc);
        if (r < 0)
            return -1;
        memset(&a->strict_comms[c], 0, sizeof(StrictComm));
        a->strict_comms[c].monotone = 1;
        a->nstrict++;
    }
    StrictComm *sc = &a->strict_comms[c];
    if (sc->n && sc->colls[sc->n - 1]->seq >= op->seq)
        sc->monotone = 0;
    if (sc->n == sc->cap) {
        Py_ssize_t cap = sc->cap ? sc->cap * 2 : 16;
        Op **colls = PyMem_Realloc(sc->colls, (size_t)cap * sizeof(Op *));
        if (colls == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        sc->colls = colls;
        sc->cap = cap;
    }
    sc->colls[sc->n++] = (Op *)Py_NewRef((PyObject *)op);
    return 0;
}

static int enqueue(Analyzer *a, Op *op, long long line)
{
    if (op->sidx < 0) {
        int32_t s = intern(a, op->stream);
        if (s < 0)
            return -1;
        op->sidx = s;
    }
    int32_t s = op->sidx;
    int64_t epoch = enqueue_clock(a, s);
    if (epoch < 0)
        return -1;
    op->epoch = epoch;
    /* unordered-access: this op's accesses against everything not done for its stream. */
    HitSet *hs = &a->hs_hits;
    hits_reset(hs);
    hits_begin(a, hs);
    Py_ssize_t nall = op->nbufs + op->nwbufs;
    for (Py_ssize_t j = 0; j < nall; j++) {
        const Buf *b = &op->bufs[j];
        if (not_done(a, s, b->lo, b->hi, b->acc, NULL, 0, hs) < 0)
            goto fail;
    }
    for (Py_ssize_t i = 0; i < hs->n; i++) {
        Hit *h = &hs->h[i];
        if (report(a, RULE_UNORDERED, line, NULL, h->op, h->lo, h->hi, NULL, op) < 0)
            goto fail;
    }
    hits_reset(hs);
    if (op->nbufs && inflight_append(a, s, op) < 0)
        return -1;
    if (a->strict && op->kind == 1 && op->captured == NULL)
        return strict_append(a, op);
    return 0;
fail:
    hits_reset(hs);
    return -1;
}

/* engine._capture: into the innermost graph capturing on this stream, else the innermost one. */
static int capture(Analyzer *a, Op *op, PyObject *stream)
{
    Py_ssize_t n = PyList_GET_SIZE(a->capturing);
    Graph *graph = NULL;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        Graph *g = (Graph *)PyList_GET_ITEM(a->capturing, i);
        int eq = PyObject_RichCompareBool(g->stream, stream, Py_EQ);
        if (eq < 0)
            return -1;
        if (eq) {
            graph = g;
            break;
        }
    }
    if (graph == NULL)
        graph = (Graph *)PyList_GET_ITEM(a->capturing, n - 1);
    if (graph->nops == graph->capops) {
        Py_ssize_t cap = graph->capops ? graph->capops * 2 : 16;
        Op **ops = PyMem_Realloc(graph->ops, (size_t)cap * sizeof(Op *));
        if (ops == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        graph->ops = ops;
        graph->capops = cap;
    }
    graph->ops[graph->nops++] = (Op *)Py_NewRef((PyObject *)op);
    return 0;
}

/* dict.pop(key, None)'s lookup: CPython answers an empty dict without hashing the key, so an
 * unhashable key is not an error there (engine.py pops live, pending_free, colls_in_flight and
 * graphs). Borrowed reference, or NULL (error set or not). */
static inline PyObject *pop_lookup(PyObject *d, PyObject *key)
{
    if (PyDict_GET_SIZE(d) == 0)
        return NULL;
    return PyDict_GetItemWithError(d, key);
}

/* ---------------------------------------------------------------- memory events */

static int h_alloc(Analyzer *a, Ev *e)
{
    REQ(bid, F_ID)
    REQINT(addr_o, F_ADDR)
    REQINT(size_o, F_SIZE)
    REQ(stream, F_STREAM)
    REQ(pool, F_POOL)
    PyObject *old = PyDict_GetItemWithError(a->live, bid);
    if (old != NULL)
        return MAL("alloc of id %R, which is live (allocated at line %lld)", bid, ((Block *)old)->line);
    if (PyErr_Occurred())
        return -1;
    i128 addr, size;
    int r = to_i128(addr_o, &addr);
    if (r)
        return r < 0 ? -1 : out_of_range(a, "addr", addr_o);
    r = to_i128(size_o, &size);
    if (r)
        return r < 0 ? -1 : out_of_range(a, "size", size_o);
    if (size < 0)
        return MAL("negative size %S", size_o);
    i128 end;
    if (__builtin_add_overflow(addr, size, &end))
        return out_of_range(a, "addr + size", addr_o);
    Block *b = PyObject_New(Block, &BlockType);
    if (b == NULL)
        return -1;
    b->id = Py_NewRef(bid);
    b->stream = Py_NewRef(stream);
    b->pool = Py_NewRef(pool);
    b->step = Py_XNewRef(a->step);
    b->site = Py_XNewRef(ev_get(e, F_SITE));
    b->stack = Py_XNewRef(ev_get(e, F_STACK));
    b->op = Py_XNewRef(ev_get(e, F_OP));
    b->window = NULL;
    b->addr = addr;
    b->end = end;
    b->line = e->line;
    b->sidx = -1;
    b->nrec = b->caprec = 0;
    b->rec = NULL;
    b->coll_touched = 0;
    for (Py_ssize_t i = 0; i < a->nwindows; i++) {
        Window *w = a->windows[i];
        if (w->addr < end && addr < w->end) {
            b->window = (Window *)Py_NewRef((PyObject *)w);
            break;
        }
    }
    int rc = -1;
    HitSet *gh = &a->hs_graph, *hs = &a->hs_hits;
    hits_reset(gh);
    hits_reset(hs);
    if (PyList_GET_SIZE(a->live_graphs)) {
        hits_begin(a, gh);
        if (graph_hits(a, addr, end, gh) < 0)
            goto done;
        for (Py_ssize_t i = 0; i < gh->n; i++)
            if (report(a, RULE_GRAPH, e->line, (PyObject *)b, gh->h[i].op, gh->h[i].lo, gh->h[i].hi,
                       DETAIL_GRAPH_ALLOC, NULL) < 0)
                goto done;
    }
    int32_t s = intern(a, stream);
    if (s < 0)
        goto done;
    b->sidx = s;
    hits_begin(a, hs);
    if (not_done(a, s, addr, end, WRITE, NULL, 0, hs) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < hs->n; i++) {
        Hit *h = &hs->h[i];
        if (hits_contains(gh, h->op->captured))
            continue;
        if (report(a, RULE_REUSE, e->line, (PyObject *)b, h->op, h->lo, h->hi, NULL, NULL) < 0)
            goto done;
    }
    if (PyDict_SetItem(a->live, bid, (PyObject *)b) < 0)
        goto done;
    if (ri_add(&a->window_blocks, addr, end, (PyObject *)b) < 0)  /* every live block */
        goto done;
    rc = 0;
done:
    hits_reset(gh);
    hits_reset(hs);
    Py_DECREF((PyObject *)b);
    return rc;
}

static int h_free(Analyzer *a, Ev *e)
{
    REQ(bid, F_ID)
    PyObject *found = pop_lookup(a->live, bid);
    if (found == NULL) {
        if (PyErr_Occurred())
            return -1;
        return MAL("free of unknown or already freed id %R", bid);
    }
    Block *b = (Block *)Py_NewRef(found);
    int rc = -1;
    HitSet *gh = &a->hs_graph, *hs = &a->hs_hits;
    hits_reset(gh);
    hits_reset(hs);
    if (PyDict_DelItem(a->live, bid) < 0)
        goto done;
    if (PyList_GET_SIZE(a->live_graphs)) {
        hits_begin(a, gh);
        if (graph_hits(a, b->addr, b->end, gh) < 0)
            goto done;
        for (Py_ssize_t i = 0; i < gh->n; i++)
            if (report(a, RULE_GRAPH, e->line, (PyObject *)b, gh->h[i].op, gh->h[i].lo, gh->h[i].hi,
                       DETAIL_GRAPH_FREE, NULL) < 0)
                goto done;
    }
    hits_begin(a, hs);
    if (not_done(a, b->sidx, b->addr, b->end, WRITE, b->rec, b->nrec, hs) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < hs->n; i++) {
        Hit *h = &hs->h[i];
        if (hits_contains(gh, h->op->captured))
            continue;
        if (report(a, RULE_FREE, e->line, (PyObject *)b, h->op, h->lo, h->hi, NULL, NULL) < 0)
            goto done;
    }
    hits_reset(gh);
    hits_reset(hs);
    if (b->nrec) {
        /* Until free_done the allocator holds the block; then the host knows these streams as
         * they were now (DESIGN 3.1). */
        PyObject *snaps = PyTuple_New(b->nrec);
        if (snaps == NULL)
            goto done;
        for (int32_t i = 0; i < b->nrec; i++) {
            ClockObj *c = clockobj_new();
            if (c == NULL) {
                Py_DECREF(snaps);
                goto done;
            }
            PyTuple_SET_ITEM(snaps, i, (PyObject *)c);
            if (snapshot(a, b->rec[i], &c->c) < 0) {
                Py_DECREF(snaps);
                goto done;
            }
        }
        int r = PyDict_SetItem(a->pending_free, bid, snaps);
        Py_DECREF(snaps);
        if (r < 0)
            goto done;
    }
    ri_remove(&a->window_blocks, b->addr, (PyObject *)b);
    if (b->window != NULL) {
        if (!b->coll_touched) {
            PyObject *pline = PyLong_FromLongLong(e->line);
            if (pline == NULL)
                goto done;
            PyObject *r = PyObject_CallMethodObjArgs((PyObject *)a, s_transient, (PyObject *)b, pline, NULL);
            Py_DECREF(pline);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
        }
    }
    rc = 0;
done:
    hits_reset(gh);
    hits_reset(hs);
    Py_DECREF((PyObject *)b);
    return rc;
}

static int h_free_done(Analyzer *a, Ev *e)
{
    REQ(bid, F_ID)
    PyObject *snaps = pop_lookup(a->pending_free, bid);
    if (snaps == NULL) {
        if (PyErr_Occurred())
            return -1;
        int live = PyDict_Contains(a->live, bid);
        if (live < 0)
            return -1;
        if (live)
            return MAL("free_done of id %R, which is still live (no free yet)", bid);
        return MAL("free_done with no pending free for id %R (free_done only follows a free of a block "
                   "with record_stream streams)", bid);
    }
    Py_INCREF(snaps);
    int rc = -1;
    if (PyDict_DelItem(a->pending_free, bid) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(snaps); i++)
        if (host_learns(a, &((ClockObj *)PyTuple_GET_ITEM(snaps, i))->c) < 0)
            goto done;
    rc = retire(a);
done:
    Py_DECREF(snaps);
    return rc;
}

static int h_record_stream(Analyzer *a, Ev *e)
{
    REQ(bid, F_ID)
    REQ(stream, F_STREAM)
    PyObject *found = PyDict_GetItemWithError(a->live, bid);
    if (found == NULL) {
        if (PyErr_Occurred())
            return -1;
        return MAL("record_stream of unknown or freed id %R", bid);
    }
    Block *b = (Block *)found;
    int ne = PyObject_RichCompareBool(stream, b->stream, Py_NE);
    if (ne <= 0)
        return ne;
    int32_t s = intern(a, stream);
    if (s < 0)
        return -1;
    if (in_set(b->rec, b->nrec, s))
        return 0;
    if (b->nrec == b->caprec) {
        int32_t cap = b->caprec ? b->caprec * 2 : 2;
        int32_t *rec = PyMem_Realloc(b->rec, (size_t)cap * sizeof(int32_t));
        if (rec == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->rec = rec;
        b->caprec = cap;
    }
    b->rec[b->nrec++] = s;
    return 0;
}

static int h_window(Analyzer *a, Ev *e)
{
    REQINT(addr_o, F_ADDR)
    REQINT(size_o, F_SIZE)
    REQ(comm, F_COMM)
    PyObject *ord = PyDict_GetItemWithError(a->window_ordinals, comm);
    long long ordinal = 0;
    if (ord != NULL) {
        ordinal = PyLong_AsLongLong(ord);
        if (ordinal == -1 && PyErr_Occurred())
            return -1;
    } else if (PyErr_Occurred()) {
        return -1;
    }
    i128 addr, size, end;
    int r = to_i128(addr_o, &addr);
    if (r)
        return r < 0 ? -1 : out_of_range(a, "addr", addr_o);
    r = to_i128(size_o, &size);
    if (r)
        return r < 0 ? -1 : out_of_range(a, "size", size_o);
    if (__builtin_add_overflow(addr, size, &end))
        return out_of_range(a, "addr + size", addr_o);
    PyObject *next = PyLong_FromLongLong(ordinal + 1);
    if (next == NULL)
        return -1;
    r = PyDict_SetItem(a->window_ordinals, comm, next);
    Py_DECREF(next);
    if (r < 0)
        return -1;
    Window *w = PyObject_New(Window, &WindowType);
    if (w == NULL)
        return -1;
    w->addr = addr;
    w->end = end;
    w->comm = Py_NewRef(comm);
    w->ordinal = ordinal;
    if (a->nwindows == a->capwindows) {
        Py_ssize_t cap = a->capwindows ? a->capwindows * 2 : 4;
        Window **ws = PyMem_Realloc(a->windows, (size_t)cap * sizeof(Window *));
        if (ws == NULL) {
            Py_DECREF((PyObject *)w);
            PyErr_NoMemory();
            return -1;
        }
        a->windows = ws;
        a->capwindows = cap;
    }
    a->windows[a->nwindows++] = w;  /* the list's reference */
    /* SGLang registers a segment as a window when the scope exits, after the allocations inside
     * it: blocks already live there count as window blocks too. */
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(a->live, &pos, &k, &v)) {
        Block *b = (Block *)v;
        if (b->window == NULL && b->addr < w->end && w->addr < b->end)
            b->window = (Window *)Py_NewRef((PyObject *)w);
    }
    return 0;
}

static int h_window_free(Analyzer *a, Ev *e)
{
    REQINT(addr_o, F_ADDR)
    REQ(comm, F_COMM)
    i128 addr;
    int r = to_i128(addr_o, &addr);
    if (r < 0)
        return -1;
    if (r == 0) {
        for (Py_ssize_t i = 0; i < a->nwindows; i++) {
            Window *w = a->windows[i];
            if (w->addr != addr)
                continue;
            int eq = PyObject_RichCompareBool(w->comm, comm, Py_EQ);
            if (eq < 0)
                return -1;
            if (eq) {
                memmove(a->windows + i, a->windows + i + 1, (size_t)(a->nwindows - i - 1) * sizeof(Window *));
                a->nwindows--;
                Py_DECREF((PyObject *)w);
                return 0;
            }
        }
    }
    return MAL("window_free of unknown window addr=%S comm=%R", addr_o, comm);
}

static int h_segment(Analyzer *a, Ev *e)
{
    REQINT(addr, F_ADDR)
    REQINT(size, F_SIZE)
    REQ(pool, F_POOL)
    (void)addr; (void)size; (void)pool;
    return 0;
}

static int h_segment_free(Analyzer *a, Ev *e)
{
    REQINT(addr, F_ADDR)
    (void)addr;
    return 0;
}

/* ---------------------------------------------------------------- device work */

/* One list of [addr, size] pairs into bufs; 0 ok, 1 not such a list, 2 out of range, -1 error.
 * Mirrors `[(a, a + n, ACC) for a, n in pairs]` followed by the `type(...) is int` checks: the
 * address must be an int, the size an int or a bool (a + True is an int). */
static int parse_pairs(PyObject *pairs, int acc, Buf *out, Py_ssize_t *k)
{
    Py_ssize_t n = PyList_GET_SIZE(pairs);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(pairs, i);
        PyObject *ad, *sz;
        if (PyList_CheckExact(p) && PyList_GET_SIZE(p) == 2) {
            ad = PyList_GET_ITEM(p, 0);
            sz = PyList_GET_ITEM(p, 1);
        } else if (PyTuple_CheckExact(p) && PyTuple_GET_SIZE(p) == 2) {
            ad = PyTuple_GET_ITEM(p, 0);
            sz = PyTuple_GET_ITEM(p, 1);
        } else {
            return 1;
        }
        if (!PyLong_CheckExact(ad) || !PyLong_Check(sz))
            return 1;
        i128 lo, len, hi;
        int r = to_i128(ad, &lo);
        if (r)
            return r < 0 ? -1 : 2;
        r = to_i128(sz, &len);
        if (r)
            return r < 0 ? -1 : 2;
        if (__builtin_add_overflow(lo, len, &hi))
            return 2;
        out[*k].lo = lo;
        out[*k].hi = hi;
        out[*k].acc = acc;
        (*k)++;
    }
    return 0;
}

static int h_launch(Analyzer *a, Ev *e)
{
    REQ(stream, F_STREAM)
    PyObject *reads = NULL, *writes = NULL;
    int rt, wt;
    if (e->pairs_fast) {  /* lists of integer pairs, read by the line scanner */
        rt = ((e->present >> F_READS) & 1) && e->npairs[0] > 0;
        wt = ((e->present >> F_WRITES) & 1) && e->npairs[1] > 0;
    } else {
        reads = ev_get(e, F_READS);
        writes = ev_get(e, F_WRITES);
        rt = reads ? PyObject_IsTrue(reads) : 0;
        if (rt < 0)
            return -1;
        wt = writes ? PyObject_IsTrue(writes) : 0;
        if (wt < 0)
            return -1;
    }
    int capturing = PyList_GET_SIZE(a->capturing) > 0;
    if (!rt && !wt) {
        if (!capturing) {
            int32_t s = intern(a, stream);
            if (s < 0 || enqueue_clock(a, s) < 0)
                return -1;
        }
        return 0;
    }
    Op *op;
    Py_ssize_t k = 0;
    if (e->pairs_fast) {
        /* within int64 each (18 digits at most), so lo + size cannot overflow */
        Py_ssize_t nr = rt ? e->npairs[0] : 0, nw = wt ? e->npairs[1] : 0;
        if ((op = op_new(nr + nw)) == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < nr; i++, k++) {
            op->bufs[k].lo = e->pairs[0][2 * i];
            op->bufs[k].hi = (i128)e->pairs[0][2 * i] + e->pairs[0][2 * i + 1];
            op->bufs[k].acc = READ;
        }
        for (Py_ssize_t i = 0; i < nw; i++, k++) {
            op->bufs[k].lo = e->pairs[1][2 * i];
            op->bufs[k].hi = (i128)e->pairs[1][2 * i] + e->pairs[1][2 * i + 1];
            op->bufs[k].acc = WRITE;
        }
        goto made;
    }
    if ((rt && !PyList_CheckExact(reads)) || (wt && !PyList_CheckExact(writes)))
        goto bad;
    Py_ssize_t n = (rt ? PyList_GET_SIZE(reads) : 0) + (wt ? PyList_GET_SIZE(writes) : 0);
    op = op_new(n);
    if (op == NULL)
        return -1;
    int r = rt ? parse_pairs(reads, READ, op->bufs, &k) : 0;
    if (r == 0 && wt)
        r = parse_pairs(writes, WRITE, op->bufs, &k);
    if (r) {
        Py_DECREF((PyObject *)op);
        if (r < 0)
            return -1;
        if (r == 2)
            return MAL("'reads' and 'writes' hold an integer outside the range the native engine handles, "
                       "got %R / %R", or_none(reads), or_none(writes));
        goto bad;
    }
made:
    op->nbufs = k;
    op->kind = 0;
    op->stream = Py_NewRef(stream);
    op->line = e->line;
    op->step = Py_XNewRef(a->step);
    op->name = Py_XNewRef(ev_get(e, F_OP));
    op->site = Py_XNewRef(ev_get(e, F_SITE));
    op->stack = Py_XNewRef(ev_get(e, F_STACK));
    int rc = capturing ? capture(a, op, stream) : enqueue(a, op, e->line);
    Py_DECREF((PyObject *)op);
    return rc;
bad:
    return MAL("'reads' and 'writes' must be lists of [addr, size] integer pairs, got %R / %R",
               or_none(reads), or_none(writes));
}

/* SeenIds.add: 1 new, 0 seen before, -1 error. Kept exactly as engine.SeenIds (a run of
 * consecutive integers plus a set for the rest). */
static int cids_add(Analyzer *a, PyObject *key)
{
    if (PyLong_CheckExact(key)) {
        i128 k;
        int r = to_i128(key, &k);
        if (r < 0)
            return -1;
        if (r == 0) {
            if (a->cids_has_range && k == a->cids_hi + 1) {
                int dup = PySet_GET_SIZE(a->cids_other) ? PySet_Contains(a->cids_other, key) : 0;
                if (dup)
                    return dup < 0 ? -1 : 0;  /* seen before, out of order */
                a->cids_hi = k;
                return 1;
            }
            if (!a->cids_has_range && PySet_GET_SIZE(a->cids_other) == 0) {
                a->cids_lo = a->cids_hi = k;
                a->cids_has_range = 1;
                return 1;
            }
            if (a->cids_has_range && a->cids_lo <= k && k <= a->cids_hi)
                return 0;
        }
    }
    int in = PySet_Contains(a->cids_other, key);
    if (in < 0)
        return -1;
    if (in)
        return 0;
    if (PySet_Add(a->cids_other, key) < 0)
        return -1;
    return 1;
}

static int cids_contains(Analyzer *a, PyObject *key)
{
    if (PyLong_CheckExact(key) && a->cids_has_range) {
        i128 k;
        int r = to_i128(key, &k);
        if (r < 0)
            return -1;
        if (r == 0 && a->cids_lo <= k && k <= a->cids_hi)
            return 1;
    }
    return PySet_Contains(a->cids_other, key);
}

static int h_coll(Analyzer *a, Ev *e)
{
    REQ(cid, F_CID)
    REQ(comm, F_COMM)
    REQINT(seq_o, F_SEQ)
    REQ(name, F_OP)
    REQ(stream, F_STREAM)
    REQ(raw, F_BUFS)
    if (!PyList_CheckExact(raw))
        return MAL("field 'bufs' must be a list, got %R", raw);
    i128 seq;
    int r = to_i128(seq_o, &seq);
    if (r)
        return r < 0 ? -1 : out_of_range(a, "seq", seq_o);
    r = cids_add(a, cid);
    if (r <= 0)
        return r < 0 ? -1 : MAL("duplicate cid %R", cid);
    Py_ssize_t n = PyList_GET_SIZE(raw);
    Op *op = op_new(n);
    if (op == NULL)
        return -1;
    int rc = -1;
    Window **win = NULL;
    char *own = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(raw, i);
        PyObject *ad = NULL, *sz = NULL, *ac = NULL;
        int acc = 0;
        if (PyDict_CheckExact(b)) {
            ad = PyDict_GetItemWithError(b, s_addr);
            sz = ad ? PyDict_GetItemWithError(b, s_size) : NULL;
            ac = sz ? PyDict_GetItemWithError(b, s_access) : NULL;
            if (ac == NULL && PyErr_Occurred())
                goto done;
            if (ac != NULL && PyUnicode_CheckExact(ac)) {
                if (PyUnicode_Compare(ac, s_r) == 0)
                    acc = 1;
                else if (PyUnicode_Compare(ac, s_w) == 0)
                    acc = 2;
                else if (PyUnicode_Compare(ac, s_rw) == 0)
                    acc = 3;
                if (!acc && PyErr_Occurred())
                    goto done;
            }
        }
        if (!acc) {
            rc = MAL("each of 'bufs' needs addr, size and access r/w/rw, got %R", b);
            goto done;
        }
        if (!PyLong_CheckExact(ad) || !PyLong_CheckExact(sz)) {
            rc = MAL("buffer addr and size must be integers, got %R", b);
            goto done;
        }
        i128 lo, len, hi;
        int r1 = to_i128(ad, &lo), r2 = r1 ? r1 : to_i128(sz, &len);
        if (r1 < 0 || r2 < 0)
            goto done;
        if (r1 || r2 || __builtin_add_overflow(lo, len, &hi)) {
            rc = out_of_range(a, "buffer", b);
            goto done;
        }
        op->bufs[i].lo = lo;
        op->bufs[i].hi = hi;
        op->bufs[i].acc = acc;
    }
    op->nbufs = n;
    op->kind = 1;
    op->stream = Py_NewRef(stream);
    op->line = e->line;
    op->step = Py_XNewRef(a->step);
    op->name = Py_NewRef(name);
    op->site = Py_XNewRef(ev_get(e, F_SITE));
    op->stack = Py_XNewRef(ev_get(e, F_STACK));
    op->cid = Py_NewRef(cid);
    op->comm = Py_NewRef(comm);
    op->seq_obj = Py_NewRef(seq_o);
    op->seq = seq;
    /* A window block is a collective buffer once any buffer touches part of it (DESIGN 4). */
    mark_coll_touched(a, op->bufs, n);
    /* Window buffers: for asymmetric-offset and successor mode. */
    Py_ssize_t nown = 0;
    if (a->nwindows && n) {
        win = PyMem_Calloc((size_t)n, sizeof(Window *));
        own = PyMem_Calloc((size_t)n, 1);
        if (win == NULL || own == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            const Buf *b = &op->bufs[i];
            for (Py_ssize_t j = 0; j < a->nwindows; j++) {
                Window *w = a->windows[j];
                if (w->addr < b->hi && b->lo < w->end) {
                    win[i] = (Window *)Py_NewRef((PyObject *)w);
                    break;
                }
            }
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (win[i] == NULL)
                continue;
            int eq = PyObject_RichCompareBool(win[i]->comm, comm, Py_EQ);
            if (eq < 0)
                goto done;
            own[i] = (char)eq;
            nown += eq;
        }
    }
    PyObject *enabled = PyObject_GetAttr(a->matcher, s_enabled);
    int on = 1;
    if (enabled == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            goto done;
        PyErr_Clear();
    } else {
        on = PyObject_IsTrue(enabled);
        Py_DECREF(enabled);
        if (on < 0)
            goto done;
    }
    if (on) {
        PyObject *sig = PyTuple_New(nown);
        if (sig == NULL)
            goto done;
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < n && k < nown; i++) {
            if (!own[i])
                continue;
            const Buf *b = &op->bufs[i];
            PyObject *po = PyLong_FromLongLong(win[i]->ordinal);
            PyObject *poff = i128_to_py(b->lo - win[i]->addr);
            PyObject *psz = i128_to_py(b->hi - b->lo);
            PyObject *t = (po && poff && psz) ? PyTuple_Pack(3, po, poff, psz) : NULL;
            Py_XDECREF(po);
            Py_XDECREF(poff);
            Py_XDECREF(psz);
            if (t == NULL) {
                Py_DECREF(sig);
                goto done;
            }
            PyTuple_SET_ITEM(sig, k++, t);
        }
        PyObject *res = PyObject_CallMethodObjArgs(a->matcher, s_submit, (PyObject *)a, comm, seq_o,
                                                   (PyObject *)op, sig, NULL);
        Py_DECREF(sig);
        if (res == NULL)
            goto done;
        Py_DECREF(res);
    }
    if (a->strict && nown) {
        /* own-window buffers apart, after the others, each part in its original order */
        Buf *tmp = PyMem_Malloc((size_t)n * sizeof(Buf));
        if (tmp == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (!own[i])
                tmp[k++] = op->bufs[i];
        for (Py_ssize_t i = 0; i < n; i++)
            if (own[i])
                tmp[k++] = op->bufs[i];
        memcpy(op->bufs, tmp, (size_t)n * sizeof(Buf));
        PyMem_Free(tmp);
        op->nbufs = n - nown;
        op->nwbufs = nown;
    }
    if (PyList_GET_SIZE(a->capturing)) {
        rc = capture(a, op, stream);
        goto done;
    }
    if (enqueue(a, op, e->line) < 0)
        goto done;
    if (snapshot(a, op->sidx, &op->clock) < 0)
        goto done;
    op->has_clock = 1;
    if (PyDict_SetItem(a->colls_in_flight, cid, (PyObject *)op) < 0)
        goto done;
    rc = 0;
done:
    if (win != NULL) {
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF((PyObject *)win[i]);
        PyMem_Free(win);
    }
    PyMem_Free(own);
    Py_DECREF((PyObject *)op);
    return rc;
}

static int h_coll_done(Analyzer *a, Ev *e)
{
    REQ(cid, F_CID)
    PyObject *found = pop_lookup(a->colls_in_flight, cid);
    if (found == NULL) {
        if (PyErr_Occurred())
            return -1;
        int seen = cids_contains(a, cid);
        if (seen < 0)
            return -1;
        if (seen)
            return 0;  /* already retired (done for the host) or captured in a graph */
        return MAL("coll_done of unknown cid %R", cid);
    }
    Op *op = (Op *)Py_NewRef(found);
    int rc = -1;
    if (PyDict_DelItem(a->colls_in_flight, cid) < 0)
        goto done;
    if (host_learns(a, &op->clock) < 0)
        goto done;
    rc = retire(a);
done:
    Py_DECREF((PyObject *)op);
    return rc;
}

static int h_record(Analyzer *a, Ev *e)
{
    REQ(event, F_EVENT)
    REQ(stream, F_STREAM)
    if (PyList_GET_SIZE(a->capturing))
        return 0;
    int32_t s = intern(a, stream);
    if (s < 0)
        return -1;
    ClockObj *c = clockobj_new();
    if (c == NULL)
        return -1;
    int r = snapshot(a, s, &c->c);
    if (r == 0)
        r = PyDict_SetItem(a->event_clocks, event, (PyObject *)c);
    Py_DECREF((PyObject *)c);
    return r;
}

static int h_wait(Analyzer *a, Ev *e)
{
    REQ(event, F_EVENT)
    REQ(stream, F_STREAM)
    if (PyList_GET_SIZE(a->capturing))
        return 0;
    PyObject *c = PyDict_GetItemWithError(a->event_clocks, event);
    if (c == NULL) {
        if (PyErr_Occurred())
            return -1;
        a->unrecorded_waits++;
        return 0;
    }
    Py_INCREF(c);
    int32_t s = intern(a, stream);
    int changed = 0, r = -1;
    if (s >= 0)
        r = clk_merge(&a->streams[s].clock, &((ClockObj *)c)->c, &changed);
    Py_DECREF(c);
    return r;
}

static int h_sync(Analyzer *a, Ev *e)
{
    PyObject *stream = ev_get(e, F_STREAM), *event = ev_get(e, F_EVENT);
    if (stream != NULL && stream != Py_None) {
        int32_t s = intern(a, stream);
        if (s < 0 || host_learns(a, &a->streams[s].clock) < 0)
            return -1;
    } else if (event != NULL && event != Py_None) {
        PyObject *c = PyDict_GetItemWithError(a->event_clocks, event);
        if (c == NULL) {
            if (PyErr_Occurred())
                return -1;
            a->unrecorded_waits++;
        } else if (host_learns(a, &((ClockObj *)c)->c) < 0) {
            return -1;
        }
    } else {
        for (Py_ssize_t s = 0; s < a->nstreams; s++)
            if (host_learns(a, &a->streams[s].clock) < 0)
                return -1;
    }
    return retire(a);
}

/* ---------------------------------------------------------------- graphs */

static Py_ssize_t list_index_is(PyObject *list, PyObject *item)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++)
        if (PyList_GET_ITEM(list, i) == item)
            return i;
    return -1;
}

static int h_graph_begin(Analyzer *a, Ev *e)
{
    REQ(gid, F_GRAPH)
    REQ(stream, F_STREAM)
    int has = PyDict_Contains(a->graphs, gid);
    if (has < 0)
        return -1;
    if (has)
        return MAL("graph_begin of graph %R, which already exists", gid);
    Graph *g = PyObject_New(Graph, &GraphType);
    if (g == NULL)
        return -1;
    g->id = Py_NewRef(gid);
    g->stream = Py_NewRef(stream);
    g->line = e->line;
    g->live = 0;
    g->ops = NULL;
    g->nops = g->capops = 0;
    memset(&g->reserved, 0, sizeof(RangeIndex));
    int r = PyDict_SetItem(a->graphs, gid, (PyObject *)g);
    if (r == 0)
        r = PyList_Append(a->capturing, (PyObject *)g);
    Py_DECREF((PyObject *)g);
    return r;
}

static int h_graph_end(Analyzer *a, Ev *e)
{
    REQ(gid, F_GRAPH)
    PyObject *found = PyDict_GetItemWithError(a->graphs, gid);
    if (found == NULL && PyErr_Occurred())
        return -1;
    Py_ssize_t i = found ? list_index_is(a->capturing, found) : -1;
    if (i < 0)
        return MAL("graph_end of graph %R, which is not being captured", gid);
    Graph *g = (Graph *)found;
    Py_INCREF(found);
    int rc = -1;
    if (PyList_SetSlice(a->capturing, i, i + 1, NULL) < 0)
        goto done;
    g->live = 1;
    ri_clear(&g->reserved);
    for (Py_ssize_t k = 0; k < g->nops; k++) {
        Op *op = g->ops[k];
        for (Py_ssize_t j = 0; j < op->nbufs + op->nwbufs; j++)
            if (ri_add(&g->reserved, op->bufs[j].lo, op->bufs[j].hi, (PyObject *)op) < 0)
                goto done;
    }
    rc = PyList_Append(a->live_graphs, found);
done:
    Py_DECREF(found);
    return rc;
}

static int h_graph_replay(Analyzer *a, Ev *e)
{
    REQ(gid, F_GRAPH)
    REQ(stream, F_STREAM)
    PyObject *found = PyDict_GetItemWithError(a->graphs, gid);
    if (found == NULL && PyErr_Occurred())
        return -1;
    if (found == NULL || !((Graph *)found)->live)
        return MAL("graph_replay of graph %R, which is not a captured, live graph", gid);
    Graph *g = (Graph *)Py_NewRef(found);
    int rc = 0;
    for (Py_ssize_t k = 0; k < g->nops && rc == 0; k++) {
        Op *r = op_replay(g->ops[k], stream, e->line, a->step);
        if (r == NULL) {
            rc = -1;
            break;
        }
        if (r->kind == 1)
            mark_coll_touched(a, r->bufs, r->nbufs + r->nwbufs);
        rc = enqueue(a, r, e->line);
        Py_DECREF((PyObject *)r);
    }
    Py_DECREF((PyObject *)g);
    return rc;
}

static int h_graph_free(Analyzer *a, Ev *e)
{
    REQ(gid, F_GRAPH)
    PyObject *found = pop_lookup(a->graphs, gid);
    if (found == NULL) {
        if (PyErr_Occurred())
            return -1;
        return MAL("graph_free of unknown graph %R", gid);
    }
    Py_INCREF(found);
    int rc = -1;
    if (PyDict_DelItem(a->graphs, gid) < 0)
        goto done;
    Py_ssize_t i = list_index_is(a->capturing, found);
    if (i >= 0 && PyList_SetSlice(a->capturing, i, i + 1, NULL) < 0)
        goto done;
    i = list_index_is(a->live_graphs, found);
    if (i >= 0 && PyList_SetSlice(a->live_graphs, i, i + 1, NULL) < 0)
        goto done;
    rc = 0;
done:
    Py_DECREF(found);
    return rc;
}

/* ---------------------------------------------------------------- annotations */

static int h_scope(Analyzer *a, Ev *e)
{
    REQ(name, F_NAME)
    REQ(enter, F_ENTER)
    (void)name;
    if (!PyBool_Check(enter))
        return MAL("field 'enter' must be true or false");
    return 0;
}

static int h_step(Analyzer *a, Ev *e)
{
    REQINT(n, F_N)
    Py_XSETREF(a->step, Py_NewRef(n));
    return PySet_Add(a->steps_seen, n);
}

static int h_dropped(Analyzer *a, Ev *e)
{
    REQINT(count, F_COUNT)
    PyObject *sum = PyNumber_Add(a->counted_drops, count);
    if (sum == NULL)
        return -1;
    Py_SETREF(a->counted_drops, sum);
    return 0;
}

static int h_hook_error(Analyzer *a, Ev *e)
{
    PyObject *count = ev_get(e, F_COUNT);
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL)
        return -1;
    PyObject *sum = PyNumber_Add(a->hook_errors, (count != NULL && PyLong_CheckExact(count)) ? count : one);
    Py_DECREF(one);
    if (sum == NULL)
        return -1;
    Py_SETREF(a->hook_errors, sum);
    return 0;
}

typedef int (*handler_fn)(Analyzer *, Ev *);

static handler_fn HANDLERS[N_KINDS] = {
    h_segment, h_segment_free, h_window, h_window_free, h_alloc, h_free, h_free_done,
    h_record_stream, h_launch, h_coll, h_coll_done, h_record, h_wait, h_sync,
    h_graph_begin, h_graph_end, h_graph_replay, h_graph_free, h_scope, h_step,
    h_dropped, h_hook_error,
};

/* ---------------------------------------------------------------- dispatch (feed_batch) */

/* The kind number of an `ev` value; -1 unknown kind; -2 error set (unhashable, as dict.get). */
static int kind_of(PyObject *kind)
{
    if (PyUnicode_CheckExact(kind) && PyUnicode_IS_COMPACT_ASCII(kind)) {
        Py_ssize_t n = PyUnicode_GET_LENGTH(kind);
        if (n == 0)
            return -1;
        const char *s = (const char *)PyUnicode_DATA(kind);
        unsigned h = kind_hash(s, n);
        for (unsigned probe = 0; probe < KT_SIZE; probe++) {
            int k = kind_table[(h + probe) & (KT_SIZE - 1)];
            if (k < 0)
                return -1;
            if (kind_len[k] == n && memcmp(KIND_NAMES[k], s, (size_t)n) == 0)
                return k;
        }
        return -1;
    }
    PyObject *id = PyDict_GetItemWithError(kind_ids, kind);
    if (id != NULL)
        return (int)PyLong_AsLong(id);
    return PyErr_Occurred() ? -2 : -1;
}

static int count_key(PyObject *counts, PyObject *key)
{
    PyObject *n = PyDict_GetItemWithError(counts, key);
    if (n == NULL && PyErr_Occurred())
        return -1;
    PyObject *one = PyLong_FromLong(1);
    if (one == NULL)
        return -1;
    PyObject *next = n ? PyNumber_Add(n, one) : Py_NewRef(one);
    Py_DECREF(one);
    if (next == NULL)
        return -1;
    int r = PyDict_SetItem(counts, key, next);
    Py_DECREF(next);
    return r;
}

static int add_problem(PyObject *problems, long long line, PyObject *what)
{
    PyObject *pl = PyLong_FromLongLong(line);
    if (pl == NULL)
        return -1;
    PyObject *t = PyTuple_Pack(2, pl, what);
    Py_DECREF(pl);
    if (t == NULL)
        return -1;
    int r = PyList_Append(problems, t);
    Py_DECREF(t);
    return r;
}

static int add_problem_str(PyObject *problems, long long line, const char *what)
{
    PyObject *s = PyUnicode_FromString(what);
    if (s == NULL)
        return -1;
    int r = add_problem(problems, line, s);
    Py_DECREF(s);
    return r;
}

/* The exception a handler raised, as feed_batch words it; 1 when it was turned into a problem,
 * 0 when it is not one feed_batch catches (left set), -1 on a new error. */
static int exception_problem(PyObject *problems, long long line, int kid)
{
    PyObject *msg = NULL;
    if (PyErr_ExceptionMatches(PyExc_KeyError)) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *args = value ? PyObject_GetAttrString(value, "args") : NULL;
        PyObject *arg0 = (args && PyTuple_Check(args) && PyTuple_GET_SIZE(args)) ? PyTuple_GET_ITEM(args, 0) : Py_None;
        msg = args ? PyUnicode_FromFormat("%s: missing field %R", KIND_NAMES[kid], arg0) : NULL;
        Py_XDECREF(args);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    } else if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        msg = PyUnicode_FromFormat("%s: mistyped field (%S)", KIND_NAMES[kid], value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    } else {
        return 0;
    }
    if (msg == NULL)
        return -1;
    int r = add_problem(problems, line, msg);
    Py_DECREF(msg);
    return r < 0 ? -1 : 1;
}

static int apply_event(Analyzer *a, Ev *e, PyObject *problems);

/* One parsed line (engine.RankAnalyzer.feed_batch's loop body): 0 done (applied, or turned into a
 * problem), -1 an error that feed_batch does not catch. */
static int feed_one(Analyzer *a, PyObject *ev, long long line, PyObject *problems)
{
    if (!PyDict_CheckExact(ev)) {
        if (ev == Py_None)
            return 0;
        int is_te = PyObject_IsInstance(ev, TraceErrorType);
        if (is_te < 0)
            return -1;
        return is_te ? add_problem(problems, line, ev) : add_problem_str(problems, line, "an event must be a JSON object");
    }
    /* one pass over the dict: field values by number */
    Ev e;
    e.present = 0;
    e.pairs_fast = 0;
    e.dict = ev;
    e.line = line;
    int unknown_key = 0;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(ev, &pos, &k, &v)) {
        int f = key_field(k);
        if (f < 0) {
            unknown_key = 1;
            continue;
        }
        e.v[f] = v;
        e.present |= (uint64_t)1 << f;
    }
    PyObject *kind = ev_get(&e, F_EV);
    if (kind == NULL || kind == Py_None)
        return add_problem_str(problems, line, "missing field 'ev'");
    if (!PyUnicode_Check(kind))
        return add_problem_str(problems, line, "field 'ev' must be a string");
    int kid = kind_of(kind);
    if (kid == -2)
        return -1;
    if (kid < 0) {
        PyObject *name = PyObject_Str(kind);
        int r = name ? count_key(a->unknown_kinds, name) : -1;
        Py_XDECREF(name);
        return r;
    }
    e.kid = kid;
    if (unknown_key || (e.present & ~kind_allowed[kid])) {
        pos = 0;
        while (PyDict_Next(ev, &pos, &k, &v)) {
            int f = key_field(k);
            if ((f < 0 || !((kind_allowed[kid] >> f) & 1)) && count_key(a->unknown_fields, k) < 0)
                return -1;
        }
    }
    return apply_event(a, &e, problems);
}

/* Runs the handler of an event whose fields are known and allowed for its kind (e->kid): feed_one's
 * tail, shared with the line scanner. */
static int apply_event(Analyzer *a, Ev *e, PyObject *problems)
{
    long long line = e->line;
    int kid = e->kid;
    a->line = line;
    int r = HANDLERS[kid](a, e);
    if (r == 0) {
        a->events++;
        return 0;
    }
    if (r == MALFORMED) {
        int p = add_problem(problems, line, a->malformed);
        Py_CLEAR(a->malformed);
        return p;
    }
    return exception_problem(problems, line, kid) > 0 ? 0 : -1;
}

static int enter(Analyzer *a)
{
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "_fastengine.setup() was not called");
        return -1;
    }
    if (a->busy) {
        PyErr_SetString(PyExc_RuntimeError, "feed_batch re-entered on the same analyzer");
        return -1;
    }
    a->busy = 1;
    return 0;
}

static PyObject *an_feed_batch(Analyzer *a, PyObject *args)
{
    long long first;
    PyObject *items, *problems;
    if (!PyArg_ParseTuple(args, "LOO!:feed_batch", &first, &items, &PyList_Type, &problems))
        return NULL;
    PyObject *seq = PySequence_Fast(items, "items must be a sequence");
    if (seq == NULL)
        return NULL;
    if (enter(a) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **arr = PySequence_Fast_ITEMS(seq);
    long long line = first - 1;
    PyObject *ret = Py_None;
    for (Py_ssize_t idx = 0; idx < count; idx++) {
        PyObject *ev = arr[idx];
        Py_INCREF(ev);
        int r = feed_one(a, ev, ++line, problems);
        Py_DECREF(ev);
        if (r < 0) {
            ret = NULL;
            break;
        }
    }
    a->busy = 0;
    Py_DECREF(seq);
    return Py_XNewRef(ret);
}

/* ---------------------------------------------------------------- the line scanner */

/* Most trace lines are written by hazsan's own writer: one compact JSON object, keys from the
 * schema, ASCII strings without escapes, integers that fit 64 bits. For those, building the dict
 * that orjson would build (and a str and an int for every field) costs several times what the
 * engine spends on the event. scan_line reads such a line straight into an Ev: Python objects only
 * for the fields a handler reads (strings shared through a small cache, as orjson shares keys),
 * the other fields only checked to be valid JSON. It accepts a line only when it is certain that
 * orjson.loads would give a dict that feed_one maps to the very same Ev; everything else (escapes,
 * non-ASCII, floats, integers of 19 digits or more, whitespace other than the final newline,
 * duplicate keys, unknown keys or keys not allowed for the kind, a missing or unknown 'ev', nesting
 * deeper than SCAN_DEPTH, anything not JSON) is left to orjson and feed_one, which then produce
 * the problem, the warning or the event exactly as before. */

enum { SCAN_OK = 0, SCAN_FALLBACK = 1, SCAN_ERROR = -1 };
#define SCAN_DEPTH 32
#define STR_CACHE_SIZE 4096
#define STR_CACHE_MAX 192

static int scanner_enabled = 1;
static long long scanned_lines = 0, fallback_lines = 0;

/* Fields no handler reads (their values are checked, never built). */
#define UNREAD_FIELDS (((uint64_t)1 << F_T) | ((uint64_t)1 << F_STEP) | ((uint64_t)1 << F_SHAPE) | ((uint64_t)1 << F_DTYPE))
#define HANDLER_MASK ((((uint64_t)1) << N_HANDLER_FIELDS) - 1)
#define BUILT_FIELDS (HANDLER_MASK & ~UNREAD_FIELDS)

/* key bytes -> field number (built by setup from the same names as field_ids) */
#define FK_SIZE 256
static struct { const char *name; Py_ssize_t len; int fid; } field_keys[FK_SIZE];

static inline unsigned key_hash(const char *s, Py_ssize_t n)
{
    return n ? kind_hash(s, n) * 2654435761u >> 8 : 0;
}

static int field_keys_build(void)
{
    memset(field_keys, 0, sizeof(field_keys));
    for (int f = 0; f < n_fields; f++) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(field_names[f], &n);
        if (s == NULL)
            return -1;
        int ascii = 1;
        for (Py_ssize_t i = 0; i < n; i++)
            ascii &= (unsigned char)s[i] >= 0x20 && (unsigned char)s[i] < 0x80 && s[i] != '"' && s[i] != '\\';
        if (!ascii)
            continue;  /* never matched by the scanner: lines with it go to orjson */
        unsigned h = key_hash(s, n);
        for (unsigned probe = 0; probe < FK_SIZE; probe++) {
            unsigned slot = (h + probe) & (FK_SIZE - 1);
            if (field_keys[slot].name == NULL) {
                field_keys[slot].name = s;
                field_keys[slot].len = n;
                field_keys[slot].fid = f;
                break;
            }
        }
    }
    return 0;
}

static inline int field_of_key(const char *s, Py_ssize_t n)
{
    unsigned h = key_hash(s, n);
    for (unsigned probe = 0; probe < FK_SIZE; probe++) {
        unsigned slot = (h + probe) & (FK_SIZE - 1);
        if (field_keys[slot].name == NULL)
            return -1;
        if (field_keys[slot].len == n && memcmp(field_keys[slot].name, s, (size_t)n) == 0)
            return field_keys[slot].fid;
    }
    return -1;
}

/* Frequent strings (streams, pools, comms, sites, op names) are made once; strings are immutable,
 * so sharing one object is invisible to the engine. */
static struct { unsigned h; PyObject *s; } str_cache[STR_CACHE_SIZE];

static PyObject *ascii_str(const char *p, Py_ssize_t n)
{
    PyObject *o = PyUnicode_New(n, 127);
    if (o != NULL)
        memcpy(PyUnicode_DATA(o), p, (size_t)n);
    return o;
}

static PyObject *cached_str(const char *p, Py_ssize_t n)
{
    if (n > STR_CACHE_MAX)
        return ascii_str(p, n);
    /* eight bytes a step; the cache compares the whole string anyway, so the hash only spreads */
    uint64_t x = (uint64_t)n * 0x9E3779B97F4A7C15ull;
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        x = (x ^ w) * 0xff51afd7ed558ccdull;
        x ^= x >> 29;
    }
    for (; i < n; i++)
        x = (x ^ (unsigned char)p[i]) * 0x100000001b3ull;
    x ^= x >> 32;
    unsigned h = (unsigned)x;
    unsigned slot = (h ^ (h >> 13)) & (STR_CACHE_SIZE - 1);
    PyObject *c = str_cache[slot].s;
    if (c != NULL && str_cache[slot].h == h && PyUnicode_GET_LENGTH(c) == n && memcmp(PyUnicode_DATA(c), p, (size_t)n) == 0)
        return Py_NewRef(c);
    PyObject *o = ascii_str(p, n);
    if (o != NULL) {
        Py_XSETREF(str_cache[slot].s, Py_NewRef(o));
        str_cache[slot].h = h;
    }
    return o;
}

typedef struct {
    const char *p, *end;
} Scan;

/* A string without escapes, all printable ASCII: its bytes (between the quotes). */
static inline int scan_string(Scan *sc, const char **s, Py_ssize_t *n)
{
    const char *q = sc->p + 1, *start = q;  /* sc->p is at the opening quote */
    /* eight bytes at a time while none of them is a quote, a backslash, a control or non-ASCII byte */
    const uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
    while (sc->end - q >= 8) {
        uint64_t w;
        memcpy(&w, q, 8);
        uint64_t quote = w ^ (ones * '"'), bslash = w ^ (ones * '\\');
        uint64_t special = ((quote - ones) & ~quote) | ((bslash - ones) & ~bslash) | (w - ones * 0x20) | w;
        if (special & highs)
            break;
        q += 8;
    }
    while (q < sc->end) {
        unsigned char c = (unsigned char)*q;
        if (c == '"') {
            *s = start;
            *n = q - start;
            sc->p = q + 1;
            return SCAN_OK;
        }
        if (c < 0x20 || c >= 0x80 || c == '\\')
            return SCAN_FALLBACK;
        q++;
    }
    return SCAN_FALLBACK;
}

/* An integer of at most 18 digits (so within int64). What follows it is checked by the caller:
 * only ',', ']' or '}' is accepted there, which leaves fractions and exponents to orjson. */
static inline int scan_int(Scan *sc, long long *out)
{
    const char *q = sc->p;
    int neg = 0;
    if (*q == '-') {
        neg = 1;
        q++;
    }
    const char *d = q;
    long long v = 0;
    while (q < sc->end && *q >= '0' && *q <= '9') {
        if (q - d >= 18)
            return SCAN_FALLBACK;
        v = v * 10 + (*q - '0');
        q++;
    }
    if (q == d || (q - d > 1 && *d == '0'))
        return SCAN_FALLBACK;
    *out = neg ? -v : v;
    sc->p = q;
    return SCAN_OK;
}

static int scan_value(Scan *sc, int depth, PyObject **out);

/* After a value inside a container: ',' (1, more follows), the closing `close` (0), else fallback (-2). */
static inline int scan_next(Scan *sc, char close)
{
    if (sc->p >= sc->end)
        return -2;
    char c = *sc->p++;
    if (c == ',')
        return 1;
    return c == close ? 0 : -2;
}

/* The items are gathered first and the list made at its size (short lists are the rule: pairs,
 * shapes, a few buffers), which spares PyList_Append's resizing. */
#define ARRAY_STACK 16

static int scan_array(Scan *sc, int depth, PyObject **out)
{
    sc->p++;  /* '[' */
    PyObject *items[ARRAY_STACK];
    Py_ssize_t n = 0;
    PyObject *list = NULL;  /* made once more than ARRAY_STACK items come */
    int r = SCAN_OK;
    if (sc->p < sc->end && *sc->p == ']') {
        sc->p++;
        goto done;
    }
    for (;;) {
        PyObject *item = NULL;
        r = scan_value(sc, depth + 1, out != NULL ? &item : NULL);
        if (r != SCAN_OK)
            goto fail;
        if (item != NULL) {
            if (list == NULL && n == ARRAY_STACK) {
                if ((list = PyList_New(n)) == NULL) {
                    Py_DECREF(item);
                    r = SCAN_ERROR;
                    goto fail;
                }
                for (Py_ssize_t i = 0; i < n; i++)
                    PyList_SET_ITEM(list, i, items[i]);
                n = 0;
            }
            if (list != NULL) {
                int rc = PyList_Append(list, item);
                Py_DECREF(item);
                if (rc < 0) {
                    r = SCAN_ERROR;
                    goto fail;
                }
            } else {
                items[n++] = item;
            }
        }
        int nx = scan_next(sc, ']');
        if (nx == 0)
            break;
        if (nx < 0) {
            r = SCAN_FALLBACK;
            goto fail;
        }
    }
done:
    if (out != NULL) {
        if (list == NULL) {
            if ((list = PyList_New(n)) == NULL) {
                r = SCAN_ERROR;
                goto fail;
            }
            for (Py_ssize_t i = 0; i < n; i++)
                PyList_SET_ITEM(list, i, items[i]);
        }
        *out = list;
    }
    return SCAN_OK;
fail:
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(items[i]);
    Py_XDECREF(list);
    return r;
}

/* A nested object (a 'bufs' entry): a dict in key order, as orjson builds it; duplicate keys are
 * left to orjson. */
static int scan_object(Scan *sc, int depth, PyObject **out)
{
    sc->p++;  /* '{' */
    PyObject *d = NULL;
    if (out != NULL && (d = PyDict_New()) == NULL)
        return SCAN_ERROR;
    if (sc->p < sc->end && *sc->p == '}') {
        sc->p++;
        goto done;
    }
    for (;;) {
        const char *ks;
        Py_ssize_t kn;
        if (sc->p >= sc->end || *sc->p != '"' || scan_string(sc, &ks, &kn) != SCAN_OK ||
            sc->p >= sc->end || *sc->p != ':')
            goto fallback;
        sc->p++;
        PyObject *key = NULL, *val = NULL;
        if (d != NULL && (key = cached_str(ks, kn)) == NULL)
            goto error;
        int r = scan_value(sc, depth + 1, d != NULL ? &val : NULL);
        if (r != SCAN_OK) {
            Py_XDECREF(key);
            Py_XDECREF(d);
            return r;
        }
        if (d != NULL) {
            int dup = PyDict_Contains(d, key);
            int rc = dup ? dup : PyDict_SetItem(d, key, val);
            Py_DECREF(key);
            Py_DECREF(val);
            if (dup > 0)
                goto fallback;
            if (rc < 0)
                goto error;
        }
        int nx = scan_next(sc, '}');
        if (nx == 0)
            break;
        if (nx < 0)
            goto fallback;
    }
done:
    if (out != NULL)
        *out = d;
    return SCAN_OK;
fallback:
    Py_XDECREF(d);
    return SCAN_FALLBACK;
error:
    Py_XDECREF(d);
    return SCAN_ERROR;
}

static inline int scan_literal(Scan *sc, const char *word, size_t n, PyObject *value, PyObject **out)
{
    if ((size_t)(sc->end - sc->p) < n || memcmp(sc->p, word, n) != 0)
        return SCAN_FALLBACK;
    sc->p += n;
    if (out != NULL)
        *out = Py_NewRef(value);
    return SCAN_OK;
}

/* One JSON value: built into *out, or only checked when out is NULL. */
static int scan_value(Scan *sc, int depth, PyObject **out)
{
    if (sc->p >= sc->end || depth > SCAN_DEPTH)
        return SCAN_FALLBACK;
    switch (*sc->p) {
    case '"': {
        const char *s;
        Py_ssize_t n;
        if (scan_string(sc, &s, &n) != SCAN_OK)
            return SCAN_FALLBACK;
        if (out != NULL && (*out = cached_str(s, n)) == NULL)
            return SCAN_ERROR;
        return SCAN_OK;
    }
    case '[':
        return scan_array(sc, depth, out);
    case '{':
        return scan_object(sc, depth, out);
    case 't':
        return scan_literal(sc, "true", 4, Py_True, out);
    case 'f':
        return scan_literal(sc, "false", 5, Py_False, out);
    case 'n':
        return scan_literal(sc, "null", 4, Py_None, out);
    default: {
        long long v;
        if (scan_int(sc, &v) != SCAN_OK)
            return SCAN_FALLBACK;
        if (out != NULL && (*out = PyLong_FromLongLong(v)) == NULL)
            return SCAN_ERROR;
        return SCAN_OK;
    }
    }
}

/* A list of [int, int] pairs, at most PAIR_MAX of them, into out (addr, size, ...); SCAN_FALLBACK
 * for anything else (the caller then reads the value the general way from where it began). */
static int scan_pairs(Scan *sc, long long *out, Py_ssize_t *n)
{
    Py_ssize_t k = 0;
    sc->p++;  /* '[' */
    if (sc->p < sc->end && *sc->p == ']') {
        sc->p++;
        *n = 0;
        return SCAN_OK;
    }
    for (;;) {
        if (k == PAIR_MAX || sc->end - sc->p < 5 || *sc->p != '[')
            return SCAN_FALLBACK;
        sc->p++;
        if (scan_int(sc, &out[2 * k]) != SCAN_OK || sc->p >= sc->end || *sc->p != ',')
            return SCAN_FALLBACK;
        sc->p++;
        if (sc->p >= sc->end || scan_int(sc, &out[2 * k + 1]) != SCAN_OK || sc->p >= sc->end || *sc->p != ']')
            return SCAN_FALLBACK;
        sc->p++;
        k++;
        int nx = scan_next(sc, ']');
        if (nx == 0)
            break;
        if (nx < 0)
            return SCAN_FALLBACK;
    }
    *n = k;
    return SCAN_OK;
}

/* The kind named by the bytes of an 'ev' string; -1 when it is none of them. */
static inline int kind_of_bytes(const char *s, Py_ssize_t n)
{
    if (n == 0)
        return -1;
    unsigned h = kind_hash(s, n);
    for (unsigned probe = 0; probe < KT_SIZE; probe++) {
        int k = kind_table[(h + probe) & (KT_SIZE - 1)];
        if (k < 0)
            return -1;
        if (kind_len[k] == n && memcmp(KIND_NAMES[k], s, (size_t)n) == 0)
            return k;
    }
    return -1;
}

static void ev_release(Ev *e, uint64_t owned)
{
    while (owned) {
        int f = __builtin_ctzll(owned);
        owned &= owned - 1;
        Py_DECREF(e->v[f]);
    }
}

/* The line as an Ev (SCAN_OK: *owned says which e->v hold a reference), or SCAN_FALLBACK (nothing
 * held), or SCAN_ERROR (a Python exception, nothing held). */
static int scan_line(const char *buf, Py_ssize_t len, Ev *e, uint64_t *owned)
{
    Scan sc = {buf, buf + len};
    if (len > 0 && buf[len - 1] == '\n')
        sc.end--;
    uint64_t own = 0;
    int kid = -1, r = SCAN_FALLBACK, fast = 0;
    e->present = 0;
    if (sc.p >= sc.end || *sc.p != '{')
        return SCAN_FALLBACK;
    sc.p++;
    for (;;) {
        const char *ks;
        Py_ssize_t kn;
        if (sc.p >= sc.end || *sc.p != '"' || scan_string(&sc, &ks, &kn) != SCAN_OK ||
            sc.p >= sc.end || *sc.p != ':')
            goto out;  /* also '{}' and keys with escapes: orjson's */
        sc.p++;
        int f = field_of_key(ks, kn);
        if (f < 0 || ((e->present >> f) & 1))
            goto out;  /* unknown (a counted warning) or repeated: orjson and feed_one decide */
        uint64_t bit = (uint64_t)1 << f;
        if (f == F_EV) {
            const char *vs;
            Py_ssize_t vn;
            if (sc.p >= sc.end || *sc.p != '"' || scan_string(&sc, &vs, &vn) != SCAN_OK ||
                (kid = kind_of_bytes(vs, vn)) < 0)
                goto out;
            e->v[F_EV] = Py_NewRef(kind_strs[kid]);
            own |= bit;
        } else if ((f == F_READS || f == F_WRITES) && sc.p < sc.end && *sc.p == '[' &&
                   (r = scan_pairs(&sc, e->pairs[f == F_WRITES], &e->npairs[f == F_WRITES])) == SCAN_OK) {
            fast |= 1 << (f == F_WRITES);
        } else if (bit & BUILT_FIELDS) {
            if (f == F_READS || f == F_WRITES)
                sc.p = ks + kn + 2;  /* scan_pairs gave up: read the value from its start */
            PyObject *v = NULL;
            r = scan_value(&sc, 1, &v);
            if (r != SCAN_OK)
                goto out;
            e->v[f] = v;
            own |= bit;
        } else {
            r = scan_value(&sc, 1, NULL);
            if (r != SCAN_OK)
                goto out;
        }
        r = SCAN_FALLBACK;
        e->present |= bit;
        int nx = scan_next(&sc, '}');
        if (nx == 0)
            break;
        if (nx < 0)
            goto out;
    }
    if (sc.p != sc.end || kid < 0 || (e->present & ~kind_allowed[kid]))
        goto out;
    if (fast) {
        /* a launch whose reads and writes (those present) both came as pairs; else orjson's */
        int rw = (int)((e->present >> F_READS) & 1) | (int)(((e->present >> F_WRITES) & 1) << 1);
        if (kid != K_LAUNCH || fast != rw)
            goto out;
    }
    e->pairs_fast = fast != 0;
    e->kid = kid;
    e->dict = NULL;
    *owned = own;
    return SCAN_OK;
out:
    ev_release(e, own);
    return r;
}

/* _feed_lines(first, raws, problems, loads, decode_error, path) -> None, or the line number of a
 * last line cut short. Parses each raw line and applies it at once, so that no batch of parsed
 * events stays alive (the cyclic GC then has nothing young to walk). Same outcome as
 * TraceFile.batches() followed by feed_batch: a line that is not JSON is a TraceError problem
 * ("not JSON: ..."), a blank one is skipped, and one without its newline that does not parse ends
 * the batch (the caller records the truncation). */
static PyObject *an_feed_lines(Analyzer *a, PyObject *args)
{
    long long first;
    PyObject *raws, *problems, *loads, *decode_error, *path;
    if (!PyArg_ParseTuple(args, "LOO!OOO:_feed_lines", &first, &raws, &PyList_Type, &problems, &loads,
                          &decode_error, &path))
        return NULL;
    if (!PyList_CheckExact(raws)) {
        PyErr_SetString(PyExc_TypeError, "raws must be a list of bytes");
        return NULL;
    }
    if (enter(a) < 0)
        return NULL;
    Py_INCREF(raws);
    vectorcallfunc call = PyVectorcall_Function(loads);
    long long line = first - 1;
    PyObject *ret = Py_None;
    for (Py_ssize_t idx = 0; idx < PyList_GET_SIZE(raws); idx++) {
        PyObject *raw = PyList_GET_ITEM(raws, idx);
        line++;
        if (scanner_enabled && PyBytes_CheckExact(raw)) {
            Ev e;
            uint64_t owned;
            Py_INCREF(raw);
            int sr = scan_line(PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw), &e, &owned);
            int r = 0;
            if (sr == SCAN_OK) {
                scanned_lines++;
                e.line = line;
                r = apply_event(a, &e, problems);
                ev_release(&e, owned);
            }
            Py_DECREF(raw);
            if (sr == SCAN_ERROR || r < 0) {
                ret = NULL;
                break;
            }
            if (sr == SCAN_OK)
                continue;
            fallback_lines++;
        }
        Py_INCREF(raw);
        PyObject *argv[1] = {raw};
        PyObject *ev = call ? call(loads, argv, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)
                            : PyObject_CallOneArg(loads, raw);
        int r = 0;
        if (ev != NULL) {
            r = feed_one(a, ev, line, problems);
            Py_DECREF(ev);
        } else if (!PyErr_ExceptionMatches(decode_error)) {
            r = -1;
        } else {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            const char *bytes = PyBytes_Check(raw) ? PyBytes_AS_STRING(raw) : NULL;
            Py_ssize_t n = bytes ? PyBytes_GET_SIZE(raw) : 0;
            if (bytes == NULL) {
                PyErr_SetString(PyExc_TypeError, "raws must be a list of bytes");
                r = -1;
            } else if (n == 0 || bytes[n - 1] != '\n') {
                ret = PyLong_FromLongLong(line);  /* cut short: the batch ends here */
                if (ret == NULL)
                    r = -1;
            } else {
                int blank = 1;
                for (Py_ssize_t i = 0; i < n && blank; i++)  /* bytes.strip()'s whitespace */
                    blank = bytes[i] == ' ' || bytes[i] == '\t' || bytes[i] == '\n' || bytes[i] == '\r' ||
                            bytes[i] == '\x0b' || bytes[i] == '\x0c';
                if (!blank) {
                    PyObject *msg = PyUnicode_FromFormat("not JSON: %S", value ? value : Py_None);
                    PyObject *te = msg ? PyObject_CallFunction(TraceErrorType, "OLO", path, line, msg) : NULL;
                    r = te ? add_problem(problems, line, te) : -1;
                    Py_XDECREF(msg);
                    Py_XDECREF(te);
                }
            }
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        Py_DECREF(raw);
        if (r < 0) {
            if (ret != Py_None)
                Py_XDECREF(ret);
            ret = NULL;
            break;
        }
        if (ret != Py_None)
            break;
    }
    a->busy = 0;
    Py_DECREF(raws);
    return ret == Py_None ? Py_NewRef(Py_None) : ret;
}

/* ---------------------------------------------------------------- other methods */

static PyObject *an_block_at(Analyzer *a, PyObject *args)
{
    PyObject *plo, *phi;
    if (!PyArg_ParseTuple(args, "OO:_block_at", &plo, &phi))
        return NULL;
    i128 lo, hi;
    int r = to_i128(plo, &lo);
    if (r == 0)
        r = to_i128(phi, &hi);
    if (r) {
        if (r > 0)
            PyErr_SetString(PyExc_OverflowError, "range outside what the native engine handles");
        return NULL;
    }
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(a->live, &pos, &k, &v)) {
        Block *b = (Block *)v;
        if (b->addr < hi && lo < b->end)
            return Block_describe(b, NULL);
    }
    Py_RETURN_NONE;
}

static PyObject *an_stats(Analyzer *a, PyObject *unused)
{
    Py_ssize_t inflight = 0, stored = 0, strict = 0, reserved = 0;
    for (Py_ssize_t s = 0; s < a->nstreams; s++) {
        inflight += a->streams[s].n - a->streams[s].start;
        stored += a->streams[s].n;
    }
    for (Py_ssize_t c = 0; c < a->nstrict; c++)
        strict += a->strict_comms[c].n;
    Py_ssize_t ng = PyList_GET_SIZE(a->live_graphs);
    for (Py_ssize_t i = 0; i < ng; i++)
        reserved += ((Graph *)PyList_GET_ITEM(a->live_graphs, i))->reserved.n;
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n}",
        "streams", a->nstreams, "inflight", inflight, "inflight_stored", stored, "strict_colls", strict,
        "live", PyDict_GET_SIZE(a->live), "window_blocks", a->window_blocks.n, "windows", a->nwindows,
        "pending_free", PyDict_GET_SIZE(a->pending_free), "colls_in_flight", PyDict_GET_SIZE(a->colls_in_flight),
        "cids_other", PySet_GET_SIZE(a->cids_other), "events_recorded", PyDict_GET_SIZE(a->event_clocks),
        "graph_reserved", reserved);
}

static PyObject *an_get_step(Analyzer *a, void *c) { return get_or_none(a->step); }

static int an_set_step(Analyzer *a, PyObject *v, void *c)
{
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete step");
        return -1;
    }
    Py_XSETREF(a->step, Py_NewRef(v));
    return 0;
}

static PyObject *an_get_strict(Analyzer *a, void *c) { return PyBool_FromLong(a->strict); }

static PyObject *an_get_windows(Analyzer *a, void *c)
{
    PyObject *l = PyList_New(a->nwindows);
    if (l == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < a->nwindows; i++)
        PyList_SET_ITEM(l, i, Py_NewRef((PyObject *)a->windows[i]));
    return l;
}

static PyGetSetDef Analyzer_getset[] = {
    {"step", (getter)an_get_step, (setter)an_set_step, "the current decode step (None before the first)", NULL},
    {"strict", (getter)an_get_strict, NULL, "--peer-completion successor", NULL},
    {"windows", (getter)an_get_windows, NULL, "registered windows, in order", NULL},
    {NULL}
};

static PyMemberDef Analyzer_members[] = {
    {"file", T_OBJECT, offsetof(Analyzer, file), READONLY, NULL},
    {"rank", T_OBJECT, offsetof(Analyzer, rank), READONLY, NULL},
    {"sink", T_OBJECT, offsetof(Analyzer, sink), READONLY, NULL},
    {"matcher", T_OBJECT, offsetof(Analyzer, matcher), READONLY, NULL},
    {"live", T_OBJECT, offsetof(Analyzer, live), READONLY, NULL},
    {"pending_free", T_OBJECT, offsetof(Analyzer, pending_free), READONLY, NULL},
    {"colls_in_flight", T_OBJECT, offsetof(Analyzer, colls_in_flight), READONLY, NULL},
    {"graphs", T_OBJECT, offsetof(Analyzer, graphs), READONLY, NULL},
    {"capturing", T_OBJECT, offsetof(Analyzer, capturing), READONLY, NULL},
    {"live_graphs", T_OBJECT, offsetof(Analyzer, live_graphs), READONLY, NULL},
    {"steps_seen", T_OBJECT, offsetof(Analyzer, steps_seen), READONLY, NULL},
    {"transients", T_OBJECT, offsetof(Analyzer, transients), READONLY, NULL},
    {"unknown_kinds", T_OBJECT, offsetof(Analyzer, unknown_kinds), READONLY, NULL},
    {"unknown_fields", T_OBJECT, offsetof(Analyzer, unknown_fields), READONLY, NULL},
    {"counted_drops", T_OBJECT, offsetof(Analyzer, counted_drops), READONLY, NULL},
    {"hook_errors", T_OBJECT, offsetof(Analyzer, hook_errors), READONLY, NULL},
    {"line", T_LONGLONG, offsetof(Analyzer, line), READONLY, NULL},
    {"events", T_LONGLONG, offsetof(Analyzer, events), READONLY, NULL},
    {"unrecorded_waits", T_LONGLONG, offsetof(Analyzer, unrecorded_waits), READONLY, NULL},
    {NULL}
};

static PyMethodDef Analyzer_methods[] = {
    {"feed_batch", (PyCFunction)an_feed_batch, METH_VARARGS,
     "feed_batch(first, items, problems): apply parsed lines (engine.RankAnalyzer.feed_batch)."},
    {"_feed_lines", (PyCFunction)an_feed_lines, METH_VARARGS,
     "_feed_lines(first, raws, problems, loads, decode_error, path): parse and apply raw lines; "
     "returns the line number of a last line cut short, else None."},
    {"_block_at", (PyCFunction)an_block_at, METH_VARARGS,
     "_block_at(lo, hi): describe() of the first live block overlapping [lo, hi), or None."},
    {"_stats", (PyCFunction)an_stats, METH_NOARGS, "Sizes of the internal state (tests, memory checks)."},
    {NULL}
};

static int Analyzer_traverse(Analyzer *a, visitproc visit, void *arg)
{
    Py_VISIT(a->file);
    Py_VISIT(a->rank);
    Py_VISIT(a->sink);
    Py_VISIT(a->matcher);
    Py_VISIT(a->stream_ids);
    Py_VISIT(a->event_clocks);
    Py_VISIT(a->strict_ids);
    Py_VISIT(a->live);
    Py_VISIT(a->window_ordinals);
    Py_VISIT(a->pending_free);
    Py_VISIT(a->colls_in_flight);
    Py_VISIT(a->cids_other);
    Py_VISIT(a->graphs);
    Py_VISIT(a->capturing);
    Py_VISIT(a->live_graphs);
    Py_VISIT(a->transients);
    Py_VISIT(a->step);
    Py_VISIT(a->steps_seen);
    Py_VISIT(a->unknown_kinds);
    Py_VISIT(a->unknown_fields);
    Py_VISIT(a->counted_drops);
    Py_VISIT(a->hook_errors);
    return 0;
}

static int Analyzer_clear(Analyzer *a)
{
    Py_CLEAR(a->file);
    Py_CLEAR(a->rank);
    Py_CLEAR(a->sink);
    Py_CLEAR(a->matcher);
    Py_CLEAR(a->stream_ids);
    Py_CLEAR(a->event_clocks);
    Py_CLEAR(a->strict_ids);
    Py_CLEAR(a->live);
    Py_CLEAR(a->window_ordinals);
    Py_CLEAR(a->pending_free);
    Py_CLEAR(a->colls_in_flight);
    Py_CLEAR(a->cids_other);
    Py_CLEAR(a->graphs);
    Py_CLEAR(a->capturing);
    Py_CLEAR(a->live_graphs);
    Py_CLEAR(a->transients);
    Py_CLEAR(a->step);
    Py_CLEAR(a->steps_seen);
    Py_CLEAR(a->unknown_kinds);
    Py_CLEAR(a->unknown_fields);
    Py_CLEAR(a->counted_drops);
    Py_CLEAR(a->hook_errors);
    Py_CLEAR(a->malformed);
    return 0;
}

static void free_c_state(Analyzer *a)
{
    hits_reset(&a->hs_graph);
    hits_reset(&a->hs_hits);
    PyMem_Free(a->hs_graph.h);
    PyMem_Free(a->hs_hits.h);
    a->hs_graph.h = a->hs_hits.h = NULL;
    a->hs_graph.cap = a->hs_hits.cap = 0;
    for (Py_ssize_t s = 0; s < a->nstreams; s++) {
        Stream *st = &a->streams[s];
        for (Py_ssize_t i = st->start; i < st->n; i++)
            Py_XDECREF((PyObject *)st->ops[i]);
        PyMem_Free(st->ops);
        PyMem_Free(st->epochs);
        clk_free(&st->clock);
    }
    PyMem_Free(a->streams);
    a->streams = NULL;
    a->nstreams = a->capstreams = 0;
    clk_free(&a->host);
    PyMem_Free(a->inflight_order);
    a->inflight_order = NULL;
    a->ninflight = a->capinflight = 0;
    for (Py_ssize_t c = 0; c < a->nstrict; c++) {
        StrictComm *sc = &a->strict_comms[c];
        for (Py_ssize_t i = 0; i < sc->n; i++)
            Py_DECREF((PyObject *)sc->colls[i]);
        PyMem_Free(sc->colls);
    }
    PyMem_Free(a->strict_comms);
    a->strict_comms = NULL;
    a->nstrict = a->capstrict = 0;
    ri_clear(&a->window_blocks);
    for (Py_ssize_t i = 0; i < a->nwindows; i++)
        Py_DECREF((PyObject *)a->windows[i]);
    PyMem_Free(a->windows);
    a->windows = NULL;
    a->nwindows = a->capwindows = 0;
}

static void Analyzer_dealloc(Analyzer *a)
{
    PyObject_GC_UnTrack(a);
    Analyzer_clear(a);
    free_c_state(a);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

static PyObject *Analyzer_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    Analyzer *a = (Analyzer *)type->tp_alloc(type, 0);
    if (a == NULL)
        return NULL;
    /* tp_alloc zeroes the object; containers made here so that a half-initialised object is safe */
    for (int i = 0; i < SMALL_STREAMS; i++)
        a->small_streams[i] = -1;
    a->stream_ids = PyDict_New();
    a->event_clocks = PyDict_New();
    a->strict_ids = PyDict_New();
    a->live = PyDict_New();
    a->window_ordinals = PyDict_New();
    a->pending_free = PyDict_New();
    a->colls_in_flight = PyDict_New();
    a->cids_other = PySet_New(NULL);
    a->graphs = PyDict_New();
    a->capturing = PyList_New(0);
    a->live_graphs = PyList_New(0);
    a->transients = PyDict_New();
    a->unknown_kinds = PyDict_New();
    a->unknown_fields = PyDict_New();
    a->counted_drops = PyLong_FromLong(0);
    a->hook_errors = PyLong_FromLong(0);
    a->step = Py_NewRef(Py_None);
    a->steps_seen = PySet_New(NULL);
    a->file = Py_NewRef(Py_None);
    a->rank = PyLong_FromLong(0);
    a->sink = Py_NewRef(Py_None);
    a->matcher = Py_NewRef(Py_None);
    if (!a->stream_ids || !a->event_clocks || !a->strict_ids || !a->live || !a->window_ordinals ||
        !a->pending_free || !a->colls_in_flight || !a->cids_other || !a->graphs || !a->capturing ||
        !a->live_graphs || !a->transients || !a->unknown_kinds || !a->unknown_fields ||
        !a->counted_drops || !a->hook_errors || !a->rank || !a->steps_seen) {
        Py_DECREF(a);
        return NULL;
    }
    return (PyObject *)a;
}

static int Analyzer_init(Analyzer *a, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"file", "rank", "sink", "matcher", "strict", NULL};
    PyObject *file, *rank, *sink, *matcher;
    int strict = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|p:Analyzer", kwlist, &file, &rank, &sink, &matcher, &strict))
        return -1;
    Py_XSETREF(a->file, Py_NewRef(file));
    Py_XSETREF(a->rank, Py_NewRef(rank));
    Py_XSETREF(a->sink, Py_NewRef(sink));
    Py_XSETREF(a->matcher, Py_NewRef(matcher));
    a->strict = strict;
    return 0;
}

static PyTypeObject AnalyzerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "sanitizer.rules._fastengine.Analyzer",
    .tp_basicsize = sizeof(Analyzer),
    .tp_dealloc = (destructor)Analyzer_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Analyzer(file, rank, sink, matcher, strict=False): one rank's engine state.\n\n"
              "The subclass must provide _report(rule, line, block, op, overlap, detail, access_op)\n"
              "and _transient(block, line) (engine.RankAnalyzer's are used as they are).",
    .tp_traverse = (traverseproc)Analyzer_traverse,
    .tp_clear = (inquiry)Analyzer_clear,
    .tp_methods = Analyzer_methods,
    .tp_members = Analyzer_members,
    .tp_getset = Analyzer_getset,
    .tp_init = (initproc)Analyzer_init,
    .tp_new = Analyzer_new,
};

/* ------------------------------------------------------------------------------ module */

/* setup(allowed, trace_error, access_codes): field numbering and allowed fields per kind from the
 * schema tables (engine._ALLOWED: kind -> frozenset of field names). Refuses a schema whose kinds
 * are not exactly the ones handled here, so that a new kind cannot be silently ignored. */
static PyObject *mod_setup(PyObject *mod, PyObject *args)
{
    PyObject *allowed, *trace_error, *codes;
    if (!PyArg_ParseTuple(args, "O!OO!:setup", &PyDict_Type, &allowed, &trace_error, &PyDict_Type, &codes))
        return NULL;
    if (!PyType_Check(trace_error)) {
        PyErr_SetString(PyExc_TypeError, "trace_error must be a type");
        return NULL;
    }
    /* access codes must be the ones hard-wired in h_coll */
    const char *cn[3] = {"r", "w", "rw"};
    if (PyDict_GET_SIZE(codes) != 3) {
        PyErr_SetString(PyExc_ValueError, "ACCESS_CODES differ from what the native engine knows");
        return NULL;
    }
    for (int i = 0; i < 3; i++) {
        PyObject *v = PyDict_GetItemString(codes, cn[i]);
        if (v == NULL || !PyLong_CheckExact(v) || PyLong_AsLong(v) != i + 1) {
            PyErr_SetString(PyExc_ValueError, "ACCESS_CODES differ from what the native engine knows");
            return NULL;
        }
    }
    if (PyDict_GET_SIZE(allowed) != N_KINDS) {
        PyErr_Format(PyExc_ValueError, "the schema has %zd event kinds, the native engine handles %d",
                     PyDict_GET_SIZE(allowed), N_KINDS);
        return NULL;
    }
    PyObject *ids = PyDict_New();
    PyObject *kids = PyDict_New();
    if (ids == NULL || kids == NULL)
        goto fail;
    PyObject *names[MAX_FIELDS] = {0};
    int nf = 0;
    for (int f = 0; f < N_HANDLER_FIELDS; f++) {
        names[f] = PyUnicode_InternFromString(HANDLER_FIELD_NAMES[f]);
        PyObject *pf = PyLong_FromLong(f);
        if (names[f] == NULL || pf == NULL || PyDict_SetItem(ids, names[f], pf) < 0) {
            Py_XDECREF(pf);
            goto fail_names;
        }
        Py_DECREF(pf);
        nf++;
    }
    uint64_t masks[N_KINDS];
    for (int k = 0; k < N_KINDS; k++) {
        PyObject *fields = PyDict_GetItemString(allowed, KIND_NAMES[k]);
        if (fields == NULL || !PyAnySet_Check(fields)) {
            PyErr_Format(PyExc_ValueError, "the schema has no field set for kind %s", KIND_NAMES[k]);
            goto fail_names;
        }
        uint64_t m = 0;
        PyObject *it = PyObject_GetIter(fields);
        if (it == NULL)
            goto fail_names;
        PyObject *name;
        while ((name = PyIter_Next(it)) != NULL) {
            Py_DECREF(name);  /* the set keeps it alive */
            PyObject *id = PyDict_GetItemWithError(ids, name);
            int f;
            if (id != NULL) {
                f = (int)PyLong_AsLong(id);
            } else {
                if (PyErr_Occurred())
                    goto fail_names;
                if (nf >= MAX_FIELDS) {
                    PyErr_SetString(PyExc_ValueError, "the schema names more fields than the native engine can number");
                    goto fail_names;
                }
                f = nf;
                names[nf++] = Py_NewRef(name);
                PyObject *pf = PyLong_FromLong(f);
                if (pf == NULL || PyDict_SetItem(ids, name, pf) < 0) {
                    Py_XDECREF(pf);
                    goto fail_names;
                }
                Py_DECREF(pf);
            }
            m |= (uint64_t)1 << f;
        }
        Py_DECREF(it);
        if (PyErr_Occurred())
            goto fail_names;
        masks[k] = m;
        PyObject *pk = PyLong_FromLong(k);
        if (pk == NULL || PyDict_SetItemString(kids, KIND_NAMES[k], pk) < 0) {
            Py_XDECREF(pk);
            goto fail_names;
        }
        Py_DECREF(pk);
    }
    /* install */
    for (int i = 0; i < KC_SIZE; i++) {
        Py_CLEAR(key_cache[i].key);
        key_cache[i].fid = -1;
    }
    for (int f = 0; f < n_fields; f++)
        Py_CLEAR(field_names[f]);
    for (int f = 0; f < nf; f++)
        field_names[f] = names[f];
    n_fields = nf;
    Py_XSETREF(field_ids, ids);
    Py_XSETREF(kind_ids, kids);
    memcpy(kind_allowed, masks, sizeof(masks));
    Py_XSETREF(TraceErrorType, Py_NewRef(trace_error));
    if (field_keys_build() < 0) {
        configured = 0;
        return NULL;
    }
    configured = 1;
    Py_RETURN_NONE;
fail_names:
    for (int f = 0; f < MAX_FIELDS; f++)
        Py_XDECREF(names[f]);
fail:
    Py_XDECREF(ids);
    Py_XDECREF(kids);
    return NULL;
}

/* _scanner(enabled=None) -> (enabled, lines scanned, lines left to orjson): for tests and benchmarks */
static PyObject *mod_scanner(PyObject *mod, PyObject *args)
{
    PyObject *enable = Py_None;
    if (!PyArg_ParseTuple(args, "|O:_scanner", &enable))
        return NULL;
    if (enable != Py_None) {
        int t = PyObject_IsTrue(enable);
        if (t < 0)
            return NULL;
        scanner_enabled = t;
    }
    return Py_BuildValue("(OLL)", scanner_enabled ? Py_True : Py_False, scanned_lines, fallback_lines);
}

static PyMethodDef module_methods[] = {
    {"_scanner", mod_scanner, METH_VARARGS,
     "_scanner(enabled=None) -> (enabled, scanned, fallback): switch the raw-line scanner, read its counts."},
    {"setup", mod_setup, METH_VARARGS,
     "setup(allowed, trace_error, access_codes): configure from the schema tables (before use)."},
    {NULL}
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_fastengine",
    "The per-rank engine of sanitizer.rules.engine in C (see sanitizer/rules/native.py).", -1, module_methods,
};

#define INTERN(var, text) do { if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL; } while (0)

PyMODINIT_FUNC PyInit__fastengine(void)
{
    memset(kind_table, -1, sizeof(kind_table));
    for (int k = 0; k < N_KINDS; k++) {
        const char *s = KIND_NAMES[k];
        kind_len[k] = (Py_ssize_t)strlen(s);
        unsigned h = kind_hash(s, kind_len[k]);
        while (kind_table[h] >= 0)
            h = (h + 1) & (KT_SIZE - 1);
        kind_table[h] = (int8_t)k;
    }
    INTERN(s_report, "_report");
    INTERN(s_transient, "_transient");
    INTERN(s_submit, "submit");
    INTERN(s_enabled, "enabled");
    INTERN(s_addr, "addr");
    INTERN(s_size, "size");
    INTERN(s_access, "access");
    INTERN(s_r, "r");
    INTERN(s_w, "w");
    INTERN(s_rw, "rw");
    INTERN(RULE_REUSE, "reuse-in-flight");
    INTERN(RULE_FREE, "free-in-flight");
    INTERN(RULE_UNORDERED, "unordered-access");
    INTERN(RULE_GRAPH, "graph-buffer-released");
    INTERN(DETAIL_GRAPH_ALLOC, "a different block was allocated over a live graph's buffer");
    INTERN(DETAIL_GRAPH_FREE, "a block holding a live graph's buffer was freed");
    INTERN(KIND_LAUNCH_STR, "launch");
    INTERN(KIND_COLL_STR, "coll");
    INTERN(k_kind, "kind");
    INTERN(k_op, "op");
    INTERN(k_stream, "stream");
    INTERN(k_line, "line");
    INTERN(k_step, "step");
    INTERN(k_site, "site");
    INTERN(k_stack, "stack");
    INTERN(k_cid, "cid");
    INTERN(k_comm, "comm");
    INTERN(k_seq, "seq");
    INTERN(k_replay_of_line, "replay_of_line");
    INTERN(k_id, "id");
    INTERN(k_addr, "addr");
    INTERN(k_size, "size");
    INTERN(k_pool, "pool");
    INTERN(k_window, "window");
    INTERN(k_window_offset, "window_offset");
    for (int k = 0; k < N_KINDS; k++)
        INTERN(kind_strs[k], KIND_NAMES[k]);
    if (PyType_Ready(&ClockType) < 0 || PyType_Ready(&OpType) < 0 || PyType_Ready(&WindowType) < 0 ||
        PyType_Ready(&BlockType) < 0 || PyType_Ready(&GraphType) < 0 || PyType_Ready(&AnalyzerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
#ifndef HAZSAN_SOURCE_DIGEST
#define HAZSAN_SOURCE_DIGEST ""
#endif
    if (PyModule_AddStringConstant(m, "SOURCE_DIGEST", HAZSAN_SOURCE_DIGEST) < 0 ||
        PyModule_AddObjectRef(m, "Analyzer", (PyObject *)&AnalyzerType) < 0 ||
        PyModule_AddObjectRef(m, "Op", (PyObject *)&OpType) < 0 ||
        PyModule_AddObjectRef(m, "Block", (PyObject *)&BlockType) < 0 ||
        PyModule_AddObjectRef(m, "Window", (PyObject *)&WindowType) < 0 ||
        PyModule_AddObjectRef(m, "Graph", (PyObject *)&GraphType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
