"""runtime/devices.resident_peak_bytes: a process's own peak resident set, not its parent's. ru_maxrss keeps the
peak from before exec, and a forked child starts with its parent's resident set as its own: effitrain started
from a notebook or a test worker holding more memory than the run used reported the parent's size."""

import subprocess
import sys

from effitrain.runtime import devices


def test_a_child_of_a_big_parent_reports_its_own_peak():
    held = bytearray(600 * 2**20)  # the parent's resident set grows by 600 MiB, every page touched
    held[:: 4096] = b"x" * len(held[:: 4096])
    child = ("import resource; from effitrain.runtime import devices; "
             "print(devices.resident_peak_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    own, inherited = map(int, subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                                             check=True).stdout.split())
    assert own < 300 * 2**20 < 600 * 2**20 <= devices.resident_peak_bytes()
    print(f"child's own peak {own / 2**20:.0f} MiB; ru_maxrss {inherited / 2**20:.0f} MiB")
    del held
