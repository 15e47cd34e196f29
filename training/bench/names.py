"""Names the ``masc bench`` command line offers, kept free of torch so that ``--help`` is fast."""

VARIANTS = ("fp32", "bf16", "nchw", "nchw_bf16", "compile", "compile_bf16")
"""The MAR forward variants of ``masc bench unet``."""

SB3_HINT = "pip install sb3-contrib (or .[bench])"
"""What to do when sb3-contrib is missing."""

SB3_POLICIES = ("mlp", "ours")
"""Networks of the MaskablePPO side: sb3's default MLP, or our :class:`PolicyNet`."""
