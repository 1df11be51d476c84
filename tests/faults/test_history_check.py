"""The checker of the fault scenarios finds what it is meant to find (a checker that cannot
fail would make every scenario pass)."""

from __future__ import annotations

from tests.faults.fault_app import payload_digest
from tests.faults.history import CallRow, History, Shard, TruthRow, check, repeats_per_fault

SHARD, OTHER_SHARD = (1, 7), (1, 8)
A, B, C = (2, 1), (2, 2), (3, 1)  # coalescing groups: category, object


def payload(row_id: int) -> str:
    """The digest of row ``row_id``'s payload (each row's is its own)."""
    return payload_digest({"n": row_id})


def rows(*spec: tuple[int, tuple[int, int]]) -> list[TruthRow]:
    return [TruthRow(row_id, SHARD, group, payload(row_id)) for row_id, group in spec]


class Log:
    """Builds a history event by event, with increasing ``seq`` and times."""

    def __init__(self) -> None:
        self.seq = 0
        self.calls: list[CallRow] = []
        self.deletions: list[tuple[int, int]] = []

    def call(
        self,
        row_id: int,
        group: tuple[int, int],
        outcome: str = "ok",
        *,
        overlap: bool = False,
        shard: Shard = SHARD,
        payload_of: int | None = None,
        pid: int = 1,
        during: tuple[float, float] | None = None,
        coalesced: int | None = None,
    ) -> None:
        """A call of ``row_id``, told ``group`` and ``shard`` as the row's (the handler's
        message says so; the truth may not), and given the payload of row ``payload_of``
        (its own by default), told that it covers ``coalesced`` rows (not told by default).
        It runs from its ``seq`` for half a second (from 1.5 s earlier with ``overlap``), or
        ``during`` the given times."""
        self.seq += 1
        start, finish = float(self.seq) - (1.5 if overlap else 0.0), self.seq + 0.5
        if during is not None:
            start, finish = during
        given = payload(row_id if payload_of is None else payload_of)
        self.calls.append(
            CallRow(self.seq, row_id, shard, group, pid, start, finish, outcome, given, coalesced)
        )

    def delete(self, *ids: int) -> None:
        for row_id in ids:
            self.seq += 1
            self.deletions.append((self.seq, row_id))

    def history(self, truth: list[TruthRow], remaining: set[int] | None = None) -> History:
        return History(truth, self.calls, self.deletions, remaining or set())


def test_a_correct_history_passes() -> None:
    truth = rows((1, A), (2, B), (3, A), (4, C))
    log = Log()
    log.call(3, A, "failed")
    log.call(3, A)  # the retry covers rows 1 and 3
    log.call(2, B)
    log.delete(1, 3, 2)
    log.call(4, C)
    log.delete(4)
    verdict = check(log.history(truth), rolled_back=[5])
    assert not verdict.problems, verdict.summary()
    assert (verdict.rows, verdict.calls, verdict.failed_calls, verdict.duplicates) == (4, 4, 1, 0)


def crash_before_the_delete() -> Log:
    """Process 1 handles groups A and B and is killed before the round's delete; process 2
    repeats them, handles C, and deletes."""
    log = Log()
    log.call(1, A, pid=1)
    log.call(2, B, pid=1)
    log.call(1, A, pid=2)
    log.call(2, B, pid=2)
    log.call(3, C, pid=2)
    log.delete(1, 2, 3)
    return log


def test_a_crash_before_the_delete_repeats_the_round_as_duplicates() -> None:
    truth = rows((1, A), (2, B), (3, C))
    verdict = check(
        crash_before_the_delete().history(truth), rolled_back=[], max_duplicates=2, killed_pids=[1]
    )
    assert not verdict.problems, verdict.summary()
    assert verdict.duplicates == 2
    assert verdict.repeats == [
        "call 3 (pid 2) of row 1 in group (2, 1) of shard (1, 7) repeated call 1 (pid 1)",
        "call 4 (pid 2) of row 2 in group (2, 2) of shard (1, 7) repeated call 2 (pid 1)",
    ]


