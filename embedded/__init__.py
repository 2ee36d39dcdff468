"""The daemon's residency engine and kernels embedded in the caller's process (no daemon):
the in-process baseline of the benchmarks and replays."""
