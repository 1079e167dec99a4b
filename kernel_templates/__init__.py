"""Kernel templates: tile shape and schedule are explicit parameters, never autotuned implicitly."""
