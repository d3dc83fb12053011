"""The device a rank opened and the model it serves (guard/stream/placement.py, the mapping in
telemetry/wire/workload.py). torch_npu cannot run here: its `torch.npu.current_device()` is a
stand-in (a namespace with that one function), as is the runner (what vLLM's runners hold:
`device`, `vllm_config`). The served name is cross-checked against vLLM's own function."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from guard.stream import placement
from telemetry.wire import workload


def runner(device=None, served=None, model="/data/models/qwen"):
    config = SimpleNamespace(model_config=SimpleNamespace(served_model_name=served, model=model))
    return SimpleNamespace(device=device, vllm_config=config)


def torch_with(npu=None, cuda=None):
    """A stand-in for `torch` after torch_npu's import: `torch.npu.current_device()`."""
    return SimpleNamespace(
        npu=SimpleNamespace(current_device=lambda: npu) if npu is not None else None,
        cuda=SimpleNamespace(current_device=lambda: cuda) if cuda is not None else None,
    )


def dev(kind, index=None):
    return SimpleNamespace(type=kind, index=index)


def test_npu_index_maps_through_the_runtime_and_the_container_lists():
    env = {"ASCEND_VISIBLE_DEVICES": "2,5,6,7", "ASCEND_RT_VISIBLE_DEVICES": "1,3"}
    # the runner names its device: runtime 1 -> container 3 -> the node's NPU 7
    assert placement.device_of(runner(dev("npu", 1)), env) == "7"
    # "npu" with no index: torch_npu's current device of this thread (0 -> 1 -> 5)
    assert placement.device_of(runner(dev("npu")), env, torch_with(npu=0)) == "5"
    # outside a container (no device plugin list): the runtime's list alone
    assert placement.device_of(runner(dev("npu", 1)), {"ASCEND_RT_VISIBLE_DEVICES": "4,6"}) == "6"
    assert placement.device_of(runner(dev("npu", 3)), {}) == "3"


def test_cuda_and_cpu():
    env = {"CUDA_VISIBLE_DEVICES": "3,1"}
    assert placement.device_of(runner(dev("cuda", 0)), env) == "3"
    assert placement.device_of(runner(dev("cuda")), env, torch_with(cuda=1)) == "1"
    uuid = {"CUDA_VISIBLE_DEVICES": "GPU-8f2a1c3e-0000-1111-2222-333344445555"}
    assert placement.device_of(runner(dev("cuda", 0)), uuid).startswith("gpu-8f2a1c3e")
    assert placement.device_of(runner(dev("cpu")), env) == ""  # nothing on CPU
    assert placement.device_of(runner(None), env) == ""
    assert placement.device_of(runner("cpu"), env) == ""  # a plain string device
    # an accelerator with no index and no runtime to ask: unknown, not a guess
    assert placement.device_of(runner(dev("npu")), {}, torch_with()) == ""


def test_a_failing_current_device_is_no_device():
    def broken():
        raise RuntimeError("no device set on this thread")

    torch = SimpleNamespace(npu=SimpleNamespace(current_device=broken))
    assert placement.device_of(runner(dev("npu")), {}, torch) == ""


@pytest.mark.parametrize(
    "served, model",
    [
        ("qwen-chat", "/data/models/qwen"),
        (["qwen-chat", "qwen"], "/data/models/qwen"),
        (None, "Qwen/Qwen2.5-7B-Instruct"),
        ("", "/data/models/qwen"),
        ([], "/data/models/qwen"),
    ],
)
def test_model_name_is_the_one_vllm_labels_its_metrics_with(served, model):
    """vLLM's metrics label `model_name` with `model_config.served_model_name`, which vLLM sets
    with `get_served_model_name(model, served_model_name)`: the same answer here."""
    model_config = pytest.importorskip("vllm.config.model")
    expected = model_config.get_served_model_name(model, served)
    assert placement.model_name_of(runner(served=served, model=model)) == expected


def test_model_name_without_a_config_and_odd_characters():
    assert placement.model_name_of(SimpleNamespace()) == ""
    odd = workload.served_model_name(SimpleNamespace(served_model_name='m"} 1\n{x', model=""))
    assert odd == "m___1__x"


def test_ascend_lists_take_ranges_and_device_names_and_cuda_uuids_stay_whole():
    """The Ascend Docker Runtime reads ASCEND_VISIBLE_DEVICES as ids, ranges ("0-3") or
    names ("Ascend910-3"); a GPU UUID has dashes too and is one entry."""
    ranges = {"ASCEND_VISIBLE_DEVICES": "0-1,4-5"}
    assert placement.device_of(runner(dev("npu", 2)), ranges) == "4"
    named = {"ASCEND_VISIBLE_DEVICES": "Ascend910-6,Ascend910-7"}
    assert placement.device_of(runner(dev("npu", 1)), named) == "7"
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-0-1,GPU-2-3"}
    assert placement.device_of(runner(dev("cuda", 1)), uuids) == "gpu-2-3"
