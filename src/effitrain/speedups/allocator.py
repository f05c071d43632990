"""The C allocator under a CPU run: freed memory kept for the next step, an allocator that keeps small
objects apart preloaded, oneDNN's kernel cache bounded. When each is switched on: speedups/process_tuning.py.

`keep_freed_memory`: glibc maps every block above its mmap threshold (adapting from 128 KiB up to 32 MiB on
64-bit) with its own mmap and unmaps it when freed, so a training step's large tensors (the word embeddings'
gradient, autocast's bf16 copies of the weights, an evaluation batch's activations) are faulted in and
zeroed by the kernel anew every step; glibc is set to serve every block from its heap (M_MMAP_MAX 0) and
keep up to KEEP bytes freed at the heap's top (M_TRIM_THRESHOLD), so a step reuses the pages of the one
before (benchmarks/results/allocator_epyc2c_2026-12-04.md; benchmarks/speedups/allocator.py measures it). `restore`
puts glibc's defaults back when a run ends (effitrain.train may run inside a longer program).

`preload`: glibc keeps pages, but not in shape: small C++ objects land in the holes freed large tensors
leave and split them, so what the process holds beyond its tensors varies with every small allocation
(benchmarks/results/memory_overhead_xeon2c_2026-12-05.md); an allocator that keeps small objects apart
from large blocks (tcmalloc's size classes, jemalloc's slabs) holds the tensors plus a near-constant. It
re-executes the `effitrain` command once with one of them in LD_PRELOAD, before torch is loaded (a library
cannot replace malloc in a running process): tcmalloc where installed, else glibc with the settings above;
jemalloc only when asked for by name (EFFITRAIN_ALLOCATOR=jemalloc), with its freed pages purged after 5 s,
because never purging grew a bf16 run without end while tcmalloc stayed flat, as fast or faster
(benchmarks/results/allocator_xeon2c_2026-12-05.md). EFFITRAIN_ALLOCATOR chooses (`system`: no preload).
`serving` says which library's malloc this process calls, for the planner and `effitrain env`.

`bound_primitive_cache` caps oneDNN's cache of compiled kernels ("primitives"), through which CPU bf16
matmuls run, one per operand shape, each holding its own buffers: batches padded to their longest example
come in many widths and grew a bf16 run's resident memory under oneDNN's default of 1024; at PRIMITIVES
(every matmul shape of a step, so the layers of one step still share theirs) it stays flat, and a width
seen again compiles its kernels again (benchmarks/results/allocator_epyc2c_2026-12-04.md, the cost:
benchmarks/results/lora_step_xeon2c_2026-12-05.md)."""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import platform
import sys
import sysconfig

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
KEEP = 256 * 1024 * 1024
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536
SWITCH = "EFFITRAIN_KEEP_FREED_MEMORY"  # 0: leave glibc as it is (to measure, or to compare)
ALLOCATOR = "EFFITRAIN_ALLOCATOR"  # auto (default), jemalloc, tcmalloc, or system (the C library's own)
CHOICES = ("auto", "jemalloc", "tcmalloc", "system")
PRELOADING = "EFFITRAIN_ALLOCATOR_PRELOADING"  # set before the re-execution: it happens once, even if it fails
# Where Debian, Fedora, conda and pip-installed copies live; the first name of each is the preferred one.
LIBRARIES = {"tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so",
                          "libtcmalloc.so"),
             "jemalloc": ("libjemalloc.so.2", "libjemalloc.so")}
AUTO = ("tcmalloc",)  # what `auto` preloads where installed (jemalloc's growth: the module's doc)
# Set unless the user set them. jemalloc: purge freed pages after 5 s, not jemalloc's default 10 s nor never
# (never purging grew a bf16 run without end, 5 s stopped the growth: the module's doc); tcmalloc: no
# "large alloc" report on stderr for blocks over 1 GiB (one line stays one).
SETTINGS = {"jemalloc": {"MALLOC_CONF": "background_thread:false,dirty_decay_ms:5000,muzzy_decay_ms:0"},
            "tcmalloc": {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 60)}}
JEMALLOC_ALL_ARENAS = 4096  # MALLCTL_ARENAS_ALL: "arena.4096.purge" purges every arena
PRIMITIVES = 64
PRIMITIVE_CACHE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"  # oneDNN reads it once, at its first primitive


