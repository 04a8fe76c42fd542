"""A death the placement backend reports while a data-plane join waits gives that rendezvous up at once,
naming the stage ([Note: a death during a join] in launcher/coordinator/stage_failover.py).

What breaks when these fail: a Ray actor whose node vanishes silently (its Load or Rejoin call never
answers, nothing refuses a connection) holds the start or the fail-over attempt until its 600 s timeout,
although the backend already said which stage died; or a late report about a replaced ring ends the
join of the ring that replaced it.
"""

from __future__ import annotations

import queue
import threading
import types

import pytest

from launcher.coordinator.coordinator import Coordinator
from launcher.coordinator.request_handle import PipelineError
from launcher.coordinator.session import PipelineSession
from launcher.coordinator.stage_failover import rejoin_all
from launcher.coordinator.stage_link import StageLink
from pipeline.engine.stage_assembly import StageLoadSpec
from pipeline.model.partition import LayerRange
from tests.conftest import LockSayingWhenContended, wait_for
from workers.channel import DataPlaneGroup, RendezvousAbandoned, hold_listener

DEATH = "stage 1 (Ray actor pid 42 on node 10.0.0.2 id 0123456789ab) died: its node was lost"


class FakeBackend:
    """A placement backend's `watch`: `report` calls the watcher as a backend's death thread does."""

    def __init__(self) -> None:
        self.on_death = None

    def watch(self, on_death) -> None:
        self.on_death = on_death

    def report(self, stage_index: int, description: str) -> None:
        threading.Thread(target=self.on_death, args=(stage_index, description), daemon=True).start()


def _coordinator(link: StageLink, generation: int) -> Coordinator:
    coord = Coordinator.__new__(Coordinator)
    coord.events, coord.generation, coord.link = queue.SimpleQueue(), generation, link
    return coord


def _session_watching(backend: FakeBackend, coord: Coordinator) -> None:
    session = PipelineSession.__new__(PipelineSession)
    session.coordinator = coord
    backend.watch(session._on_stage_death(coord.generation))


def _specs(port: int) -> list[StageLoadSpec]:
    return [StageLoadSpec(model_dir="unused", stage_index=i, num_stages=2, layer_range=LayerRange(2 * i, 2 * i + 2),
                          max_num_seqs=1, max_model_len=16, dist_master_port=port) for i in range(2)]


@pytest.mark.timeout(120)
def test_a_death_the_backend_reports_during_a_rejoin_ends_the_attempt_at_once_naming_the_stage():
    """Stage 0 (a real rank 1) Rejoins; stage 1's node vanished: its Rejoin call never answers. The
    backend reports the death: the attempt fails at once with the backend's line, and stage 0's join ends.
    Before, the attempt waited for the round's own timeout (here 30 s; 600 s in the coordinator)."""
    port, released, stage0 = hold_listener("127.0.0.1"), threading.Event(), {}
    link = StageLink(num_stages=2, master_addr="127.0.0.1", master_port=port, timeout_s=5.0, max_num_seqs=1,
                     record_timeline=False)
    backend, coord = FakeBackend(), _coordinator(link, generation=3)
    _session_watching(backend, coord)

    def survivor_rejoins(request, timeout):
        try:
            DataPlaneGroup(master_addr="127.0.0.1", master_port=request.dist_master_port, rank=1, world_size=3,
                           timeout_s=5.0, connect_timeout_s=60.0)
        except RendezvousAbandoned as exc:
            stage0["error"] = exc
            raise

    def vanished(request, timeout):
        backend.report(1, DEATH)  # the backend notices what the control plane never will
        released.wait(60.0)

    stubs = [types.SimpleNamespace(Rejoin=survivor_rejoins), types.SimpleNamespace(Rejoin=vanished)]
    try:
        with pytest.raises(PipelineError) as failed:
            rejoin_all(stubs, _specs(port), set(), link.join, timeout_s=30.0, attempt=3, abandon=link.close)
        assert DEATH in str(failed.value) and "\n" not in str(failed.value), failed.value
        assert "not done within" not in str(failed.value)
        assert wait_for(lambda: "error" in stage0, timeout_s=30.0), "stage 0 still waits at the rendezvous"
        kind, (generation, error) = coord.events.get_nowait()  # the report still reaches the engine thread
        assert (kind, generation, str(error)) == ("error", 3, DEATH)
    finally:
        released.set()
        link.close()


