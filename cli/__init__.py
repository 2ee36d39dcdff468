"""The operator's command line, ``sparsekv``: stats, clients, blocks, top, health, warm-cpus,
replay, trace, demo and bench (``main.py`` parses; one module a command that needs more than a screen)."""
