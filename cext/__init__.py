"""Cython hot paths: utf8 (boundary tracker), chunk (SSE serializer), tick (scheduler), stops (stop-string automaton)."""
