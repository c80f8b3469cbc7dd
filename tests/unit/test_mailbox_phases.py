"""The mailboxes' phases (``symm.Mailbox``), on the host: what lets a CUDA graph captured at each phase
replay for good (``graphs.GraphedRun``), and the mailboxes a captured plan keeps to itself
(``symm.OwnMailboxes``). The kernels that use them run on GPUs: tests/gpu/test_overlap_gpu.py."""

from __future__ import annotations

import torch

from tp_fusion.runtime import symm


def _box(phase: int, n: int = 2, parts: int = 3) -> symm.Mailbox:
    """A mailbox's host state alone (no symmetric memory)."""
    box = object.__new__(symm.Mailbox)
    box.rank, box.n, box.parts, box.phase = 0, n, parts, phase
    return box


def test_a_flag_is_set_again_two_calls_later_with_the_other_bit():
    """A wait for this call's bit can neither pass on the call before's push (another flag word) nor
    on the push two calls before (the same word, the other bit), so no flag is ever reset."""
    flags = {phase: (_box(phase)._flag_offset(1, 2), _box(phase)._bit()) for phase in range(symm.Mailbox.PHASES)}
    for phase, (word, bit) in flags.items():
        next_word, _ = flags[(phase + 1) % 4]
        two_on_word, two_on_bit = flags[(phase + 2) % 4]
        assert next_word != word and two_on_word == word and two_on_bit != bit
    assert len(set(flags.values())) == 4
    assert all(_box(p)._flag_offset(1, 2) < 4 * 2 * 2 * 3 for p in range(4))  # within the [2, n, parts] words


def test_the_phases_come_round_every_four_calls():
    box = _box(0)
    seen = []
    for _ in range(8):
        seen.append((box.phase % 2, box._bit()))  # the buffer and the bit a call uses
        box.start_call()
    assert box.phase == 0 and seen[:4] == seen[4:] and len(set(seen[:4])) == 4


def test_own_mailboxes_are_apart_from_the_shared_ones(monkeypatch):
    class Box:
        def __init__(self, parts, part_shape, dtype, pg, device):
            self.phase = 0

    monkeypatch.setattr(symm, "Mailbox", Box)
    monkeypatch.setattr(symm, "_mailboxes", {})
    monkeypatch.setattr(symm.dist, "group_name", lambda pg: "world")
    args = ("allgather_linear", 1, (4, 8), torch.bfloat16, None, torch.device("cuda", 0))
    shared = symm.mailbox(*args)
    with symm.OwnMailboxes() as own:
        mine = symm.mailbox(*args)
        assert mine is not shared and symm.mailbox(*args) is mine and list(own.boxes.values()) == [mine]
    assert symm.mailbox(*args) is shared
    mine.phase = 3
    phases = own.phases()
    mine.phase = 1
    own.set_phases(phases)
    assert mine.phase == 3 and shared.phase == 0
    # A later scope, maybe at a freed one's address, never finds that one's mailboxes (a rank that
    # reused one would skip a creation its peers make collectively: round 14 hung so on 2x H200).
    seen = [shared, mine]
    del own
    for _ in range(4):
        with symm.OwnMailboxes():
            box = symm.mailbox(*args)
        assert all(box is not old for old in seen)
        seen.append(box)


def test_a_plan_whose_graphs_are_gone_runs_eagerly_on_their_mailboxes(monkeypatch):
    """Once a plan's graphs are released (before the process group goes) or a recapture failed on this
    rank, its eager runs use the graphs' own mailboxes: the peers' replays use those, and their phases
    are kept in step with the replays. On the shared mailboxes the ranks would wait on different flags."""
    from tp_fusion import DataType, FusionDefinition
    from tp_fusion.runtime.runner import Runner

    with FusionDefinition() as fd:
        x = fd.define_tensor([4, 8], dtype=DataType.Float)
        fd.add_output(fd.ops.mul(x, x))
    runner = Runner(fd.compile([[4, 8]]))
    scopes = []
    monkeypatch.setattr(runner, "run_eager",
                        lambda inputs, numbers: scopes.append(symm._owner[-1] if symm._owner else None))

    class Released:
        alive = False
        mailboxes = symm.OwnMailboxes()

    runner.run([torch.ones(4, 8)])
    runner.graph = Released()
    runner.run([torch.ones(4, 8)])
    assert scopes == [None, Released.mailboxes] and not symm._owner
