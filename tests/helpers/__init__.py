"""Helpers the test modules share: apps, worlds and fixtures-in-code.  A test module imports from here, never from another test module."""
