# cython: language_level=3
# distutils: language = c++
#
# magpie's RMM memory resource (include/magpie_rmm.hpp) as a subclass of
# RMM's Python DeviceMemoryResource, so that rmm.mr.set_current_device_resource
# hands it to every RMM user in the process: Python (rmm.DeviceBuffer, CuPy
# and Numba through RMM's allocators) and C++ (libcudf and other callers of
# rmm::mr::get_current_device_resource_ref) alike. Allocations go straight
# from RMM's C++ code into magpie: no Python call, no GIL.
#
# Built on first use by magpie/rmm.py (Cython, then the C++ compiler)
# against the installed rmm package's .pxd files and librmm's headers.
from cython.operator cimport dereference as deref
from libcpp.memory cimport unique_ptr

from rmm.librmm.memory_resource cimport device_async_resource_ref
from rmm.pylibrmm.memory_resource._memory_resource cimport DeviceMemoryResource


cdef extern from "magpie_rmm.hpp" namespace "magpie" nogil:
    cdef cppclass rmm_memory_resource:
        rmm_memory_resource() except +


cdef extern from * nogil:
    """
    static cython_device_async_resource_ref magpie_rmm_ref(magpie::rmm_memory_resource &r) {
      return cython_device_async_resource_ref(rmm::device_async_resource_ref{r});
    }
    """
    device_async_resource_ref magpie_rmm_ref(rmm_memory_resource &r)


cdef class MagpieMemoryResource(DeviceMemoryResource):
    """Device memory from magpie (magpie_malloc_async / magpie_free_async on
    the stream RMM passes). Every instance is equal to every other: any of
    them frees what another handed out."""

    cdef unique_ptr[rmm_memory_resource] c_obj

    def __cinit__(self):
        self.c_obj.reset(new rmm_memory_resource())
        self.c_ref = magpie_rmm_ref(deref(self.c_obj))

    def __repr__(self):
        return "magpie.rmm.MagpieMemoryResource()"