def test_a_death_during_the_start_gives_up_the_coordinators_join():
    link = StageLink(num_stages=2, master_addr="127.0.0.1", master_port=41000, timeout_s=5.0, max_num_seqs=1,
                     record_timeline=False)
    backend, coord = FakeBackend(), _coordinator(link, generation=0)
    _session_watching(backend, coord)
    backend.on_death(1, DEATH)
    assert link.abandoned.is_set() and link.abandoned.reason == DEATH


def test_a_late_report_about_a_replaced_ring_leaves_the_new_join_alone():
    link = StageLink(num_stages=2, master_addr="127.0.0.1", master_port=41000, timeout_s=5.0, max_num_seqs=1,
                     record_timeline=False)
    coord = _coordinator(link, generation=4)
    coord.fail(PipelineError(DEATH), generation=3)  # a death the fail-over to generation 4 already handles
    assert not link.abandoned.is_set()
    kind, (generation, error) = coord.events.get_nowait()  # queued as before: the engine thread drops it
    assert (kind, generation, str(error)) == ("error", 3, DEATH)


def test_a_death_after_the_join_leaves_the_ring_to_the_fail_over():
    link = StageLink(num_stages=2, master_addr="127.0.0.1", master_port=41000, timeout_s=5.0, max_num_seqs=1,
                     record_timeline=False)
    link.channel = object()  # joined
    _coordinator(link, generation=0).fail(PipelineError(DEATH))
    assert not link.abandoned.is_set()  # the engine thread's recovery closes it, after the queued report


def test_a_fail_over_attempt_has_its_new_link_before_the_backend_watch_resumes(monkeypatch):
    """A stage that died while the watch was paused is reported as the watch resumes: that report must
    find the attempt's own link (still joining), not the replaced ring's (joined: left alone). Before,
    the watch resumed first and such a report gave nothing up."""
    from launcher.coordinator import stage_failover

    old = types.SimpleNamespace(close=lambda: None, channel=object())
    coord = _coordinator(old, generation=1)
    coord._receivers_stopping, coord.stubs, coord.channels, coord._unloaded = threading.Event(), [], [], set()
    coord._new_link = lambda port: types.SimpleNamespace(master_port=port, channel=None, join=None, close=None)
    seen = []
    fo = types.SimpleNamespace(pause_watch=lambda: None, resume_watch=lambda: seen.append(coord.link),
                               dead_stages=lambda: [], data_port=lambda: 41001, load_specs=lambda port: [])
    monkeypatch.setattr(stage_failover, "restart_dead_stages", lambda *a, **k: {1})
    monkeypatch.setattr(stage_failover, "wait_reachable", lambda *a, **k: None)

    def rejoin_all_stops(*args, **kwargs):
        raise PipelineError("stop here")

    monkeypatch.setattr(stage_failover, "rejoin_all", rejoin_all_stops)
    with pytest.raises(PipelineError, match="stop here"):
        coord._restart_and_replay(fo)
    assert len(seen) == 1 and seen[0] is not old and seen[0].master_port == 41001


class _FailOverRunsMidReport(Coordinator):
    """A coordinator whose engine thread starts a fail-over (generation bumped, then the link replaced) right
    after a death report read the generation: the report's thread was descheduled there (a Ray watcher is
    not joined by pause_watch)."""

    def __init__(self, link: StageLink, new_link: StageLink, generation: int) -> None:
        self.events, self.link, self._generation, self._new_link_later = queue.SimpleQueue(), link, generation, new_link

    @property
    def generation(self) -> int:
        seen = self._generation
        if self._new_link_later is not None:  # the engine thread runs now: _restart_and_replay's order
            self._generation += 1
            self.link, self._new_link_later = self._new_link_later, None
        return seen


