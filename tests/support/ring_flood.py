"""A client process that writes wave records of one TP rank into its wave ring at full speed.

The ring is the real one (telemetry/wire/wave_ring.py, the writer the guard's engine thread
uses), in the sidecar's liveness directory; the rank names itself over one real gRPC stream
from the worker's own streamer, which carries heartbeats and no waves, as a worker with
`wave_ring` on does. The ring holds every record (`slots` ≥ records), so what is measured is
the sidecar's drain, not a race with the writer. Collectives are not in the records: they
still travel over gRPC in ring mode.

    python -m tests.support.ring_flood ADDRESS LIVE_DIR --tp 0 --tp-size 4 --records 100000

Prints `ready` once connected, waits for a line on stdin, writes, prints one JSON line
(records written, writer seconds), waits for another line, and closes its stream.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from telemetry.wire.wave_ring import RingWriter, ring_path
from tests.support.flood import make_streamer, synthetic_wave


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("live_dir")
    parser.add_argument("--engine", default="ring-flood")
    parser.add_argument("--run-id", default="run-ring-flood")
    parser.add_argument("--tp", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=4)
    parser.add_argument("--records", type=int, default=100_000)
    args = parser.parse_args()
    slots = 1 << max(4, (args.records - 1).bit_length())
    writer = RingWriter.create(
        ring_path(args.live_dir, args.run_id, 0, 0, args.tp),
        slots=slots,
        slot_bytes=512,
        rank=(0, args.tp, 0),
    )
    streamer = make_streamer(args.address, args)
    streamer.start()
    deadline = time.monotonic() + 20
    while not streamer.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    # the first heartbeat batch registers the rank, and with it the ring
    time.sleep(0.2)
    print("ready" if streamer.connected else "not connected", flush=True)
    sys.stdin.readline()
    rng = random.Random(args.tp)
    start_ns = time.time_ns()
    records = [synthetic_wave(rng, wave, start_ns) for wave in range(1, args.records + 1)]
    began = time.process_time()  # CPU: the machine may be shared
    for record in records:
        writer.write(record)
    took = time.process_time() - began
    print(json.dumps({"records": args.records, "writer_s": took, "error": ""}), flush=True)
    sys.stdin.readline()
    streamer.stop()
    writer.close()


if __name__ == "__main__":
    main()
