"""speedups/allocator.py: on glibc, a CPU run's large blocks come from malloc's heap (reused step after
step) instead of fresh mappings, and glibc's settings are put back when the run ends."""

import ctypes
import os
import platform

import pytest
import torch
from effitrain.speedups import allocator

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
BLOCK = 48 * 1024 * 1024  # above glibc's largest mmap threshold (32 MiB): mapped on its own by default


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mallinfo() -> MallInfo2:
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2()


def held_in_its_own_mapping() -> bool:
    """Whether glibc maps a large block on its own. The block is larger than the whole heap (arena), so no
    free chunk left there by earlier runs in this process can serve it: only a fresh mapping or the heap's
    growth can (pages untouched, so nothing is written)."""
    before = mallinfo()
    block = torch.empty(BLOCK + before.arena, dtype=torch.uint8)
    mapped = mallinfo().hblks > before.hblks  # hblks: blocks glibc mapped on their own
    del block
    return mapped


def test_large_blocks_come_from_the_heap_while_kept(monkeypatch):
    monkeypatch.delenv(allocator.SWITCH, raising=False)
    allocator.restore()
    assert held_in_its_own_mapping()
    try:
        assert allocator.keep_freed_memory()
        assert not held_in_its_own_mapping()
    finally:
        allocator.restore()
    assert held_in_its_own_mapping()


def test_the_switch_leaves_glibc_alone(monkeypatch):
    monkeypatch.setenv(allocator.SWITCH, "0")
    allocator.restore()
    assert not allocator.keep_freed_memory()
    assert held_in_its_own_mapping()


def test_a_user_setting_of_the_primitive_cache_is_kept(monkeypatch):
    monkeypatch.setenv(allocator.PRIMITIVE_CACHE, "7")
    allocator.bound_primitive_cache()
    assert os.environ[allocator.PRIMITIVE_CACHE] == "7"


def test_a_cpu_run_keeps_freed_memory_and_restores_it(tiny_model_dir, tmp_path, monkeypatch):
    import effitrain

    monkeypatch.delenv(allocator.PRIMITIVE_CACHE, raising=False)  # put back (or removed) after the test
    calls = []
    keep, restore = allocator.keep_freed_memory, allocator.restore
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append("keep") or keep())
    monkeypatch.setattr(allocator, "restore", lambda: calls.append("restore") or restore())
    rows = "\n".join(f"\"message {i} {'win' if i % 2 else 'hello'}\",{['ham', 'spam'][i % 2]}" for i in range(24))
    (tmp_path / "d.csv").write_text("text,label\n" + rows + "\n")
    effitrain.train({"model": str(tiny_model_dir), "data": str(tmp_path / "d.csv"), "max_steps": 1,
                     "batch_size": 8, "max_length": 16, "output_dir": str(tmp_path / "run")})
    assert calls == ["keep", "restore"]
    assert os.environ[allocator.PRIMITIVE_CACHE] == str(allocator.PRIMITIVES)  # bf16 matmuls' kernel cache
    assert held_in_its_own_mapping()  # glibc's own behaviour again after the run
