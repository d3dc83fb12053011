"""The stand-in backend's driver: active, on the CPU; it launches nothing (the interpreter
runs the kernels). Runs wherever Triton asks for its drivers."""

import torch
from triton.backends.driver import DriverBase


class InterpreterCPUDriver(DriverBase):
    def __init__(self):
        super().__init__()

    @staticmethod
    def is_active():
        return True

    def map_python_to_cpp_type(self, ty):  # compiling only: never under TRITON_INTERPRET=1
        raise NotImplementedError("interpreter only")

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_benchmarker(self):
        raise NotImplementedError("interpreter only")
