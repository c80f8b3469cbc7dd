"""pytest plugin: the ``multidevice_test`` fixture, like nvFuser's, for tests that run on every rank.

Write a test as in nvFuser's ``tests/python/multidevice``; the test body runs on every rank::

    import torch
    from tp_fusion import DataType, FusionDefinition, ParallelType
    from tp_fusion.multidevice import DeviceMesh

    def test_pointwise(multidevice_test):
        d = multidevice_test.size
        mesh = DeviceMesh(torch.arange(d))
        with FusionDefinition() as fd:
            x = fd.define_tensor([-1, 4], dtype=DataType.Float)
            y = fd.ops.relu(x)
            fd.add_output(y)
            for tv in (x, y):
                tv.set_device_mesh(mesh)
            x.axis(0).parallelize(ParallelType.mesh_x)
        full = torch.randn(d, 4)  # the same on every rank: the fixture seeds torch with 0
        (out,) = fd.execute([multidevice_test.shard_tensor(full, x)])
        torch.testing.assert_close(out.cpu(), multidevice_test.shard_tensor(full.relu(), y).cpu())

Run it either way; both run the same file:

- ``python -m pytest tests/nvfuser``: each test runs on spawned CPU ranks joined by gloo, once per
  world size of ``--multidevice-ranks`` (default ``1,2,4``), shown as ``test_pointwise[ranks2]``.
  Per world size, one set of ranks runs every selected test (``pytest`` inside each rank) and the
  ranks' outcomes are reported here: a test fails if it fails on any rank. The ranks judge ``xfail``
  marks (a strict one that passes there fails the test), and their verdict is what this process reports.
  A rank whose test raised aborts its group as it leaves the test, so no peer waits out a collective
  it will not join, and the next test joins a fresh group.
- ``torchrun --nproc_per_node=N -m pytest tests/nvfuser``: each test runs once on torchrun's ranks,
  CUDA and NCCL when there are GPUs, else CPU and gloo.

The fixture gives ``rank``, ``size``, ``local_rank``, ``local_size``, ``device``,
``shard_tensor(full, tv_or_sharding)`` (the local shard, on ``device``), ``shard_tensor_1d(full, dim,
mesh)`` and ``barrier()``; it seeds torch with 0 before the test and ends with a barrier. The
``setup_default_process_group`` fixture (nvFuser's, for tests that call torch.distributed directly)
and the ``mpi`` marker are accepted too. ``@pytest.mark.ranks(2, 4)`` runs a test only at those world
sizes; ``pytest.skip`` inside a test skips one.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from dataclasses import dataclass

import pytest

RANK_FIXTURES = ("multidevice_test", "setup_default_process_group")
_PARAM = "_multidevice_ranks"
_spawned_world = _spawned_rank = 0  # in ranks started by this plugin: their world size and rank
_spawned_store = None  # and the store their process group met through
_generation = 0  # how many groups they joined through it
_ended = 0  # how many rank tests they ended
_RAISED = pytest.StashKey[bool]()  # in a spawned rank: whether a test's body raised there


@dataclass
class MultideviceTest:
    """This rank's view of the process group, handed to a test by the ``multidevice_test`` fixture."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    device: object  # torch.device

    def shard_tensor(self, full, tv_or_sharding):
        """This rank's shard of ``full`` under a TensorView's (or a Sharding's) sharding, on ``device``."""
        from tp_fusion.multidevice import shard_tensor

        return shard_tensor(full, tv_or_sharding, self.rank).to(self.device)

    def shard_tensor_1d(self, full, dim: int, mesh):
        """This rank's chunk of ``full`` split evenly along ``dim`` over a 1-D ``mesh``, on ``device``."""
        if self.rank not in mesh:
            return full.new_empty((0,)).to(self.device)
        if full.shape[dim] % mesh.size:
            from tp_fusion.errors import ShardingError

            raise ShardingError(f"shard_tensor_1d: dim {dim} of a {list(full.shape)} tensor (extent {full.shape[dim]}) "
                                f"does not split evenly over the {mesh.size} devices of {mesh}")
        return full.chunk(mesh.size, dim)[mesh.devices.index(self.rank)].contiguous().to(self.device)

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        from tp_fusion.runtime import dist

        if dist.world_size() > 1:
            dist.barrier()


