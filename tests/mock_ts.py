"""TorchServe's Context as the handler uses it, for handler-tier tests (imports nothing of slm_core)."""


class MockContext:
    """What SlmHandler uses of ts.context.Context: system properties, model-config.yaml, request
    headers, and what it sets (statuses, headers, metrics)."""

    def __init__(self, model_dir, model_yaml_config: dict | None = None, request_headers: list[dict] | None = None):
        self.system_properties = {"model_dir": str(model_dir), "gpu_id": None}
        self.model_yaml_config = model_yaml_config or {}
        self.request_headers = request_headers or []
        self.status, self.headers, self.counters, self.histograms = {}, {}, {}, {}
        self.metrics = self

    def get_all_request_header(self, idx):
        return self.request_headers[idx] if idx < len(self.request_headers) else {}

    def set_response_status(self, code, phrase, idx):
        self.status[idx] = (code, phrase)

    def set_response_content_type(self, idx, value):
        self.set_response_header(idx, "Content-Type", value)

    def set_response_header(self, idx, key, value):
        self.headers.setdefault(idx, {})[key] = value

    def add_counter(self, name, value, idx=None, dimensions=()):
        key = (name, *(f"{d.name}={d.value}" for d in dimensions))
        self.counters[key if dimensions else name] = self.counters.get(key if dimensions else name, 0) + value

    def add_time(self, name, value, idx=None, unit="ms", dimensions=(), metric_type=None):
        self.add_metric(name, value, unit, idx, dimensions, metric_type)

    def add_metric(self, name, value, unit, idx=None, dimensions=(), metric_type=None):
        """Histograms (by TorchServe's MetricTypes name) keep every observation."""
        assert getattr(metric_type, "name", None) == "HISTOGRAM", (name, metric_type)
        self.histograms.setdefault((name, unit), []).append(value)