def test_a_report_about_the_ring_a_fail_over_is_replacing_never_gives_up_the_new_join():
    """Before, `fail` read the generation (still the old one), then `self.link` (already the attempt's new
    one), and gave the new attempt's join up for a death that attempt is about to restart."""
    old, new = (StageLink(num_stages=2, master_addr="127.0.0.1", master_port=port, timeout_s=5.0, max_num_seqs=1,
                          record_timeline=False) for port in (41000, 41001))
    coord = _FailOverRunsMidReport(old, new, generation=2)
    coord.fail(PipelineError(DEATH), generation=2)
    assert coord.link is new and not new.abandoned.is_set()
    assert old.abandoned.reason == DEATH  # the replaced ring's join (if it still waited) heard it


def _fake_data_plane(monkeypatch, group_class) -> None:
    """StageLink.join builds `group_class` for its DataPlaneGroup, over a stand-in channel and send queue."""
    monkeypatch.setattr("launcher.coordinator.stage_link.DataPlaneGroup", group_class)
    monkeypatch.setattr("launcher.coordinator.stage_link.Channel",
                        lambda group, **kwargs: types.SimpleNamespace(group=group))
    monkeypatch.setattr("launcher.coordinator.stage_link.SendQueue",
                        lambda channel: types.SimpleNamespace(abandon=lambda: None))


def test_a_join_given_up_as_its_group_formed_names_the_reason(monkeypatch):
    """A death report that lands just as rank 0's group forms: `join` closes the new group and raises,
    naming the report's reason, not only the port (the reviewer's race: the flag is set after the
    channel check of `abandon_join` but before `join` looks at it)."""
    link = StageLink(num_stages=2, master_addr="127.0.0.1", master_port=1, timeout_s=5.0, max_num_seqs=1,
                     record_timeline=False)
    closed = []

    class FormingGroup:  # forms, while the backend's report gives the join up
        def __init__(self, **kwargs) -> None:
            kwargs["abandoned"].give_up(DEATH)

        def close(self) -> None:
            closed.append(True)

    _fake_data_plane(monkeypatch, FormingGroup)
    with pytest.raises(RendezvousAbandoned, match="abandoned as it formed: stage 1 .* died: its node was lost"):
        link.join()
    assert closed == [True]


def test_a_death_reported_as_the_join_forms_never_marks_a_joined_link_abandoned(monkeypatch):
    """The reviewer's interleaving, forced: `abandon_join` has looked at the channel (none yet) and is about
    to set the flag when `join`'s group forms and `join` publishes its channel. Now the join waits for
    `abandon_join` ([Note: joined or abandoned, never both] in launcher/coordinator/stage_link.py), then
    closes its group and raises naming the reason. Before, the join returned a joined link whose flag
    `abandon_join` then set (a death report read as a given-up join while the ring ran)."""
    link = StageLink(num_stages=2, master_addr="127.0.0.1", master_port=1, timeout_s=5.0, max_num_seqs=1,
                     record_timeline=False)
    join_went_on, closed, outcome = threading.Event(), [], {}
    link._join_lock = LockSayingWhenContended(join_went_on)  # the join waits for it, or (before) did not

    class FormedGroup:
        def __init__(self, **kwargs) -> None:
            pass

        def close(self) -> None:
            closed.append(True)

    _fake_data_plane(monkeypatch, FormedGroup)

    def join() -> None:
        try:
            link.join()
            outcome["joined"] = True
        except RendezvousAbandoned as exc:
            outcome["error"] = exc
        finally:
            join_went_on.set()

    class GiveUpAfterTheJoinRan(type(link.abandoned)):
        def give_up(self, reason: str) -> None:  # abandon_join, past its look at the channel
            threading.Thread(target=join, daemon=True).start()
            assert join_went_on.wait(timeout=30.0), "the join neither ended nor waited for abandon_join"
            super().give_up(reason)

    link.abandoned = GiveUpAfterTheJoinRan()
    link.abandon_join(DEATH)
    assert wait_for(lambda: outcome, timeout_s=30.0)
    assert not (link.abandoned.is_set() and link.channel is not None), "a joined link was marked abandoned"
    assert "error" in outcome and f"abandoned as it formed: {DEATH}" in str(outcome["error"]), outcome
    assert link.channel is None and closed == [True]
