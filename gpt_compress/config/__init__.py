"""Typed configuration: dataclasses with every default in one place, YAML sections, overrides.

A YAML file has FleetX-style sections (``Global``, ``Model``, ``Data``, ``Engine``,
``Optimizer``, ``Generation``, ...). Each section maps onto one dataclass; YAML and
``-o Section.key=value`` overrides only change fields. Unknown sections or keys are errors
that name the key and suggest the closest valid one. ``Model.preset`` picks a named size
first; explicit ``Model`` keys then override it.

The sections live in ``model.py`` (Global, Model, PRESETS), ``train.py`` (Data, Optimizer,
Engine, Generation, Parallel), ``compress.py`` (Prune, Distill, Quant, Pipeline) and
``apps.py`` (Finetune, Serve); YAML reading and coercion in ``parse.py``. This module joins
them into ``Config`` and re-exports every section, so ``from gpt_compress.config import X`` is
the one import.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError  # noqa: F401  (re-exported)
from .apps import BATCHING, FinetuneConfig, LoraConfig, ServeConfig  # noqa: F401
from .compress import (OBSERVERS, QUANT_WEIGHT_BITS, W8A8, WEIGHT_ONLY, DistillConfig,  # noqa: F401
                       PipelineConfig, PruneConfig, QuantConfig, QuantVariant, matches_any)
from .model import PRESETS, GlobalConfig, ModelConfig  # noqa: F401
from .parse import build_section, load_yaml, merge, parse_override, suggest  # noqa: F401
from .train import (DataConfig, EngineConfig, GenerationConfig, LRConfig, OptimizerConfig,  # noqa: F401
                    ParallelConfig)


@dataclass
class Config:
    """The whole configuration of a run: one dataclass per YAML section."""

    global_: GlobalConfig = field(default_factory=GlobalConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def to_dict(self) -> dict:
        """Sections keyed by their YAML names."""
        return {sec: dataclasses.asdict(getattr(self, attr)) for sec, attr in SECTIONS.items()}


# YAML section name -> attribute of Config.
SECTIONS: dict[str, str] = {
    "Global": "global_",
    "Model": "model",
    "Data": "data",
    "Engine": "engine",
    "Optimizer": "optimizer",
    "Generation": "generation",
    "Prune": "prune",
    "Distill": "distill",
    "Parallel": "parallel",
    "Quant": "quant",
    "Pipeline": "pipeline",
    "Serve": "serve",
    "Finetune": "finetune",
}


def build_config(raw: dict, overrides: list[str] = (), source: str = "<config>") -> Config:
    """Apply ``overrides`` to raw YAML sections and build a checked ``Config``."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in (raw or {}).items()}
    origins: dict[str, dict[str, str]] = {}  # section -> key -> the override that set it
    for text in overrides:
        keys, value = parse_override(text)
        origins.setdefault(keys[0], {})[keys[1]] = text
        node = raw.setdefault(keys[0], {})
        for k in keys[1:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {k} is not a section")
        node[keys[-1]] = value
    kwargs = {}
    for section, body in raw.items():
        if section not in SECTIONS:
            if section in origins:
                text = next(iter(origins[section].values()))
                raise ConfigError(f"-o {text}: unknown section {section!r}{suggest(section, SECTIONS)}; "
                                  f"valid sections: {', '.join(SECTIONS)}")
            raise ConfigError(f"unknown section {section!r} in {source}{suggest(section, SECTIONS)}; "
                              f"valid sections: {', '.join(SECTIONS)}")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"section {section} in {source} must be a mapping")
        attr = SECTIONS[section]
        if attr == "model":
            body = dict(body)
            preset = body.pop("preset", None)
            if preset is not None:
                if str(preset) not in PRESETS:
                    raise ConfigError(f"{source}: unknown Model.preset {preset!r}"
                                      f"{suggest(str(preset), PRESETS)}; choose one of {', '.join(PRESETS)}")
                body = {**PRESETS[str(preset)], "name": str(preset), **body}
        cls = typing.get_type_hints(Config)[attr]
        kwargs[attr] = build_section(cls, body, f"{source}: {section}", origins.get(section))
    return Config(**kwargs)


def load_config(path: Optional[str] = None, overrides: list[str] = ()) -> Config:
    """Load ``path`` (optional) and apply ``-o Section.key=value`` overrides."""
    raw = load_yaml(path) if path else {}
    return build_config(raw, overrides, source=path or "<defaults>")
