"""Sessions in traces and in the simulator: the format's session fields, sessions inferred from block
chains, the agentic generator, and the session-aware policy against LRU and the tree optimum."""

import pytest

from tiercake.agent_traces import AgentShape, agentic_trace
from tiercake.analysis.cache_sim import SESSION_INFO, TierSpec, accesses, optimum, session_stream, simulate
from tiercake.policies import LRU, SessionAware, create_eviction
from tiercake.policies.base import SessionEvent, SessionState
from tiercake.traces import (
    TraceRecord,
    infer_sessions,
    oracle_announcements,
    read_trace,
    synthetic_trace,
    write_trace,
)

BLANK = dict(session=None, turn=None, pause_ms=None, closes=None, fork_of=None)


def rec(ids, t=0, partial=False, **extra):
    tokens = 512 * len(ids) - (100 if partial else 0)
    return TraceRecord(timestamp=t, input_length=tokens, output_length=1, hash_ids=tuple(ids), **extra)


def partition(records, families=False):
    """Sessions (or, ``families``, sessions with their forks) as sets of record indexes: names differ
    between the generator and the inference."""
    parent = {(r.tenant, r.session): (r.tenant, r.fork_of) for r in records if r.fork_of}
    groups: dict = {}
    for n, record in enumerate(records):
        name = (record.tenant, record.session)
        while families and name in parent:
            name = parent[name]
        groups.setdefault(name, set()).add(n)
    return sorted(map(sorted, groups.values()))


def test_session_fields_round_trip_and_bad_ones_are_refused(tmp_path):
    record = rec([1, 2], session="s1", turn=2, pause_ms=4000, closes=False, fork_of="s0")
    write_trace(tmp_path / "t.jsonl", [record, rec([3])])
    back = read_trace(tmp_path / "t.jsonl")
    assert back[0] == record and back[1].session is None
    assert "session" not in (tmp_path / "t.jsonl").read_text().splitlines()[1]
    for bad in ({"pause_ms": -1}, {"turn": -1}, {"session": ""}, {"pause_ms": float("nan")}):
        with pytest.raises(ValueError):
            rec([1], **bad)


def test_a_request_extending_a_whole_prompt_continues_its_session_and_a_second_one_forks():
    records = [
        rec([1, 2, 3], t=0, partial=True),  # full blocks 1, 2; block 3 is refilled next turn
        rec([1, 2, 4, 5], t=1000),  # extends the whole prompt: the same session
        rec([1, 2, 4, 5, 6], t=3000),  # extends turn 2: the same session again
        rec([1, 2, 4, 5, 7], t=3500),  # extends turn 2 too, which was already continued: a fork
        rec([1, 9], t=4000),  # shares only the first block (a system prompt): a new session
    ]
    out = infer_sessions(records)
    assert [r.session for r in out] == ["s0", "s0", "s0", "s3", "s4"]
    assert [r.turn for r in out] == [0, 1, 2, 0, 0]
    assert out[3].fork_of == "s0" and out[4].fork_of is None
    # the inference reads the past only: the pauses and closes the trace lacks stay unknown
    assert [(r.pause_ms, r.closes) for r in out] == [(None, None)] * 5
    told = oracle_announcements(out)  # what a client that knew its future would have said
    assert [r.pause_ms for r in told] == [1000, 2000, None, None, None]
    assert [r.closes for r in told] == [False, False, True, True, True]
    assert infer_sessions([]) == []
    with pytest.raises(ValueError):
        infer_sessions(records, min_blocks=0)


def test_tenants_never_share_a_session_and_given_sessions_are_kept():
    records = [rec([1, 2], tenant="a"), rec([1, 2, 3], tenant="b"), rec([1, 2, 4], tenant="a", session="mine")]
    out = infer_sessions(records)
    assert out[1].session != out[0].session and out[2].session == "mine"


def test_the_inference_recovers_the_generators_sessions():
    truth = agentic_trace(AgentShape(sessions=60, seed=4, subagent_p=0.0, tenants=2))
    assert any(r.pause_ms for r in truth) and not any(r.fork_of for r in truth)
    inferred = infer_sessions([r.model_copy(update=BLANK) for r in truth])
    assert partition(inferred) == partition(truth)
    assert [r.turn for r in inferred] == [r.turn for r in truth]
    assert not any(r.closes for r in inferred)  # nothing announced them
    assert [r.closes for r in oracle_announcements(inferred)] == [r.closes for r in truth]


