# Types for Cython's compile of records.py (pure-Python mode: records.py is the source, run as it
# is when interpreted). Only declarations here, no logic.
cimport cython


cdef class LiveBlock:
    cdef public object id, stream, ev, record_streams, window, step, captured_in
    cdef public long long addr, end, serial, colls_seen
    cdef public Py_ssize_t line
    cdef public bint coll_touched


cdef class Op:
    cdef public object kind, stream, bufs, step, ev, cid, comm, seq, clock, captured, window_bufs, index_keys, succ_keys
    cdef public object released
    cdef public long long epoch, wide_serial
    cdef public bint observed
    cdef public Py_ssize_t line

    cpdef list buffers(self)


cdef class Window:
    cdef public long long addr, end
    cdef public object comm, ordinal


cdef class Graph:
    cdef public object id, stream, ops, line, reserved, pool, foreign, foreign_reserved, ordering, side_streams
    cdef public bint live
    cdef public Py_ssize_t ordinal


@cython.locals(block=LiveBlock)
cpdef LiveBlock new_block(object bid, long long addr, long long size, object stream, Py_ssize_t line,
                          object step, object ev)

@cython.locals(op=Op)
cpdef Op new_op(object kind, object stream, object bufs, Py_ssize_t line, object step, object ev)

cpdef widen(dict hits, object op, object lo, object hi)
