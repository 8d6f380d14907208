"""Bad input through REST, measured: generated malformed and adversarial requests
interleaved with valid ones, sent concurrently to a running TorchServe. Every bad one must get a
4xx JSON error, every valid one its correct answer (the one it gets alone, before the run: exact to
1e-5, or with --archive within what the package's build allows compiled against eager for its
precision, judged per request, since under load a request shares a graph call whose bf16 GEMMs
may round otherwise), and no worker may restart. Each valid one is first sent alone twice: the
second answer must be byte-identical to the first, whichever worker gives it (determinism;
the handler names the worker in X-Slm-Worker).

    python -m bench.reliability --url http://127.0.0.1:8080/predictions/NAME --management \\
        http://127.0.0.1:8081 --model NAME --task score --max-items 16 --max-tokens 160 --bad 1000

Overload and soak (open loop: requests arrive at a fixed rate whatever the answers, as from
many independent clients, sent by several generator processes that take turns in one schedule),
against a running model or a private TorchServe on one archive:

    python -m bench.reliability overload --archive NAME.mar --task score --seconds 60 [--capacity R]
    python -m bench.reliability soak --archive NAME.mar --task score --seconds 600 [--capacity R]
    python -m bench.reliability fuzz,overload --archive NAME.mar --workers 2 --task beam --max-tokens 512 \
        --workload W2 --tokenizer bench/assets/tokenizer.json   # the H200: W2's requests, 2 workers

Several steps, comma-separated, run on one server one after the other (--out then holds
{step: result}). --workload W1|W2|W3 makes overload's and soak's valid requests that
workload's (bench.workloads) instead of the short multilingual ones.

overload offers 0.8x capacity for 10 s, factor (3) x capacity for --seconds, then 0.8x for 10 s
(with --deadline-ms, each request carrying that deadline: refusals are counted for a full queue
and for the deadline, and the answers that came after it);
soak offers 0.8x capacity for --seconds and reports each window. Both sample the workers' host
memory (and GPU memory where nvidia-smi runs) every second.
kill and gpu-fault offer 0.8x capacity for --fault-seconds and, 5 s in, kill -9 one worker or run
bench.gpu_fault beside the workers (an illegal memory access on the GPU): the requests lost, and
when a new worker answers.
ready stops the workers and starts 1, then 6 (--ready-counts) together, with no traffic: seconds
from the scale request until each is READY. scale-up offers 0.8x capacity for --fault-seconds and,
5 s in, doubles the workers: the requests lost, P99 per second, when each new worker is READY and
when the first answers.
catalog-swap offers 0.8x capacity to an --archive that follows a catalog store (--store): each of
--catalogs published and activated in turn, then a rollback; per event, when every worker served
the new version, answers of an older one after it, failures and P99 against before; GPU memory
before and after.
Without --capacity, it is measured first (bench.loadgen sweep: the highest closed-loop QPS within
the SLO).

Modules, one per step: fuzz.py (bad input), overload.py, soak.py, faults.py (kill, gpu-fault),
catalog_swap.py,
over open_loop.py (the generator and what it measures); __main__.py is the command line.
tests/e2e/test_serving.py runs the bad-input part against the CPU test archives in CI.
"""
