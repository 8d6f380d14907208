"""Score with a classification head: per text, a `*ForSequenceClassification` checkpoint's head at
its last token's hidden state after the final norm, in FP32. Its label names come from the
checkpoint's id2label unless the task names them (the build resolves them into the manifest)."""

from slm_core.errors import SpecError
from slm_core.tasks.texts import TextsTask


class ClassifierTask(TextsTask):
    head = "classifier"
    graph = "classifier"

    def __init__(self, spec, tokenizer):
        super().__init__(spec, tokenizer)
        if len(spec.labels) < 2:
            raise SpecError("a classifier task's labels are not resolved from its checkpoint "
                            "(slm_core.build.graphs.ClassifierGraph.resolve)")
