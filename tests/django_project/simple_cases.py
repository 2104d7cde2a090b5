"""Cases that use no database: Django's runner sets up no test database for them."""

from django.test import SimpleTestCase


class NoDatabase(SimpleTestCase):
    def test_needs_no_database(self) -> None:
        self.assertEqual(1 + 1, 2)