def test_duplicates_above_the_ceiling_are_a_problem() -> None:
    truth = rows((1, A), (2, B), (3, C))
    history = crash_before_the_delete().history(truth)
    assert check(history, rolled_back=[], max_duplicates=1).excess_duplicates == [
        "2 duplicate calls, more than the 1 allowed; first: ["
        "'call 3 (pid 2) of row 1 in group (2, 1) of shard (1, 7) repeated call 1 (pid 1)', "
        "'call 4 (pid 2) of row 2 in group (2, 2) of shard (1, 7) repeated call 2 (pid 1)']"
    ]
    # Where no fault can repeat a call, the ceiling is zero: the default.
    verdict = check(history, rolled_back=[])
    assert len(verdict.excess_duplicates) == 1 and verdict.problems == verdict.excess_duplicates


def test_a_repeat_of_a_call_of_a_process_that_was_not_killed_is_a_problem() -> None:
    truth = rows((1, A), (2, B), (3, C))
    history = crash_before_the_delete().history(truth)
    verdict = check(history, rolled_back=[], max_duplicates=2, killed_pids=[2])
    assert verdict.excess_duplicates == [
        "call 3 (pid 2) of row 1 repeated call 1 of pid 1, which was not killed",
        "call 4 (pid 2) of row 2 repeated call 2 of pid 1, which was not killed",
    ]


def test_repeats_are_counted_against_the_process_whose_calls_they_repeat() -> None:
    truth = rows((1, A), (2, B), (3, C))
    history = crash_before_the_delete().history(truth)
    verdict = check(history, rolled_back=[], max_duplicates=2, max_repeats_per_pid=2)
    assert verdict.repeats_by_pid == {1: 2}
    assert verdict.excess_duplicates == []
    verdict = check(history, rolled_back=[], max_duplicates=2, max_repeats_per_pid=1)
    assert verdict.excess_duplicates == [
        "2 duplicate calls repeated calls of pid 1, more than the 1 allowed per process"
    ]


def test_repeats_are_counted_against_the_last_fault_before_they_started() -> None:
    """Faults that the worker survives (its connections terminated) leave no killed process to
    blame: each repeat is the cost of the last fault before it, and one before any fault is
    unexplained. The repeats here start at 3 and 4."""
    truth = rows((1, A), (2, B), (3, C))
    verdict = check(crash_before_the_delete().history(truth), rolled_back=[], max_duplicates=2)
    assert [call.seq for call in verdict.repeat_calls] == [3, 4]
    assert repeats_per_fault(verdict.repeat_calls, [2.5]) == ([2], 0)
    assert repeats_per_fault(verdict.repeat_calls, [2.5, 3.5]) == ([1, 1], 0)
    assert repeats_per_fault(verdict.repeat_calls, [3.5, 9.0]) == ([1, 0], 1)


def test_a_row_deleted_before_its_handler_succeeded_is_lost() -> None:
    truth = rows((1, A), (2, A))
    log = Log()
    log.call(1, A)  # covers row 1 only: row 2 was not seen by this call
    log.delete(1, 2)
    verdict = check(log.history(truth), rolled_back=[])
    assert verdict.lost == [
        "row 2 deleted (seq 3) before it was handled",
        "latest row 2 of group (2, 1) in (1, 7) never handled",
    ]


def test_a_failed_call_does_not_cover_its_rows() -> None:
    log = Log()
    log.call(1, A, "failed")
    log.delete(1)
    assert check(log.history(rows((1, A))), rolled_back=[]).lost


def test_a_row_left_in_the_table_is_lost_unless_expected() -> None:
    log = Log()
    log.call(1, A, "failed")
    assert check(log.history(rows((1, A)), remaining={1}), rolled_back=[]).lost
    assert not check(log.history(rows((1, A)), remaining={1}), rolled_back=[], pending_ok=[1]).lost


