"""Score with label tokens: per text, the LM head's rows of the labels' first tokens at its last
token, softmaxed over the labels only (or the logits as they are)."""

from slm_core.errors import SpecError
from slm_core.tasks.texts import TextsTask


class LabelsTask(TextsTask):
    head = "labels"
    graph = "labels"

    def __init__(self, spec, tokenizer):
        super().__init__(spec, tokenizer)
        self.label_ids = self.tokenizer.first_tokens(spec.labels, "label")
        if len(set(self.label_ids)) != len(self.label_ids):
            raise SpecError(f"labels {list(spec.labels)} do not start with distinct tokens: {self.label_ids}")

    def constants(self) -> dict:
        return {"label_ids": self.label_ids}  # the LM head rows the graph holds
