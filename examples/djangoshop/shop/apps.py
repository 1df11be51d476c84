from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "examples.djangoshop.shop"
    label = "shop"

    def ready(self) -> None:
        # The handlers use the models: registered once the models are loaded.
        from examples.djangoshop.shop import handlers  # noqa: F401
