"""Search spaces of the tunable kernels: tunables, feasibility rules and heuristic defaults.

``base.SearchSpace`` is the declaration format; ``hstu_triton`` declares the Triton HSTU templates.
Each backend keeps its space in its own module (e.g. a ``*cute*`` module for the CuTe DSL backend) and
registers it with ``autotune.tuning.registry``. Nothing is imported here so that modules stay independent.
"""
