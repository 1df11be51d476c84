from __future__ import annotations

from django.contrib import admin
from django.urls import path

from tests.django_app import views

urlpatterns = [
    path("write/<int:organization>", views.write),
    path("flushed/<int:organization>", views.flushed_write),
    path("report/<int:organization>", views.write_and_report),
    path("request-transaction/<int:organization>", views.write_in_the_request_transaction),
    path(
        "flushed-request-transaction/<int:organization>",
        views.flushed_write_in_the_request_transaction,
    ),
    path("async/<int:organization>", views.async_write),
    path("projects/<str:name>", views.create_project),
    path("admin/", admin.site.urls),
]
