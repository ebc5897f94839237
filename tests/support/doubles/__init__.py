"""Test doubles (named as such): stand-ins where the real thing needs hardware absent here."""
