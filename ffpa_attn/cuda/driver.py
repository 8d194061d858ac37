"""The few CUDA driver API calls the launcher needs, through ctypes on ``libcuda`` (every call checked).

torch's runtime already created the device's primary context; module loads and launches run in it on
torch's current stream. Nothing here is imported before a CUDA call is actually made.
"""
from __future__ import annotations

import ctypes
import threading

_LIB: ctypes.CDLL | None = None
_LOCK = threading.Lock()

# CUfunction_attribute values (cuda.h)
ATTR_LOCAL_SIZE_BYTES = 3
ATTR_NUM_REGS = 4
ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CUDADriverError(RuntimeError):
    """A CUDA driver call returned an error code."""


def lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        with _LOCK:
            if _LIB is None:
                lib_ = ctypes.CDLL("libcuda.so.1")
                lib_.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                lib_.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                lib_.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
                lib_.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                                     ctypes.c_char_p]
                lib_.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
                lib_.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
                lib_.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
                lib_.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
                lib_.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
                lib_.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
                lib_.cuLaunchKernel.argtypes = [
                    ctypes.c_void_p,                                   # CUfunction
                    ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,       # grid
                    ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,       # block
                    ctypes.c_uint,                                     # dynamic shared memory
                    ctypes.c_void_p,                                   # CUstream
                    ctypes.POINTER(ctypes.c_void_p),                   # kernelParams
                    ctypes.c_void_p,                                   # extra
                ]
                _LIB = lib_
    return _LIB


def check(res: int, what: str) -> None:
    """Raise :class:`CUDADriverError` with the driver's name and text for a non-zero result."""
    if res == 0:
        return
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    lib().cuGetErrorName(res, ctypes.byref(name))
    lib().cuGetErrorString(res, ctypes.byref(text))
    raise CUDADriverError(f"{what} failed: {(name.value or b'?').decode()} ({res}): "
                          f"{(text.value or b'').decode()}")


def require_context(device_index: int) -> None:
    """Make sure a context is current on this thread: torch's (the device's primary context) if none is."""
    ctx = ctypes.c_void_p()
    check(lib().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        return
    dev = ctypes.c_int()
    check(lib().cuDeviceGet(ctypes.byref(dev), int(device_index)), "cuDeviceGet")
    check(lib().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(lib().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def load_function(cubin: bytes, name: str, device_index: int) -> tuple[ctypes.c_void_p, ctypes.c_void_p]:
    """Load a cubin into the device's current context and look up the extern "C" kernel ``name``."""
    require_context(device_index)
    module, func = ctypes.c_void_p(), ctypes.c_void_p()
    image = ctypes.create_string_buffer(cubin, len(cubin))
    check(lib().cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
    check(lib().cuModuleGetFunction(ctypes.byref(func), module, name.encode()), f"cuModuleGetFunction({name})")
    return module, func


def set_max_dynamic_smem(func: ctypes.c_void_p, nbytes: int) -> None:
    check(lib().cuFuncSetAttribute(func, ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes)),
          f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes})")


def func_attribute(func: ctypes.c_void_p, attr: int) -> int:
    val = ctypes.c_int()
    check(lib().cuFuncGetAttribute(ctypes.byref(val), attr, func), f"cuFuncGetAttribute({attr})")
    return val.value


def launch(func: ctypes.c_void_p, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
           stream: int, params: bytes) -> None:
    """``cuLaunchKernel`` with one by-value struct argument (``params``, packed to the kernel's layout)."""
    buf = ctypes.create_string_buffer(params, len(params))
    args = (ctypes.c_void_p * 1)(ctypes.cast(buf, ctypes.c_void_p))
    check(lib().cuLaunchKernel(func, grid[0], grid[1], grid[2], block[0], block[1], block[2], int(smem),
                               ctypes.c_void_p(stream or None), args, None), "cuLaunchKernel")
