"""The tiny project with Django's admin and the lease store's admin pages (admin_cases.py)."""

from .settings import *  # noqa: F403 - the project's settings (DJANGO_PROJECT_LEASE applied), then the admin's

INSTALLED_APPS = ["django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
                  "django.contrib.sessions", "django.contrib.messages", "celery_lease.contrib.django",
                  "celery_lease.contrib.django.admin"]
MIDDLEWARE = ["django.contrib.sessions.middleware.SessionMiddleware",
              "django.middleware.csrf.CsrfViewMiddleware",
              "django.contrib.auth.middleware.AuthenticationMiddleware",
              "django.contrib.messages.middleware.MessageMiddleware"]
TEMPLATES = [{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
              "OPTIONS": {"context_processors": ["django.template.context_processors.request",
                                                 "django.contrib.auth.context_processors.auth",
                                                 "django.contrib.messages.context_processors.messages"]}}]
ROOT_URLCONF = "tests.django_project.urls"

try:  # Django's MySQL backend imports MySQLdb: PyMySQL stands in where mysqlclient is not installed
    import MySQLdb  # noqa: F401
except ImportError:
    import pymysql

    pymysql.install_as_MySQLdb()
