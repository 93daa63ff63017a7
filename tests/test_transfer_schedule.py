"""The fetcher's scheduler, decision by decision: hand-built download states and source views, the time passed
in. No threads, sockets, clocks or sleeps: every property here is a property of `choose` alone."""

from __future__ import annotations

import copy

import pytest

from swarmrl.protocol.manifest import ShardRef
from swarmrl.transfer.fetcher import FetchConfig
from swarmrl.transfer.schedule import (
    ENDGAME_FIRST_S,
    Consult,
    DownloadState,
    Fail,
    Pick,
    SourceView,
    Wait,
    choose,
    needs_sources,
)
from swarmrl.transfer.sources import WAIT

SHARDS = [ShardRef(sha256=f"{i:02x}" * 32, size=100) for i in range(6)]
SHA = [s.sha256 for s in SHARDS]


def peer(name: str, *held: int) -> SourceView:
    return SourceView(key=name, name=name, seed=False, held={SHA[i] for i in held})


def seed(name: str = "origin") -> SourceView:
    return SourceView(key=name, name=name, seed=True, held=set(SHA))


def state(n: int = len(SHARDS), now: float = 0.0) -> DownloadState:
    return DownloadState.begin(SHARDS[:n], now)


def config(**kw: object) -> FetchConfig:
    return FetchConfig(**{"spread_holders": False, **kw})


def pick(decision: object) -> tuple[int, str]:
    """(shard index, source key) of a Pick."""
    assert isinstance(decision, Pick), decision
    return SHA.index(decision.shard.sha256), decision.source.key


def run(st: DownloadState, sources: list[SourceView], now: float, cfg: FetchConfig,
        hints: dict[str, object] | None = None) -> object:
    """`choose`, answering every Consult from `hints` (missing: no opinion) as the executor does."""
    answers: dict[str, object] = {}
    while True:
        d = choose(st, sources, now, cfg, answers)
        if not isinstance(d, Consult):
            return d
        answers[d.seed.key] = (hints or {}).get(d.seed.key)


def test_rarest_shard_first_and_seeds_only_for_what_no_peer_holds():
    # shard 0: 3 peer holders, 1: 2, 2: 1, 3..5: none.
    peers = [peer("p1", 0, 1, 2), peer("p2", 0, 1), peer("p3", 0)]
    st, cfg = state(), config(max_parallel_peers=1)
    taken = []
    for _ in range(3):
        d = run(st, [*peers, seed()], 0.0, cfg)
        i, key = pick(d)
        taken.append(i)
        st.start(d, 0.0)
        st.delivered(SHA[i])
        st.end(d, 0.0, 1.0, ok=True)
    assert taken == [2, 1, 0]  # rarest first
    d = run(st, [*peers, seed()], 1.0, cfg)
    assert pick(d) == (3, "origin")  # nothing left that a peer holds: the seed, in rank order


def test_choose_reads_the_state_and_never_changes_it():
    st = state()
    st.failed[SHA[0]] = {"p1"}
    before = copy.deepcopy(st)
    for now in (0.0, 5.0, 500.0):
        run(st, [peer("p1", 0, 1), peer("p2", 3), seed()], now, config())
    assert st == before


def test_a_seed_is_consulted_with_its_queue_of_rarest_shards_and_its_hint_is_followed():
    st, cfg = state(), config()
    sources = [peer("p1", 0), seed()]
    first = choose(st, sources, 0.0, cfg)
    # p1 is free and holds shard 0: no seed needed yet.
    assert pick(first) == (0, "p1")
    st.start(first, 0.0)
    d = choose(st, sources, 0.0, cfg)
    assert isinstance(d, Consult) and d.seed.key == "origin"
    assert [SHA.index(s.sha256) for s in d.queue] == [1, 2, 3, 4, 5]  # shard 0 is in flight
    assert pick(choose(st, sources, 0.0, cfg, {"origin": SHARDS[4]})) == (4, "origin")  # its suggestion
    assert pick(choose(st, sources, 0.0, cfg, {"origin": None})) == (1, "origin")  # no opinion: the first
    assert pick(choose(st, sources, 0.0, cfg, {"origin": SHARDS[0]})) == (1, "origin")  # not in its queue


def test_a_seeds_wait_moves_on_to_the_next_seed_and_otherwise_waits():
    st, cfg = state(), config()
    two = [seed("seed-peer"), seed("origin")]
    # Each shard goes to the first seed that has not failed it: the second seed is asked only for shards the
    # first failed. A WAIT from the first seed leaves its shards alone this round.
    assert isinstance(choose(st, two, 0.0, cfg, {"seed-peer": WAIT}), Wait)
    st.failed_by(SHA[5], "seed-peer", "seed-peer: reset")
    d = choose(st, two, 0.0, cfg, {"seed-peer": WAIT})
    assert isinstance(d, Consult) and d.seed.key == "origin" and [s.sha256 for s in d.queue] == [SHA[5]]
    assert pick(choose(st, two, 0.0, cfg, {"seed-peer": WAIT, "origin": None})) == (5, "origin")


