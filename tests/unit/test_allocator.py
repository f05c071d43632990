"""speedups/allocator.py: on glibc, a CPU run's large blocks come from malloc's heap (reused step after
step) instead of fresh mappings, and glibc's settings are put back when the run ends; the `effitrain`
command's preload of tcmalloc or jemalloc, and the planner's overhead under each."""

import ctypes
import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from effitrain.errors import UserError
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


# The preload: `effitrain` re-executes itself once with tcmalloc or jemalloc under malloc.
PRELOADED = [kind for kind in allocator.LIBRARIES if allocator.find(kind)]
REPORT = ("import json, os, sys; from effitrain.speedups import allocator; allocator.preload(); "
          "print(json.dumps([allocator.serving()[0], os.environ.get('MALLOC_CONF'), sys.argv[1:]]))")


def preloaded_run(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in (allocator.PRELOADING, "LD_PRELOAD", "MALLOC_CONF")}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env={**environment, **env})


@pytest.mark.parametrize("kind", PRELOADED)
def test_the_preload_puts_the_library_under_malloc_once(kind):
    out = preloaded_run(REPORT, "a", "--b c", EFFITRAIN_ALLOCATOR=kind)
    assert out.returncode == 0, out.stderr
    served, settings, argv = json.loads(out.stdout)  # printed once: one re-execution, then the program itself
    assert served == kind and argv == ["a", "--b c"] and out.stderr == ""
    assert settings == (allocator.SETTINGS["jemalloc"]["MALLOC_CONF"] if kind == "jemalloc" else None)


def test_auto_takes_tcmalloc_never_jemalloc_and_system_none():
    if not PRELOADED:
        pytest.skip("neither tcmalloc nor jemalloc is installed")
    auto = "tcmalloc" if "tcmalloc" in PRELOADED else "glibc"  # jemalloc only by name: its growth (allocator.py)
    assert json.loads(preloaded_run(REPORT, EFFITRAIN_ALLOCATOR="auto").stdout)[0] == auto
    assert json.loads(preloaded_run(REPORT, EFFITRAIN_ALLOCATOR="system").stdout)[0] == "glibc"


def test_a_user_setting_of_jemalloc_is_kept():
    if "jemalloc" not in PRELOADED:
        pytest.skip("jemalloc is not installed")
    out = preloaded_run(REPORT, EFFITRAIN_ALLOCATOR="jemalloc", MALLOC_CONF="narenas:2")
    assert json.loads(out.stdout)[:2] == ["jemalloc", "narenas:2"]


def test_a_preload_the_linker_refused_is_not_tried_again():
    """The marker is set before the re-execution: if the library did not load, the program runs on glibc."""
    out = preloaded_run(REPORT, **{allocator.PRELOADING: "tcmalloc", "EFFITRAIN_ALLOCATOR": "auto"})
    assert json.loads(out.stdout)[0] == "glibc"


def test_an_allocator_asked_for_by_name_and_missing_is_one_line(monkeypatch):
    monkeypatch.setattr(allocator, "find", lambda kind: None)
    monkeypatch.setenv(allocator.ALLOCATOR, "jemalloc")
    with pytest.raises(UserError, match="libjemalloc.so.2 was found.*apt-get install libjemalloc2"):
        allocator.preload()
    monkeypatch.setenv(allocator.ALLOCATOR, "auto")
    allocator.preload()  # auto without a library: glibc, nothing said
    monkeypatch.setenv(allocator.ALLOCATOR, "mimalloc")
    with pytest.raises(UserError, match="EFFITRAIN_ALLOCATOR='mimalloc' is not an allocator.*auto, jemalloc"):
        allocator.preload()


GIVE_BACK = """
import json, sys, torch
from effitrain.speedups import allocator
allocator.preload()
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024
before = rss()
block = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, touched
del block
kept = rss()
allocator.give_back()
print(json.dumps([allocator.serving()[0], kept - before, rss() - before]))
"""