def _rank_mode() -> bool:
    """True in a rank: spawned by this plugin, or started by torchrun (the test of tp_fusion.launch,
    spelled out here so that loading the plugin imports no torch)."""
    return bool(_spawned_world) or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _world_size() -> int:
    return _spawned_world or int(os.environ["WORLD_SIZE"])


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def setup_default_process_group():
    """The default torch.distributed process group: joined once per session (under torchrun from its
    environment; spawned ranks are already in one) and left at the end if this fixture joined it."""
    if not _rank_mode():
        yield None
        return
    import torch

    from tp_fusion.launch import init_from_env
    from tp_fusion.runtime import dist

    global _spawned_store
    joined = not dist.is_initialized()
    device = init_from_env() if joined else torch.device("cpu")
    if _spawned_world:
        from torch.distributed.distributed_c10d import _get_default_store

        _spawned_store = _get_default_store()
        _join_fresh_group()
    yield device
    if joined:
        dist.destroy_process_group()


@pytest.fixture
def multidevice_test(setup_default_process_group, request):
    """A ``MultideviceTest`` for this rank; None in the pytest process that only collects the ranks' results."""
    if not _rank_mode():
        yield None
        return
    import torch

    from tp_fusion.fusion_definition import restart_creation_order
    from tp_fusion.runtime import dist

    rank, size = dist.rank(), dist.world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    fixture = MultideviceTest(rank, size, local_rank, local_size, setup_default_process_group)
    torch.manual_seed(0)
    restart_creation_order()  # an earlier test may have created fusions on some ranks only
    yield fixture
    if _spawned_store is None:
        fixture.barrier()
    else:
        _end_spawned_test(request.node.stash.get(_RAISED, False))


def _end_spawned_test(raised: bool) -> None:
    """Spawned ranks, after a rank test: the ranks' barrier, through the launch's store rather than the
    process group. A rank whose test raised (a failed assert, a skip or xfail on that rank only) may
    have peers waiting in a collective it will never join: it aborts its process group first, so that
    they error out at once instead of at the group's timeout. Where any rank's test raised, every rank
    leaves its group and the next test joins a fresh one (``pytest_runtest_setup``)."""
    global _ended
    from tp_fusion.runtime import dist, faults

    if raised:
        faults.abort_process_groups()
    _ended += 1
    key = f"tp_fusion_pytest_end/{_ended}/"
    _spawned_store.set(f"{key}{_spawned_rank}", "1" if raised else "0")
    if any(_spawned_store.get(f"{key}{r}") == b"1" for r in range(_spawned_world)):
        dist.destroy_process_group()


# --- plugin hooks -------------------------------------------------------------------------------


def pytest_addoption(parser):
    group = parser.getgroup("tp_fusion")
    group.addoption("--multidevice-ranks", default="1,2,4", metavar="N,N,...",
                    help="world sizes at which tests using the multidevice_test fixture run on spawned gloo "
                         "ranks (not under torchrun, which gives its own)")
    parser.addini("multidevice_timeout", "seconds one set of spawned ranks may take for all its tests",
                  default="600")


def pytest_configure(config):
    config.addinivalue_line("markers", "mpi: a test that runs on every rank (nvFuser's marker; no effect here)")
    config.addinivalue_line("markers", "ranks(*sizes): run this multidevice test only at these world sizes")
    if not _rank_mode():
        config.pluginmanager.register(_Spawner(config), "tp_fusion_spawner")


def _is_rank_test(fixturenames) -> bool:
    return any(name in fixturenames for name in RANK_FIXTURES)


def _marked_worlds(node) -> tuple[int, ...] | None:
    marker = node.get_closest_marker("ranks")
    return None if marker is None else tuple(marker.args)


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc):
    if _rank_mode() or not _is_rank_test(metafunc.fixturenames):
        return
    worlds = [int(w) for w in metafunc.config.getoption("multidevice_ranks").split(",") if w.strip()]
    only = _marked_worlds(metafunc.definition)
    worlds = [w for w in worlds if only is None or w in only]
    metafunc.fixturenames.append(_PARAM)
    metafunc.parametrize(_PARAM, worlds, ids=[f"ranks{w}" for w in worlds])


