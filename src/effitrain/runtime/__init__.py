"""The machine and its processes: devices, distributed launch variables and process groups, the
libraries' versions and logging. No model code."""
