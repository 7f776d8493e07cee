"""Export a checkpoint to deployable programs: one entry, ``export`` (``api.py``), choosing the
float, int8 or tensor-parallel path; the leaves ``static`` (Paddle Inference programs), ``onnx``
(paddle2onnx + graph fixes), ``int8`` (quantized programs) and ``partition`` (rank exports);
``validate`` checks every export against the dygraph model before it is renamed into place."""
from .api import export, export_model  # noqa: F401
