"""Quantization: QAT, PTQ, weight-only and sensitivity analysis as ``model -> model`` transforms.

``config.py`` (the ``Quant`` section, pure Python), ``quantize.py`` (fake-quant layers and the
transform), ``ptq.py`` (calibration observers), ``sensitivity.py`` (per-layer ranking),
``deploy.py`` (int8 Paddle model); the int8 exporter is ``gpt_compress/export/int8.py``.
This package's ``__init__`` imports nothing, so reading the config stays free of Paddle.
"""
