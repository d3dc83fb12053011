"""The sidecar's stop names its steps and their times, so that a slow stop says which step."""

from __future__ import annotations

import time

from structlog.testing import capture_logs

from telemetry.sidecar.app import Sidecar, SidecarSettings
from tests.support.ports import free_port


def test_stop_times_each_step_and_names_a_slow_one(tmp_path, monkeypatch):
    sidecar = Sidecar(
        SidecarSettings(
            listen=f"unix://{tmp_path / 's.sock'}",
            store=str(tmp_path / "s.db"),
            metrics_host="127.0.0.1",
            metrics_port=free_port(),
            health_port=0,
            query_port=0,
            publish=False,
        )
    )
    sidecar.start()
    writer_stop = sidecar.writer.stop

    def slow_writer_stop() -> None:
        time.sleep(1.2)
        writer_stop()

    monkeypatch.setattr(sidecar.writer, "stop", slow_writer_stop)
    with capture_logs() as logs:
        sidecar.stop()
    events = {entry["event"]: entry for entry in logs}
    assert events["sidecar_stop_step_slow"]["step"] == "writer"
    assert events["sidecar_stop_step_slow"]["ms"] >= 1200
    stopped = events["sidecar_stopped"]["stop_ms"]
    assert set(stopped) == {
        "grpc",
        "rings",
        "cross_rank",
        "roster",
        "writer",
        "incidents",
        "metrics_http",
    }
    assert stopped["writer"] >= 1200 and stopped["grpc"] < 1000
    assert not (tmp_path / "s.sock").exists()
