# Types for Cython's compile of engine.py (pure-Python mode: engine.py is the source, run as it is
# when interpreted). Only declarations here, no logic; the records and tables it keeps are typed in
# the .pxd files of their own modules. The classes engine.py also re-exports (engine.Op, ...) are
# cimported under other names: a cimported name is not made a module attribute.
cimport cython

from sanitizer.order.clocks cimport StreamClocks
from sanitizer.rules.inflight cimport InFlightTable as InFlightTableType
from sanitizer.rules.intervals cimport RangeIndex, SeenIds
from sanitizer.rules.kinds cimport hazsan_slot, kind_entry
from sanitizer.rules.records cimport LiveBlock as LiveBlockType, Op as OpType, new_block, new_op, widen
from sanitizer.rules.successor cimport SuccessorWaits as SuccessorWaitsType
from sanitizer.rules.windows cimport WindowBlocks as WindowBlocksType, WindowTable as WindowTableType


cdef class RankAnalyzer:
    cdef public object file, rank, sink, matcher, step, completions, threads
    cdef public StreamClocks clocks
    cdef public bint successor
    cdef public InFlightTableType inflight
    cdef public SuccessorWaitsType successor_waits
    cdef public WindowBlocksType window_blocks
    cdef public dict live, pending_free, colls_in_flight, graphs, handlers
    cdef public list observed_ops
    cdef public RangeIndex live_ranges, graph_index
    cdef public Py_ssize_t graphs_made_live
    cdef public list capturing, live_graphs
    cdef public SeenIds cids
    cdef public set steps_seen, comms
    cdef public Py_ssize_t max_comms
    cdef public Py_ssize_t line, events, unrecorded_waits
    cdef public long long allocs, ranges_upto, colls_issued
    cdef public object counted_drops, hook_errors  # sums of counts read from the trace: unbounded

    @cython.locals(line=Py_ssize_t, code=int, codes=dict, entry=tuple)
    cpdef feed_batch(self, Py_ssize_t first, list items, list problems)
    @cython.locals(windows=WindowTableType)
    cpdef on_coll(self, object ev, Py_ssize_t line, tuple at=*)
    cpdef on_sync(self, object ev, Py_ssize_t line)
    cpdef on_coll_done(self, object ev, Py_ssize_t line)
    @cython.locals(op=OpType)
    cpdef _observed(self, object cid)
    @cython.locals(host=dict, keep=list, op=OpType, lo=cython.longlong, hi=cython.longlong)
    cpdef _release_observed(self, long long addr, long long end)
    cpdef on_step(self, object ev, Py_ssize_t line)
    cpdef on_record(self, object ev, Py_ssize_t line, tuple at=*)
    cpdef on_wait(self, object ev, Py_ssize_t line, tuple at=*)
    cpdef on_scope(self, object ev, Py_ssize_t line)
    cpdef on_record_stream(self, object ev, Py_ssize_t line, tuple at=*)
    cpdef on_free_done(self, object ev, Py_ssize_t line, tuple at=*)

    @cython.locals(hits=dict)
    cpdef dict _not_done(self, object stream, long long lo, long long hi, int access, list unfinished, object protected=*)

    @cython.locals(addr=cython.longlong, size=cython.longlong)
    cpdef on_alloc(self, object ev, Py_ssize_t line, tuple at=*)

    @cython.locals(end=cython.longlong, block=LiveBlockType, windows=WindowTableType)
    cpdef _alloc(self, object ev, Py_ssize_t line, object bid, long long addr, long long size, object stream)

    @cython.locals(released=dict, shared=dict, asked=dict, hits=dict)
    cpdef tuple _graph_hits(self, long long lo, long long hi, object pool, object block)

    cpdef bint _shares_pool(self, object g, object pool, object block)

    @cython.locals(upto=cython.longlong, new=list, block=LiveBlockType, ranges=RangeIndex)
    cpdef RangeIndex _live_ranges(self)

    @cython.locals(block=LiveBlockType)
    cpdef on_free(self, object ev, Py_ssize_t line, tuple at=*)

    @cython.locals(addr=cython.longlong, end=cython.longlong)
    cpdef _free(self, object bid, LiveBlockType block, Py_ssize_t line)

    @cython.locals(bufs=list, op=OpType)
    cpdef on_launch(self, object ev, Py_ssize_t line, tuple at=*)

    @cython.locals(lo=cython.longlong, hi=cython.longlong, acc=int, unfinished=list)
    cpdef _enqueue(self, OpType op)
    cpdef _own_lane(self, OpType op)
    cpdef _issued_by(self, object stream)

    @cython.locals(host=dict)
    cpdef _retire(self, object learned=*)
