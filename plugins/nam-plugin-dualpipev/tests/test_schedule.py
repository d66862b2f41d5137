"""The DualPipeV order as plain data: complete, dependency-safe, free of deadlocks (in the order and in the
exchanges the executor runs), with the bubble numbers the README states. Pure Python, no torch."""

from __future__ import annotations

import pytest

from nam_core.errors import ConfigError
from nam_plugin_dualpipev.schedule import (
    B,
    Exchange,
    F,
    Layout,
    Message,
    Op,
    ScheduleError,
    check_order,
    compare_with_1f1b,
    dualpipev_order,
    exchange_plan,
    forward_only,
    one_f_one_b_order,
    simulate,
    simulate_exchanges,
)

SIZES = [(pp, m) for pp in (2, 3, 4) for m in (2 * pp, 2 * pp + 1, 3 * pp, 4 * pp + 3)]


@pytest.mark.parametrize("pp, m", SIZES)
def test_every_rank_runs_one_f_and_one_b_per_chunk_and_microbatch_f_first(pp, m):
    order = dualpipev_order(pp, m)
    check_order(order, Layout(pp), m)
    for ops in order:
        assert len(ops) == 4 * m
        for chunk in (0, 1):
            for i in range(m):
                assert ops.index(Op(F, chunk, i)) < ops.index(Op(B, chunk, i))


@pytest.mark.parametrize("pp, m", SIZES)
def test_the_order_runs_to_the_end_and_every_rank_computes_the_same_work(pp, m):
    sim = simulate(dualpipev_order(pp, m), pp)
    assert sim.steps == [4 * m] * pp
    assert sim.busy == [6.0 * m] * pp  # 2 chunks x (F 1 + B 2) per micro-batch
    assert sim.makespan >= 6.0 * m


@pytest.mark.parametrize("pp, m", SIZES)
def test_the_executors_exchanges_do_not_deadlock_even_when_every_send_waits(pp, m):
    order = dualpipev_order(pp, m)
    for o in (order, forward_only(order)):
        plan = exchange_plan(o, pp)
        assert [[a for a in acts if isinstance(a, Op)] for acts in plan] == o  # the ops, in order
        simulate_exchanges(plan, pp)


@pytest.mark.parametrize("pp, m", [(2, 5), (3, 7), (4, 9)])
def test_each_link_receives_in_the_order_it_sends(pp, m):
    """NCCL matches sends to receives by order alone: the two sequences of every link must be equal."""
    plan = exchange_plan(dualpipev_order(pp, m), pp)
    sent, received = {}, {}
    for rank, actions in enumerate(plan):
        for a in actions:
            if isinstance(a, Exchange):
                for msg in a.sends:
                    sent.setdefault((rank, msg.dst), []).append(msg)
                for msg in a.recvs:
                    received.setdefault((msg.src, rank), []).append(msg)
    assert sent == received
    assert len(sent) == 2 * (pp - 1)  # each neighbour pair, both directions; the V's turn sends nothing


def test_a_backward_swapped_before_its_forward_is_a_deadlock():
    order = dualpipev_order(2, 4)
    ops = order[0]
    f, b = ops.index(Op(F, 1, 0)), ops.index(Op(B, 1, 0))
    ops[f], ops[b] = ops[b], ops[f]
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 at B1\(mb 0\) .* waits for F\(stage 3, mb 0\)"):
        simulate(order, 2)
    with pytest.raises(ScheduleError, match="deadlock"):
        exchange_plan(order, 2)


def test_the_turn_of_the_v_is_a_dependency():
    """On the last rank chunk 1 reads chunk 0's output of the same micro-batch, with no message."""
    order = dualpipev_order(2, 4)
    last = order[1]
    assert last[:2] == [Op(F, 0, 0), Op(F, 1, 0)]
    last[0], last[1] = last[1], last[0]
    with pytest.raises(ScheduleError, match=r"rank 1 at F1\(mb 0\) .* waits for F\(stage 1, mb 0\)"):
        simulate(order, 2)


