# Types for Cython's compile of kinds.py (pure-Python mode: kinds.py is the source, run as it is
# when interpreted). Only declarations here, no logic. The engine cimports hazsan_slot from here.
cimport cython

cdef extern from *:
    """
    /* hazsan: an event's field read from its slot (kinds.py, slots_of): msgspec keeps a struct's
       fields in slots, each with a member descriptor (T_OBJECT_EX) on the class. */
    #include <structmember.h>
    static inline Py_ssize_t hazsan_slot_offset(PyObject *descr) {
        PyMemberDef *m;
        if (Py_TYPE(descr) != &PyMemberDescr_Type) return -1;
        m = ((PyMemberDescrObject *)descr)->d_member;
        if (m->type != T_OBJECT_EX || m->offset <= 0) return -1;
        return m->offset;
    }
    static inline PyObject *hazsan_slot(PyObject *o, Py_ssize_t offset) {
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

cdef bint COMPILED

@cython.locals(offset=Py_ssize_t, offsets=list)
cpdef object slots_of(object kind, int number)

cpdef tuple kind_entry(object kind)
