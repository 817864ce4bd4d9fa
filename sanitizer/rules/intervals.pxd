# Types for Cython's compile of intervals.py (pure-Python mode: intervals.py is the source, run as
# it is when interpreted). Only declarations here, no logic.
cimport cython


cdef class RangeIndex:
    cdef public dict classes, longest
    cdef public long long serial
    cdef public Py_ssize_t count

    @cython.locals(key=tuple)
    cpdef add(self, object lo, object hi, object item)

    @cython.locals(key=tuple, i=Py_ssize_t, n=Py_ssize_t)
    cpdef remove(self, object lo, object hi, object item)

    @cython.locals(found=list, key=tuple, i=Py_ssize_t, n=Py_ssize_t)
    cpdef list overlapping(self, object lo, object hi)

    @cython.locals(best=tuple, key=tuple)
    cpdef object first_added(self, object lo, object hi)


cdef class SeenIds:
    cdef public object lo, hi
    cdef public set other

    cpdef bint add(self, object key)