def test_spread_holders_asks_the_least_used_peer_first():
    """p1 alone holds the two rarest shards and already has a request open. Rarest first asks p1 again; spreading
    asks p2 (idle) for the rarest shard it holds."""
    sources = [peer("p1", 0, 1, 2, 3, 4, 5), peer("p2", 2, 3, 4, 5)]
    for spread, expected in ((False, (1, "p1")), (True, (2, "p2"))):
        st, cfg = state(), config(spread_holders=spread, requests_per_peer=2)
        st.start(Pick(SHARDS[0], sources[0]), 0.0)
        assert pick(choose(st, sources, 0.0, cfg)) == expected


def test_max_parallel_peers_counts_peers_and_a_peer_in_use_gets_its_second_request():
    sources = [peer("p1", *range(6)), peer("p2", *range(6))]
    st, cfg = state(), config(max_parallel_peers=1, requests_per_peer=2)
    first = choose(st, sources, 0.0, cfg)
    st.start(first, 0.0)
    second = choose(st, sources, 0.0, cfg)
    assert second.source.key == first.source.key  # the one peer allowed, its second request
    st.start(second, 0.0)
    assert st.peer_in_flight == 1 and st.load[first.source.key] == 2
    assert isinstance(choose(st, sources, 0.0, cfg), Wait)  # that peer is full; the other may not be asked
    st.end(second, 0.0, 1.0, ok=False)  # a request ends: the peer has room again
    assert choose(st, sources, 1.0, cfg).source.key == first.source.key


def test_a_busy_source_is_left_alone_until_the_time_it_gave():
    sources = [peer("p1", 0), seed()]
    st, cfg = state(), config()
    st.busy("p1", until=10.0)
    assert isinstance(choose(st, sources, 9.9, cfg), Consult)  # p1 skipped: the seed is next
    assert pick(choose(st, sources, 10.0, cfg)) == (0, "p1")


def test_a_source_that_failed_a_shard_no_longer_counts_as_its_holder():
    sources = [peer("p1", 0, 1), seed()]
    st, cfg = state(), config()
    st.failed_by(SHA[0], "p1", "p1: timeout")
    st.failed_by(SHA[1], "p1", "p1: timeout")
    d = choose(st, sources, 0.0, cfg)
    assert isinstance(d, Consult) and d.queue[0].sha256 == SHA[0]  # shard 0 is the seed's again, first in line


def test_a_failed_request_puts_its_shard_back_at_the_head_of_the_line():
    st, cfg = state(), config()
    sources = [seed()]
    d = run(st, sources, 0.0, cfg)
    assert pick(d) == (0, "origin")
    st.start(d, 0.0)
    assert isinstance(run(st, sources, 0.0, cfg), Wait)  # the seed's one request slot is taken
    st.failed_by(SHA[0], "other", "other: reset")
    st.end(d, 0.0, 1.0, ok=False)
    assert next(iter(st.pending)) == SHA[0] and SHA[0] in st.remaining and not st.in_flight


def test_no_good_copy_anywhere_fails_and_says_whether_the_shard_is_simply_gone():
    cfg = config()
    st = state()
    st.failed_by(SHA[2], "origin", "origin: bad bytes (hash mismatch)")
    d = run(st, [seed()], 0.0, cfg)
    assert isinstance(d, Fail) and d.shard == SHA[2] and not d.unavailable and "bad bytes" in d.reason
    st = state()
    st.failed_by(SHA[2], "origin", "origin: 404", not_held=True)
    d = run(st, [seed()], 0.0, cfg)
    assert isinstance(d, Fail) and d.unavailable
    st = state()  # a peer still holds it: not a failure yet
    st.failed_by(SHA[2], "origin", "origin: 404", not_held=True)
    assert not isinstance(run(st, [peer("p1", 2), seed()], 0.0, cfg), Fail)


def test_without_seeds_a_download_fails_only_after_the_stall_timeout_with_nothing_in_flight():
    cfg = config(stall_timeout_s=30.0)
    st = state(now=100.0)
    assert isinstance(choose(st, [peer("p1")], 129.0, cfg), Wait)
    d = choose(st, [peer("p1")], 131.0, cfg)
    assert isinstance(d, Fail) and "6 missing shards" in d.reason
    st.start(Pick(SHARDS[0], peer("p2", 0)), 131.0)
    assert isinstance(choose(st, [peer("p1")], 500.0, cfg), Wait)  # something is still on its way


