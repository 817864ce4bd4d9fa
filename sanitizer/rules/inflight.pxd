# Types for Cython's compile of inflight.py (pure-Python mode: inflight.py is the source, run as it
# is when interpreted). Only declarations here, no logic.
cimport cython

from sanitizer.order.clocks cimport StreamClocks
from sanitizer.rules.records cimport Op, widen


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


cpdef track_op(dict classes, Op op, long long number)


cdef class InFlightTable:
    cdef public dict streams
    cdef public BufferIndex wide
    cdef public long long entered, colls
    cdef public object settled

    @cython.locals(unfinished=list, vh=dict, vx=dict, fl=InFlight, known=cython.longlong, h=cython.longlong)
    cpdef list unfinished(self, StreamClocks clocks, object stream, object protected=*)

    @cython.locals(hits=dict, key=tuple, op=Op, fl=InFlight, known=cython.longlong,
                   blo=cython.longlong, bhi=cython.longlong, bacc=int)
    cpdef dict not_done(self, StreamClocks clocks, object stream, long long lo, long long hi, int access,
                        list unfinished, object protected)

    @cython.locals(vh=dict, vx=dict, found=dict, key=tuple, op=Op, known=cython.longlong, h=cython.longlong,
                   unfinished=list)
    cpdef list wide_unfinished(self, StreamClocks clocks, object stream, long long lo, long long hi, int access,
                               object protected)

    @cython.locals(fl=InFlight)
    cpdef push(self, Op op, object epoch)

    @cython.locals(streams=dict, fl=InFlight, known=cython.longlong, op=Op)
    cpdef retire(self, dict host, object learned, dict colls_in_flight)

    @cython.locals(fl=InFlight, ops=list, op=Op, wide=BufferIndex, i=Py_ssize_t)
    cpdef widen_index(self)

    @cython.locals(fl=InFlight, ops=list, i=Py_ssize_t)
    cpdef narrow_index(self)


@cython.locals(rlo=cython.longlong, rhi=cython.longlong)
cpdef bint overlaps_any(list ranges, long long lo, long long hi)

cpdef object known_by_recorded(StreamClocks clocks, object protected, object s, object known)