@pytest.mark.parametrize("kind", PRELOADED)
def test_give_back_returns_what_the_preloaded_allocator_keeps(kind):
    """After give_back the freed block is the system's again, whether the allocator kept it (tcmalloc) or
    returned it when it was freed (jemalloc under effitrain's setting purges large blocks at once)."""
    out = preloaded_run(GIVE_BACK, EFFITRAIN_ALLOCATOR=kind)
    assert out.returncode == 0, out.stderr
    served, kept, left = json.loads(out.stdout)
    assert served == kind and left < 32 * 2**20
    if kind == "tcmalloc":  # it keeps freed memory until asked
        assert kept > 200 * 2**20


def test_planner_overhead_follows_the_allocator(monkeypatch):
    from effitrain.planning import planner as plan

    shapes = plan.model_shapes("causal-lm", "gpt2:n_layer=2,n_embd=64,n_head=2")
    planner = plan.Planner(shapes, 32, "cpu")
    setting = plan.Setting("fp32", "adamw", False, 4, 1)
    glibc = planner.estimate(setting)
    assert glibc.overhead > plan.CPU_OVERHEAD["constant"]  # the heap churn's share on top
    for kind, overhead in plan.PRELOADED_OVERHEAD.items():
        monkeypatch.setattr(allocator, "serving", lambda kind=kind: (kind, f"/lib/lib{kind}.so"))
        assert not allocator.keeps_freed_memory()
        estimate = planner.estimate(setting)
        assert estimate.overhead == overhead and estimate.total - overhead == glibc.total - glibc.overhead


def test_the_environment_for_a_child_keeps_the_users_preloads_first(monkeypatch):
    monkeypatch.setattr(allocator, "find", lambda kind: f"/lib/lib{kind}.so")
    environment = allocator.preloaded_environment({"LD_PRELOAD": "/opt/libmine.so", allocator.ALLOCATOR: "tcmalloc"})
    assert environment["LD_PRELOAD"] == "/opt/libmine.so:/lib/libtcmalloc.so"
    assert environment[allocator.PRELOADING] == "tcmalloc" and "MALLOC_CONF" not in environment
    assert allocator.preloaded_environment({allocator.ALLOCATOR: "system"}) is None
    chosen = allocator.preloaded_environment({})  # auto, every library installed: tcmalloc, with its setting
    assert chosen[allocator.PRELOADING] == "tcmalloc" and "MALLOC_CONF" not in chosen
    assert all(chosen[name] == value for name, value in allocator.SETTINGS["tcmalloc"].items())
    jemalloc = allocator.preloaded_environment({allocator.ALLOCATOR: "jemalloc"})
    assert jemalloc["MALLOC_CONF"] == allocator.SETTINGS["jemalloc"]["MALLOC_CONF"]


def test_a_copy_the_linker_cannot_preload_is_passed_over(tmp_path, monkeypatch):
    """A broken libtcmalloc found first (here: an empty file) would make ld.so print its error on every
    command and run glibc anyway: the next copy that preloads is taken, else none."""
    broken = tmp_path / allocator.LIBRARIES["tcmalloc"][0]
    broken.write_bytes(b"")
    real = allocator.find("tcmalloc")
    folders = allocator._folders()
    monkeypatch.setattr(allocator, "_folders", lambda: [str(tmp_path), *folders])
    assert allocator.find("tcmalloc") == real and not allocator._preloads(str(broken))
    monkeypatch.setattr(allocator, "_folders", lambda: [str(tmp_path)])
    assert allocator.find("tcmalloc") is None


def test_an_allocator_asked_for_by_name_is_not_silently_replaced_by_the_users_preload(monkeypatch):
    monkeypatch.delenv(allocator.PRELOADING, raising=False)
    monkeypatch.setattr(allocator, "serving", lambda: ("jemalloc", "/opt/libjemalloc.so.2"))
    monkeypatch.setenv(allocator.ALLOCATOR, "tcmalloc")
    with pytest.raises(UserError, match=r"EFFITRAIN_ALLOCATOR=tcmalloc, but this process already runs jemalloc's "
                                        r"malloc \(/opt/libjemalloc.so.2\), through LD_PRELOAD"):
        allocator.preloading()
    for kept in ("auto", "jemalloc", "system"):  # the user's own preload stays: nothing to re-execute
        monkeypatch.setenv(allocator.ALLOCATOR, kept)
        assert allocator.preloading() is None
