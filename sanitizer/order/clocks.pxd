# Types for Cython's compile of clocks.py (pure-Python mode; clocks.py is the source).
cimport cython


cpdef object merge_changed(dict target, dict other, object changed)

@cython.locals(base=dict, count=cython.longlong)
cpdef object merge_stored(dict target, tuple stored, object changed)


cdef class StreamClocks:
    cdef public dict streams, host, events, frozen
    cdef public object union
    cdef public Py_ssize_t max_streams, max_events
    cdef public set dirty

    cdef dict _new_stream(self, object stream)
    cpdef dict stream_clock(self, object stream)

    @cython.locals(clock=dict)
    cpdef object enqueue(self, object stream)

    cpdef record(self, object event, object stream)
    cpdef bint wait(self, object stream, object event)
    cpdef object host_learns(self, tuple stored)
    cpdef object host_learns_clock(self, dict clock)
    @cython.locals(clock=dict)
    cpdef object sync_stream(self, object stream)
    @cython.locals(streams=dict, clock=dict)
    cpdef object sync_device(self, object lanes=*)
    cpdef fold(self, object stream, dict clock)
    @cython.locals(base=dict, merged=dict)
    cpdef tuple snapshot_of_host(self, object stream)
    @cython.locals(clock=dict, base=dict)
    cpdef tuple snapshot(self, object stream)
