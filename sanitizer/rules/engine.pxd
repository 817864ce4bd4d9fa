# Types for Cython's compile of engine.py (pure-Python mode: engine.py is the source, run as it is
# when interpreted). Only declarations here, no logic.
cimport cython

cdef extern from *:
    """
    /* hazsan: an event's field read from its slot (engine.py, _slots_of): msgspec keeps a struct's
       fields in slots, each with a member descriptor (T_OBJECT_EX) on the class. */
    #include <structmember.h>
    static Py_ssize_t hazsan_slot_offset(PyObject *descr) {
        PyMemberDef *m;
        if (Py_TYPE(descr) != &PyMemberDescr_Type) return -1;
        m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type != T_OBJECT_EX || m->offset <= 0) return -1;
        return m->offset;
    }
    static PyObject *hazsan_slot(PyObject *o, Py_ssize_t offset) {
        PyObject *v = *(PyObject **)((char *)o + offset);
        if (v == NULL) {
            PyErr_SetString(PyExc_AttributeError, "event field not set");
            return NULL;
        }
        Py_INCREF(v);
        return v;
    }
    """
    Py_ssize_t hazsan_slot_offset(object descr)
    object hazsan_slot(object o, Py_ssize_t offset)

from sanitizer.order.clocks cimport StreamClocks
from sanitizer.rules.intervals cimport RangeIndex, SeenIds


cdef class Block:
    cdef public object id, stream, ev, record_streams, window, step
    cdef public long long addr, end, serial
    cdef public Py_ssize_t line
    cdef public bint coll_touched


cdef class Op:
    cdef public object kind, stream, bufs, step, ev, cid, comm, seq, clock, captured, window_bufs, index_keys, succ_keys
    cdef public long long epoch, wide_serial
    cdef public Py_ssize_t line

    cpdef list buffers(self)


cdef class Window:
    cdef public long long addr, end
    cdef public object comm, ordinal


cdef class WindowTable:
    cdef public RangeIndex index
    cdef public dict by_key
    cdef public Py_ssize_t count
    cdef public list small

    cpdef add(self, Window w)
    cpdef bint remove(self, object addr, object comm)

    @cython.locals(small=list, w=Window)
    cpdef object first_at(self, long long lo, long long hi)


cdef class Graph:
    cdef public object id, stream, ops, line, reserved
    cdef public bint live
    cdef public Py_ssize_t ordinal


cdef class BufferIndex:
    cdef public dict classes, longest
    cdef public long long serial

    cpdef add(self, object op)

    @cython.locals(keys=list, key=tuple, i=Py_ssize_t)
    cpdef list add_keys(self, object bufs, object op)

    cpdef remove(self, object op)

    @cython.locals(key=tuple, i=Py_ssize_t)
    cpdef remove_keys(self, object keys)

    @cython.locals(first=cython.longlong)
    cpdef long long add_serial(self, object bufs, object op)

    @cython.locals(serial=cython.longlong, key=tuple)
    cpdef remove_serial(self, object bufs, long long first)

    @cython.locals(found=list, key=tuple, i=Py_ssize_t, n=Py_ssize_t)
    cpdef list overlapping(self, object lo, object hi)


cdef class BlockSet:
    cdef public list small
    cdef public RangeIndex index
    cdef public Py_ssize_t count

    cpdef add(self, Block block)
    cpdef remove(self, Block block)

    @cython.locals(small=list, found=list, b=Block)
    cpdef list overlapping(self, long long lo, long long hi)


cdef class InFlight:
    cdef public list ops, epochs, cuts
    cdef public long long last, pushed, base, tracked, order
    cdef public Py_ssize_t start, indexed
    cdef public BufferIndex index
    cdef public dict classes

    cpdef push(self, Op op, object epoch=*)

    @cython.locals(epochs=list, start=Py_ssize_t, n=Py_ssize_t, stop=Py_ssize_t, gone=list, op=Op)
    cpdef list retire_upto(self, long long known)

    @cython.locals(classes=dict, ops=list, base=cython.longlong, i=cython.longlong, pushed=cython.longlong,
                   retired=cython.longlong, last=cython.longlong)
    cpdef _track(self)

    @cython.locals(index=BufferIndex, ops=list, n=Py_ssize_t, i=Py_ssize_t, held=dict, op=Op)
    cpdef BufferIndex by_address(self)


cdef class SuccessorWait:
    cdef public list colls, epochs, entries
    cdef public Py_ssize_t start, base, ordinal
    cdef public set streams
    cdef public RangeIndex index
    cdef public bint ordered

    cpdef push(self, Op op)
    cpdef _unorder(self)

    @cython.locals(colls=list, start=Py_ssize_t, n=Py_ssize_t, i=Py_ssize_t, k=Py_ssize_t,
                   first=Py_ssize_t, op=Op, item=tuple, found=list)
    cpdef object not_done(self, StreamClocks clocks, object stream, long long lo, long long hi, int access,
                          object protected, object hits)

    @cython.locals(colls=list, start=Py_ssize_t, n=Py_ssize_t, i=Py_ssize_t, k=Py_ssize_t,
                   stop=Py_ssize_t, op=Op, entries=list)
    cpdef object retire(self, dict host)