def test_missing_and_repeated_ops_are_named():
    order = dualpipev_order(2, 4)
    order[1][order[1].index(Op(B, 0, 3))] = Op(B, 0, 2)
    named = r"rank 1 .* missing \['B0\(mb 3\)'\], repeated or foreign \['B0\(mb 2\)'\]"
    with pytest.raises(ScheduleError, match=named):
        check_order(order, Layout(2), 4)


def test_the_exchange_simulator_can_fail():
    """Two ranks that each send first and receive second, in separate batches: a deadlock when every send
    waits for its receive (the case the executor's plan is built to avoid)."""
    a = Message("act", 0, 0, 0, 1)
    b = Message("grad", 1, 0, 1, 0)
    plan = [[Exchange(sends=(a,)), Exchange(recvs=(b,))], [Exchange(sends=(b,)), Exchange(recvs=(a,))]]
    with pytest.raises(ScheduleError, match="deadlock in the exchanges"):
        simulate_exchanges(plan, 2)
    simulate_exchanges([[Exchange(sends=(a,), recvs=(b,))], [Exchange(sends=(b,), recvs=(a,))]], 2)


@pytest.mark.parametrize("pp, m, problem", [
    (1, 8, r"needs pp >= 2, found pp=1"),
    (2, 3, r"at pp=2 needs at least 2 x pp = 4 micro-batches per step, found 3"),
    (4, 7, r"at pp=4 needs at least 2 x pp = 8 micro-batches per step, found 7"),
])
def test_sizes_the_schedule_cannot_take_are_config_errors(pp, m, problem):
    with pytest.raises(ConfigError, match=problem) as e:
        dualpipev_order(pp, m)
    assert e.value.hint


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_the_1f1b_baseline_has_its_textbook_bubble(pp):
    """(P - 1) x (F + B) per rank, with 1F1B's stage of two chunks: F = 2, B = 4. A check on the simulator."""
    sim = simulate(one_f_one_b_order(pp, 16), pp, shape="line", f_cost=2.0, b_cost=4.0)
    assert sim.idle == [6.0 * (pp - 1)] * pp


# The README's table ("Bubble and memory"): chunk-forward units, F = 1 and B = 2 per chunk.
README = {
    (2, 8): (51, 3, 54, 6, 5, 4),
    (2, 16): (99, 3, 102, 6, 5, 4),
    (4, 8): (59, 11, 66, 18, 9, 8),
    (4, 16): (107, 11, 114, 18, 9, 8),
}


@pytest.mark.parametrize("pp, m", sorted(README))
def test_the_readme_numbers(pp, m):
    row = compare_with_1f1b(pp, m)
    got = (row["dualpipev_step"], row["dualpipev_bubble_per_rank"], row["1f1b_step"], row["1f1b_bubble_per_rank"],
           row["dualpipev_peak_activations"], row["1f1b_peak_activations"])
    assert got == README[pp, m]


@pytest.mark.parametrize("pp", range(2, 9))
@pytest.mark.parametrize("extra", [0, 3, None])
def test_the_readme_patterns_bubble_4p_minus_5_and_2p_plus_1_activations_on_every_rank(pp, extra):
    m = 4 * pp if extra is None else 2 * pp + extra
    sim = simulate(dualpipev_order(pp, m), pp)
    assert sim.idle == [4.0 * pp - 5] * pp
    assert sim.peak_activations == [2.0 * pp + 1] * pp


@pytest.mark.parametrize("pp, m, dualpipev, line", [(2, 8, 56, 54), (2, 16, 112, 102), (4, 8, 62, 66),
                                                     (4, 16, 118, 114)])
def test_the_readme_numbers_when_every_send_waits_for_its_receive(pp, m, dualpipev, line):
    v = simulate_exchanges(exchange_plan(dualpipev_order(pp, m), pp), pp)
    one = simulate_exchanges(exchange_plan(one_f_one_b_order(pp, m), pp, shape="line"), pp,
                             f_cost=2.0, b_cost=4.0)
    assert (v.makespan, one.makespan) == (dualpipev, line)
