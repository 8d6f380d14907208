"""torch.export of the request graphs with dynamic shapes inside the task bounds."""

import torch
from torch.export import Dim, ExportedProgram
from torch.fx.experimental import _config as fx_config

from slm_core.spec import TaskSpec


def example_inputs(task: TaskSpec, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Inputs to trace with. Dynamic dims get sizes >= 2 (0/1 would specialise to constants)."""
    if task.task == "score":
        ids = torch.arange(8, dtype=torch.int32, device=device) + 1  # texts of 3 and 5 tokens
        return ids, torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    return (torch.arange(6, dtype=torch.int32, device=device) + 1,)


def dynamic_shapes(task: TaskSpec) -> tuple[dict[int, Dim], ...]:
    if task.task == "score":
        tokens = Dim("tokens", min=1, max=task.call_tokens)
        boundaries = Dim("texts_plus_one", min=2, max=task.call_texts + 1)
        return {0: tokens}, {0: boundaries}
    return ({0: Dim("prompt_tokens", min=1, max=task.max_prompt_tokens)},)


def export_graph(graph: torch.nn.Module, task: TaskSpec) -> ExportedProgram:
    device = next(graph.parameters()).device
    # Size-oblivious: reason about a dynamic dim as "any size in range" instead of guarding on 1
    # (one text gives a cu_seqlens[1:] of size 1, which would otherwise specialise).
    with torch.inference_mode(False), torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(graph, example_inputs(task, device), dynamic_shapes=dynamic_shapes(task), strict=False)