def pytest_runtest_setup(item):
    if _rank_mode() and _is_rank_test(getattr(item, "fixturenames", ())):
        only, world = _marked_worlds(item), _world_size()
        if only is not None and world not in only:
            pytest.skip(f"runs on {' or '.join(map(str, only))} ranks, not {world}")
        if _spawned_store is not None:
            from tp_fusion.runtime import dist

            if not dist.is_initialized():
                _join_fresh_group()  # a failure inside a plan in an earlier test aborted the group


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """In a spawned rank: note whether the test's body raised, for the fixture's teardown."""
    report = yield
    if _spawned_store is not None and call.when == "call":
        item.stash[_RAISED] = call.excinfo is not None
    return report


def _join_fresh_group() -> None:
    """Spawned ranks: leave the default group if any and join a new one through the launch's store.

    Done once tests are collected, because a group made before modules that tests import can
    outlive an abort (see ``tp_fusion.runtime.dist.warm_up_before_init``), and after a test whose
    failure aborted every rank's groups (tp_fusion's fault propagation), so later tests still run.
    """
    global _generation
    import torch.distributed as tdist

    from tp_fusion.runtime import dist

    dist.destroy_process_group()
    _generation += 1
    store = tdist.PrefixStore(f"tp_fusion_pytest_{_generation}", _spawned_store)
    tdist.init_process_group("gloo", store=store, rank=_spawned_rank, world_size=_spawned_world,
                             timeout=datetime.timedelta(seconds=120))


def _world_of(item) -> int:
    """The world size ``item`` runs at on spawned ranks; 0 for a test of this process."""
    return getattr(item, "callspec", None) and item.callspec.params.get(_PARAM, 0) or 0


def _rank_nodeid(item) -> str:
    """The id the ranks know ``item`` by: its own, less the world-size parameter (added last)."""
    suffix = f"ranks{item.callspec.params[_PARAM]}"
    head, ids = item.nodeid[:-1].rsplit("[", 1)
    return head if ids == suffix else f"{head}[{ids.removesuffix('-' + suffix)}]"


_VERDICT = pytest.StashKey[str]()  # a rank test's outcome on the ranks (``_Spawner._verdict``)


