# Types for Cython's compile of windows.py (pure-Python mode: windows.py is the source, run as it
# is when interpreted). Only declarations here, no logic.
cimport cython

from sanitizer.rules.intervals cimport RangeIndex
from sanitizer.rules.records cimport LiveBlock, Window


cdef class WindowTable:
    cdef public RangeIndex index
    cdef public dict by_key
    cdef public Py_ssize_t count
    cdef public list small

    cpdef add(self, Window w)
    cpdef bint remove(self, object addr, object comm)

    @cython.locals(small=list, w=Window)
    cpdef object first_at(self, long long lo, long long hi)


cdef class BlockSet:
    cdef public list small
    cdef public RangeIndex index
    cdef public Py_ssize_t count

    cpdef add(self, LiveBlock block)
    cpdef remove(self, LiveBlock block)

    @cython.locals(small=list, found=list, b=LiveBlock)
    cpdef list overlapping(self, long long lo, long long hi)


cdef class WindowBlocks:
    cdef public WindowTable windows
    cdef public BlockSet blocks
    cdef public dict ordinals, transients
    cdef public list touches

    @cython.locals(w=Window)
    cpdef Window register(self, object addr, object size, object comm)

    @cython.locals(block=LiveBlock)
    cpdef adopt(self, Window w, RangeIndex ranges)


    @cython.locals(touches=list, blocks=BlockSet, windows=WindowTable, blk=LiveBlock, w=Window,
                   lo=cython.longlong, hi=cython.longlong)
    cpdef bint mark_coll_touched(self, object bufs, long long allocs)

    @cython.locals(t=cython.longlong, blk=LiveBlock)
    cpdef apply_touches(self, RangeIndex ranges)

    cpdef transient(self, LiveBlock block, Py_ssize_t line, object rank, object step, object file)
    cpdef finish(self, object sink)
