"""Decoding engine: strategies yield Steps, ``stream`` turns them into text and statistics."""
