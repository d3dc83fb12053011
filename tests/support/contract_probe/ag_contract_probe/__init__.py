"""A test-only vLLM general plugin that records, inside a real `vllm serve`'s worker, where the
guard runs relative to Model Runner V2's own machinery; for tests/e2e/test_mrv2.py only.

It is loaded by putting tests/support/contract_probe on PYTHONPATH of the server
(`tests.support.vllm_server.contract_probe_env`): vLLM finds its entry point beside the
guard's. It replaces nothing of vLLM or the guard: it wraps, in each process, the guard
processor's entry points and MRV2's `AsyncOutput.get_output` to note what they saw, and writes
JSON lines to `$AG_CONTRACT_PROBE_DIR/<pid>.jsonl`:

- `{"e": "step"|"sample", "inference": bool}`: whether torch's inference mode was on when the
  guard's step (sample) decorator handed the call to the processor (each distinct value once);
- `{"e": "logits", "req": id, "row": [...]}`: the logits row the guard's sampler hook saw, as it
  saw it, for requests whose id holds "contract";
- `{"e": "read", "output": type, "tokens": bool, "trimmed": bool}`: each distinct way the guard's
  after-sample read (`read_sampled`) met a runner output: whether it found sampled token ids on
  the host (an output of a step that scheduled nothing carries empty lists), and whether that
  output came back from `AsyncOutput.get_output` (the D2H copy's wait and the trim of each row
  to its sampled count).
"""

from __future__ import annotations

import json
import os
import threading

ENV = "AG_CONTRACT_PROBE_DIR"
MARK = "contract"

_lock = threading.Lock()
_seen: set[tuple] = set()
_trimmed: list = [None]  # the output the last AsyncOutput.get_output returned
_installed = False


def _write(record: dict, once: bool = False) -> None:
    key = tuple(sorted(record.items()))
    with _lock:
        if once:
            if key in _seen:
                return
            _seen.add(key)
        path = os.path.join(os.environ[ENV], f"{os.getpid()}.jsonl")
        with open(path, "a") as out:
            out.write(json.dumps(record) + "\n")


def _wrap_processor() -> None:
    import torch

    from guard import processor as processor_mod

    cls = processor_mod.GuardProcessor
    run_step, run_sample, on_logits = cls.run_step, cls.run_sample, cls.on_logits
    read_sampled = processor_mod.read_sampled

    def probed_run_step(self, fn, runner, args, kwargs):
        _write({"e": "step", "inference": torch.is_inference_mode_enabled()}, once=True)
        return run_step(self, fn, runner, args, kwargs)

    def probed_run_sample(self, fn, runner, args, kwargs):
        _write({"e": "sample", "inference": torch.is_inference_mode_enabled()}, once=True)
        return run_sample(self, fn, runner, args, kwargs)

    def probed_on_logits(self, logits, rows_per_req, req_ids=None):
        for row, req_id in enumerate(req_ids or ()):
            if MARK in req_id and row < logits.shape[0]:
                _write({"e": "logits", "req": req_id, "row": logits[row].tolist()})
        return on_logits(self, logits, rows_per_req, req_ids)

    def probed_read_sampled(output, runner=None):
        result = read_sampled(output, runner)
        _write(
            {
                "e": "read",
                "output": type(output).__name__,
                "tokens": bool(result[0]),
                "trimmed": output is _trimmed[0],
            },
            once=True,
        )
        return result

    cls.run_step, cls.run_sample, cls.on_logits = (
        probed_run_step,
        probed_run_sample,
        probed_on_logits,
    )
    processor_mod.read_sampled = probed_read_sampled


def _wrap_async_output(module) -> None:
    cls = module.AsyncOutput
    get_output = cls.get_output

    def probed_get_output(self, *args, **kwargs):
        result = _trimmed[0] = get_output(self, *args, **kwargs)
        return result

    cls.get_output = probed_get_output


def register() -> None:
    global _installed
    if _installed or not os.environ.get(ENV):
        return
    _installed = True
    from ascend_runtime.attach.import_hooks import when_imported

    _wrap_processor()
    when_imported("vllm.v1.worker.gpu.async_utils", _wrap_async_output)
