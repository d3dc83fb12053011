"""A stand-in for triton-cpu (Triton's CPU backend), for the MRV2 end-to-end tests only.

vLLM's CPU build runs Model Runner V2 only where Triton has a `cpu` backend
(`vllm.triton_utils.HAS_TRITON`), and triton-cpu is not published for this platform. This
package registers a `cpu` backend entry (tests/support/triton_interp/*.dist-info) whose driver
only says it is active. With TRITON_INTERPRET=1 Triton runs every `@triton.jit` kernel in its
own interpreter on the CPU tensors, so this backend's compiler is never reached: MRV2's real
kernels run, only not compiled. Loaded by putting tests/support/triton_interp on PYTHONPATH of
the `vllm serve` process (tests/support/vllm_server.py `mrv2_env`); it runs in each process
that imports Triton, on whichever thread imports it.
"""
