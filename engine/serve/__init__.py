"""Engines behind one interface (interface.py), the local engine and the HTTP API."""
