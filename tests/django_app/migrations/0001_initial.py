"""The test app's models, and the outbox tables of both its outbox apps."""

from __future__ import annotations

import django.db.models.deletion
from django.db import migrations, models

from outbox_bridge.contrib.django.operations import CreateOutbox


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="Note",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("text", models.TextField()),
            ],
        ),
        migrations.CreateModel(
            name="Organization",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=200)),
            ],
            options={"abstract": False},
        ),
        migrations.CreateModel(
            name="Project",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=200)),
                (
                    "organization",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, to="django_app.organization"
                    ),
                ),
            ],
            options={"abstract": False},
        ),
        CreateOutbox("tests.django_app.outbox:app", tables=["django_outbox"]),
        CreateOutbox("tests.django_app.outbox:archive_app"),
    ]
