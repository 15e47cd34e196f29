"""The README's Python example runs as written."""

import re
from pathlib import Path

import torch


def test_the_readme_python_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the README has a Python example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # noqa: S102 - the documented example itself
    image, served = scope["image"], scope["served"]
    assert image.shape == (128, 128) and torch.isfinite(image).all() and image.min() >= 0
    assert served.mar_used.shape == (1,) and len(scope["lines"]) == 13
