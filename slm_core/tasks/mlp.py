"""Score with a user's MLP head: per text, the embedding that head: embedding answers (the last
token's hidden state after the final norm, FP32, cut to `dims`, L2-normalised if `normalize`), fed
to an MLP read from the safetensors file the task names (`mlp`; slm_core.compile.mlp_head says its
layout), run in FP32 inside the compiled graph. Its output row per text is answered as a
classifier's: softmax over the row (`output: probs`) or the row itself (`logits`), with the
output names from the task's labels, else the file's, else LABEL_i (resolved at build). FLOPs
are a classifier's (TextsTask.flops: the prefill and a head of one row per output over the hidden
state): the serve side does not read the MLP's widths."""

import shutil
from dataclasses import replace
from pathlib import Path

from slm_core.errors import SpecError
from slm_core.spec import TaskSpec
from slm_core.tasks.texts import TextsTask

MLP_FILE = "mlp.safetensors"  # the head's file in a package


class MlpTask(TextsTask):
    head = "mlp"
    graph = "mlp"

    def check_head(self, spec) -> None:
        if spec.mlp is None:
            raise SpecError("head: mlp needs the task key 'mlp': the safetensors file of the MLP")
        self.check_output(spec)
        if len(spec.labels) < (2 if spec.output == "probs" else 1):
            raise SpecError(
                f"an MLP head answering {spec.output} needs at least "
                f"{2 if spec.output == 'probs' else 1} output(s), got {len(spec.labels)}"
            )

    def write_data(self, package: Path) -> TaskSpec:
        shutil.copyfile(self.spec.mlp, package / MLP_FILE)  # the package then says what its graph holds
        return replace(self.spec, mlp=MLP_FILE)

    def constants(self) -> dict:
        return {"dims": self.spec.dims, "normalize": self.spec.normalize, "mlp": MLP_FILE}
