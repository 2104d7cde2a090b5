"""The admin at /admin/ (admin_settings.py)."""

from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
