"""Stand-in for torch_npu (tests only): an NPU that does not exist on this machine.

Only the names ascend-guard's probes use are here. The device is simulated: work queued on the
stream advances `clock_ms`; `complete()` makes the device catch up. An event is done once the
device has passed the point where it was recorded. `Event.synchronize` fails the test, because
the probes must never wait for the device.
"""

from . import npu

__all__ = ["npu"]