class _Spawner:
    """In the pytest process: runs the rank tests of one world size on spawned ranks, once, and
    reports each test's outcome from them."""

    def __init__(self, config):
        self.config = config
        self.outcomes: dict[int, tuple[dict, str | None]] = {}
        self.last: dict[int, object] = {}  # world size -> the last of its tests

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items):
        if not self.config.pluginmanager.hasplugin("timeout"):
            return
        for item in items:
            if _world_of(item):
                item.add_marker(pytest.mark.timeout(0))  # the ranks' own timeouts bound them

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem):
        world = _world_of(pyfuncitem)
        if not world:
            return None
        if world not in self.outcomes:
            batch = [i for i in pyfuncitem.session.items if _world_of(i) == world]
            self.last[world] = batch[-1]
            self.outcomes[world] = self._run(world, batch)
        verdict, text = self._verdict(pyfuncitem, world)
        pyfuncitem.stash[_VERDICT] = verdict
        if verdict == "failed":
            pytest.fail(text, pytrace=False)
        if verdict == "xfailed":
            pytest.xfail(text)
        if verdict == "skipped":
            pytest.skip(text)
        return True

    def _verdict(self, item, world: int) -> tuple[str, str]:
        """The outcome of ``item`` over the ranks that ran it ("failed", "xfailed", "skipped" or
        "passed") and its reason."""
        results, error = self.outcomes[world]
        ranks = results.get(_rank_nodeid(item))
        if ranks is None or len(ranks) < world:
            return "failed", f"this test did not finish on all {world} ranks: {error or 'no report'}"
        failed = {r: text for r, (outcome, text) in sorted(ranks.items()) if outcome == "failed"}
        if failed:
            return "failed", "\n".join(f"===== rank {r} =====\n{text}" for r, text in failed.items())
        if error and item is self.last[world]:
            return "failed", f"the ranks did not exit cleanly after their last test: {error}"
        xfailed = [text for outcome, text in ranks.values() if outcome == "xfailed"]
        if xfailed:  # an expected failure on a rank (a strict xfail that passed there failed above)
            return "xfailed", xfailed[0]
        if all(outcome == "skipped" for outcome, _ in ranks.values()):
            return "skipped", ranks[0][1] if 0 in ranks else next(iter(ranks.values()))[1]
        return "passed", ""

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item, call):
        """The ranks have applied the test's xfail marks already, so their verdict stands, whatever
        this process's own reading of the marks would make of it: a strict xfail that passed on the
        ranks failed there and fails here, and a test that passed there passes here."""
        report = yield
        verdict = item.stash.get(_VERDICT, None)
        if call.when == "call" and verdict in ("failed", "passed") \
                and (report.outcome != verdict or hasattr(report, "wasxfail")):
            report.outcome = verdict
            if hasattr(report, "wasxfail"):
                del report.wasxfail
            if verdict == "passed":
                report.longrepr = None
        return report

    def _run(self, world: int, items) -> tuple[dict, str | None]:
        """Run ``items`` (in their order) on ``world`` spawned ranks: ({nodeid: {rank: (outcome,
        text)}}, the launch's error or None)."""
        from tp_fusion.launch import RanksFailed, run_on_ranks

        nodeids = list(dict.fromkeys(_rank_nodeid(i) for i in items))
        root = self.config.rootpath
        args = [str(root / n) for n in nodeids] + [
            f"--rootdir={root}", "-p", "no:cacheprovider", "-q", "--no-header", "-o", "addopts=",
            "-o", "timeout_method=thread", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
        if self.config.inipath is not None:
            args += ["-c", str(self.config.inipath)]
        if not self.config.pluginmanager.has_plugin("tp_fusion"):  # loaded by -p, not as installed: pass it on
            args += ["-p", "no:tp_fusion", "-p", "tp_fusion.testing"]
        deadline = float(self.config.getini("multidevice_timeout"))
        with tempfile.TemporaryDirectory(prefix="tp_fusion_pytest_") as out:
            error = None
            try:
                run_on_ranks(_pytest_on_rank, world, args, out, timeout_s=min(120.0, deadline),
                             deadline_s=deadline)
            except RanksFailed as e:
                error = str(e)
            results: dict[str, dict[int, tuple[str, str]]] = {}
            for r in range(world):
                path = os.path.join(out, f"rank{r}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        for nodeid, outcome in json.load(f).items():
                            results.setdefault(nodeid, {})[r] = tuple(outcome)
        return results, error


class _Reporter:
    """In a spawned rank: record each test's outcome (failed in any phase, else xfailed, skipped or
    passed) and its reason."""

    def __init__(self):
        self.outcomes: dict[str, list[str]] = {}

    def pytest_runtest_logreport(self, report):
        previous = self.outcomes.get(report.nodeid)
        if previous is not None and previous[0] == "failed":
            return
        if report.failed:
            self.outcomes[report.nodeid] = ["failed", f"({report.when}) {report.longreprtext}"]
        elif report.skipped and hasattr(report, "wasxfail"):
            self.outcomes[report.nodeid] = ["xfailed", report.wasxfail]
        elif report.skipped and previous is None:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.outcomes[report.nodeid] = ["skipped", reason]
        elif report.when == "call" and report.passed:
            self.outcomes[report.nodeid] = ["passed", ""]


def _pytest_on_rank(rank: int, world: int, args: list[str], out: str) -> None:
    """A spawned rank: run pytest on ``args`` inside the process group, write the outcomes to ``out``."""
    global _spawned_world, _spawned_rank
    _spawned_world, _spawned_rank = world, rank
    reporter = _Reporter()
    pytest.main(args, plugins=[reporter])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(reporter.outcomes, f)
