"""The cuda backend: per-GPU workers, rank buffers, the device step and its transports (see daemon/README.md)."""