def test_handling_a_group_before_a_lower_pending_row_is_an_order_violation() -> None:
    log = Log()
    log.call(2, B)
    log.call(1, A)
    log.delete(1, 2)
    verdict = check(log.history(rows((1, A), (2, B))), rolled_back=[])
    assert len(verdict.order_violations) == 1 and not verdict.lost


def test_passing_a_failed_head_is_an_order_violation() -> None:
    log = Log()
    log.call(1, A, "failed")
    log.call(2, B)  # the head failed: the shard must wait
    log.delete(2)
    log.call(1, A)
    log.delete(1)
    assert len(check(log.history(rows((1, A), (2, B))), rolled_back=[]).order_violations) == 1


def test_a_call_for_a_rolled_back_row_is_found() -> None:
    log = Log()
    log.call(9, A)
    verdict = check(log.history(rows()), rolled_back=[9])
    assert verdict.phantom_calls == ["call 1 handled rolled-back row 9"]


def test_overlapping_calls_of_one_shard_are_found() -> None:
    log = Log()
    log.call(1, A)
    log.call(2, B, overlap=True)
    log.delete(1, 2)
    assert len(check(log.history(rows((1, A), (2, B))), rolled_back=[]).overlaps) == 1


def test_a_call_is_judged_by_its_rows_truth_not_by_what_it_was_told() -> None:
    # Row 2 (group B) is delivered as if it were of group A: that must not cover row 1.
    log = Log()
    log.call(2, A)
    log.delete(1, 2)
    verdict = check(log.history(rows((1, A), (2, B))), rolled_back=[])
    assert verdict.mismatched_calls == [
        "call 1 of row 2 named group (2, 1) of shard (1, 7); the row is in group (2, 2) of "
        "shard (1, 7)"
    ]
    assert "row 1 deleted (seq 2) before it was handled" in verdict.lost
    assert "latest row 1 of group (2, 1) in (1, 7) never handled" in verdict.lost


def test_a_call_told_another_rows_shard_is_mismatched_and_covers_only_its_own_row() -> None:
    truth = [TruthRow(1, SHARD, A, payload(1)), TruthRow(2, OTHER_SHARD, A, payload(2))]
    log = Log()
    log.call(2, A, shard=SHARD)  # row 2 is of the other shard
    log.delete(1, 2)
    verdict = check(log.history(truth), rolled_back=[])
    assert verdict.mismatched_calls == [
        "call 1 of row 2 named group (2, 1) of shard (1, 7); the row is in group (2, 1) of "
        "shard (1, 8)"
    ]
    assert verdict.lost == [
        "row 1 deleted (seq 2) before it was handled",
        "latest row 1 of group (2, 1) in (1, 7) never handled",
    ]


def test_a_call_told_a_shard_or_group_that_no_row_has_is_a_phantom_call() -> None:
    log = Log()
    log.call(1, A, shard=(2, 99))  # no committed row is in shard (2, 99)
    log.call(2, (9, 9))  # nor in group (9, 9)
    log.delete(1, 2)
    verdict = check(log.history(rows((1, A), (2, B))), rolled_back=[])
    assert verdict.phantom_calls == [
        "call 1 of row 1 named group (2, 1) of shard (2, 99), which no committed row has",
        "call 2 of row 2 named group (9, 9) of shard (1, 7), which no committed row has",
    ]
    assert not verdict.mismatched_calls


def test_a_call_given_an_older_rows_payload_is_mismatched() -> None:
    log = Log()
    log.call(3, A, payload_of=1)  # the newest row of the group, with the oldest one's payload
    log.delete(1, 3)
    log.call(2, B, payload_of=99)  # a payload that no committed row has
    log.delete(2)
    verdict = check(log.history(rows((1, A), (2, B), (3, A))), rolled_back=[])
    assert verdict.mismatched_calls == [
        "call 1 of row 3 was given row 1's payload",
        "call 4 of row 2 was given no committed row's payload",
    ]
    assert verdict.problems == verdict.mismatched_calls