def test_with_subagents_the_inference_recovers_each_family_and_its_forks():
    """A parent's next turn and its subagents all extend its last prompt: from blocks alone, the first
    to arrive continues the session and the others fork from it. Families come out whole."""
    truth = agentic_trace(AgentShape(sessions=60, seed=4, subagent_p=0.4, tenants=2))
    inferred = infer_sessions([r.model_copy(update=BLANK) for r in truth])
    assert partition(inferred, families=True) == partition(truth, families=True)
    assert len({r.session for r in inferred if r.fork_of}) == len({r.session for r in truth if r.fork_of})


def test_the_generator_is_seeded_and_checks_its_shape():
    assert agentic_trace(sessions=20, seed=3) == agentic_trace(sessions=20, seed=3)
    assert agentic_trace(sessions=20, seed=3) != agentic_trace(sessions=20, seed=4)
    for bad in (
        {"rate_per_s": 0},
        {"tool_pause_s": float("nan")},
        {"fan": (3, 2)},
        {"agent_share": 2},
        {"context_blocks": (5, 2)},
    ):
        with pytest.raises(ValueError):
            AgentShape(**bad)
    # a session's own context: its first prompt is that much longer than the shared system prompt
    plain, long = (
        agentic_trace(sessions=20, seed=3, subagent_p=0.0, system_blocks=2, context_blocks=c) for c in ((0, 0), (8, 8))
    )
    firsts = [{len(r.hash_ids) for r in records if r.turn == 0} for records in (plain, long)]
    # system prompt (2) + context + the turn's own blocks (1-4) + its partial block
    assert firsts[0] <= set(range(4, 8)) and firsts[1] <= set(range(12, 16)) and len(firsts[1]) > 1


def test_honest_clients_announce_a_share_abandon_sessions_and_compact_long_ones():
    """Generated clients tell what real ones do: a share of the agents' pauses, no close for an
    abandoned session, and a compacted conversation whose next prompt keeps only its system prompt
    (and a summary) of what came before."""
    base = dict(sessions=120, seed=6, subagent_p=0.0, agent_share=1.0, system_blocks=3)
    told = agentic_trace(**base)
    honest = agentic_trace(**base, announce_share=0.5, abandon_p=1.0, compact_p=1.0, compact_after=6)
    share = sum(r.pause_ms is not None for r in honest) / sum(r.pause_ms is not None for r in told)
    assert 0.35 < share < 0.65
    assert any(r.closes for r in told) and not any(r.closes for r in honest)
    last: dict = {}
    compacted = 0
    for record in honest:
        before = last.get(record.session)
        if before is not None and record.hash_ids[: len(before) - 1] != before[:-1]:
            compacted += 1
            assert record.hash_ids[:3] == before[:3]  # the system prompt stays; the rest is new
            assert not set(record.hash_ids[3:]) & set(before)
        last[record.session] = record.hash_ids
    assert compacted > 20
    said = agentic_trace(**base, announce_bias=0.5)
    assert [r.pause_ms and r.pause_ms * 2 for r in said] == pytest.approx([r.pause_ms for r in told], abs=2)
    bad_shapes = ({"announce_share": 1.5}, {"abandon_p": -0.1}, {"compact_p": float("nan")}, {"compact_after": 0})
    for bad in (*bad_shapes, {"announce_bias": 0}, {"announce_bias": float("inf")}):
        with pytest.raises(ValueError):
            AgentShape(**bad)


class Recording(LRU):
    name = "recording"

    def __init__(self):
        super().__init__()
        self.events: list[SessionEvent] = []

    def on_session(self, event):
        self.events.append(event)


def test_the_simulator_tells_every_tier_of_sessions_and_the_optimum_ignores_them():
    records = infer_sessions([rec([1, 2], t=0), rec([1, 2, 3], t=2000)])
    tiers = [TierSpec(1, Recording()), TierSpec(10, Recording())]
    stream = session_stream(records, "oracle")
    assert simulate(stream, tiers).accesses == 5
    for tier in tiers:
        states = [(e.state, e.at, e.resume_in) for e in tier.eviction.events]
        assert states == [
            (SessionState.ACTIVE, 0, None),
            (SessionState.PAUSED, 0, 2.0),
            (SessionState.ACTIVE, 2, None),
            (SessionState.CLOSED, 2, None),
        ]
    assert optimum(stream, 2).hit_ratio == optimum(accesses(records), 2).hit_ratio
    assert [e.resume_in for e in session_stream(records, "close") if isinstance(e, SessionEvent)] == [None] * 4
    with pytest.raises(ValueError):
        session_stream(records, "everything")


