"""What training imports: artifact loading and validation, dispatch, the custom ops and the fused layer.

Never imports the tuner (``autotune.tuning``): a training job needs torch and triton (and the CuTe
DSL only when an artifact picks it), not optuna, workers or the CLI.
"""
