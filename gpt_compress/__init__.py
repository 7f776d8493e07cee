"""gpt-compress: pretrain, compress, export and serve GPT models with PaddlePaddle."""
import os as _os

# `import paddle` forces OMP_NUM_THREADS=1 when it is unset; default to the machine's cores.
_os.environ.setdefault("OMP_NUM_THREADS", str(_os.cpu_count() or 1))

from . import runtime as _runtime  # noqa: E402

_runtime.openmp_spin()  # before anything loads libgomp (import paddle does): see runtime.GOMP_SPINCOUNT

__version__ = "0.1.0"

from .config import Config, ConfigError, ModelConfig, PRESETS, load_config  # noqa: E402

__all__ = ["Config", "ConfigError", "ModelConfig", "PRESETS", "load_config", "__version__",
           "GPTForCausalLM", "GPTForSequenceClassification", "GPTModel", "load_model", "save_model"]


def __getattr__(name):
    # Model classes import paddle; keep `import gpt_compress` light for config-only users.
    if name in ("GPTForCausalLM", "GPTForSequenceClassification", "GPTModel"):
        from .model import gpt
        return getattr(gpt, name)
    if name in ("load_model", "save_model"):
        from . import checkpoint
        return getattr(checkpoint, name)
    raise AttributeError(name)
