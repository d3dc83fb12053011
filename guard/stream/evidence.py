"""What a worker leaves next to its liveness record so that the sidecar can gather hang evidence
without the rank's help: a signal that dumps every thread's Python stack, and the facts the
sidecar needs to use it (and torch's flight recorder) safely.

At start-up (engine thread, from the processor's `_start_live_record`) the guard:

- picks a real-time signal that nothing in the process handles (`SIGRTMIN+6` upward; vLLM
  handles SIGINT, SIGTERM, SIGTSTP and SIGQUIT; SLURM and torchelastic forward SIGUSR1/2) and
  registers `faulthandler` on it, writing to `<record>.stacks`. The handler is C code that
  needs no GIL, so a rank whose engine thread waits in a collective, even one that holds the
  GIL, answers; a stopped process answers only after SIGCONT, and the sidecar does not signal
  one. `chain=False`: chaining would re-raise into the signal's default action, which ends the
  process;
- writes `<record>.facts.json` (pid, start time, that signal, the stack file, the engine
  thread's id as faulthandler prints it, and the flight recorder's pipe and dump paths where
  torch has one for this backend). The sidecar sends the signal only to the process these facts
  name, and only a signal the facts say is handled (any other would kill the worker).

Why not `sys._current_frames()` from the streamer thread: it needs the GIL, which a wait inside a
custom op (vLLM's CPU shared-memory all-reduce) holds. Why not py-spy: an outside binary, and it
needs ptrace rights the sidecar should not have.

`keep_bounded` (streamer thread, with each heartbeat) empties the stack file once it passes
`MAX_STACK_FILE`; `close` (engine thread, at shutdown) unregisters and removes both files.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import signal
import sys
import threading
from typing import IO, Any

import structlog

from telemetry.wire.liveness_record import companion_path, proc_stat

log = structlog.get_logger("ascend_guard.evidence")

MAX_STACK_FILE = 1 << 20
FIRST_SIGNAL_OFFSET = 6  # SIGRTMIN + 6: clear of glibc's and common runtimes' first RT signals

# torch's flight recorder per backend: (trace buffer size, dump pipe stem, dump file prefix)
# variables, each a list of names (newest first), and the dump prefix's default
FLIGHT_RECORDER_ENV = {
    "nccl": (
        ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
        ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE",),
        ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
        "/tmp/nccl_trace_rank_",
    ),
    "hccl": (
        ("TORCH_HCCL_TRACE_BUFFER_SIZE",),
        ("TORCH_HCCL_DEBUG_INFO_PIPE_FILE",),
        ("TORCH_HCCL_DEBUG_INFO_TEMP_FILE",),
        "/tmp/hccl_trace_rank_",
    ),
}


def _first_env(names: tuple[str, ...], environ: dict[str, str]) -> tuple[str, str]:
    for name in names:
        if environ.get(name):
            return name, environ[name]
    return names[0], ""


def flight_recorder(
    backend: str, rank: int | None, environ: dict[str, str] | None = None
) -> dict[str, Any]:
    """Where torch's flight recorder of this process can be triggered, and where it dumps; or
    why it cannot ("available": False and a note)."""
    env = dict(os.environ if environ is None else environ)
    spec = FLIGHT_RECORDER_ENV.get(backend)
    if spec is None:
        return {
            "available": False,
            "backend": backend or "unknown",
            "note": f"torch has no flight recorder for backend {backend or 'unknown'} "
            "(it records NCCL and HCCL process groups)",
        }
    size_vars, pipe_vars, dump_vars, dump_default = spec
    size_name, size = _first_env(size_vars, env)
    pipe_name, stem = _first_env(pipe_vars, env)
    dump_name, prefix = _first_env(dump_vars, env)
    try:
        entries = int(size or 0)
    except ValueError:
        entries = 0
    if entries <= 0 or not stem or rank is None:
        return {
            "available": False,
            "backend": backend,
            "note": f"not enabled: set {size_name} > 0 and {pipe_name} before the process "
            "group is created",
        }
    return {
        "available": True,
        "backend": backend,
        "entries": entries,
        "pipe": f"{stem}{rank}.pipe",
        "dump": f"{prefix or dump_default}{rank}",
        "dump_from": dump_name if prefix else f"{dump_name} (unset: torch's default)",
    }


def _backend_and_rank() -> tuple[str, int | None]:
    """The default process group's backend and this process's global rank, if torch.distributed
    is already imported and initialized (never imported here: guard/ knows no runtime)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return str(dist.get_backend()).lower(), int(dist.get_rank())
    except Exception:  # noqa: BLE001 - evidence is best effort
        pass
    return "", None