cdef class RankAnalyzer:
    cdef public object file, rank, sink, matcher, step, transients, settled, completions
    cdef public StreamClocks clocks
    cdef public bint successor
    cdef public BufferIndex wide
    cdef public long long entered
    cdef public dict inflight, successor_waits, successor_on, live, window_ordinals, pending_free, colls_in_flight, graphs, handlers
    cdef public RangeIndex live_ranges, successor_index, graph_index
    cdef public Py_ssize_t graphs_made_live
    cdef public BlockSet window_blocks
    cdef public WindowTable windows
    cdef public list capturing, live_graphs, touches
    cdef public SeenIds cids
    cdef public set steps_seen, comms
    cdef public Py_ssize_t max_comms
    cdef public Py_ssize_t line, events, unrecorded_waits
    cdef public long long allocs, ranges_upto
    cdef public object counted_drops, hook_errors  # sums of counts read from the trace: unbounded

    @cython.locals(line=Py_ssize_t, code=int, codes=dict, entry=tuple)
    cpdef feed_batch(self, Py_ssize_t first, list items, list problems)
    cpdef on_coll(self, object ev, Py_ssize_t line, tuple at=*)
    cpdef on_sync(self, object ev, Py_ssize_t line)
    cpdef on_coll_done(self, object ev, Py_ssize_t line)
    cpdef on_step(self, object ev, Py_ssize_t line)
    cpdef on_record(self, object ev, Py_ssize_t line, tuple at=*)
    cpdef on_wait(self, object ev, Py_ssize_t line, tuple at=*)
    cpdef on_scope(self, object ev, Py_ssize_t line)
    cpdef on_record_stream(self, object ev, Py_ssize_t line, tuple at=*)
    cpdef on_free_done(self, object ev, Py_ssize_t line, tuple at=*)

    @cython.locals(unfinished=list, vh=dict, vx=dict, fl=InFlight, known=cython.longlong, h=cython.longlong)
    cpdef list _unfinished(self, object stream, object protected=*)

    @cython.locals(vh=dict, vx=dict, found=dict, key=tuple, op=Op, known=cython.longlong, h=cython.longlong,
                   unfinished=list)
    cpdef list _wide_unfinished(self, object stream, long long lo, long long hi, int access, object protected)

    @cython.locals(fl=InFlight, ops=list, op=Op, wide=BufferIndex, i=Py_ssize_t)
    cpdef _widen_index(self)

    @cython.locals(fl=InFlight, ops=list, i=Py_ssize_t)
    cpdef _narrow_index(self)

    @cython.locals(hits=dict, key=tuple, op=Op, fl=InFlight, known=cython.longlong,
                   blo=cython.longlong, bhi=cython.longlong, bacc=int, write=int)
    cpdef dict _not_done(self, object stream, long long lo, long long hi, int access, list unfinished, object protected=*)

    @cython.locals(addr=cython.longlong, size=cython.longlong, end=cython.longlong, block=Block, w=Window)
    cpdef on_alloc(self, object ev, Py_ssize_t line, tuple at=*)

    @cython.locals(upto=cython.longlong, new=list, block=Block, ranges=RangeIndex)
    cpdef RangeIndex _live_ranges(self)

    @cython.locals(block=Block, addr=cython.longlong, end=cython.longlong)
    cpdef on_free(self, object ev, Py_ssize_t line, tuple at=*)

    @cython.locals(t=cython.longlong, touches=list, window_blocks=BlockSet, windows=WindowTable, blk=Block,
                   w=Window, lo=cython.longlong, hi=cython.longlong)
    cpdef _mark_coll_touched(self, object bufs)

    @cython.locals(ranges=RangeIndex, t=cython.longlong, blk=Block)
    cpdef _apply_touches(self)

    @cython.locals(bufs=list, op=Op)
    cpdef on_launch(self, object ev, Py_ssize_t line, tuple at=*)

    @cython.locals(fl=InFlight, lo=cython.longlong, hi=cython.longlong, acc=int, unfinished=list)
    cpdef _enqueue(self, Op op)

    @cython.locals(vh=dict, inflight=dict, fl=InFlight, known=cython.longlong, op=Op)
    cpdef _retire(self, object learned=*)


@cython.locals(block=Block)
cdef Block _new_block(object bid, long long addr, long long size, object stream, Py_ssize_t line,
                      object step, object ev)

@cython.locals(op=Op)
cdef Op _new_op(object kind, object stream, object bufs, Py_ssize_t line, object step, object ev)

cpdef _track_op(dict classes, Op op, long long number)
cpdef tuple _kind_entry(object kind)

cdef bint COMPILED

@cython.locals(offset=Py_ssize_t, offsets=list)
cpdef object _slots_of(object kind, int number)
