"""deploy/drain.py waits for the requests a worker holds (slm_core/serve/in_flight.py), which
TorchServe's own queue no longer counts: against a stand-in TorchServe (its metrics and management
answers) with no arrivals and empty queues, a drain reports drained only once the worker's call
has ended and the quiet period has passed after it."""

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from deploy_env import DEPLOY

from slm_core.serve import in_flight


@pytest.fixture
def drain(tmp_path, monkeypatch):
    monkeypatch.setenv("SLM_IN_FLIGHT_DIR", str(tmp_path / "in-flight"))
    monkeypatch.setenv("DRAIN_FILE", str(tmp_path / "draining"))
    spec = importlib.util.spec_from_file_location("drain", DEPLOY / "drain.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def torchserve():
    """A stand-in for TorchServe's metrics and management APIs: 7 arrivals so far, one model with
    an empty queue. Returns its URL (the same for both)."""

    class Answers(BaseHTTPRequestHandler):
        def do_GET(self):
            body = {
                "/metrics": b'ts_inference_requests_total{model_name="m"} 7.0\n',
                "/models": json.dumps({"models": [{"modelName": "m"}]}).encode(),
                "/models/m/all": json.dumps([{"jobQueueStatus": {"pendingRequests": 0}}]).encode(),
            }[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_mark_stands_while_a_batch_is_handled_and_goes_after_it_even_on_failure(drain):
    assert drain.held() == 0
    with in_flight.holding(3):
        assert drain.held() == 3
        with in_flight.holding(2):  # another batch of the same process (threads of an async worker)
            assert drain.held() == 5
        assert drain.held() == 3
    assert drain.held() == 0
    with pytest.raises(RuntimeError), in_flight.holding(1):
        raise RuntimeError("the call failed")
    assert drain.held() == 0


def test_a_mark_of_a_process_that_is_gone_does_not_count(drain, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "in-flight"
    folder.mkdir()
    (folder / f"{int(dead.stdout)}-0").write_text("4")  # a worker killed with its batch (kill -9)
    (folder / "notes.txt").write_text("not a mark")
    (folder / f"{os.getpid()}-99").write_text("")  # a mark being written: one request
    assert drain.held() == 1


def test_the_drain_waits_for_a_call_longer_than_its_quiet_period(drain, torchserve):
    """No arrival and empty queues from the start: TorchServe's counters alone say drained after
    the quiet period (0.3 s), while a worker's call runs 1.5 s. The drain waits for the call."""
    ended = {}

    def call():
        with in_flight.holding(1):
            time.sleep(1.5)
        ended["at"] = time.monotonic()

    worker = threading.Thread(target=call)
    worker.start()
    time.sleep(0.1)
    start = time.monotonic()
    assert drain.drain(torchserve, torchserve, quiet=0.3, timeout=10, poll=0.05)
    drained = time.monotonic()
    worker.join()
    # quiet for 0.3 s after the last poll that saw the call (at most one 0.05 s poll before its end)
    assert drained >= ended["at"] + 0.3 - 0.05, (drained - start, ended["at"] - start)
    assert drain.drain_file().exists()
    assert drain.drain(torchserve, torchserve, quiet=0.3, timeout=10, poll=0.05)  # nothing held: the quiet period
    assert time.monotonic() - drained < 2
