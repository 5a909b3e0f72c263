"""Tests on 2 CPU ranks (gloo), started by :mod:`launcher`."""
