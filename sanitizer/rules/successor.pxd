# Types for Cython's compile of successor.py (pure-Python mode: successor.py is the source, run as
# it is when interpreted). Only declarations here, no logic.
cimport cython

from sanitizer.order.clocks cimport StreamClocks
from sanitizer.rules.intervals cimport RangeIndex
from sanitizer.rules.records cimport Op, widen


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


cdef class SuccessorWaits:
    cdef public dict by_comm, on
    cdef public RangeIndex index

    @cython.locals(sc=SuccessorWait, keys=list, waiting=RangeIndex, listed=dict)
    cpdef push(self, Op op)

    @cython.locals(waiting=RangeIndex, asked=dict, sc=SuccessorWait)
    cpdef object not_done(self, StreamClocks clocks, object stream, long long lo, long long hi, int access,
                          object protected, object hits)

    @cython.locals(on=dict, asked=list, waiting=RangeIndex, sc=SuccessorWait, op=Op, listed=dict)
    cpdef retire(self, dict host, object learned, object completions)
