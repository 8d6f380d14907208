"""Score with a classification head: per text, a `*ForSequenceClassification` checkpoint's head at
its last token's hidden state after the final norm, in FP32. Its label names come from the
checkpoint's id2label unless the task names them (the build resolves them into the manifest)."""

from slm_core.tasks.texts import TextsTask


class ClassifierTask(TextsTask):
    head = "classifier"
    graph = "classifier"
