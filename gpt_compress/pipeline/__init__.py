"""`gptc pipeline`: every stage from text to a compressed, deployed, evaluated model."""
from .stages import Pipeline, PipelineError

__all__ = ["Pipeline", "PipelineError"]
