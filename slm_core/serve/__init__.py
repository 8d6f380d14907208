"""Serve time: loading a package, the runtime, CUDA-graph replay, the REST protocol."""
