"""bench: closed-loop load over TorchServe's REST API for workloads W1-W3, MFU, and the HF peer."""
