"""The Django settings that mypy's django-stubs plugin loads to type the models: the tests'
project with the Django example's app beside it."""

from __future__ import annotations

from tests.django_settings import *  # noqa: F403
from tests.django_settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "examples.djangoshop.shop"]
