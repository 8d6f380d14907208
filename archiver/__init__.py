"""archiver: checkpoint + task spec -> compiled graph + tokenizer + manifest -> NAME.mar."""
