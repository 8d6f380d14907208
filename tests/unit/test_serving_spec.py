"""The serving spec: one frozen spec written into model-config.yaml and read back by the handler,
its measured defaults, and the queue sized for a deadline."""

import pytest

from slm_core import SpecError
from slm_core.serving import ServingOptions, ServingSpec, call_time, deadline_room, plan, worker_batch

BEAM_MS = {"1": 8.0, "2": 9.6, "4": 12.5, "8": 18.1}  # an H200 beam archive's calls at the bounds (ms)


def test_defaults_are_the_measured_best_deployments():
    """Left open: 2 sync workers per GPU on CUDA splitting max_batch, the queue for an 80 ms
    deadline; CPU builds (development) one worker and TorchServe's default queue."""
    spec, note = plan(ServingOptions(), "cuda", 8, BEAM_MS)
    assert (spec.workers, spec.batch, spec.queue, spec.deadline_ms, spec.cuda_graphs) == (2, 4, 11, 80.0, True)
    assert "queue of 11 for a 80 ms deadline" in note and "12.5 ms" in note
    spec, _ = plan(ServingOptions(device_ids=(0, 1)), "cuda", 8, BEAM_MS)
    assert (spec.workers, spec.batch, spec.queue, spec.device_ids) == (4, 4, 22, (0, 1))  # 2 per GPU, each GPU's queue
    spec, note = plan(ServingOptions(), "cpu", 1, {"1": 500.0})
    assert (spec.workers, spec.batch, spec.queue, spec.deadline_ms) == (1, 1, 100, None) and "CPU" in note
    spec, _ = plan(ServingOptions(workers=1, queue=5, device_ids=(0,)), "cpu", 4, {"4": 1.0})
    assert (spec.workers, spec.batch, spec.queue, spec.device_ids) == (1, 4, 5, ())  # no GPU list on CPU


def test_the_queue_is_sized_for_the_deadline():
    """A request behind q others finishes after about (q / per_call + calls + 1) x call_ms: the
    queue is the largest q within 90 % of the deadline, at least 1 per GPU."""
    # 2 calls of 4 at once, 12 ms each: a request behind 12 others finishes after (12 / 4 + 2 + 1) x 12 = 72 ms
    assert int(deadline_room(80, 12, per_call=4, calls=2)) == 12
    assert plan(ServingOptions(workers=1), "cuda", 8, BEAM_MS)[0].queue == 15  # one call of 8: 18.1 ms
    assert plan(ServingOptions(workers=2), "cuda", 4, {"2": 9.6, "4": 12.5})[0].queue == 9  # calls of 2: 9.6 ms
    spec, note = plan(ServingOptions(), "cuda", 8, {"4": 60.0, "8": 90.0})
    assert spec.queue == 1 and "may miss it" in note  # no room: at least 1, and the build says so
    assert plan(ServingOptions(deadline_ms=40), "cpu", 1, {"1": 4.0})[0].queue == 7  # (36 / 4 - 2) x 1
    assert (
        worker_batch(8, 1) == 8 and worker_batch(8, 2) == 4 and worker_batch(8, 3) == 3 and worker_batch(8, 4, 2) == 4
    )
    assert call_time(BEAM_MS, 3) == 12.5 and call_time(BEAM_MS, 8) == 18.1 and call_time(BEAM_MS, 9) == 18.1


def test_model_config_round_trips_and_says_what_torchserve_reads():
    spec = plan(
        ServingOptions(device_ids=(0, 1), batch_delay_ms=2, response_timeout_s=60, accuracy_sample=0.01),
        "cuda",
        8,
        BEAM_MS,
    )[0]
    assert (spec.accuracy_sample, spec.accuracy_max_diff, spec.accuracy_min_shared) == (0.01, 0.05, 0.6)
    config = spec.model_config()
    assert {
        k: config[k]
        for k in (
            "minWorkers",
            "maxWorkers",
            "batchSize",
            "maxBatchDelay",
            "jobQueueSize",
            "responseTimeout",
            "deviceType",
            "deviceIds",
        )
    } == {
        "minWorkers": 4,
        "maxWorkers": 4,
        "batchSize": 4,
        "maxBatchDelay": 2,
        "jobQueueSize": 22,
        "responseTimeout": 60,
        "deviceType": "gpu",
        "deviceIds": [0, 1],
    }
    assert ServingSpec.from_model_config(config) == spec
    cpu = ServingSpec("cpu", 1, 2, 30)
    assert "deviceIds" not in cpu.model_config() and ServingSpec.from_model_config(cpu.model_config()) == cpu
    for handler, message in (
        ({"contexts": 2}, r"unknown keys \['contexts'\]"),
        ({"workers": 3}, "unknown keys"),
        ({"cuda_graphs": "false"}, "must be true or false"),
    ):
        with pytest.raises(SpecError, match=message):
            ServingSpec.from_model_config({**cpu.model_config(), "handler": handler})


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(batch_delay_ms=0), "waits 100 ms for every batch"),
        (dict(workers=0), "workers must be a positive integer"),
        (dict(queue=-1), "queue must be a positive integer"),
        (dict(deadline_ms=0), "deadline_ms must be a positive number"),
        (dict(deadline_ms=float("inf")), "deadline_ms must be a positive number"),
        (dict(cuda_graphs="no"), "cuda_graphs must be true or false"),
        (dict(device_ids=(0, 0)), "distinct and not negative"),
        (dict(accuracy_sample=1.5), "accuracy_sample must be a number from 0 to 1"),
        (dict(accuracy_sample=True), "accuracy_sample must be a number from 0 to 1"),
        (dict(accuracy_min_shared=-0.1), "accuracy_min_shared must be a number from 0 to 1"),
        (dict(accuracy_max_diff=-1), "accuracy_max_diff must be a number at least 0"),
    ],
)
def test_options_refuse_what_torchserve_would_misread(options, message):
    with pytest.raises(SpecError, match=message):
        ServingOptions(**options)
