"""Quantization: QAT, PTQ, weight-only and sensitivity analysis as ``model -> model`` transforms.

The ``Quant`` section (``QuantConfig``) lives with the other sections in ``gpt_compress/config/``;
here: ``quantize.py`` (fake-quant layers and the transform), ``ptq.py`` (calibration observers),
``sensitivity.py`` (per-layer ranking, the skip file), ``deploy.py`` (int8 Paddle model); the
int8 exporter is ``gpt_compress/export/int8.py``.
"""
