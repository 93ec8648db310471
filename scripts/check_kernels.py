"""Compiles every CUDA kernel source (src/kernels/cuda/*.cu, each after common.cuh, as
src/kernels/cuda/nvrtc.rs does at start-up) with NVRTC for sm_90, on a machine without a
GPU: a source that does not compile would fail every GPU start. Prints each source's
entry points; exits non-zero on the first error, with NVRTC's log.

NVRTC and the CUDA headers come from the `nvidia-cuda-nvrtc` and `nvidia-cuda-runtime`
wheels (CUDA 13, as the GPU hosts have), which .ci/run installs:

    python scripts/check_kernels.py [ARCH]
"""
import ctypes
import glob
import os
import re
import sys

import nvidia

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "kernels", "cuda")


def cuda_dir():
    for base in nvidia.__path__:
        for sub in ("cu13", ""):
            d = os.path.join(base, sub)
            if glob.glob(os.path.join(d, "lib", "libnvrtc.so*")) and os.path.exists(
                    os.path.join(d, "include", "cuda_fp16.h")):
                return d
    sys.exit("no NVRTC: pip install nvidia-cuda-nvrtc nvidia-cuda-runtime")


def main(arch="sm_90"):
    base = cuda_dir()
    lib = ctypes.CDLL(sorted(glob.glob(os.path.join(base, "lib", "libnvrtc.so*")))[0])
    common = open(os.path.join(ROOT, "common.cuh")).read()
    # The sources nvrtc.rs compiles, in its order.
    names = re.findall(r'\("(\w+)", include_str!\("\w+\.cu"\)\)', open(os.path.join(ROOT, "nvrtc.rs")).read())
    assert names, "nvrtc.rs lists no sources"
    opts = [f"--gpu-architecture={arch}".encode(), f"--include-path={base}/include".encode()]
    for name in names:
        src = (common + open(os.path.join(ROOT, name + ".cu")).read()).encode()
        prog = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, f"{name}.cu".encode(), 0, None, None) == 0
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            print(log.value.decode(errors="replace"))
            sys.exit(f"{name}.cu does not compile for {arch}")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        entries = re.findall(r"^\.visible \.entry (\w+)\(", ptx.value.decode(), re.M)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        print(f"{name}.cu: {len(entries)} kernels for {arch}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
