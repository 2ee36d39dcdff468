"""CUDA C++ kernel sources, compiled at run time through CuPy (see README.md)."""
