"""Forward-only capture (runtime/serving/inference.py): what a user sees when it fails."""

import pytest
import torch

from torchalpa.frontends.torch_export import CaptureError, capture_forward


def test_forward_capture_failure_is_explained():
    # Found by the type checker: the error path called the explainer with an argument short.
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x    # data-dependent control flow: not capturable

    with pytest.raises(CaptureError, match="could not trace"):
        capture_forward(Branchy(), (torch.ones(2),), outputs=True)
