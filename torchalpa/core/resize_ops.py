"""The ATen ops that resize a tensor's trailing spatial dims (upsampling, and its
backward), with how many dims each resizes: the sharding rule
(``passes/rules/resize.py``) and the runtime's localization of shape arguments
(``runtime/lowering/localize.py``) both read this table."""

from __future__ import annotations

__all__ = ["UPSAMPLES", "UPSAMPLE_BACKWARDS"]

# op -> number of trailing spatial dims it resizes
UPSAMPLES = {
    "aten.upsample_nearest1d.default": 1,
    "aten.upsample_nearest2d.default": 2,
    "aten.upsample_nearest3d.default": 3,
    "aten._upsample_nearest_exact1d.default": 1,
    "aten._upsample_nearest_exact2d.default": 2,
    "aten._upsample_nearest_exact3d.default": 3,
    "aten.upsample_linear1d.default": 1,
    "aten.upsample_bilinear2d.default": 2,
    "aten._upsample_bilinear2d_aa.default": 2,
    "aten.upsample_bicubic2d.default": 2,
    "aten._upsample_bicubic2d_aa.default": 2,
    "aten.upsample_trilinear3d.default": 3,
}
UPSAMPLE_BACKWARDS = {op.replace(".default", "_backward.default"): n
                      for op, n in UPSAMPLES.items()}
