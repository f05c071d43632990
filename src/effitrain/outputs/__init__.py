"""What a run leaves on disk: the run folder and its lock (run_folder), strict JSON and YAML files
(files), the log and its sinks (sinks, tracking)."""
