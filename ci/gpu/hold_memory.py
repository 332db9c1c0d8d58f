"""Hold GPU memory so that a given amount stays free (a planted allocation, under which --fit must keep its
target): `python3 ci/gpu/hold_memory.py LEAVE_MIB READY_FILE STOP_FILE`. Allocates with cudaMalloc until the device reports
LEAVE_MIB free (within 64 MiB), writes the free and total MiB to READY_FILE, and holds them until STOP_FILE exists."""
import ctypes
import glob
import sys
import time

MiB = 1 << 20


def cudart() -> ctypes.CDLL:
    for pattern in ("/usr/local/cuda/lib64/libcudart.so*", "/usr/local/cuda/targets/*/lib/libcudart.so*"):
        for path in sorted(glob.glob(pattern)):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    raise SystemExit("hold_memory: no libcudart under /usr/local/cuda")


def mem_info(rt: ctypes.CDLL) -> tuple[int, int]:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    rc = rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
    if rc != 0:
        raise SystemExit(f"hold_memory: cudaMemGetInfo failed ({rc})")
    return free.value, total.value


def main() -> None:
    leave, ready, stop = int(sys.argv[1]) * MiB, sys.argv[2], sys.argv[3]
    rt = cudart()
    held = []
    chunk = 4096 * MiB
    while True:
        free, total = mem_info(rt)
        excess = free - leave
        if excess < 64 * MiB:
            break
        size = min(excess, chunk)
        ptr = ctypes.c_void_p()
        if rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(size)) != 0:
            chunk //= 2
            if chunk < 64 * MiB:
                break
            continue
        held.append(ptr)
    free, total = mem_info(rt)
    with open(ready, "w") as fh:
        fh.write(f"{free // MiB} {total // MiB}\n")
    while True:
        try:
            open(stop).close()
            return
        except FileNotFoundError:
            time.sleep(0.5)


if __name__ == "__main__":
    main()
