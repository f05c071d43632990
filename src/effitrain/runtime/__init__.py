"""The machine and its processes: devices, the cluster a job runs on (Slurm, a PyTorchJob), where its
nodes meet, launcher variables and process groups, a launched job's workers and their end, the libraries'
versions and logging. No model code."""