SHAPES = {  # other shapes than the conversation trace: the session-aware policy is not tuned to one
    "agents": lambda: agentic_trace(sessions=40, seed=1),
    "chats": lambda: agentic_trace(sessions=60, seed=2, agent_share=0.0),
    "subagent fans": lambda: agentic_trace(sessions=25, seed=3, subagent_p=0.5),
    "busy tenants": lambda: agentic_trace(sessions=50, seed=4, tenants=3, rate_per_s=2.0),
    "long, badly announced pauses": lambda: agentic_trace(
        sessions=40, seed=5, tool_pause_s=60, chat_pause_s=300, announce_sigma=1.0
    ),
    "inferred from the synthetic generator": lambda: infer_sessions(synthetic_trace(800, tenants=2, seed=5)),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_session_policy_is_never_below_lru_whatever_it_is_told(shape):
    records = SHAPES[shape]()
    blind = session_stream(records, "none")
    told: list[tuple[str, list]] = []  # levels that tell the same events (a trace without pauses): one run
    for info in SESSION_INFO[1:]:  # told nothing, it is its fallback (reuse: never below LRU, tested apart)
        stream = session_stream(records, info)
        if all(stream != other for _, other in told):
            told.append((info, stream))
    for capacity in (60, 200):
        lru = simulate(blind, [TierSpec(capacity, LRU())]).hit_ratio
        for info, stream in told:
            aware = simulate(stream, [TierSpec(capacity, create_eviction("session"))])
            assert aware.hit_ratio >= lru, (shape, capacity, info, aware.hit_ratio, lru)


def test_only_the_oracle_reads_the_future():
    """On a trace whose records carry sessions but no pauses or closes, "announced" and "close" tell
    the policy exactly what "open" does, and score the same; the oracle tells it more. Cut the trace
    short and every other level's events for what is left are unchanged: only the oracle's move."""
    records = infer_sessions(synthetic_trace(600, tenants=2, seed=7))
    assert all(r.session for r in records) and not any(r.pause_ms or r.closes for r in records)
    opened = session_stream(records, "open")
    assert session_stream(records, "announced") == opened == session_stream(records, "close")
    scores = {
        info: simulate(session_stream(records, info), [TierSpec(150, create_eviction("session"))]).hit_ratio
        for info in ("open", "close", "announced", "oracle")
    }
    assert scores["open"] == scores["close"] == scores["announced"] != scores["oracle"]
    cut = len(records) // 2
    for info in SESSION_INFO:
        short = session_stream(records[:cut], info)
        assert (session_stream(records, info)[: len(short)] == short) == (info != "oracle"), info


def share_of_optimum(records, capacity, info="announced", announce_sigma=0.0, fallback="lru"):
    policy = create_eviction("session", {"fallback": fallback})
    aware = simulate(session_stream(records, info, announce_sigma), [TierSpec(capacity, policy)]).hit_ratio
    return aware / optimum(accesses(records), capacity).hit_ratio


def test_on_a_generated_agentic_trace_announced_pauses_get_near_the_optimum():
    records = agentic_trace(sessions=150, seed=1)
    assert share_of_optimum(records, 300) >= 0.85
    assert share_of_optimum(records, 1000) >= 0.95


def tiercake(*args, cwd):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "tiercake.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.cluster
def test_the_session_commands_run_as_the_readme_prints_them(tmp_path):
    """trace generate --agentic, trace sessions, policy eval --sessions and bench sessions, end to end."""
    import json

    out = tiercake("trace", "generate", "--agentic", "--sessions", "40", "--out", "agents.jsonl", cwd=tmp_path)
    assert "wrote" in out
    truth = read_trace(tmp_path / "agents.jsonl")
    assert all(r.session and r.turn is not None for r in truth)
    write_trace(tmp_path / "blank.jsonl", [r.model_copy(update=BLANK) for r in truth])
    honest = ("--announce-share", "0.5", "--announce-sigma", "0.69", "--abandon", "1", "--compact", "0.1")
    tiercake("trace", "generate", "--agentic", "--sessions", "40", *honest, "--out", "honest.jsonl", cwd=tmp_path)
    import subprocess
    import sys

    refused = subprocess.run(
        [sys.executable, "-m", "tiercake.cli", "trace", "generate", "--agentic", "--abandon", "2", "--out", "x.jsonl"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2 and "probabilities" in refused.stderr and not (tmp_path / "x.jsonl").exists()
    told = read_trace(tmp_path / "honest.jsonl")
    assert len(told) > 100 and not any(r.closes for r in told if not r.fork_of)  # subagents still end
    assert 0 < sum(r.pause_ms is not None for r in told) < sum(r.pause_ms is not None for r in truth)
    out = tiercake("trace", "sessions", "blank.jsonl", "--out", "inferred.jsonl", cwd=tmp_path)
    inferred = read_trace(tmp_path / "inferred.jsonl")
    assert partition(inferred, families=True) == partition(truth, families=True)
    assert f"in {len({r.session for r in inferred})} sessions" in out

    tiercake(
        "policy", "eval", "session", "--trace", "blank.jsonl", "--capacity", "100,300", "--sessions", "oracle",
        "--json", "eval.json", "--plot", "eval.png", cwd=tmp_path,
    )  # fmt: skip
    figures = json.loads((tmp_path / "eval.json").read_text())["figures"]
    mine = [f for f in figures if f["name"] == "hit_ratio.session"]
    assert len(mine) == 2 and all(f["params"]["sessions"] == "oracle" for f in mine)
    for f in mine:
        lru = next(
            g for g in figures if g["name"] == "hit_ratio.lru" and g["params"]["capacity"] == f["params"]["capacity"]
        )
        assert lru["value"] <= f["value"] <= f["limit"] + 1e-12

    tiercake("bench", "sessions", "--quick", "--trace", "blank.jsonl", "--json", "bench.json", cwd=tmp_path)
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["bench"] == "sessions"
    names = {(f["name"], f["params"]["trace"]) for f in report["figures"]}
    for trace in ("agentic (generated)", "agentic, honest clients (generated)", "blank.jsonl"):
        assert {("vs_best_blind.session.announced", trace), ("hit_ratio.session.oracle", trace)} <= names
    for f in report["figures"]:
        if f["name"].startswith("router."):  # the session router against ttft, simulated
            assert f["params"]["trace"] == "agentic (generated)" and f["value"] > 0 and f["limit"] > 0
            continue
        assert f["name"].startswith(("hit_ratio.", "vs_best_blind.")) and 0 <= f["value"] <= 1
        if f["name"].startswith("hit_ratio."):
            assert f["ratio"] <= 1 + 1e-9  # nothing beats the optimum
    routed = {f["name"]: f for f in report["figures"] if f["name"].startswith("router.")}
    assert routed.keys() == {"router.bytes_moved", "router.local_hit_ratio", "router.ttft_mean_s"}


def test_two_tenants_one_past_its_quota_and_the_other_kept_at_its_floor():
    """A loud tenant (many agent sessions) and a quiet one (a few long chats) share a 400-block tier:
    the loud one never retains more than its quota, and the quiet one, kept at its floor, hits more
    than without it."""
    loud = agentic_trace(AgentShape(sessions=120, seed=8, rate_per_s=2.0, system_prompts=1))
    quiet = agentic_trace(
        AgentShape(sessions=6, seed=9, agent_share=0.0, chat_turns=(8, 12), chat_pause_s=120, system_prompts=1)
    )
    records = sorted(
        [r.model_copy(update={"tenant": "loud"}) for r in loud]
        + [r.model_copy(update={"tenant": "quiet"}) for r in quiet],
        key=lambda r: r.timestamp,
    )
    stream = session_stream(records, "announced")
    seen: list[float] = []

    class Checked(SessionAware):
        def on_session(self, event):
            super().on_session(event)
            seen.append(self.describe()["held_by_tenant"].get("loud", 0))

    simulate(stream, [TierSpec(400, Checked(LRU(), tenant_quota=150))])
    # past the quota only while an active turn holds what it computes, until its pause
    assert seen and max(seen) <= 150 + max(len(r.hash_ids) for r in loud)
    assert sum(s > 150 for s in seen) < 0.05 * len(seen)
    blind = simulate(stream, [TierSpec(400, SessionAware(LRU()))])
    floored = simulate(stream, [TierSpec(400, SessionAware(LRU(), tenant_floor=150))])
    assert blind.tenant_accesses["quiet"] > 200
    assert floored.tenant_hit_ratio("quiet") > blind.tenant_hit_ratio("quiet"), (
        floored.tenant_hit_ratio("quiet"),
        blind.tenant_hit_ratio("quiet"),
    )


def test_the_live_benchs_pool_is_a_share_of_every_conversation_at_its_longest():
    from tiercake.bench import sessions_live
    from tiercake.traces import TraceRecord

    def record(session: str, blocks: int) -> TraceRecord:
        return TraceRecord(
            timestamp=0, input_length=512 * blocks, output_length=1, hash_ids=list(range(blocks)), session=session
        )

    records = [record("a", 4), record("a", 10), record("b", 6)]  # a at its longest: 10 blocks; b: 6
    kv_per_token = 4096
    whole = 16 * sessions_live.TOKENS_PER_BLOCK * kv_per_token
    assert sessions_live.pool_bytes(records, kv_per_token, 1.0) == whole
    assert sessions_live.pool_bytes(records, kv_per_token, 0.5) == whole // 2
    quick = sessions_live.scenarios(quick=True)
    assert [s.name for s in quick] == ["fleet"] and [s.name for s in sessions_live.scenarios(False)] == [
        "fleet",
        "staggered",
    ]
    assert all(r.session for r in agentic_trace(quick[0].shape))