def test_a_row_that_vanished_without_a_deletion_is_lost() -> None:
    log = Log()
    log.call(1, A)
    log.call(2, B)
    log.delete(1)  # row 2 is gone from the table, but no delete of it was recorded
    verdict = check(log.history(rows((1, A), (2, B)), remaining=set()), rolled_back=[])
    assert verdict.lost == ["row 2 vanished without a deletion"]


def test_a_row_handled_after_its_group_was_deleted_is_an_order_violation() -> None:
    log = Log()
    log.call(1, A)
    log.delete(1)
    log.call(1, A)  # the row is gone: nothing may handle it any more
    verdict = check(log.history(rows((1, A))), rolled_back=[])
    assert verdict.order_violations == ["call 3 handled row 1 after its group was deleted"]
    assert verdict.problems == verdict.order_violations


def test_a_call_for_a_row_never_written_is_a_phantom_call() -> None:
    log = Log()
    log.call(1, A)
    log.call(5, A)  # no row 5 was committed or rolled back
    log.delete(1)
    verdict = check(log.history(rows((1, A))), rolled_back=[4])
    assert verdict.phantom_calls == ["call 2 handled never written row 5"]
    assert verdict.problems == verdict.phantom_calls


def test_a_call_nested_inside_another_of_its_shard_is_an_overlap() -> None:
    log = Log()
    log.call(1, A, during=(0.0, 10.0))
    log.call(2, B, during=(2.0, 3.0))  # starts and ends while call 1 runs
    log.call(3, C, during=(4.0, 5.0))  # so does this one
    log.delete(1, 2, 3)
    verdict = check(log.history(rows((1, A), (2, B), (3, C))), rolled_back=[])
    assert verdict.overlaps == [
        "shard (1, 7): call 2 (pid 1) started while call 1 (pid 1) was running",
        "shard (1, 7): call 3 (pid 1) started while call 1 (pid 1) was running",
    ]


def test_calls_of_different_shards_may_run_at_the_same_time() -> None:
    truth = [TruthRow(1, SHARD, A, payload(1)), TruthRow(2, OTHER_SHARD, A, payload(2))]
    log = Log()
    log.call(1, A, during=(0.0, 10.0))
    log.call(2, A, shard=OTHER_SHARD, during=(2.0, 3.0))
    log.delete(1, 2)
    verdict = check(log.history(truth), rolled_back=[])
    assert not verdict.problems, verdict.summary()


def test_overlaps_are_found_in_the_shard_of_the_row_not_the_one_a_call_was_told() -> None:
    truth = [TruthRow(1, SHARD, A, payload(1)), TruthRow(2, SHARD, B, payload(2))]
    log = Log()
    log.call(1, A, during=(0.0, 10.0))
    log.call(2, A, shard=OTHER_SHARD, during=(2.0, 3.0))  # told another shard: still row 2's
    log.delete(1, 2)
    verdict = check(log.history(truth), rolled_back=[])
    assert verdict.overlaps == [
        "shard (1, 7): call 2 (pid 1) started while call 1 (pid 1) was running"
    ]


# -- overlaps shorter than a second -----------------------------------------------------------


def two_calls(first: tuple[float, float], second: tuple[float, float]) -> list[str]:
    """The overlaps found between a call of row 1 and one of row 2 (another group of the same
    shard, another process) that ran at these times."""
    log = Log()
    log.call(1, A, pid=1, during=first)
    log.call(2, B, pid=2, during=second)
    log.delete(1, 2)
    return check(log.history(rows((1, A), (2, B))), rolled_back=[]).overlaps