def bound_primitive_cache() -> None:
    """oneDNN's primitive cache held to PRIMITIVES, unless the environment sets it: call before the
    process's first oneDNN kernel (its first bf16 matmul), or it has no effect."""
    os.environ.setdefault(PRIMITIVE_CACHE, str(PRIMITIVES))


@functools.cache  # platform.libc_ver reads the interpreter's binary
def _glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)  # this process's own C library
    except OSError:
        return None


class _SymbolInfo(ctypes.Structure):  # dlfcn.h's Dl_info
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


@functools.cache  # which malloc a process calls is fixed when it starts
def serving() -> tuple[str, str]:
    """(kind, file) of the library whose malloc this process calls: kind "tcmalloc", "jemalloc", "glibc",
    or "other" (another preloaded allocator, or not Linux: file ""). Read with dladdr on the address the
    dynamic linker resolves `malloc` to, so a library merely loaded, not preloaded, does not count."""
    if platform.system() != "Linux":
        return "other", ""
    unknown = ("glibc", "") if _glibc() is not None else ("other", "")  # where dladdr cannot tell
    try:
        process = ctypes.CDLL(None)
        dladdr = process.dladdr
    except (OSError, AttributeError):  # glibc before 2.34 keeps dladdr in libdl
        try:
            process, dladdr = ctypes.CDLL(None), ctypes.CDLL("libdl.so.2").dladdr
        except (OSError, AttributeError):
            return unknown
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_SymbolInfo)]
    info = _SymbolInfo()
    if not dladdr(ctypes.cast(process.malloc, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return unknown
    file = os.fsdecode(info.dli_fname)
    name = os.path.basename(file)
    for kind in LIBRARIES:
        if kind in name:
            return kind, file
    return ("glibc", file) if name.startswith("libc.so") and _glibc() is not None else ("other", file)


def requested(environ=os.environ) -> str:
    """EFFITRAIN_ALLOCATOR's value, checked: UserError for one effitrain does not know."""
    value = environ.get(ALLOCATOR, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        from effitrain.errors import UserError

        raise UserError(f"{ALLOCATOR}={environ[ALLOCATOR]!r} is not an allocator effitrain knows",
                        f"set it to one of {', '.join(CHOICES)}, or unset it (auto)")
    return value


def find(kind: str) -> str | None:
    """The path of the allocator library `kind` that the dynamic linker can preload, looked for where its
    packages install it (a broken copy found first is passed over: preloaded, ld.so would print its error
    on every command and run glibc's malloc)."""
    for name in LIBRARIES[kind]:
        for folder in _folders():
            for found in sorted(glob.glob(os.path.join(folder, name))):
                if _preloads(found):
                    return found
    return None


def _folders() -> list[str]:
    folders = [os.path.join(sys.prefix, "lib"), os.environ.get("CONDA_PREFIX", "") and
               os.path.join(os.environ["CONDA_PREFIX"], "lib"), "/usr/local/lib"]
    multiarch = sysconfig.get_config_var("MULTIARCH")
    folders += [f"/usr/lib/{multiarch}", f"/lib/{multiarch}"] if multiarch else []
    return [folder for folder in folders + ["/usr/lib64", "/usr/lib"] if folder]


@functools.cache
def _preloads(path: str) -> bool:
    """Whether a program starts with `path` preloaded, ld.so saying nothing (a few milliseconds: `true`)."""
    import shutil
    import subprocess

    program = shutil.which("true") or sys.executable
    # The library alone: the allocators' own settings (a MALLOC_CONF jemalloc complains of) are the run's matter
    settings = {name for kind in SETTINGS.values() for name in kind}
    environment = {k: v for k, v in os.environ.items() if k not in settings}
    try:
        started = subprocess.run([program] if program != sys.executable else [program, "-S", "-c", ""],
                                 env={**environment, "LD_PRELOAD": path}, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return started.returncode == 0 and not started.stderr


def preloading() -> dict | None:
    """At the `effitrain` command's start, before torch is imported: the environment to re-execute this
    same command with, jemalloc or tcmalloc preloaded (as EFFITRAIN_ALLOCATOR asks), when this process runs
    glibc's malloc on Linux and the library is installed; else None. UserError when the allocator asked
    for by name is not installed, or for a value effitrain does not know."""
    wanted = requested()  # a value it does not know is refused, preloaded or not
    if os.environ.get(PRELOADING) or not sys.executable:
        return None  # tried once already (a preload the linker refused), or embedded
    kind, file = serving()
    if kind != "glibc":  # the user's own LD_PRELOAD put another malloc in place: it stays, unless asked otherwise
        if wanted in LIBRARIES and kind != wanted:
            from effitrain.errors import UserError

            raise UserError(f"{ALLOCATOR}={wanted}, but this process already runs {kind}'s malloc "
                            f"({file or 'preloaded'}), through LD_PRELOAD", f"take it out of LD_PRELOAD, or set "
                            f"{ALLOCATOR}=auto to keep it")
        return None
    return preloaded_environment(os.environ)


def reexecute(environment: dict) -> None:
    """This process replaced by the same command in `environment` (`preloading`'s); returns where it is not
    allowed to (a sandbox: glibc's malloc, as without the library). Processes it starts (`launch`'s workers,
    `bench`'s variants) inherit the preload. Never call it in a program that has done work."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environment)
    except OSError:
        pass


def preload() -> None:
    """`preloading`, then `reexecute` where there is an allocator to preload (what `__main__` does, less its
    answer to --help and mistakes before the re-execution)."""
    environment = preloading()
    if environment is not None:
        reexecute(environment)


def preloaded_environment(environ) -> dict | None:
    """`environ` with the allocator EFFITRAIN_ALLOCATOR asks for preloaded (LD_PRELOAD, its settings, the
    marker), for a process to start with; None where none is to be (system, or auto and none installed).
    UserError for an unknown value, or an allocator asked for by name and not installed."""
    wanted = requested(environ)
    if wanted == "system":
        return None
    kinds = AUTO if wanted == "auto" else (wanted,)
    found = next(((kind, path) for kind in kinds if (path := find(kind))), None)
    if found is None:
        if wanted == "auto":
            return None  # glibc with effitrain's settings: works, with a less predictable memory peak
        from effitrain.errors import UserError

        package = {"tcmalloc": "libtcmalloc-minimal4", "jemalloc": "libjemalloc2"}[wanted]
        raise UserError(f"{ALLOCATOR}={wanted} but no {LIBRARIES[wanted][0]} was found",
                        f"install it (Debian/Ubuntu: apt-get install {package}), or set {ALLOCATOR}=auto")
    kind, path = found
    environment = dict(environ)
    environment.update({name: value for name, value in SETTINGS[kind].items() if name not in environment})
    environment["LD_PRELOAD"] = ":".join(filter(None, [environment.get("LD_PRELOAD", ""), path]))
    environment[PRELOADING] = kind
    return environment


def keeps_freed_memory() -> bool:
    """Whether a CPU run in this environment will keep freed memory in glibc's heap (what
    `keep_freed_memory` would do), without changing anything: the memory planner's CPU overhead model
    depends on it. False under a preloaded allocator (it keeps pages its own way)."""
    return _glibc() is not None and serving()[0] == "glibc" and os.environ.get(SWITCH, "1") != "0"


def keep_freed_memory() -> bool:
    """glibc keeps freed blocks for reuse; whether it applied (glibc's malloc only, and unless SWITCH is 0)."""
    libc = _glibc()
    if not keeps_freed_memory():
        return False
    if libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, KEEP):
        return True
    restore()  # not half set: the caller registers no restore when this returns False
    return False


def give_back() -> None:
    """Return the allocator's free memory to the kernel (after an out-of-memory error): glibc's free
    memory at its heap's top, or what tcmalloc or jemalloc keep."""
    kind, file = serving()
    try:
        if kind == "tcmalloc":
            ctypes.CDLL(file).MallocExtension_ReleaseFreeMemory()
        elif kind == "jemalloc":
            purge = f"arena.{JEMALLOC_ALL_ARENAS}.purge".encode()
            ctypes.CDLL(file).mallctl(purge, None, None, None, ctypes.c_size_t(0))
        elif kind == "glibc":
            _glibc().malloc_trim(0)
    except (OSError, AttributeError):  # a build without the symbol: the memory stays with the allocator
        pass


def restore() -> None:
    """glibc's own settings again (its thresholds then stay fixed: glibc adapts them only until set)."""
    libc = _glibc()
    if libc is not None and serving()[0] == "glibc":
        libc.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)
