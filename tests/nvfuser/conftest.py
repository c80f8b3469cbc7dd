"""``world`` for the string conditions of the ports' xfail marks (see gaps.py): the number of ranks
where the test body runs (spawned gloo ranks or torchrun's), 0 in the pytest process that only spawns
ranks and collects their outcomes."""

import os

import pytest


def _world() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):  # torchrun, before the group
        return int(os.environ["WORLD_SIZE"])
    return 0


@pytest.hookimpl
def pytest_markeval_namespace(config):
    return {"world": _world()}
