"""A user's MLP head (task key `mlp`), read from a safetensors file and checked against the model.

Layout: tensors `layers.0.weight` [width_1, dims], `layers.0.bias` [width_1] (optional), ...,
`layers.K.weight` [outputs, width_K] (+ bias): linear layers in order, the activation between
them (not after the last). The file's metadata (string to string) names the activation,
`activation`: relu, gelu or silu (default relu), and optionally the outputs, `labels`: a JSON
array of names. Write one with safetensors.torch.save_file(tensors, path, metadata).
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from slm_core.errors import SpecError

ACTIVATIONS = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu}
NAME = re.compile(r"layers\.(\d+)\.(weight|bias)")


@dataclass(frozen=True)
class MlpHead:
    weights: tuple[torch.Tensor, ...]  # FP32, [out, in] each
    biases: tuple[torch.Tensor | None, ...]
    activation: str
    labels: tuple[str, ...]  # from the file's metadata; () if it names none

    @property
    def outputs(self) -> int:
        return self.weights[-1].shape[0]


def read_mlp(path: "str | Path", inputs: int) -> MlpHead:
    """The MLP in `path`, whose first layer must take `inputs` (the task's dims) features;
    SpecError naming what does not fit."""
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata() or {}
    except FileNotFoundError:
        raise SpecError(f"mlp file {str(path)!r} does not exist") from None
    except Exception as e:  # safetensors raises its own error types for a file it cannot read
        raise SpecError(f"mlp file {str(path)!r} is not a safetensors file: {e}") from None
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        m = NAME.fullmatch(key)
        if m is None:
            raise SpecError(f"mlp file holds {key!r}: expected only layers.N.weight and layers.N.bias")
        layers.setdefault(int(m.group(1)), {})[m.group(2)] = value.float()
    if sorted(layers) != list(range(len(layers))) or not layers:
        raise SpecError(f"mlp file's layers are {sorted(layers)}: expected layers 0..K with none missing")
    activation = meta.get("activation", "relu")
    if activation not in ACTIVATIONS:
        raise SpecError(f"mlp activation {activation!r} must be one of {sorted(ACTIVATIONS)}")
    weights, biases, width = [], [], inputs
    for i in range(len(layers)):
        w, b = layers[i].get("weight"), layers[i].get("bias")
        if w is None or w.ndim != 2:
            raise SpecError(
                f"mlp layers.{i}.weight must be a matrix [out, in], got {None if w is None else list(w.shape)}"
            )
        if w.shape[1] != width:
            what = (
                f"the task's dims {inputs} (the embedding it reads)" if i == 0 else f"layers.{i - 1}'s {width} outputs"
            )
            raise SpecError(f"mlp layers.{i}.weight is {list(w.shape)}: it takes {w.shape[1]} inputs, but {what}")
        if b is not None and list(b.shape) != [w.shape[0]]:
            raise SpecError(f"mlp layers.{i}.bias is {list(b.shape)}, expected [{w.shape[0]}]")
        weights.append(w)
        biases.append(b)
        width = w.shape[0]
    labels, names = (), meta.get("labels")
    if names is not None:
        try:
            labels = json.loads(names)
        except ValueError:
            labels = None
        if not isinstance(labels, list):
            raise SpecError("mlp metadata 'labels' must be a JSON array of names")
        labels = tuple(labels)
        if len(labels) != width or not all(isinstance(n, str) and n for n in labels):
            raise SpecError(f"mlp metadata 'labels' must name the {width} outputs, got {list(labels)[:8]}")
    return MlpHead(tuple(weights), tuple(biases), activation, labels)
