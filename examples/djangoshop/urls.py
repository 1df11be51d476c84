from __future__ import annotations

from django.urls import path

from examples.djangoshop.shop import views

urlpatterns = [
    path("organizations", views.create_organization),
    path("organizations/<int:organization>/projects", views.create_project),
    path("organizations/<int:organization>/invitations", views.invite),
    path("search", views.search),
]