def test_calls_overlapping_by_a_millisecond_are_found() -> None:
    started = 1_764_000_000.25  # a time.time() of these days: milliseconds are still exact
    assert two_calls((started, started + 0.010), (started + 0.009, started + 0.020)) == [
        "shard (1, 7): call 2 (pid 2) started while call 1 (pid 1) was running"
    ]


def test_calls_overlapping_by_a_tenth_of_a_millisecond_are_found() -> None:
    started = 1_764_000_000.25
    assert len(two_calls((started, started + 0.0050), (started + 0.0049, started + 0.008))) == 1


def test_a_call_nested_a_few_milliseconds_inside_another_is_found() -> None:
    started = 1_764_000_000.25
    assert len(two_calls((started, started + 0.004), (started + 0.001, started + 0.002))) == 1


def test_a_call_that_starts_when_the_previous_one_ended_is_no_overlap() -> None:
    started = 1_764_000_000.25
    assert two_calls((started, started + 0.005), (started + 0.005, started + 0.010)) == []
    assert two_calls((started, started + 0.005), (started + 0.0051, started + 0.010)) == []


# -- coalescing: groups whose lowest and highest ids order differently ----------------------


def test_groups_run_by_their_lowest_pending_id_not_their_highest() -> None:
    """Group A has rows 1 and 3, group B row 2: A comes first (its lowest id is 1), handled
    with row 3; ordering by the highest id would run B first."""
    truth = rows((1, A), (2, B), (3, A))
    by_lowest = Log()
    by_lowest.call(3, A, coalesced=2)
    by_lowest.delete(1, 3)
    by_lowest.call(2, B, coalesced=1)
    by_lowest.delete(2)
    verdict = check(by_lowest.history(truth), rolled_back=[], visible_to={1: 3})
    assert not verdict.problems, verdict.summary()
    by_highest = Log()
    by_highest.call(2, B, coalesced=1)
    by_highest.delete(2)
    by_highest.call(3, A, coalesced=2)
    by_highest.delete(1, 3)
    assert check(by_highest.history(truth), rolled_back=[]).order_violations == [
        "call 1 handled group (2, 2) of shard (1, 7) from id 2 while row 1 of another group "
        "was pending"
    ]


def test_a_call_told_it_covers_fewer_rows_than_its_group_had_is_uncoalesced() -> None:
    truth = rows((1, A), (2, B), (3, A))
    log = Log()
    log.call(3, A, coalesced=1)  # handled with the newest row, but said to cover only it
    log.delete(1, 3)
    log.call(2, B, coalesced=1)
    log.delete(2)
    verdict = check(log.history(truth), rolled_back=[])
    assert verdict.uncoalesced == [
        "call 1 of row 3 covered 1 row(s) of group (2, 1) of shard (1, 7); 2 were pending "
        "up to it: [1, 3]"
    ]
    assert verdict.problems == verdict.uncoalesced


def not_coalesced() -> Log:
    """Every row handled on its own, in id order, each deleted before the next call: group A's
    rows 1 and 3 are two calls."""
    log = Log()
    for row_id, group in ((1, A), (2, B), (3, A)):
        log.call(row_id, group, coalesced=1)
        log.delete(row_id)
    return log


def test_a_group_handled_without_the_newest_row_its_process_could_see_is_uncoalesced() -> None:
    truth = rows((1, A), (2, B), (3, A))
    # Row 3 was committed before the process started: the call of row 1 had to be row 3's.
    verdict = check(not_coalesced().history(truth), rolled_back=[], visible_to={1: 3})
    assert verdict.uncoalesced == [
        "call 1 (pid 1) handled row 1 of group (2, 1) of shard (1, 7) while its row 3, "
        "committed before the process started, was pending"
    ]
    assert verdict.problems == verdict.uncoalesced
    # Committed after the process started (up to row 2), row 3 may come in a later call.
    assert not check(not_coalesced().history(truth), rolled_back=[], visible_to={1: 2}).problems
