"""The stand-in backend's compiler: refuses to compile (TRITON_INTERPRET=1 never asks it to).
Runs wherever Triton lists its backends."""

from triton.backends.compiler import BaseBackend


class InterpreterCPUBackend(BaseBackend):
    @staticmethod
    def supports_target(target):
        return target.backend == "cpu"

    def hash(self):
        return "ag-interp"

    def parse_options(self, options):
        raise NotImplementedError("interpreter only")

    def add_stages(self, stages, options, language):
        raise NotImplementedError("interpreter only")

    def load_dialects(self, context):
        pass

    def get_module_map(self):
        return {}
