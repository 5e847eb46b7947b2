"""Runs in the user's process: the engines, the worker set and its clients (calls, weight sync, signatures, schedule choice, generation session)."""
