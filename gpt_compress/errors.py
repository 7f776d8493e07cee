"""The one hierarchy of errors a user can cause (bad config, data, checkpoint, export, request).

A leaf module: it imports nothing from the package, so every layer can raise these. The CLI
catches `GptcError` once, prints `gptc <command>: error: <message>` on one line and exits
non-zero; anything else escaping a command is a bug in gpt-compress, not in the user's input.
"""
from __future__ import annotations


class GptcError(Exception):
    """Root: a problem with the user's input or files, phrased for the user (what, where, what to do)."""

    exit_code = 1


class ConfigError(GptcError, ValueError):
    """A configuration problem, phrased for the user (which file, section and key)."""

    exit_code = 2


class DataError(GptcError, ValueError):
    """Bad input data or a bad data file, phrased for the user: which file, which line, what to do."""


class CheckpointError(GptcError, RuntimeError):
    """A checkpoint is missing, corrupt or does not match the model."""


class UnsafePickleError(CheckpointError, ValueError):
    """A pickled file asks the unpickler for something a plain state dict never needs."""


class ExportError(GptcError, RuntimeError):
    """Export failed: unsupported model or format, or outputs that do not match dygraph."""


class OutputError(GptcError, ValueError):
    """An output path holds something gpt-compress must not replace (a file, a foreign directory),
    or one of its own outputs without ``--overwrite``. Nothing is touched."""


class DiskFullError(OutputError):
    """The device filled while an output was being written; the partial output was removed and
    whatever the path held before is intact."""


class OutputLocked(OutputError):
    """Another gpt-compress process is writing the same output (its lock file names the pid)."""


class ModelDirError(GptcError, RuntimeError):
    """An exported model directory is missing, incomplete, corrupt or from a newer exporter."""


class InputError(GptcError, ValueError):
    """A request the model cannot serve (empty prompt, unknown token ids, too long)."""


class PipelineError(GptcError, RuntimeError):
    """A pipeline stage failed or cannot run; the message names the stage and what to do."""


class Interrupted(GptcError):
    """Ctrl-C or SIGTERM: the message says what was saved and how to resume. The exit code is
    128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports it."""

    exit_code = 130

    def __init__(self, message: str, signum: int = 2):
        super().__init__(message)
        self.exit_code = 128 + signum


class TrainingDiverged(GptcError, RuntimeError):
    """The loss became NaN/inf or spiked; the last good checkpoint is kept."""


class InsufficientMemory(ConfigError):
    """The command would not fit in the memory available (a pre-flight estimate, ``memory.py``)."""


class KernelError(GptcError, RuntimeError):
    """gpt-compress's fused CPU operators could not be built or loaded (the message names why)."""