# -- the end game ----------------------------------------------------------------------------------------------


def in_endgame(holders: list[SourceView], began: float = 0.0) -> tuple[DownloadState, list[Pick]]:
    """Two shards left, both in flight from the first holder since `began`; four earlier downloads took 1 s."""
    st = state(2, now=began)
    picks = []
    for i in range(2):
        p = Pick(SHARDS[i], holders[0])
        st.start(p, began)
        picks.append(p)
    st.durations.extend([1.0, 1.0, 1.0, 1.0])
    return st, picks


@pytest.mark.parametrize("patience", [2.0, 4.0])
def test_the_end_game_doubles_only_a_download_slower_than_patience_times_the_median(patience):
    holders = [peer("slow", 0, 1), peer("fast", 0, 1)]
    st, _ = in_endgame(holders)
    cfg = config(endgame_patience=patience, requests_per_peer=2)
    assert not st.pending
    assert isinstance(choose(st, holders, patience - 0.01, cfg), Wait)
    assert not needs_sources(st, patience - 0.01, cfg)  # the executor need not even list the sources
    d = choose(st, holders, patience, cfg)
    assert isinstance(d, Pick) and d.duplicate and d.source.key == "fast"
    assert st.start(d, patience)  # a duplicate
    # At most two requests per shard: the other shard may still be doubled, this one never again.
    d2 = choose(st, holders, patience, cfg)
    assert isinstance(d2, Pick) and d2.shard.sha256 != d.shard.sha256
    st.start(d2, patience)
    assert isinstance(choose(st, holders, patience + 100, cfg), Wait)


def test_before_any_download_ended_the_end_game_waits_its_first_delay_and_patience_0_doubles_at_once():
    holders = [peer("a", 0, 1), peer("b", 0, 1)]
    st, _ = in_endgame(holders)
    st.durations.clear()
    assert isinstance(choose(st, holders, ENDGAME_FIRST_S - 0.01, config()), Wait)
    assert isinstance(choose(st, holders, ENDGAME_FIRST_S, config()), Pick)
    assert isinstance(choose(st, holders, 0.0, config(endgame_patience=0.0)), Pick)
    assert isinstance(choose(st, holders, 100.0, config(endgame=False)), Wait)


def test_the_end_game_asks_peers_first_and_only_the_first_seed_for_a_shard_a_peer_is_slow_with():
    slow, s1, s2 = peer("slow", 0, 1), seed("seed-peer"), seed("origin")
    st, _ = in_endgame([slow])
    d = choose(st, [slow, s1, s2], 10.0, config())
    assert isinstance(d, Pick) and d.duplicate and d.source.key == "seed-peer"  # never the second seed
    st.start(d, 10.0)
    assert isinstance(choose(st, [slow, s1, s2], 20.0, config(origin_parallel=2)), Pick)  # shard 1, same seed
    # A shard in flight from a seed is never doubled by a seed.
    st2 = state(1)
    st2.start(Pick(SHARDS[0], s1), 0.0)
    assert isinstance(choose(st2, [s1, s2], 100.0, config(origin_parallel=2)), Wait)
    assert pick(choose(st2, [s1, s2, peer("p", 0)], 100.0, config())) == (0, "p")


def test_the_first_copy_wins_and_a_late_one_changes_nothing_but_the_load():
    a, b = peer("a", 0), peer("b", 0)
    st = state(1)
    first, second = Pick(SHARDS[0], a), Pick(SHARDS[0], b, duplicate=True)
    st.start(first, 0.0)
    assert st.start(second, 5.0)
    assert st.delivered(SHA[0])
    st.end(second, 5.0, 6.0, ok=True)
    assert not st.remaining and not st.pending and st.durations[-1] == 1.0
    assert not st.delivered(SHA[0])  # the slow copy arrives late
    st.end(first, 0.0, 9.0, ok=True)
    assert st.load == {"a": 0, "b": 0} and st.peer_in_flight == 0 and not st.in_flight


def test_ties_are_broken_by_the_salt_not_by_the_order_of_the_sources():
    sources = [peer(f"p{i}", *range(6)) for i in range(8)]
    chosen = {choose(DownloadState.begin(SHARDS, 0.0, salt=salt), sources, 0.0, config()).source.key
              for salt in range(64)}
    assert len(chosen) >= 4  # equal peers share the first request between them
    again = {choose(DownloadState.begin(SHARDS, 0.0, salt=7), sources, 0.0, config()).source.key for _ in range(5)}
    assert len(again) == 1  # the same state, the same answer
