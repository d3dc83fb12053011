"""Slow, independent calls a module's tests read (fresh interpreters that import vLLM, about
11 s of one core each), run side by side from the first test that asks for one."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


def side_by_side(
    call: Callable[..., Any], args_by_key: Mapping[str, tuple]
) -> Iterator[dict[str, Future]]:
    """For a module fixture: yields `{key: future of call(*args)}`, one worker per core. At
    teardown, calls a `-k` selection never read are cancelled before they start."""
    pool = ThreadPoolExecutor(min(len(args_by_key), os.cpu_count() or 2))
    yield {key: pool.submit(call, *args) for key, args in args_by_key.items()}
    pool.shutdown(cancel_futures=True)
