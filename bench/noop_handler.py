"""A handler that answers at once: the ceiling of TorchServe plus the load generator on this host."""


class NoopHandler:
    def initialize(self, ctx) -> None:
        pass

    def handle(self, data, ctx):
        return ['{"ok":true}'] * len(data)
