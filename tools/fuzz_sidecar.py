"""The long fuzz run: many hostile inputs against a real sidecar process over real gRPC.

Inputs come from the strategies of tests/unit/telemetry/test_fuzz_ingest.py (valid protobuf with hostile
values, valid shapes with huge integers / NaN / infinities, raw and truncated bytes), plus
single-byte mutations of serialized batches; one stream per input. Afterwards it checks:

- the sidecar is still running (checked every 1,000 inputs too) and every input got a status:
  OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED (anything else is a failure: UNKNOWN means an
  exception escaped);
- every label value on /metrics is bounded (at most 65 values per label and family, engine 33);
- the sidecar's log stayed small (refusal lines are rate-limited), in bytes per input.

    python tools/fuzz_sidecar.py [--inputs 100000] [--seed 1]

Ends with one line:  fuzz: N inputs, 0 crashes, 0 unanswered, labels bounded, log B bytes/input
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from telemetry.wire.proto import guard_pb2  # noqa: E402
from tests.support.sidecar import SidecarProcess  # noqa: E402
from tests.unit.telemetry.test_fuzz_ingest import batches, valid_with_hostile_numbers  # noqa: E402

METHOD = "/ascend_guard.v1.GuardIngest/Stream"
ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


def _mutate(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return bytes([rng.randrange(256)])
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="ag-fuzz-"))
    sidecar = SidecarProcess.start(root, address=f"unix://{root / 'guard.sock'}")
    channel = grpc.insecure_channel(sidecar.address)
    call = channel.stream_unary(
        METHOD, request_serializer=lambda b: b, response_deserializer=guard_pb2.Ack.FromString
    )
    codes: collections.Counter[str] = collections.Counter()
    unanswered: list[str] = []
    crashed = False
    sent = 0
    start = time.monotonic()

    def send(data: bytes) -> None:
        nonlocal sent, crashed
        sent += 1
        try:
            call(iter([data]), timeout=30)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
        codes[code.name] += 1
        if code not in ANSWERS and len(unanswered) < 20:
            unanswered.append(f"{code.name}: {data[:60]!r}")
        if sent % 1000 == 0:
            if sidecar.proc.poll() is not None:
                crashed = True
                raise SystemExit(f"the sidecar exited after {sent} inputs")
            print(f"{sent} inputs, {time.monotonic() - start:.0f} s, {dict(codes)}", flush=True)

    inputs = st.one_of(
        batches().map(lambda b: b.SerializeToString()),
        valid_with_hostile_numbers().map(lambda b: b.SerializeToString()),
        st.binary(max_size=512),
    )

    @settings(
        max_examples=args.inputs,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
    )
    @given(data=inputs)
    def fuzz(data: bytes) -> None:
        send(data if rng.random() < 0.8 else _mutate(data, rng))

    try:
        fuzz()
    finally:
        channel.close()
        alive = sidecar.proc.poll() is None
        text = sidecar.metrics_text() if alive else ""
        sidecar.stop()
    log_bytes = sidecar.log_path.stat().st_size
    worst = 0
    for family in text_string_to_metric_families(text):
        values: dict[str, set[str]] = {}
        for sample in family.samples:
            for name, value in sample.labels.items():
                values.setdefault(name, set()).add(value)
        for name, seen in values.items():
            cap = 33 if name == "engine" else 65
            worst = max(worst, len(seen) - cap)
            if len(seen) > cap:
                print(f"unbounded: {family.name} {name} has {len(seen)} values")
    elapsed = time.monotonic() - start
    print(f"{sent} inputs in {elapsed:.0f} s; answers: {dict(codes)}")
    for line in unanswered:
        print("unanswered:", line)
    crashes = int(crashed or not alive)
    answered = {a.name for a in ANSWERS}
    other = sum(n for code, n in codes.items() if code not in answered)
    print(
        f"fuzz: {sent} inputs, {crashes} crashes, {other} unanswered, labels "
        f"{'bounded' if worst <= 0 else 'NOT bounded'}, log {log_bytes / max(1, sent):.1f} "
        f"bytes/input ({log_bytes} in all)"
    )
    return 0 if not crashes and not unanswered and worst <= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
