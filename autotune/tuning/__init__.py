"""The offline tuner: tasks, studies, workers, measurement, the farm and the ``autotune`` CLI.

Reads the op specs (``autotune.spec``) and writes artifacts the runtime (``autotune.runtime``) loads.
"""