def _kernel_handler(sig: int) -> int | None:
    """The handler the kernel holds for `sig` (0: SIG_DFL), read with sigaction(2): unlike
    `signal.getsignal`, it also sees handlers that C code (or faulthandler) installed after
    start-up. None where it cannot be read. The handler is the first field of glibc's
    `struct sigaction` on x86-64 and aarch64; the buffer is larger than the struct."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        old = ctypes.create_string_buffer(256)
        if libc.sigaction(ctypes.c_int(sig), None, old) != 0:
            return None
        return ctypes.c_void_p.from_buffer(old).value or 0
    except (OSError, AttributeError, TypeError):
        return None


def _free_signal() -> int | None:
    """The first real-time signal from SIGRTMIN+6 that nothing handles (SIG_DFL both in
    Python's table and in the kernel)."""
    for sig in range(signal.SIGRTMIN + FIRST_SIGNAL_OFFSET, signal.SIGRTMAX):
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(sig) == signal.SIG_DFL and _kernel_handler(sig) in (0, None):
                return sig
    return None


class RankEvidence:
    """The stack signal and the facts file of one worker process."""

    def __init__(self, record_path: str, sig: int, stacks: IO[bytes], facts_path: str) -> None:
        self.record_path = record_path
        self.signal = sig
        self._stacks = stacks
        self._facts_path = facts_path

    @classmethod
    def install(cls, record_path: str) -> RankEvidence | None:
        """Register the stack signal and write the facts (None, with a warning, if either
        cannot be done: bundles then hold this rank's ring and /proc view without a stack)."""
        sig = _free_signal()
        if sig is None:
            log.warning("stack_signal_unavailable", note="every real-time signal is taken")
            return None
        stacks_path = companion_path(record_path, "stacks")
        facts_path = companion_path(record_path, "facts.json")
        stacks = None
        try:
            fd = os.open(stacks_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            stacks = os.fdopen(fd, "ab", buffering=0)
            faulthandler.register(sig, file=stacks, all_threads=True, chain=False)
            backend, rank = _backend_and_rank()
            pid = os.getpid()
            stat = proc_stat(pid)
            facts = {
                "pid": pid,
                "start_ticks": stat[1] if stat else 0,
                "stack_signal": sig,
                "stack_file": stacks_path,
                "engine_thread": f"0x{threading.get_ident():016x}",
                "flight_recorder": flight_recorder(backend, rank),
            }
            tmp = f"{facts_path}.{pid}.tmp"
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(facts, handle, sort_keys=True)
            os.chmod(tmp, 0o644)
            os.replace(tmp, facts_path)
        except (OSError, ValueError, RuntimeError) as exc:
            log.warning("rank_evidence_unavailable", path=stacks_path, error=str(exc))
            with contextlib.suppress(Exception):
                faulthandler.unregister(sig)
            if stacks is not None:
                stacks.close()
            for path in (stacks_path, facts_path):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            return None
        return cls(record_path, sig, stacks, facts_path)

    def keep_bounded(self) -> None:
        """Empty the stack file once it passes MAX_STACK_FILE (streamer thread; a dump written
        meanwhile lands at the new end: the file is opened for appending)."""
        try:
            fd = self._stacks.fileno()
            if os.fstat(fd).st_size > MAX_STACK_FILE:
                os.ftruncate(fd, 0)
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        with contextlib.suppress(Exception):
            faulthandler.unregister(self.signal)
        with contextlib.suppress(OSError):
            self._stacks.close()
        for path in (self._facts_path, companion_path(self.record_path, "stacks")):
            with contextlib.suppress(OSError):
                os.unlink(path)
