"""Transactional Django tests stay apart: with ``outbox_bridge.contrib.django`` installed,
Django's flush after each ``TransactionTestCase`` (``django_db(transaction=True)``) empties the
outbox tables with the model tables, so a row a test leaves behind never reaches the next
test's drain, in either order. ``manage.py flush`` and ``sqlflush`` name the outbox tables,
keep the owner tables and the outbox's identity."""

from __future__ import annotations

import unittest
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import transaction
from django.test import TransactionTestCase

from outbox_bridge.contrib.django.testing import drain_outbox_django
from outbox_bridge.contrib.django.writes import write_row
from tests.django_app.outbox import app
from tests.django_support import ARCHIVE, OUTBOX, next_identifier, rows
from tests.harness import Category


def write_own_row() -> int:
    shard = next_identifier()
    with transaction.atomic():
        return write_row(
            app,
            category=Category.ORGANIZATION_UPDATE,
            shard_identifier=shard,
            object_identifier=shard,
        )


# The two tests below pass in either order; in this order, the second failed while the first
# test's row stayed for it.


@pytest.mark.django_db(transaction=True)
def test_a_transactional_test_leaves_its_row_undrained() -> None:
    written = write_own_row()
    assert [row["id"] for row in rows()] == [written]


@pytest.mark.django_db(transaction=True)
def test_the_next_transactional_test_drains_only_its_own_row() -> None:
    written = write_own_row()
    report = drain_outbox_django(app)
    assert report.handled == 1
    assert [message.id for message in report.messages] == [written]


class LeavesARow(TransactionTestCase):
    __test__ = False  # run by the test below, in both orders

    def test_it(self) -> None:
        self.assertEqual([row["id"] for row in rows()], [])
        write_own_row()


class DrainsItsOwnRow(TransactionTestCase):
    __test__ = False

    def test_it(self) -> None:
        written = write_own_row()
        report = drain_outbox_django(app)
        self.assertEqual([message.id for message in report.messages], [written])


@pytest.mark.parametrize("order", [(LeavesARow, DrainsItsOwnRow), (DrainsItsOwnRow, LeavesARow)])
def test_transaction_test_cases_see_no_row_of_the_one_before(
    order: tuple[type[TransactionTestCase], ...], django_db_setup: None, django_db_blocker
) -> None:
    suite = unittest.TestSuite(case("test_it") for case in [*order, *order])
    result = unittest.TestResult()
    with django_db_blocker.unblock():
        suite.run(result)
        left = rows()
    problems = [text for _, text in result.failures + result.errors]
    assert result.testsRun == 4 and not problems, "\n".join(problems)
    assert left == []  # the last test's flush emptied it too


@pytest.mark.django_db(transaction=True)
def test_sqlflush_names_the_outbox_tables_but_not_their_owner_tables() -> None:
    output = StringIO()
    call_command("sqlflush", stdout=output)
    statements = output.getvalue().splitlines()
    outbox = [s for s in statements if OUTBOX in s]
    assert outbox == [f'TRUNCATE "{ARCHIVE}", "{OUTBOX}";']  # the identity kept
    assert "_owners" not in output.getvalue()
    assert any('"django_app_note"' in s and "RESTART IDENTITY" in s for s in statements)


@pytest.mark.django_db(transaction=True)
def test_manage_py_flush_empties_the_outbox_and_keeps_its_identity() -> None:
    first = write_own_row()
    call_command("flush", interactive=False, verbosity=0)
    assert rows() == []
    assert write_own_row() > first
